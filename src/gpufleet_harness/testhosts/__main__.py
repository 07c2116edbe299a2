"""python -m gpufleet_harness.testhosts"""

import sys

from gpufleet_harness.testhosts.cli import main

sys.exit(main())
