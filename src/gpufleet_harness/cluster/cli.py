"""``gpufleet cluster build|up|down|status`` (also ``python -m gpufleet_harness.cluster``): the test
cluster alone.

This is the bare Kubernetes cluster the tests use (control plane + kubelet nodes in namespaces); the simulated
GPU fleet is ``gpufleet lab`` (:mod:`gpufleet_harness.lab`).

``up`` runs in the foreground until interrupted (Ctrl-C, or ``gpufleet cluster down`` from another shell),
then removes everything it started. The cluster directory holds ``env`` (``export KUBECONFIG=...``) and the
logs.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from gpufleet_harness.cluster.cluster import LAB_PREFIX, OWNER_FILE, TestCluster, reap_stale_clusters
from gpufleet_harness.cluster.gomod import is_module_version
from gpufleet_harness.cluster.k8s_build import (
    DEBIAN_K8S,
    DEFAULT_K8S_VERSION,
    NEWEST_K8S_VERSION,
    ensure_k8s,
    missing_build_requirements,
    resolve_version,
)
from gpufleet_harness.cluster.k8s_cache import BuildError
from gpufleet_harness.cluster.node import RUNTIMES
from gpufleet_harness.cluster.process import ClusterError


def _base(args: argparse.Namespace) -> Path:
    return Path(args.base or os.environ.get("GPUFLEET_LAB_DIR") or tempfile.gettempdir())


def cmd_build(args: argparse.Namespace) -> int:
    """Build (or find) the Kubernetes binaries and print the cache entry."""
    if args.check:
        version = resolve_version(args.version or args.default_version)
        if version is not None and is_module_version(version):
            from gpufleet_harness.cluster.k8s_modbuild import missing_requirements

            missing = missing_requirements(version.removeprefix("v"))
        else:
            missing = missing_build_requirements()
        print("\n".join(missing) or "all build requirements present")
        return 1 if missing else 0
    try:
        artifacts = ensure_k8s(args.version or args.default_version, args.cache, build=not args.no_build,
                               niceness=args.nice, prune=args.prune)  # fmt: skip
    except BuildError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(json.dumps({"version": artifacts.version, "bin": str(artifacts.bin_dir),
                      "git_version": artifacts.git_version}))  # fmt: skip
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    """Start a test cluster and keep it running until SIGINT/SIGTERM."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        artifacts = ensure_k8s(args.version, args.cache, build=not args.no_build)
        with TestCluster(artifacts, args.base, keep=args.keep) as cluster:
            started = time.monotonic()
            cp = cluster.start_control_plane()
            if args.scheduler or args.extender_config:
                cluster.start_scheduler(args.extender_config)
            nodes = [cluster.start_kubelet_node(name, runtime=args.runtime) for name in args.node]
            kubeconfig = cp.kubeconfig()
            (cluster.dir / "env").write_text(f"export KUBECONFIG={kubeconfig}\n")
            summary = {
                "lab": str(cluster.dir),  # the key scripts read; kept
                "kubeconfig": str(kubeconfig),
                "apiserver": cp.url,
                "nodes": {
                    n.name: {
                        "ip": n.node_ip,
                        "runtime": n.runtime,
                        "device_plugin_dir": str(n.device_plugin_dir),
                    }
                    for n in nodes
                },
                "seconds": round(time.monotonic() - started, 1),
            }
            print(json.dumps(summary, indent=2), flush=True)
            while not stop.wait(1.0):
                for daemon in cp.daemons:
                    daemon.check()
    except (BuildError, ClusterError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


def _clusters(base: Path) -> list[tuple[Path, dict[str, object]]]:
    found = []
    for cluster_dir in sorted(base.glob(f"{LAB_PREFIX}*")):
        try:
            found.append((cluster_dir, json.loads((cluster_dir / OWNER_FILE).read_text())))
        except (OSError, ValueError):
            continue
    return found


def cmd_status(args: argparse.Namespace) -> int:
    """List test clusters under the base directory with their owner process and kubeconfig."""
    for cluster_dir, owner in _clusters(_base(args)):
        alive = Path(f"/proc/{owner.get('pid')}").exists()
        env = cluster_dir / "env"
        print(f"{cluster_dir}  owner={owner.get('pid')} {'running' if alive else 'gone'}  "
              f"{env.read_text().strip() if env.exists() else ''}")  # fmt: skip
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    """Ask running clusters' owners to stop (SIGTERM), wait, then remove whatever stale clusters remain."""
    base = _base(args)
    targets = [(d, o) for d, o in _clusters(base) if args.lab is None or d == Path(args.lab).resolve()]
    for cluster_dir, owner in targets:
        pid = int(str(owner.get("pid")))
        if pid == os.getpid():
            continue
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        print(f"stopped {cluster_dir}")
    for removed in reap_stale_clusters(base):
        print(f"removed stale {removed}")
    return 0


def build_options(parser: argparse.ArgumentParser, default_version: str | None = None) -> None:
    """Where the Kubernetes build comes from (shared with ``gpufleet lab``, whose default differs)."""
    default = default_version or f"$GPUFLEET_K8S_VERSION, else {DEFAULT_K8S_VERSION}"
    parser.add_argument(
        "--version",
        help=f"Kubernetes to use: an upstream release built from its Go modules ({NEWEST_K8S_VERSION}), "
        f"{DEBIAN_K8S} for Debian's kubernetes source (1.20.2 on Debian 12), or a Debian source version "
        f"(default: {default})",
    )
    parser.set_defaults(default_version=default_version)
    parser.add_argument("--cache", help="cache root (default $GPUFLEET_CACHE or /var/cache/gpufleet)")
    parser.add_argument("--no-build", action="store_true", help="fail instead of building when not cached")


def add_build_command(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], default_version: str | None = None
) -> argparse.ArgumentParser:
    build = sub.add_parser("build", help="build or find the Kubernetes binaries")
    build_options(build, default_version)
    build.add_argument("--prune", action="store_true", help="remove the source tree after building")
    build.add_argument("--nice", type=int, default=10, help="niceness of the compiler")
    build.add_argument("--check", action="store_true", help="only list missing build requirements")
    build.set_defaults(func=cmd_build)
    return build


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser], name: str = "cluster") -> None:
    """Add ``cluster`` and its sub-commands to the ``gpufleet`` parser."""
    parser = subparsers.add_parser(name, help="bare Kubernetes test cluster (root)", description=__doc__)
    parser.add_argument("--base", help="where cluster directories go (default $GPUFLEET_LAB_DIR or /tmp)")
    sub = parser.add_subparsers(dest="lab_command", metavar="ACTION", required=True)

    add_build_command(sub)

    up = sub.add_parser("up", help="start a test cluster in the foreground")
    build_options(up)
    up.add_argument("--scheduler", action="store_true", help="start kube-scheduler")
    up.add_argument("--extender-config", help="YAML with an extenders section (implies --scheduler)")
    up.add_argument("--node", action="append", default=[], metavar="NAME", help="start a kubelet node")
    up.add_argument(
        "--runtime",
        choices=RUNTIMES,
        default="containerd",
        help="the nodes' container runtime: containerd through CRI (default), or dockershim (1.20 only)",
    )
    up.add_argument("--keep", action="store_true", help="keep the cluster directory after stopping")
    up.set_defaults(func=cmd_up)

    down = sub.add_parser("down", help="stop running clusters and remove stale ones")
    down.add_argument("lab", nargs="?", help="one cluster directory (default: all)")
    down.set_defaults(func=cmd_down)

    status = sub.add_parser("status", help="list test clusters")
    status.set_defaults(func=cmd_status)


def main(argv: list[str] | None = None) -> int:
    """``python -m gpufleet_harness.cluster ...`` (same as ``gpufleet cluster ...``)."""
    parser = argparse.ArgumentParser(prog="gpufleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["cluster", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    return int(args.func(args))
