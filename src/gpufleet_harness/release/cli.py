"""``gpufleet release wheel | collection | images | all [--out DIR]``: what an operator installs, built from
this checkout (docs/install.md). Exit 0 built, 1 a step failed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_OUT = Path("dist")


def _run(args: argparse.Namespace) -> int:
    from .collection import build as build_collection
    from .collection import build_wheel
    from .images import SERVICES, BuildError
    from .images import build as build_images

    out: Path = args.out
    done: dict[str, object] = {}
    try:
        if args.what in ("wheel", "all"):
            done["wheel"] = str(build_wheel(out))
        if args.what in ("collection", "all"):
            done["collection"] = str(build_collection(out))
        if args.what in ("images", "all"):
            done["images"] = build_images(out / "images", tuple(args.only or SERVICES))
    except BuildError as err:
        print(f"gpufleet release {args.what}: {err}", file=sys.stderr)
        return 1
    print(json.dumps(done, indent=2))
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``gpufleet release``."""
    parser = sub.add_parser(
        "release",
        help="build the wheel, the collection artifact and the service images",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("what", choices=("wheel", "collection", "images", "all"))
    parser.add_argument(
        "--out",
        type=Path,
        default=DEFAULT_OUT,
        help="where they go (images in OUT/images with images.json); default ./dist",
    )
    parser.add_argument(
        "--only",
        action="append",
        metavar="SERVICE",
        help="images: build only this one (device-plugin, extender); repeatable",
    )
    parser.set_defaults(func=_run)
