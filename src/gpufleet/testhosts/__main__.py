"""python -m gpufleet.testhosts"""

import sys

from gpufleet.testhosts.cli import main

sys.exit(main())
