import sys

from omnirl.rollout.cli import main

sys.exit(main())
