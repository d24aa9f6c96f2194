"""``python -m omnirl.trainer``: the same as ``uv run trainer``."""

import sys

from omnirl.trainer.cli import main

sys.exit(main())
