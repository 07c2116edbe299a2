"""The `gpufleet` command line: one parser, sub-commands contributed by each subpackage."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

from gpufleet import __version__

# Each module exposes register(subparsers) -> None and sets `func` on its parsers.
_COMMAND_MODULES = ("gpufleet.gpu.cli", "gpufleet.extender.cli", "gpufleet.validation.cli",
                    "gpufleet.runner.cli", "gpufleet.wheelhouse")  # fmt: skip
# Other packages add theirs through this entry point group (the test harness: `gpufleet sim`, `cluster`,
# `lab`, `testhosts`; pyproject.toml). The product never imports the harness by name.
COMMAND_GROUP = "gpufleet.commands"
# Top-level modules that only an extra installs (pyproject.toml's optional-dependencies), by extra.
_EXTRA_OF = {"ansible": "controller", "ansible_runner": "controller", "testinfra": "controller",
             "pyVmomi": "esxi", "molecule": "molecule", "gpufleet_harness": "harness"}  # fmt: skip


def _command_modules() -> list[str]:
    plugins = sorted(metadata.entry_points(group=COMMAND_GROUP), key=lambda ep: ep.name)
    return [*_COMMAND_MODULES, *(ep.value for ep in plugins)]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gpufleet", description=__doc__)
    parser.add_argument("--version", action="version", version=f"gpufleet {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _command_modules():
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as err:
            if _missing_extra(err) is None:
                raise
            continue  # a command of a package that is not installed (the harness, in a base install)
        module.register(sub)
    return parser


def _missing_extra(err: ModuleNotFoundError) -> str | None:
    """The extra that would have installed the missing module, if one would."""
    return _EXTRA_OF.get((err.name or "").partition(".")[0])


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except ModuleNotFoundError as err:
        extra = _missing_extra(err)
        if extra is None:
            raise
        print(f"gpufleet {args.command}: needs {err.name}, which comes with an extra of gpufleet: "
              f"pip install 'gpufleet[{extra}]'", file=sys.stderr)  # fmt: skip
        return 2


if __name__ == "__main__":
    sys.exit(main())
