"""The HTTP(S) face of the extender: the scheduler's verbs plus inspect, healthz, readyz, metrics, version.

Standard library `ThreadingHTTPServer` with HTTP/1.1 keep-alive (the scheduler's Go client reuses
connections). TLS handshakes run in the per-connection thread, so a slow or hostile client cannot stall
`accept()`. Every failure inside a handler becomes a JSON error response; the process stays up.
"""

from __future__ import annotations

import json
import logging
import socket
import ssl
import sys
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import unquote, urlsplit

from gpufleet.extender.api import BadRequest
from gpufleet.extender.service import Extender
from gpufleet.extender.settings import Settings
from gpufleet.logs import log_event

VERBS = ("filter", "prioritize", "bind")
# What answers without a client certificate when a client CA is set: the kubelet's liveness and readiness
# probes present none (an HTTPS probe only encrypts), and these two say nothing about the cluster.
OPEN_PATHS = ("/healthz", "/readyz")
# Idle keep-alive connections are closed after this many seconds.
CONNECTION_TIMEOUT = 120.0


class ExtenderServer(ThreadingHTTPServer):
    """Serves one `Extender`."""

    daemon_threads = True
    allow_reuse_address = True
    # socketserver's listen backlog is 5: a burst of new connections (a restarted scheduler, several
    # schedulers, a busy accept loop) would overflow it, and Linux drops the extra SYNs, which clients
    # retry only after 1 s, then 3 s. The kernel caps this at net.core.somaxconn.
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], extender: Extender, settings: Settings) -> None:
        self.extender = extender
        self.settings = settings
        self.prefix = "" if settings.url_prefix == "/" else settings.url_prefix
        self.max_body = settings.max_body_mib * 1024 * 1024
        self.tls: ssl.SSLContext | None = None
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Broken connections (TLS refused, resets) are routine; anything else is a bug worth a traceback."""
        exc = sys.exc_info()[1]
        client = str(client_address[0]) if client_address else None
        if isinstance(exc, ConnectionError | TimeoutError | ssl.SSLError):
            log_event("connection_error", logging.DEBUG, client=client, error=repr(exc))
        else:
            log_event("connection_crashed", logging.ERROR, exc=exc, client=client)

    @property
    def url(self) -> str:
        """Where the scheduler should point urlPrefix (loopback when bound to all interfaces)."""
        host, port = self.server_address[:2]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else str(host)
        scheme = "https" if self.tls else "http"
        return f"{scheme}://{host}:{port}{self.prefix}"


def tls_context(settings: Settings) -> ssl.SSLContext:
    """Server TLS context; with a client CA, a certificate a client presents must be signed by it (else the
    handshake fails), and every request but GET OPEN_PATHS must come with one (the handler refuses it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(settings.tls_cert_file, settings.tls_key_file)
    if settings.tls_client_ca_file:
        # OPTIONAL, not REQUIRED: the kubelet's HTTPS probes present no certificate, and a Deployment whose
        # probes cannot connect never becomes ready. The handler asks for the certificate instead.
        context.verify_mode = ssl.CERT_OPTIONAL
        context.load_verify_locations(settings.tls_client_ca_file)
    return context


def make_server(extender: Extender, settings: Settings) -> ExtenderServer:
    """Bind the listening socket (port 0 picks a free one) and wrap it in TLS when configured."""
    server = ExtenderServer((settings.listen_address, settings.port), extender, settings)
    if settings.https:
        server.tls = tls_context(settings)
        server.socket = server.tls.wrap_socket(server.socket, server_side=True, do_handshake_on_connect=False)
    return server


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "gpufleet-extender"
    timeout = CONNECTION_TIMEOUT
    # Buffer each response (headers + body) into one write, flushed by http.server after every request:
    # headers and body in separate small segments would meet Nagle's algorithm and the client's
    # delayed ACK, costing ~40 ms per call.
    wbufsize = 256 * 1024
    server: ExtenderServer

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if isinstance(self.connection, ssl.SSLSocket):
            self.connection.do_handshake()

    def log_message(self, format: str, *args: Any) -> None:
        log_event("http", logging.DEBUG, line=format % args)

    # ------------------------------------------------------------------ plumbing

    def _send(self, status: int, body: Any, content_type: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else json.dumps(body, separators=(",", ":")).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refused_without_certificate(self) -> bool:
        """True (after answering 401) when a client CA is set and this connection presented no certificate
        signed by it; only GET OPEN_PATHS are answered without one."""
        if not self.server.settings.tls_client_ca_file or not isinstance(self.connection, ssl.SSLSocket):
            return False
        if self.connection.getpeercert():
            return False
        if self.command == "GET" and (self._path().rstrip("/") or "/") in OPEN_PATHS:
            return False
        self.close_connection = True  # a POST body stays unread
        self._send(
            HTTPStatus.UNAUTHORIZED, {"Error": "a client certificate signed by the client CA is required"}
        )
        return True

    def _path(self) -> str:
        path = unquote(urlsplit(self.path).path)
        prefix = self.server.prefix
        if prefix and (path == prefix or path.startswith(prefix + "/")):
            path = path[len(prefix) :] or "/"
        return path

    def _read_body(self) -> bytes:
        """The request body, read in full so the connection stays usable whatever happens next."""
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            self.close_connection = True
            raise _HttpError(HTTPStatus.LENGTH_REQUIRED, "send Content-Length, not chunked bodies")
        raw_length = self.headers.get("Content-Length")
        if raw_length is None:
            self.close_connection = True
            raise _HttpError(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
        try:
            length = int(raw_length)
        except ValueError:
            self.close_connection = True
            raise _HttpError(HTTPStatus.BAD_REQUEST, "Content-Length is not a number") from None
        if length < 0 or length > self.server.max_body:
            self.close_connection = True  # the body stays unread; the connection cannot be reused
            raise _HttpError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, f"body over {self.server.max_body} bytes")
        return self.rfile.read(length)

    @staticmethod
    def _parse(data: bytes) -> Any:
        # ValueError covers bad JSON, bad UTF-8 and integers past Python's 4,300-digit conversion limit;
        # the C decoder's recursion guard bounds nesting (about 1,000 levels: no scheduler message nests
        # deeper than a few dozen) and raises RecursionError, which is the client's fault too.
        try:
            return json.loads(data)
        except ValueError as exc:
            raise _HttpError(HTTPStatus.BAD_REQUEST, f"body is not JSON: {str(exc)[:200]}") from None
        except RecursionError:
            raise _HttpError(HTTPStatus.BAD_REQUEST, "body is JSON nested too deep") from None

    # ------------------------------------------------------------------ verbs

    def do_POST(self) -> None:
        verb = self._path().strip("/")
        started = time.perf_counter()
        status = HTTPStatus.OK
        if self._refused_without_certificate():
            return
        try:
            body = self._read_body()
            if verb not in VERBS:
                raise _HttpError(HTTPStatus.NOT_FOUND, f"no verb {verb!r}; POST one of {', '.join(VERBS)}")
            args = self._parse(body)
            api = self.server.extender.api
            result = (
                api.filter_json(args)
                if verb == "filter"
                else (api.prioritize_json(args) if verb == "prioritize" else api.bind(args))
            )
            self._send(status, result)
        except _HttpError as exc:
            status = exc.status
            self._send(status, {"Error": exc.message})
        except BadRequest as exc:
            status = HTTPStatus.BAD_REQUEST
            self._send(status, {"Error": str(exc)})
        except (ConnectionError, TimeoutError):
            status = HTTPStatus.REQUEST_TIMEOUT
            self.close_connection = True
        except Exception as exc:  # the scheduler gets an error, the process keeps serving
            status = HTTPStatus.INTERNAL_SERVER_ERROR
            log_event("handler_crashed", logging.ERROR, exc=exc, verb=verb)
            self._send(status, {"Error": f"internal error: {exc!r}"})
        finally:
            metrics = self.server.extender.metrics
            label = verb if verb in VERBS else "other"
            metrics.inc("gpufleet_extender_requests_total", verb=label, code=str(int(status)))
            metrics.observe("gpufleet_extender_request_seconds", time.perf_counter() - started, verb=label)

    def do_GET(self) -> None:
        path = self._path().rstrip("/") or "/"
        extender = self.server.extender
        if self._refused_without_certificate():
            return
        try:
            if path == "/healthz":
                self._send(HTTPStatus.OK, {"status": "ok"})
            elif path == "/readyz":
                ready = extender.state.synced
                self._send(
                    HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE,
                    {"ready": ready, "watch_error": extender.state.watch_error},
                )
            elif path == "/metrics":
                self._send(HTTPStatus.OK, extender.metrics.render().encode(), "text/plain; version=0.0.4")
            elif path == "/version":
                self._send(HTTPStatus.OK, extender.version())
            elif path == "/inspect":
                self._send(HTTPStatus.OK, extender.state.inspect())
            elif path.startswith("/inspect/"):
                node = path[len("/inspect/") :]
                found = extender.state.inspect_node(node)
                if found is None:
                    self._send(
                        HTTPStatus.NOT_FOUND, {"Error": f"node {node!r} is not in the extender's cache"}
                    )
                else:
                    self._send(HTTPStatus.OK, found)
            else:
                self._send(HTTPStatus.NOT_FOUND, {"Error": f"nothing at {path}"})
        except (ConnectionError, TimeoutError):
            self.close_connection = True
        except Exception as exc:
            log_event("handler_crashed", logging.ERROR, exc=exc, path=path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"Error": f"internal error: {exc!r}"})


class _HttpError(Exception):
    def __init__(self, status: HTTPStatus, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
