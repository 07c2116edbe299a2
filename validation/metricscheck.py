"""The Prometheus side of validation: instant queries and scrape targets through Prometheus's HTTP API.

Settings come from the expectations' ``cluster.prometheus`` section: ``url`` (the Prometheus that scrapes
the GPU nodes' device plugins) and ``timeout`` (seconds a check waits for a series to appear, default 90:
a telemetry round, a scrape interval and a rule of slack). Standard library only.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any

DEFAULT_TIMEOUT_S = 90.0
# The GPU series every GPU has wherever NVML reads its memory (docs/metrics.md).
GPU_SERIES = "DCGM_FI_DEV_FB_USED"
UP_SERIES = "gpufleet_gpu_up"


class PrometheusError(Exception):
    """Prometheus could not be asked, or answered an error; the message says which and why."""


class PrometheusApi:
    """The few calls the checks make, against one Prometheus."""

    def __init__(self, settings: dict[str, Any]) -> None:
        url = settings.get("url")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"cluster.prometheus.url is {url!r}: expected an http(s) URL of Prometheus")
        self.url = url.rstrip("/")
        self.timeout_s = float(settings.get("timeout", DEFAULT_TIMEOUT_S))

    def _get(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        where = f"{self.url}/api/v1/{path}"
        try:
            with urllib.request.urlopen(f"{where}?{query}", timeout=15) as response:
                doc = json.load(response)
        except urllib.error.HTTPError as exc:
            doc = json.loads(exc.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PrometheusError(f"Prometheus at {self.url} does not answer: {exc}") from None
        if doc.get("status") != "success":
            why = f"{doc.get('errorType')}: {doc.get('error')}"
            raise PrometheusError(f"Prometheus at {self.url}: {path}: {why}")
        return doc["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's samples: each {"metric": {label: value}, "value": [time, "value"]}."""
        return list(self._get("query", query=expr)["result"])

    def wait(
        self, expr: str, enough: Callable[[list[dict[str, Any]]], bool] = bool
    ) -> tuple[list[dict[str, Any]], float]:
        """(samples, seconds waited): polls `expr` until its samples are `enough` (default: any) or the
        timeout passes (a device plugin just deployed may not have been scraped yet)."""
        started = time.monotonic()
        while True:
            found = self.query(expr)
            waited = time.monotonic() - started
            if enough(found) or waited >= self.timeout_s:
                return found, waited
            time.sleep(1.0)

    def targets_of(self, node: str) -> list[str]:
        """The scrape targets labelled ``node=<node>``, each as "<url> is <health>[: <last error>]"."""
        out = []
        for target in self._get("targets", state="active")["activeTargets"]:
            if (target.get("labels") or {}).get("node") == node:
                error = target.get("lastError") or ""
                said = f"{target.get('scrapeUrl')} is {target.get('health')}"
                out.append(f"{said}: {error}" if error else said)
        return out


def uuid_regex(uuids: list[str]) -> str:
    """A PromQL regex matching exactly these UUIDs (they hold only hex digits and dashes)."""
    return "|".join(uuids)
