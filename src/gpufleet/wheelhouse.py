"""`gpufleet wheelhouse DIR`: gpufleet and everything it installs with, as wheels in one directory.

GPU nodes often have no package index. Role gpufleet_kubernetes, with the device plugin in systemd mode and
``gpufleet_kubernetes_device_plugin_wheelhouse: DIR``, copies the directory to each node and installs from it
with ``pip --no-index``. The wheels are built here, where an index is reachable, by this interpreter's pip:
the node's Python must have the same major.minor (and platform) for the binary wheels (grpcio, protobuf).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import gpufleet


def source_tree() -> Path | None:
    """The checkout gpufleet runs from (its pyproject.toml), or None for an installed wheel."""
    root = Path(gpufleet.__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def build(dest: Path, *, quiet: bool = True) -> list[Path]:
    """Fill ``dest`` with wheels of gpufleet (this version) and its dependencies; return them."""
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
    return sorted(dest.glob("*.whl"))


def _run(args: argparse.Namespace) -> int:
    try:
        wheels = build(Path(args.dir))
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
    parser.set_defaults(func=_run)
