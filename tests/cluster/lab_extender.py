"""A pass-through kube-scheduler extender for tests: records every call, keeps every node, scores 0."""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class ExtenderCall:
    """One request the scheduler made: verb, pod and the candidate node names."""

    verb: str
    namespace: str
    pod: str
    nodes: tuple[str, ...]


class PassThroughExtender:
    """HTTP extender on 127.0.0.1 (free port) that accepts all nodes for ``managed_resources``."""

    def __init__(self, managed_resources: tuple[str, ...] = ("example.com/gpu-mem",)) -> None:
        self.managed_resources = managed_resources
        self.calls: list[ExtenderCall] = []
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="lab-extender", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def config(self) -> dict[str, Any]:
        """The ``extenders`` section of a KubeSchedulerConfiguration pointing at this server."""
        return {
            "extenders": [{
                "urlPrefix": self.url, "filterVerb": "filter", "prioritizeVerb": "prioritize", "weight": 1,
                "enableHTTPS": False, "nodeCacheCapable": False, "ignorable": False,
                "managedResources": [{"name": r, "ignoredByScheduler": True} for r in self.managed_resources],
            }]
        }  # fmt: skip

    def calls_for(self, pod: str, verb: str = "filter") -> list[ExtenderCall]:
        with self._lock:
            return [c for c in self.calls if c.pod == pod and c.verb == verb]

    def start(self) -> PassThroughExtender:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        extender = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                args = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                meta = (args.get("Pod") or {}).get("metadata", {})
                nodes = args.get("Nodes") or {}
                names = args.get("NodeNames") or [n["metadata"]["name"] for n in nodes.get("items") or []]
                verb = self.path.rstrip("/").rsplit("/", 1)[-1]
                with extender._lock:
                    extender.calls.append(ExtenderCall(verb, meta.get("namespace", ""), meta.get("name", ""),
                                                       tuple(names)))  # fmt: skip
                if verb == "filter":
                    reply: Any = {"Nodes": args.get("Nodes"), "NodeNames": args.get("NodeNames"),
                                  "FailedNodes": {}, "Error": ""}  # fmt: skip
                elif verb == "prioritize":
                    reply = [{"Host": n, "Score": 0} for n in names]
                else:
                    self.send_error(404)
                    return
                body = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler
