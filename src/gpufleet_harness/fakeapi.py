"""A Kubernetes API server stand-in over HTTP, backed by InMemoryCluster: for `KubeCluster`'s tests and the
extender's benchmark over HTTP (an extender process that lists and watches through the real client).

It speaks just the endpoints the extender uses (list, paged with ``limit`` and ``continue``, watch,
get and merge-patch of nodes and pods, pods/binding; nodes and pods as metadata only when the Accept header
asks, as `PartialObjectMetadataList` and `PartialObjectMetadata`),
answers errors as `Status` objects with the right codes, keeps an event log so a watch from a
resourceVersion replays what it missed, and answers 410 for versions older than the log.
"""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from gpufleet.extender.cluster import ApiError
from gpufleet_harness.memapi import InMemoryCluster


class _Recorder:
    """A ClusterSink that appends every change to the fake's event log."""

    def __init__(self, fake: FakeApiServer) -> None:
        self.fake = fake

    def replace_nodes(self, objs: Any) -> None:
        pass

    def replace_pods(self, objs: Any) -> None:
        pass

    def upsert_node(self, obj: dict[str, Any]) -> None:
        self.fake.record("nodes", "MODIFIED", obj)

    def delete_node(self, obj: dict[str, Any]) -> None:
        self.fake.record("nodes", "DELETED", obj)

    def upsert_pod(self, obj: dict[str, Any]) -> None:
        self.fake.record("pods", "MODIFIED", obj)

    def delete_pod(self, obj: dict[str, Any]) -> None:
        self.fake.record("pods", "DELETED", obj)

    def set_watch_error(self, message: str | None) -> None:
        pass


class FakeApiServer:
    """Serve `cluster` at `self.url` until `close()`."""

    def __init__(self, cluster: InMemoryCluster, port: int = 0) -> None:
        self.cluster = cluster
        self.events: list[tuple[int, str, str, dict[str, Any]]] = []
        self.oldest = 0  # watches from before this resourceVersion get 410 Gone
        self.requests: list[tuple[str, str, str, Any]] = []  # method, path, content type, body
        self.accepts: list[tuple[str, str]] = []  # (path with query, Accept) of every GET
        # Snapshots of paged lists, their objects encoded, by (kind, field selector, metadata only,
        # resourceVersion), for their continue tokens.
        self.pages: dict[tuple[str, str, bool, str], list[str]] = {}
        # Each object's JSON by (kind, metadata only), then (namespace, name) -> (resourceVersion, text):
        # every change bumps the resourceVersion (InMemoryCluster._bump), so the pair names one content.
        # A real API server's watch cache keeps serializations much like this, and its Go encoder is far
        # quicker than json.dumps; without the memo a 5,000-node list spends seconds here, not in the client.
        self.encodings: dict[tuple[str, bool], dict[tuple[str, str], tuple[str, str]]] = {}
        self.cond = threading.Condition()
        self.stop = threading.Event()
        self._recorder = threading.Thread(
            target=cluster.watch, args=(_Recorder(self), self.stop), daemon=True
        )
        self._recorder.start()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self))
        self.server.daemon_threads = True
        threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        ).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def write_kubeconfig(self, path: Path) -> Path:
        """A kubeconfig naming this server (no credentials: the stand-in checks none); returns ``path``."""
        path.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{self.url}'}}}}]\n"
            "users: [{name: nobody, user: {}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: nobody}}]\n"
        )
        return path

    def encoder(self, kind: str, metadata: bool) -> Callable[[dict[str, Any]], str]:
        """JSON of an object of `kind` as a list item (its `PartialObjectMetadata` when `metadata`),
        encoded once per resourceVersion."""
        memo = self.encodings.setdefault((kind, metadata), {})

        def encode(obj: dict[str, Any]) -> str:
            meta = obj["metadata"]
            key, version = (meta.get("namespace") or "", meta["name"]), meta["resourceVersion"]
            known = memo.get(key)
            if known is None or known[0] != version:
                known = memo[key] = (version, json.dumps(_partial(obj) if metadata else obj))
            return known[1]

        return encode

    def record(self, kind: str, change: str, obj: dict[str, Any]) -> None:
        with self.cond:
            self.events.append((int(obj["metadata"]["resourceVersion"]), kind, change, obj))
            self.cond.notify_all()

    def compact(self) -> None:
        """Forget the event log, as etcd compaction does: older watches must relist."""
        with self.cond:
            self.oldest = int(self.cluster.snapshot()[2]) + 1
            self.events.clear()

    def close(self) -> None:
        self.stop.set()
        with self.cond:
            self.cond.notify_all()
        self.server.shutdown()
        self.server.server_close()


