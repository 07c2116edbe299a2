"""Debian's Prometheus (package ``prometheus``) on a free loopback port, scraping fixed targets: the lab's
GPU nodes, or a device plugin on the simulator in a test. Queries go through its HTTP API.

    with Prometheus(workdir, [ScrapeTarget("127.0.0.1:9402", {"node": "n1"})], interval_s=1) as prom:
        prom.wait_for("up == 1")
        prom.query('DCGM_FI_DEV_GPU_TEMP{Hostname="n1"}')   # [{"metric": {...}, "value": [ts, "31"]}, ...]
"""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from gpufleet_harness.cluster.process import ClusterError, Daemon, free_ports, wait_for

BINARY = "prometheus"
JOB = "gpufleet-gpu"
READY_TIMEOUT_S = 60.0


class PrometheusMissing(ClusterError):
    """Debian's prometheus binary is not installed (scripts/bootstrap installs the package)."""


@dataclass(frozen=True)
class ScrapeTarget:
    """One endpoint to scrape, `host:port`, with labels of its own (e.g. the node it is)."""

    address: str
    labels: dict[str, str] = field(default_factory=dict)


def binary() -> str:
    """The prometheus executable; PrometheusMissing when the package is not installed."""
    found = shutil.which(BINARY)
    if not found:
        raise PrometheusMissing(
            "Debian's prometheus is not installed: apt-get install prometheus (scripts/bootstrap does)"
        )
    return found


def scrape_config(targets: Sequence[ScrapeTarget], interval_s: float, job: str = JOB) -> dict[str, Any]:
    """A prometheus.yml scraping `targets` every `interval_s` seconds at /metrics."""
    interval = f"{max(1, round(interval_s * 1000))}ms"
    return {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "scrape_configs": [
            {
                "job_name": job,
                "scrape_interval": interval,
                "scrape_timeout": interval,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": [t.address], "labels": dict(t.labels)} for t in targets],
            }
        ],
    }


class Prometheus:
    """One Prometheus process with its own config and storage under `workdir`."""

    def __init__(
        self,
        workdir: Path,
        targets: Sequence[ScrapeTarget],
        interval_s: float = 5.0,
        port: int | None = None,
    ) -> None:
        self.workdir = workdir
        self.targets = list(targets)
        self.interval_s = interval_s
        self.port = port or free_ports(1)[0]
        self.daemon: Daemon | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Prometheus:
        """Write the config, start the process, wait until it is ready (ClusterError with its log if not)."""
        exe = binary()
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "prometheus.yml"
        config.write_text(yaml.safe_dump(scrape_config(self.targets, self.interval_s), sort_keys=False))
        argv = [
            exe,
            f"--config.file={config}",
            f"--storage.tsdb.path={self.workdir / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--storage.tsdb.retention.time=1d",
            "--log.level=warn",
        ]
        self.daemon = Daemon("prometheus", argv, self.workdir / "prometheus.log", cwd=self.workdir)
        wait_for(
            "prometheus to be ready", self._ready, READY_TIMEOUT_S, interval=0.2, alive=self.daemon.check
        )
        return self

    def check(self) -> None:
        """Raise ClusterError with the log tail if the process has exited."""
        if self.daemon is not None:
            self.daemon.check()

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None

    def __enter__(self) -> Prometheus:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def api(self, path: str, **params: str) -> Any:
        """GET /api/v1/<path> with `params`; its `data` (ClusterError when Prometheus answers an error)."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as response:
                doc = json.load(response)
        except urllib.error.HTTPError as exc:
            doc = json.loads(exc.read() or b"{}")
        if doc.get("status") != "success":
            said = f"{doc.get('errorType')}: {doc.get('error')}"
            raise ClusterError(f"prometheus /api/v1/{path}?{query}: {said}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant vector query: its samples, each {"metric": labels, "value": [time, "value"]}."""
        data = self.api("query", query=expr)
        return list(data["result"])

    def wait_for(self, expr: str, timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Wait until `expr` returns samples; return them (ClusterError after the timeout)."""
        return wait_for(f"prometheus to answer {expr}", lambda: self.query(expr), timeout_s, interval=0.5)
