"""The lab's long-running side on this machine: the stand-in APT repository and Prometheus.

``python -m gpufleet_harness.lab.supervisor --state-dir DIR`` is started detached by ``gpufleet lab up``
and runs until SIGTERM (``gpufleet lab down``). It owns, and stops on exit:

- the signed stand-in APT repository (NVIDIA's container toolkit and fabric manager are not reachable here);
- Debian's Prometheus (:mod:`gpufleet_harness.prometheus`), scraping each host's device plugin /metrics on the
  loopback port ``gpufleet lab up`` published it on (``--scrape host=port,...``), each target labelled with
  its node.

The Kubernetes control plane is not here: kubeadm runs it in a host of its own
(:mod:`gpufleet_harness.lab.kubeadm`). When everything is up it writes ``supervisor.json`` (ports, repository
URL) and ``ready``; the CLI waits for them.
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

from gpufleet_harness.prometheus import Prometheus, ScrapeTarget
from gpufleet_harness.testhosts.aptrepo import RepoServer, build_repo

from .spec import GATEWAY

log = logging.getLogger("gpufleet_harness.lab.supervisor")


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2) + "\n")
    tmp.chmod(0o600)
    tmp.replace(path)


SCRAPE_INTERVAL_S = 5.0


def serve(state_dir: Path, scrape: dict[str, int] | None = None) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / "ready").unlink(missing_ok=True)
    started = time.monotonic()
    repo = build_repo(state_dir / "apt-repo")
    repo_server = RepoServer(repo.root).start()
    targets = [ScrapeTarget(f"127.0.0.1:{port}", {"node": host}) for host, port in (scrape or {}).items()]
    prometheus = Prometheus(state_dir / "prometheus", targets, SCRAPE_INTERVAL_S)
    try:
        prometheus.start()
        state = {
            "pid": os.getpid(),
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
        log.info("lab supervisor up in %.1fs", time.monotonic() - started)
        while not stop.wait(1.0):
            prometheus.check()
        return 0
    finally:
        (state_dir / "ready").unlink(missing_ok=True)
        prometheus.stop()
        repo_server.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufleet_harness.lab.supervisor")
    parser.add_argument("--state-dir", required=True, type=Path)
    parser.add_argument("--scrape", default="", help="host=port,...: each host's /metrics on 127.0.0.1")
    args = parser.parse_args(argv)
    scrape = {host: int(port) for host, _, port in (p.partition("=") for p in args.scrape.split(",") if p)}
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return serve(args.state_dir.resolve(), scrape)
    except Exception:
        log.exception("lab supervisor failed")
        return 1


if __name__ == "__main__":
    sys.exit(main())