def _status(code: int, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "code": code,
    }


def _negotiate(accept: str, servable: str) -> bool | None:
    """Whether to answer metadata only: the first media type of the Accept header this request can be
    served as, as the real API server negotiates. `servable` is the `as=` form the request allows
    (PartialObjectMetadataList for a list, PartialObjectMetadata for a watch); None: nothing acceptable."""
    for media in (accept or "application/json").split(","):
        kind, *params = (part.strip() for part in media.split(";"))
        if kind not in ("application/json", "*/*", "application/*"):
            continue
        options = dict(p.partition("=")[::2] for p in params)
        if "as" not in options:
            return False
        if options == {"as": servable, "g": "meta.k8s.io", "v": "v1"}:
            return True
    return None


def _partial(obj: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1", "metadata": obj["metadata"]}


def _handler(fake: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # HTTP/1.1 with chunked watch bodies, as the real API server streams them: each event arrives
        # as its own chunk, so the client sees it at once.
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, code: int, doc: Any) -> None:
            self._send_bytes(code, json.dumps(doc).encode())

        def _send_bytes(self, code: int, data: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _body(self) -> Any:
            data = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            return json.loads(data) if data else None

        def _dispatch(self, method: str) -> None:
            if fake.stop.is_set():
                # An outage drops connections; a kept-alive one must not keep answering.
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)
                return
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            body = self._body() if method in ("PATCH", "POST") else None
            fake.requests.append((method, parts.path, self.headers.get("Content-Type", ""), body))
            if method == "GET":
                fake.accepts.append((self.path, self.headers.get("Accept", "")))
            segments = parts.path.strip("/").split("/")
            try:
                if segments[:2] != ["api", "v1"]:
                    raise ApiError(f"no route {parts.path}", 404)
                rest = segments[2:]
                if rest in (["nodes"], ["pods"]) and method == "GET":
                    watch = query.get("watch") == "true"
                    accept = self.headers.get("Accept", "")
                    wanted = _negotiate(accept, "PartialObjectMetadata" + ("" if watch else "List"))
                    if wanted is None:
                        raise ApiError(f"none of {accept!r} can be served", 406)
                    if watch:
                        self._watch(
                            rest[0],
                            int(query.get("resourceVersion", "0")),
                            float(query.get("timeoutSeconds", "30")),
                            wanted,
                        )
                    else:
                        self._list(
                            rest[0],
                            query.get("fieldSelector", ""),
                            int(query.get("limit", "0")),
                            query.get("continue", ""),
                            wanted,
                        )
                elif rest[:1] == ["nodes"] and len(rest) == 2:
                    if method == "GET":
                        self._send(200, fake.cluster.get_node(rest[1]))
                    else:
                        assert self.headers["Content-Type"] == "application/merge-patch+json"
                        meta = body["metadata"]
                        self._send(
                            200,
                            fake.cluster.patch_node_annotations(
                                rest[1], meta["annotations"], meta["resourceVersion"]
                            ),
                        )
                elif rest[:1] == ["namespaces"] and rest[2:3] == ["pods"] and len(rest) == 4:
                    namespace, name = rest[1], rest[3]
                    if method == "GET":
                        self._send(200, fake.cluster.get_pod(namespace, name))
                    else:
                        assert self.headers["Content-Type"] == "application/merge-patch+json"
                        meta = body["metadata"]
                        self._send(
                            200,
                            fake.cluster.patch_pod_annotations(
                                namespace,
                                name,
                                meta.get("uid", ""),
                                meta["annotations"],
                                meta.get("resourceVersion"),
                            ),
                        )
                elif rest[:1] == ["namespaces"] and rest[4:] == ["binding"] and method == "POST":
                    assert body["kind"] == "Binding" and body["target"]["kind"] == "Node"
                    fake.cluster.bind_pod(
                        rest[1], rest[3], body["metadata"].get("uid", ""), body["target"]["name"]
                    )
                    self._send(
                        201,
                        {
                            "kind": "Status",
                            "apiVersion": "v1",
                            "metadata": {},
                            "status": "Success",
                            "code": 201,
                        },
                    )
                else:
                    raise ApiError(f"no route {method} {parts.path}", 404)
            except ApiError as exc:
                code = exc.status or 500
                self._send(code, _status(code, str(exc)))

        def _list(self, kind: str, selector: str, limit: int, token: str, metadata: bool) -> None:
            if token:
                # A continuation reads the snapshot its first page was cut from, as the real server does.
                try:
                    version, offset = token.split(":")
                    items = fake.pages[(kind, selector, metadata, version)]
                except (ValueError, KeyError):
                    raise ApiError("continue token expired or invalid", 410) from None
                start = int(offset)
            else:
                keep = None
                if selector.startswith("spec.nodeName="):
                    wanted = selector.split("=", 1)[1]
                    keep = lambda p: (p.get("spec") or {}).get("nodeName") == wanted  # noqa: E731
                items, version = fake.cluster.encoded(kind, fake.encoder(kind, metadata), keep)
                start = 0
            end = start + limit if limit > 0 else len(items)
            meta: dict[str, Any] = {"resourceVersion": version}
            if end < len(items):
                fake.pages[(kind, selector, metadata, version)] = items
                meta["continue"] = f"{version}:{end}"
            else:  # the last page: the snapshot is not needed any more
                fake.pages.pop((kind, selector, metadata, version), None)
            head = (
                {"kind": "PartialObjectMetadataList", "apiVersion": "meta.k8s.io/v1"}
                if metadata
                else {"kind": "List", "apiVersion": "v1"}
            )
            head_json = json.dumps({**head, "metadata": meta})[:-1]
            self._send_bytes(200, f'{head_json}, "items": [{", ".join(items[start:end])}]}}'.encode())

        def _watch(self, kind: str, since: int, timeout: float, metadata: bool) -> None:
            if since < fake.oldest - 1:
                self._send(410, _status(410, "too old resource version"))
                return
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            deadline = time.monotonic() + timeout
            position = 0
            while not fake.stop.is_set() and time.monotonic() < deadline:
                with fake.cond:
                    position = min(position, len(fake.events))  # the log was compacted
                    pending = [e for e in fake.events[position:] if e[1] == kind and e[0] > since]
                    position = len(fake.events)
                    if not pending:
                        fake.cond.wait(0.05)
                        continue
                for version, _, change, obj in pending:
                    shown = _partial(obj) if metadata else obj
                    line = json.dumps({"type": change, "object": shown}).encode() + b"\n"
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
                    since = version
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            if fake.stop.is_set():
                self.close_connection = True

        def do_GET(self) -> None:
            self._dispatch("GET")

        def do_PATCH(self) -> None:
            self._dispatch("PATCH")

        def do_POST(self) -> None:
            self._dispatch("POST")

    return Handler


def extender_command(kubeconfig: Path, port: int) -> list[str]:
    """``gpufleet-extender serve`` as a Python process of its own, on 127.0.0.1:``port``, reading
    ``kubeconfig`` (e.g. :meth:`FakeApiServer.write_kubeconfig`)."""
    return [sys.executable, "-m", "gpufleet.extender", "serve", "--kubeconfig", str(kubeconfig),
            "--listen-address", "127.0.0.1", "--port", str(port)]  # fmt: skip
