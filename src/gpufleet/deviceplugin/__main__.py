"""`python -m gpufleet.deviceplugin`."""

import sys

from gpufleet.deviceplugin.app import main

sys.exit(main())
