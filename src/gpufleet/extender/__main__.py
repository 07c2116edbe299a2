"""`python -m gpufleet.extender`: the same commands as the `gpufleet-extender` console script."""

import sys

from gpufleet.extender.cli import main

sys.exit(main())
