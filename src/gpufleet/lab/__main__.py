"""``python -m gpufleet.lab build|up|down|status``."""

import sys

from gpufleet.lab.cli import main

sys.exit(main())
