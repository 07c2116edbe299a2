"""`gpufleet wheelhouse DIR`: gpufleet and everything it installs with, as wheels in one directory.

GPU nodes often have no package index. Role gpufleet_kubernetes, with the device plugin in systemd mode and
``gpufleet_kubernetes_device_plugin_wheelhouse: DIR``, copies the directory to each node and installs from it
with ``pip --no-index``. The wheels are built here, where an index is reachable, by this interpreter's pip,
for this interpreter's Python; ``--python 3.13`` (repeatable) adds the binary wheels (grpcio, protobuf,
PyYAML) for nodes whose Python is another one (Debian 13's is 3.13, Debian 12's 3.11), for this machine's
architecture, from the index's manylinux wheels.
"""

from __future__ import annotations

import argparse
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import gpufleet


def source_tree() -> Path | None:
    """The checkout gpufleet runs from (its pyproject.toml), or None for an installed wheel."""
    root = Path(gpufleet.__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


# manylinux tags pip may take binary wheels under for another Python (newest first; glibc 2.28 covers
# Debian 11 and later, EL 8 and later, Ubuntu 20.04 and later).
MANYLINUX = ("manylinux_2_28", "manylinux_2_17", "manylinux2014")


def build(dest: Path, *, quiet: bool = True, pythons: Sequence[str] = ()) -> list[Path]:
    """Fill ``dest`` with wheels of gpufleet (this version) and its dependencies; return them. ``pythons``:
    other Pythons (``3.13``) whose wheels go in too, so that nodes running them install from ``dest``."""
    for version in pythons:
        if not re.fullmatch(r"3\.[0-9]{1,2}", version):
            raise RuntimeError(f"--python {version!r}: expected a Python 3 major.minor such as 3.13")
    dest.mkdir(parents=True, exist_ok=True)
    tree = source_tree()
    what = str(tree) if tree else f"gpufleet=={gpufleet.__version__}"
    argv = [sys.executable, "-m", "pip", "wheel", "--wheel-dir", str(dest), what]
    if quiet:
        argv.insert(4, "--quiet")
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tail = result.stderr.strip()[-1500:]
        raise RuntimeError(f"pip wheel {what} failed (rc {result.returncode}): {tail}")
    # Older builds of gpufleet in a reused directory would let pip pick the wrong one: keep this version's.
    for stale in dest.glob("gpufleet-*.whl"):
        if not stale.name.startswith(f"gpufleet-{gpufleet.__version__}-"):
            stale.unlink()
    machine = platform.machine()
    for version in pythons:
        # gpufleet's own wheel (pure Python) is found in dest; its dependencies come as wheels for that Python
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--dest", str(dest), "--find-links",
                str(dest), "--only-binary=:all:", "--implementation", "cp", "--python-version", version,
                *(a for tag in MANYLINUX for a in ("--platform", f"{tag}_{machine}")),
                f"gpufleet=={gpufleet.__version__}"]  # fmt: skip
        result = subprocess.run(argv, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = result.stderr.strip()[-1500:]
            raise RuntimeError(f"pip download for Python {version} failed (rc {result.returncode}): {tail}")
    return sorted(dest.glob("*.whl"))


def _run(args: argparse.Namespace) -> int:
    try:
        wheels = build(Path(args.dir), pythons=args.python)
    except RuntimeError as err:
        print(f"gpufleet wheelhouse: {err}", file=sys.stderr)
        return 1
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {size:.0f} MiB in {args.dir}")
    print(f"use: -e gpufleet_kubernetes_device_plugin_wheelhouse={Path(args.dir).resolve()}")
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gpufleet wheelhouse``."""
    parser = sub.add_parser(
        "wheelhouse",
        help="wheels of gpufleet and its dependencies, for GPU nodes without a package index",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("dir", help="directory to fill (created if missing)")
    parser.add_argument(
        "--python",
        action="append",
        default=[],
        metavar="X.Y",
        help="also the wheels for this Python on the nodes (repeatable), e.g. 3.13 for Debian 13",
    )
    parser.set_defaults(func=_run)
