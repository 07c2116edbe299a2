"""``python -m gpufleet.validation``: run the validation suites (see gpufleet.validation.cli)."""

import sys

from gpufleet.validation.cli import main

sys.exit(main())
