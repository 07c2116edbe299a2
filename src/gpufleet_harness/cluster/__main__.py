"""``python -m gpufleet_harness.cluster build|up|down|status``."""

import sys

from gpufleet_harness.cluster.cli import main

sys.exit(main())
