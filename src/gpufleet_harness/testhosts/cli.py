"""`gpufleet testhosts ...` / `python -m gpufleet_harness.testhosts ...`: images, stand-in repo, molecule
runs."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from gpufleet_harness.testhosts import images, molecule
from gpufleet_harness.testhosts.aptrepo import RepoServer, build_repo
from gpufleet_harness.testhosts.podman import ensure_containers_conf
from gpufleet_harness.testhosts.workspace import missing_tools, state_dir


def _conf(_args: argparse.Namespace) -> int:
    print(f"export CONTAINERS_CONF={ensure_containers_conf()}")
    return 0


def _doctor(_args: argparse.Namespace) -> int:
    missing = missing_tools()
    for item in missing:
        print(f"missing: {item}")
    print(f"state dir: {state_dir()}")
    return 1 if missing else 0


def _image(args: argparse.Namespace) -> int:
    for suite in args.suites:
        started = time.monotonic()
        name = images.build_image(images.ImageSpec(suite), force=args.force)
        print(f"{name} ({time.monotonic() - started:.1f} s)")
    return 0


def _repo(args: argparse.Namespace) -> int:
    repo = build_repo()
    print(f"repo: {repo.root} (key {repo.fingerprint})")
    if not args.serve:
        return 0
    server = RepoServer(repo.root, port=args.port)
    print(
        f"serving on http://127.0.0.1:{server.port} "
        f"(test hosts: http://{molecule.HOST_LOOPBACK_FROM_CONTAINER}:{server.port}); Ctrl-C stops",
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        server.stop()
    return 0


def _molecule(args: argparse.Namespace) -> int:
    names = args.scenario or molecule.scenarios()
    runs = molecule.run_scenarios(names, args.molecule_command, args.extra)
    for run in runs:
        print(f"{run.scenario:28} {run.command:8} {'ok' if run.ok else 'FAILED':7} {run.seconds:7.1f} s")
    return 0 if all(run.ok for run in runs) else 1


def register(subparsers: Any) -> None:
    """Add the ``testhosts`` command to the gpufleet CLI."""
    parser = subparsers.add_parser("testhosts", help="podman test hosts, stand-in NVIDIA repo, molecule runs")
    sub = parser.add_subparsers(dest="testhosts_command", metavar="ACTION", required=True)
    sub.add_parser("conf", help="write containers.conf and print the export line").set_defaults(func=_conf)
    sub.add_parser("doctor", help="check host tools").set_defaults(func=_doctor)
    image = sub.add_parser("image", help="build test-host images (cached by content key)")
    image.add_argument("suites", nargs="*", default=list(images.DEBIAN_SUITES))
    image.add_argument("--force", action="store_true", help="rebuild even when the cached image matches")
    image.set_defaults(func=_image)
    repo = sub.add_parser("repo", help="build the signed stand-in repository (and serve it)")
    repo.add_argument("--serve", action="store_true")
    repo.add_argument("--port", type=int, default=0, help="port on 127.0.0.1 (default: a free one)")
    repo.set_defaults(func=_repo)
    mol = sub.add_parser("molecule", help="run molecule scenarios with images and repo in place")
    mol.add_argument(
        "molecule_command",
        nargs="?",
        default="test",
        metavar="COMMAND",
        help="molecule command (test, converge, verify, ...)",
    )
    mol.add_argument("-s", "--scenario", action="append", help="scenario (repeatable; default: all)")
    mol.add_argument(
        "-a",
        "--arg",
        dest="extra",
        action="append",
        default=[],
        help="extra argument for molecule (repeatable), e.g. -a=--destroy=never",
    )
    mol.set_defaults(func=_molecule)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufleet_harness.testhosts")
    register(parser.add_subparsers(dest="command", metavar="COMMAND", required=True))
    args = parser.parse_args(["testhosts", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)
