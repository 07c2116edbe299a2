"""Prometheus metrics (text exposition format) and the optional `/metrics` + `/healthz` HTTP endpoint.

The registry itself is gpufleet.metrics; this module names the plugin's series.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar
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


REQUEST_TIMEOUT_S = 10.0  # the longest wait for one read of a request (socket timeout)
HEADER_DEADLINE_S = 10.0  # the request line and headers must be in by then, however they trickle in
MAX_CONNECTIONS = 16  # connections served at once; more are closed unanswered (Prometheus uses one)


class _Deadlines:
    """Shuts down the connections whose request has not been read in full by their deadline: one thread for
    the server, however many connections trickle."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._open: dict[socket.socket, float] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="gpufleet-http-deadlines", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def watch(self, conn: socket.socket) -> None:
        with self._cond:
            self._open[conn] = time.monotonic() + self.seconds
            self._cond.notify()

    def done(self, conn: socket.socket) -> None:
        with self._cond:
            self._open.pop(conn, None)

    def _run(self) -> None:
        with self._cond:
            while not self._stopped:
                now = time.monotonic()
                for conn in [c for c, at in self._open.items() if at <= now]:
                    del self._open[conn]
                    with contextlib.suppress(OSError):  # the handler's blocked read ends, and its thread
                        conn.shutdown(socket.SHUT_RDWR)
                nearest = min(self._open.values(), default=now + 3600)
                self._cond.wait(max(0.0, nearest - now))


class _Server(ThreadingHTTPServer):
    """ThreadingHTTPServer that serves at most `limit` connections at once and closes any beyond."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], limit: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(limit)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # closed unanswered: costs no thread
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


class HttpEndpoint:
    """`GET /metrics` and `GET /healthz` on a background thread. `extra` adds already-rendered series (the
    GPU telemetry) to /metrics. A request costs the same whatever it carries: the query string is ignored,
    a body is never read, and http.server refuses request lines over 64 KiB and more than 100 headers.
    A connection's request line and headers must be in within `header_deadline_s` in all (one that
    trickles them is closed then), and at most `max_connections` are served at once (more are closed
    unanswered), so slow or many clients hold a bounded number of threads for a bounded time."""

    def __init__(
        self,
        address: str,
        port: int,
        metrics: Metrics,
        healthy: Callable[[], tuple[bool, str]],
        extra: Callable[[], str] | None = None,
        *,
        header_deadline_s: float = HEADER_DEADLINE_S,
        max_connections: int = MAX_CONNECTIONS,
    ) -> None:
        registry, check = metrics, healthy
        deadlines = self._deadlines = _Deadlines(header_deadline_s)

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S

            def setup(self) -> None:
                super().setup()
                deadlines.watch(self.connection)

            def finish(self) -> None:
                deadlines.done(self.connection)
                super().finish()

            def do_GET(self) -> None:
                deadlines.done(self.connection)  # the request is in: answering is not bounded by it
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

        self.server = _Server((address, port), Handler, max_connections)
        self._thread = threading.Thread(target=self.server.serve_forever, name="gpufleet-http", daemon=True)

    @property
    def port(self) -> int:
        """The bound port (useful with port 0)."""
        return int(self.server.server_address[1])

    def start(self) -> None:
        """Serve in the background."""
        self._deadlines.start()
        self._thread.start()

    def stop(self) -> None:
        """Stop serving and close the socket."""
        self.server.shutdown()
        self.server.server_close()
        self._deadlines.stop()
