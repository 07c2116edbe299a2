import sys

from gpufleet.fleetlab.cli import main

sys.exit(main())
