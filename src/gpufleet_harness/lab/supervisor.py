"""The lab's long-running side on this machine: control plane, kube-scheduler as a static pod, APT repo.

``python -m gpufleet_harness.lab.supervisor --state-dir DIR --hosts a,b,c`` is started detached by
``gpufleet lab up`` and runs until SIGTERM (``gpufleet lab down``). It owns, and stops on exit:

- etcd, kube-apiserver and kube-controller-manager (:mod:`gpufleet_harness.cluster.cluster`) on 127.0.0.1; the
  apiserver's certificate also names the address containers reach this machine's loopback at, so the
  kubelets in the hosts and host-network pods verify it;
- kube-scheduler, run from a kubeadm-style manifest the way a kubelet runs a static pod (restarted when the
  manifest changes): the Ansible role points it at the extender by editing that manifest, as on a real
  control-plane node;
- the signed stand-in APT repository (NVIDIA's container toolkit and fabric manager are not reachable here);
- Debian's Prometheus (:mod:`gpufleet_harness.prometheus`), scraping each host's device plugin /metrics on the
  loopback port ``gpufleet lab up`` published it on (``--scrape host=port,...``), each target labelled with
  its node.

When everything is up it writes ``state.json`` (ports, kubeconfigs, certificates, repository URL) and
``ready``; the CLI waits for them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gpufleet_harness.cluster.cluster import TestCluster
from gpufleet_harness.cluster.k8s_build import ensure_k8s
from gpufleet_harness.cluster.process import free_ports
from gpufleet_harness.cluster.staticpod import StaticPodRunner, write_kubeadm_manifest
from gpufleet_harness.prometheus import Prometheus, ScrapeTarget
from gpufleet_harness.testhosts.aptrepo import RepoServer, build_repo

from .spec import GATEWAY, LAB_K8S_VERSION

log = logging.getLogger("gpufleet_harness.lab.supervisor")


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


SCRAPE_INTERVAL_S = 5.0


def serve(state_dir: Path, hosts: list[str], scrape: dict[str, int] | None = None) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "ready").unlink(missing_ok=True)
    started = time.monotonic()
    repo = build_repo(state_dir / "apt-repo")
    repo_server = RepoServer(repo.root).start()
    runner: StaticPodRunner | None = None
    lab = TestCluster(ensure_k8s(LAB_K8S_VERSION, build=False), state_dir / "cluster")
    targets = [ScrapeTarget(f"127.0.0.1:{port}", {"node": host}) for host, port in (scrape or {}).items()]
    prometheus = Prometheus(state_dir / "prometheus", targets, SCRAPE_INTERVAL_S)
    try:
        prometheus.start()
        cp = lab.start_control_plane(serving_ips=[GATEWAY], node_lifecycle=True)
        for host in hosts:
            cp.node_credentials(host)
        scheduler_kubeconfig = cp.kubeconfig("system:kube-scheduler")
        (secure_port,) = free_ports(1)
        manifests = state_dir / "manifests"
        manifest = manifests / "kube-scheduler.yaml"
        write_kubeadm_manifest(manifest, scheduler_kubeconfig, secure_port, lab.artifacts.git_version)
        runner = StaticPodRunner(manifest, lab.artifacts.binary("kube-scheduler"), lab.logs).start()
        nodes = {
            host: {"cert": str(cp.users[f"system:node:{host}"].cert.cert),  # type: ignore[union-attr]
                   "key": str(cp.users[f"system:node:{host}"].cert.key)}  # type: ignore[union-attr]
            for host in hosts
        }  # fmt: skip
        state = {
            "pid": os.getpid(),
            "lab_dir": str(lab.dir),
            "logs": str(lab.logs),
            "k8s_version": lab.artifacts.version,
            "k8s_bin": str(lab.artifacts.bin_dir),
            "k8s_images": str(lab.artifacts.images_dir),
            "apiserver": {"url": cp.url, "port": cp.port, "gateway_url": f"https://{GATEWAY}:{cp.port}"},
            "ca": str(cp.ca.cert),
            "kubeconfig": str(cp.kubeconfig()),
            "scheduler": {
                "kubeconfig": str(scheduler_kubeconfig),
                "manifest": str(manifest),
                "secure_port": secure_port,
            },
            "nodes": nodes,
            "prometheus": {"url": prometheus.url, "port": prometheus.port, "scrape": dict(scrape or {})},
            "repo": {
                "root": str(repo.root),
                "port": repo_server.port,
                "url": f"http://{GATEWAY}:{repo_server.port}",
            },
            "seconds": round(time.monotonic() - started, 1),
        }
        _write_json(state_dir / "supervisor.json", state)
        (state_dir / "ready").write_text(str(os.getpid()) + "\n")
        log.info("lab control plane up in %.1fs", time.monotonic() - started)
        while not stop.wait(1.0):
            for daemon in cp.daemons:
                daemon.check()
            prometheus.check()
        return 0
    finally:
        (state_dir / "ready").unlink(missing_ok=True)
        prometheus.stop()
        if runner is not None:
            runner.stop()
        lab.close()
        repo_server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufleet_harness.lab.supervisor")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--hosts", required=True, help="comma-separated node names to make certificates for")
    parser.add_argument("--scrape", default="", help="host=port,...: each host's /metrics on 127.0.0.1")
    args = parser.parse_args(argv)
    scrape = {host: int(port) for host, _, port in (p.partition("=") for p in args.scrape.split(",") if p)}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return serve(args.state_dir.resolve(), [h for h in args.hosts.split(",") if h], scrape)
    except Exception:
        log.exception("lab supervisor failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
