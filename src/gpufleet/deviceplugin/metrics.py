"""Prometheus metrics (text exposition format) and the optional `/metrics` + `/healthz` HTTP endpoint.

The registry itself is gpufleet.metrics; this module names the plugin's series.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar
from urllib.parse import urlsplit

from gpufleet.metrics import Metrics as BaseMetrics


class Metrics(BaseMetrics):
    """The device plugin's series."""

    HELP: ClassVar[dict[str, tuple[str, str]]] = {
        "gpufleet_dp_allocate_total": ("counter", "Allocate calls by resource and gRPC status code."),
        "gpufleet_dp_allocate_seconds": ("histogram", "Allocate handling time in seconds."),
        "gpufleet_dp_preferred_total": (
            "counter", "GetPreferredAllocation calls by resource and status code."
        ),
        "gpufleet_dp_devices": ("gauge", "Advertised devices by resource and health."),
        "gpufleet_dp_listandwatch_streams": ("gauge", "Open ListAndWatch streams by resource."),
        "gpufleet_dp_registrations_total": (
            "counter", "Registrations with the kubelet by resource and result."
        ),
        "gpufleet_dp_kubelet_restarts_total": ("counter", "Kubelet restarts (kubelet.sock recreated) seen."),
        "gpufleet_dp_health_events_total": ("counter", "NVML health events by kind and code."),
        "gpufleet_dp_health_transitions_total": ("counter", "GPU health changes by new state."),
        "gpufleet_dp_handoff_total": ("counter", "GPU-memory hand-off outcomes."),
    }


REQUEST_TIMEOUT_S = 10.0  # a client that stalls mid-request holds its connection's thread this long at most


class HttpEndpoint:
    """`GET /metrics` and `GET /healthz` on a background thread. `extra` adds already-rendered series (the
    GPU telemetry) to /metrics. A request costs the same whatever it carries: the query string is ignored,
    a body is never read, and http.server refuses request lines over 64 KiB and more than 100 headers."""

    def __init__(
        self,
        address: str,
        port: int,
        metrics: Metrics,
        healthy: Callable[[], tuple[bool, str]],
        extra: Callable[[], str] | None = None,
    ) -> None:
        registry, check = metrics, healthy

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def do_GET(self) -> None:
                path = urlsplit(self.path).path
                if path == "/metrics":
                    body = registry.render() + (extra() if extra else "")
                    self._send(200, body, "text/plain; version=0.0.4")
                elif path == "/healthz":
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
