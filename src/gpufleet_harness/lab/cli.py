"""``gpufleet lab build | up | status | down``: the simulated GPU fleet (root, podman).

Exit codes: 0 done (``status``: the lab is up and every node Ready), 1 it failed or is not up, 2 usage.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from typing import Any

from gpufleet.handoff import MIG_RESOURCE_PREFIX
from gpufleet_harness.cluster.cli import add_build_command

from .spec import CONTROL_PLANE, CONTROL_PLANE_CONTAINERD, K8S_VERSION, LabSpec


def _spec(args: argparse.Namespace) -> LabSpec:
    return LabSpec.from_env()


def _say(quiet: bool) -> Any:
    return (lambda _msg: None) if quiet else (lambda msg: print(f"lab: {msg}", file=sys.stderr, flush=True))


def cmd_up(args: argparse.Namespace) -> int:
    from gpufleet_harness.cluster.k8s_cache import BuildError
    from gpufleet_harness.cluster.process import ClusterError

    from .hostsetup import HostError
    from .lab import LabUpError, up

    spec = _spec(args)
    try:
        state = up(spec, progress=_say(args.json))
    except (LabUpError, HostError, BuildError, ClusterError, RuntimeError) as err:
        print(f"error: lab up failed: {err}", file=sys.stderr)
        print("  (what was made is still there for a look; `gpufleet lab down` removes it)", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(state, indent=2))
    else:
        _print_status(spec)
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from .lab import down

    down(_spec(args), progress=_say(args.json))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from .lab import status

    doc = status(_spec(args))
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        _print_status(_spec(args), doc)
    return 0 if doc["up"] else 1


def _print_status(spec: LabSpec, doc: dict[str, Any] | None = None) -> None:
    from .lab import status

    doc = doc or status(spec)
    print(f"lab {doc['name']}: {'up' if doc['up'] else 'NOT up'}"
          f"{'' if doc['supervisor'] else ' (supervisor not running)'}"
          f"{' on Kubernetes ' + doc['kubernetes'] if doc.get('kubernetes') else ''}")  # fmt: skip
    print(f"{'host':<18} {'container':<30} {'runtime':<15} {'state':<9} {'node':<6} {'GPUs':>4}  MIG devices")
    cp = doc.get("control_plane") or {}
    if cp:
        runtime = f"containerd {CONTROL_PLANE_CONTAINERD}"
        print(f"{CONTROL_PLANE[:18]:<18} {cp['container'][:30]:<30} {runtime:<15} "
              f"{cp['container_state'][:9]:<9} {'Ready' if cp['node_ready'] else '-':<6} {'-':>4}  "
              "(kubeadm control plane)")  # fmt: skip
    for name, host in doc["hosts"].items():
        node = "Ready" if host["node_ready"] else "-"
        migs = host.get("allocatable_mig", {})
        mig = ", ".join(f"{n} {r.removeprefix(MIG_RESOURCE_PREFIX)}" for r, n in migs.items())
        print(f"{name[:18]:<18} {host['container'][:30]:<30} {host.get('runtime', '?')[:15]:<15} "
              f"{host['container_state'][:9]:<9} {node:<6} {host['allocatable_gpus']:>4}  "
              f"{mig or '-'}")  # fmt: skip
    if doc.get("kubeconfig"):
        print(f"KUBECONFIG={doc['kubeconfig']}")
    if doc.get("prometheus"):
        print(f"prometheus: {doc['prometheus']} (every host's device plugin /metrics)")
    print(f"inventory: {doc['inventory']}")


def cmd_build_all(args: argparse.Namespace) -> int:
    """The Kubernetes build of the lab's release (unless --version names another), then (unless --check)
    the lab's images: a kubeadm host per containerd it runs, and the gpufleet image."""
    from gpufleet_harness.cluster.cli import cmd_build

    args.version = args.version or K8S_VERSION
    rc = cmd_build(args)
    if rc or args.check or not args.images:
        return rc
    from gpufleet_harness.cluster.images import ensure_lab_image

    from .kubeadm import ensure_host_image
    from .spec import DEFAULT_HOSTS

    kinds = sorted({CONTROL_PLANE_CONTAINERD, *(h.containerd for h in DEFAULT_HOSTS)})
    hosts = {f"containerd {kind}": ensure_host_image(kind) for kind in kinds}
    print(json.dumps({"host_images": hosts, "gpufleet_image": ensure_lab_image().name}))
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    lab = subparsers.add_parser("lab", help="the simulated GPU fleet: podman hosts + Kubernetes (root)",
                                description=__doc__)  # fmt: skip
    sub = lab.add_subparsers(dest="lab_command", metavar="ACTION", required=True)
    build = add_build_command(sub, K8S_VERSION)
    build.add_argument("--images", action="store_true", help="also build the lab's host and gpufleet images")
    build.set_defaults(func=cmd_build_all)
    for name, func, text in (
        ("up", cmd_up, "bring the lab up (idempotent) and write its inventory"),
        ("status", cmd_status, "containers, nodes and GPUs of the lab"),
        ("down", cmd_down, "remove every container, volume, process and file the lab made"),
    ):
        parser = sub.add_parser(name, help=text)
        parser.add_argument("--json", action="store_true", help="machine-readable output on stdout")
        parser.set_defaults(func=func)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpufleet")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["lab", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING)
    return int(args.func(args))
