import sys

from omnirl.reward.cli import main

sys.exit(main())
