"""Prometheus metrics (text exposition format) and the optional `/metrics` + `/healthz` HTTP endpoint.

Kept in the standard library: a handful of counters, gauges and one latency histogram do not justify a
new dependency on every GPU node.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

_HELP = {
    "gpufleet_dp_allocate_total": ("counter", "Allocate calls by resource and gRPC status code."),
    "gpufleet_dp_allocate_seconds": ("histogram", "Allocate handling time in seconds."),
    "gpufleet_dp_preferred_total": ("counter", "GetPreferredAllocation calls by resource and status code."),
    "gpufleet_dp_devices": ("gauge", "Advertised devices by resource and health."),
    "gpufleet_dp_listandwatch_streams": ("gauge", "Open ListAndWatch streams by resource."),
    "gpufleet_dp_registrations_total": ("counter", "Registrations with the kubelet by resource and result."),
    "gpufleet_dp_kubelet_restarts_total": ("counter", "Kubelet restarts (kubelet.sock recreated) seen."),
    "gpufleet_dp_health_events_total": ("counter", "NVML health events by kind and code."),
    "gpufleet_dp_health_transitions_total": ("counter", "GPU health changes by new state."),
    "gpufleet_dp_handoff_total": ("counter", "GPU-memory hand-off outcomes."),
}
_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0)

Labels = tuple[tuple[str, str], ...]


def _labels(labels: dict[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def _fmt(name: str, labels: Labels, value: float) -> str:
    def esc(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    body = ",".join(f'{k}="{esc(v)}"' for k, v in labels)
    return f"{name}{{{body}}} {value:g}" if body else f"{name} {value:g}"


class Metrics:
    """A tiny thread-safe metrics registry."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = {}
        self._hist: dict[str, dict[Labels, list[float]]] = {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        """Add to a counter."""
        key = _labels(labels)
        with self._lock:
            series = self._values.setdefault(name, {})
            series[key] = series.get(key, 0.0) + value

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        with self._lock:
            self._values.setdefault(name, {})[_labels(labels)] = value

    def get(self, name: str, **labels: str) -> float:
        """Current value of a counter or gauge series (0 when never set)."""
        with self._lock:
            return self._values.get(name, {}).get(_labels(labels), 0.0)

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Record one observation in a histogram: per-bucket counts, then sum and count."""
        key = _labels(labels)
        with self._lock:
            cells = self._hist.setdefault(name, {}).setdefault(key, [0.0] * (len(_BUCKETS) + 2))
            for i, bound in enumerate(_BUCKETS):
                if value <= bound:
                    cells[i] += 1
            cells[-2] += value
            cells[-1] += 1

    def render(self) -> str:
        """All series in Prometheus text format."""
        lines: list[str] = []
        with self._lock:
            for name in sorted(set(self._values) | set(self._hist)):
                kind, text = _HELP.get(name, ("untyped", name))
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                for key, value in sorted(self._values.get(name, {}).items()):
                    lines.append(_fmt(name, key, value))
                for key, cells in sorted(self._hist.get(name, {}).items()):
                    for bound, count in zip(_BUCKETS, cells, strict=False):
                        lines.append(_fmt(f"{name}_bucket", (*key, ("le", f"{bound:g}")), count))
                    lines.append(_fmt(f"{name}_bucket", (*key, ("le", "+Inf")), cells[-1]))
                    lines.append(_fmt(f"{name}_sum", key, cells[-2]))
                    lines.append(_fmt(f"{name}_count", key, cells[-1]))
        return "\n".join(lines) + "\n"


class HttpEndpoint:
    """`GET /metrics` and `GET /healthz` on a background thread."""

    def __init__(
        self, address: str, port: int, metrics: Metrics, healthy: Callable[[], tuple[bool, str]]
    ) -> None:
        registry, check = metrics, healthy

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    self._send(200, registry.render(), "text/plain; version=0.0.4")
                elif self.path == "/healthz":
                    ok, why = check()
                    self._send(200 if ok else 503, why + "\n", "text/plain")
                else:
                    self._send(404, "not found\n", "text/plain")

            def _send(self, code: int, body: str, ctype: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: object) -> None:
                pass  # scrapes every few seconds would drown the event log

        self.server = ThreadingHTTPServer((address, port), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, name="gpufleet-http", daemon=True)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self.server.server_address[1])

    def start(self) -> None:
        """Serve in the background."""
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()
