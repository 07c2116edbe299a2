import sys

from gpufleet_harness.lab.cli import main

sys.exit(main())
