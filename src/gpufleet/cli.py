"""The `gpufleet` command line: one parser, sub-commands contributed by each subpackage."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from gpufleet import __version__

# Each module exposes register(subparsers) -> None and sets `func` on its parsers.
_COMMAND_MODULES = ("gpufleet_harness.sim.cli", "gpufleet.gpu.cli", "gpufleet_harness.cluster.cli",
                    "gpufleet_harness.lab.cli", "gpufleet.extender.cli", "gpufleet_harness.testhosts.cli",
                    "gpufleet.validation.cli", "gpufleet.runner.cli", "gpufleet.wheelhouse")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufleet", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpufleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
