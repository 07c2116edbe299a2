"""`gpufleet sim …`: build the simulated NVML, list/materialize fixtures, print env, inject failures."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

EXIT_USAGE = 2


def _fail(msg: str, code: int = EXIT_USAGE) -> int:
    print(f"gpufleet sim: {msg}", file=sys.stderr)
    return code


def _cmd_build(args: argparse.Namespace) -> int:
    try:
        print(simbuild.build_library(force=args.force, quiet=False))
    except simbuild.BuildError as e:
        return _fail(str(e), 1)
    return 0


def _cmd_list(args: argparse.Namespace) -> int:
    names = simmachine.fixture_names()
    width = max(map(len, names), default=0)
    for name in names:
        print(f"{name:<{width}}  {simmachine.fixture_description(name)}")
    return 0


def _materialize(fixture: str, root: Path, build: bool) -> Path:
    return simmachine.materialize(fixture, root, build=build)


def _cmd_materialize(args: argparse.Namespace) -> int:
    try:
        root = _materialize(args.fixture, Path(args.root), not args.no_build)
    except simmachine.FixtureError as e:
        return _fail(str(e))
    except FileExistsError as e:
        return _fail(str(e))
    except simbuild.BuildError as e:
        return _fail(str(e), 1)
    print(root)
    return 0


def _is_current(root: Path, fixture: str) -> bool:
    """A root made from this fixture (injected state in it is kept)."""
    try:
        m = json.loads((root / "machine.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(m.get("name") == Path(fixture).stem)


def _refresh_library(root: Path) -> None:
    """Point lib/ at the current build when the sources changed; an injected `library missing` stays."""
    link = root / "lib" / "libnvidia-ml.so.1"
    lib = simbuild.build_library()
    if link.is_symlink() and link.resolve() != lib.resolve():
        simmachine.set_library_files(root, True, lib)


def _cmd_env(args: argparse.Namespace) -> int:
    try:
        simmachine.fixture_path(args.fixture)
        root = Path(args.root) if args.root else simmachine.default_root(args.fixture)
        if args.fresh or not _is_current(root, args.fixture):
            _materialize(args.fixture, root, True)
        else:
            _refresh_library(root)
    except (simmachine.FixtureError, FileExistsError) as e:
        return _fail(str(e))
    except simbuild.BuildError as e:
        return _fail(str(e), 1)
    for key, value in simmachine.sim_env(root).items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


def _cmd_inject(args: argparse.Namespace) -> int:
    try:
        print(simcontrol.inject(Path(args.root), args.what))
    except (simcontrol.InjectError, FileNotFoundError) as e:
        return _fail(str(e))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `sim` and its sub-commands to the top-level parser."""
    sim = subparsers.add_parser("sim", help="the GPU simulator (NVML library, fixtures, failure injection)",
                                description=__doc__)
    sub = sim.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    sim.set_defaults(func=lambda _args: (sim.print_help(sys.stderr), EXIT_USAGE)[1])

    p = sub.add_parser("build", help="compile libnvidia-ml.so.1 (cached) and print its path")
    p.add_argument("--force", action="store_true", help="rebuild even if a cached build exists")
    p.set_defaults(func=_cmd_build)

    p = sub.add_parser("list", help="list fixtures with a one-line description")
    p.set_defaults(func=_cmd_list)

    p = sub.add_parser("materialize", help="expand FIXTURE into a sim root at ROOT (replacing it)")
    p.add_argument("fixture", metavar="FIXTURE", help="fixture name (see `gpufleet sim list`) or YAML path")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--no-build", action="store_true", help="do not build/link the library into lib/")
    p.set_defaults(func=_cmd_materialize)

    p = sub.add_parser("env", help="print export lines for FIXTURE, materializing its root if needed",
                       epilog='usage in a shell: eval "$(gpufleet sim env dgx-a100)"')
    p.add_argument("fixture", metavar="FIXTURE")
    p.add_argument("--root", metavar="DIR", help="sim root (default: $XDG_RUNTIME_DIR or /tmp)")
    p.add_argument("--fresh", action="store_true", help="re-materialize even if the root is current")
    p.set_defaults(func=_cmd_env)

    p = sub.add_parser("inject", help="inject a failure into a sim root",
                       description=f"One of: {simcontrol.USAGE}.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("what", nargs="+", metavar="WORD", help=simcontrol.USAGE)
    p.set_defaults(func=_cmd_inject)
