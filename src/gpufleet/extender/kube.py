"""`ClusterSource` over the `kubernetes` Python client's connection (client 29-37, API servers 1.20+).

The client reads the kubeconfig or the service account (`gpufleet.kubeconfig`), builds the TLS connection
pool and keeps the credentials fresh (exec plugins, rotated service-account tokens); the calls themselves go
through that pool as plain HTTP requests. The generated API classes are not used: the extender makes seven
kinds of call, and in client 37 the first `CoreV1Api` builds about 250 pydantic models, 0.7 s of CPU before
the first list. Objects stay plain dicts (the form the scheduler sends), cut to the fields decisions read as
each list page or watch event arrives (`watchcache.project`), and watch streams are read line by line. A
list's next page is fetched while the one before is applied (`_Listing`).
Patches are JSON merge patches; `metadata.resourceVersion` in a patch is the API server's optimistic
concurrency precondition (409 on mismatch) and `metadata.uid` cannot change (422 on mismatch).
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import quote, urlencode

import urllib3

from gpufleet.extender.cluster import (
    ApiError,
    ClusterSink,
    ConflictError,
    InvalidError,
    NotFoundError,
    UnavailableError,
)
from gpufleet.extender.watchcache import NODE_FIELDS, POD_FIELDS, project
from gpufleet.kubeconfig import api_client
from gpufleet.logs import log_event

GONE = 410
JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
# Nodes are read as metadata only (the extender reads names, labels and annotations: NODE_FIELDS), as
# client-go's metadata informers do: the API server leaves out status (images, conditions, node info),
# about half of a Node's JSON. Plain JSON comes second, for a server that cannot convert; `project` reads
# either. Lists answer PartialObjectMetadataList, watch events carry PartialObjectMetadata (meta.k8s.io/v1,
# served since Kubernetes 1.15; checked against the lab's 1.20 API server).
_METADATA = "application/json;as=PartialObjectMetadata{};g=meta.k8s.io;v=v1,application/json"
NODE_LIST_ACCEPT = _METADATA.format("List")
NODE_WATCH_ACCEPT = _METADATA.format("")
_PATHS = {"nodes": "/api/v1/nodes", "pods": "/api/v1/pods"}


def error_for(status: int, body: bytes | str | None, what: str) -> ApiError:
    """The extender's ApiError kind for an HTTP error status, with the API server's Status message."""
    message = ""
    try:
        doc = json.loads(body or b"{}")
        message = str(doc.get("message") or "") if isinstance(doc, dict) else ""
    except ValueError:
        pass
    text = f"{what}: {status} {message}".strip()
    if status == 409:
        return ConflictError(text)
    if status == 404:
        return NotFoundError(text)
    if status == 0 or status == 429 or status >= 500:
        return UnavailableError(text, status or None)
    return InvalidError(text, status)


def translate(exc: BaseException, what: str) -> ApiError:
    """Map an exception of a call onto the extender's ApiError kinds: urllib3's connection, timeout and
    protocol errors, and OSError underneath them, are the API server being unavailable."""
    if isinstance(exc, ApiError):
        return exc
    return UnavailableError(f"{what}: {type(exc).__name__}: {exc}")


class KubeCluster:
    """Reads, writes and watches through the connection of one `kubernetes.client.ApiClient`."""

    def __init__(
        self, api_client: Any, timeout: float = 10.0, watch_timeout: int = 300, page_size: int = 500
    ) -> None:
        self.api_client = api_client
        self.configuration = api_client.configuration
        self.pool = api_client.rest_client.pool_manager
        self.host = str(self.configuration.host).rstrip("/")
        self.timeout = timeout
        self.watch_timeout = watch_timeout
        self.page_size = page_size
        self._open: set[Any] = set()
        self._open_lock = threading.Lock()
        self._errors: dict[str, str] = {}

    @classmethod
    def from_config(cls, kubeconfig: str = "", timeout: float = 10.0) -> KubeCluster:
        """From a kubeconfig file, else the pod's service account, else the default kubeconfig."""
        return cls(api_client(kubeconfig), timeout)

    # ------------------------------------------------------------------ plumbing

    def _headers(self, accept: str, content_type: str | None) -> dict[str, str]:
        headers = {"Accept": accept, "User-Agent": str(self.api_client.user_agent)}
        if content_type:
            headers["Content-Type"] = content_type
        # The bearer token, read anew each time: the client's refresh hook renews exec-plugin and
        # service-account tokens. Client certificates are the pool's.
        for setting in self.configuration.auth_settings().values():
            if setting.get("in") == "header" and setting.get("value"):
                headers[setting["key"]] = setting["value"]
        return headers

    def _request(
        self,
        what: str,
        method: str,
        path: str,
        query: Mapping[str, Any] | None = None,
        body: Any = None,
        *,
        content_type: str | None = None,
        accept: str = JSON,
        stream: bool = False,
        timeout: Any = None,
    ) -> Any:
        """Send one request; the urllib3 response (2xx only) when `stream`, else the body as a dict."""
        url = self.host + path + ("?" + urlencode(query) if query else "")
        data = json.dumps(body).encode() if body is not None else None
        try:
            response = self.pool.request(
                method,
                url,
                body=data,
                headers=self._headers(accept, content_type if data is not None else None),
                preload_content=not stream,
                timeout=timeout if timeout is not None else self.timeout,
            )
        except Exception as exc:
            raise translate(exc, what) from None
        if not 200 <= response.status <= 299:
            payload = response.data if not stream else response.read()
            if stream:
                response.release_conn()
            raise error_for(response.status, payload, what)
        if stream:
            return response
        try:
            doc = json.loads(response.data) if response.data else {}
        except ValueError:
            raise UnavailableError(f"{what}: reply is not JSON") from None
        return doc if isinstance(doc, dict) else {}

    # ------------------------------------------------------------------ ClusterSource

    def get_node(self, name: str) -> dict[str, Any]:
        """GET the node."""
        return self._request(f"get node {name}", "GET", _node_path(name))

    def patch_node_annotations(
        self, name: str, annotations: Mapping[str, str | None], resource_version: str
    ) -> dict[str, Any]:
        """Merge-patch annotations with the resourceVersion precondition."""
        body = {"metadata": {"resourceVersion": resource_version, "annotations": dict(annotations)}}
        return self._request(
            f"patch node {name}", "PATCH", _node_path(name), body=body, content_type=MERGE_PATCH
        )

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """GET the pod."""
        return self._request(f"get pod {namespace}/{name}", "GET", _pod_path(namespace, name))

    def patch_pod_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Merge-patch annotations; uid (and resourceVersion) in the patch act as preconditions."""
        meta: dict[str, Any] = {"annotations": dict(annotations)}
        if uid:
            meta["uid"] = uid
        if resource_version:
            meta["resourceVersion"] = resource_version
        return self._request(
            f"patch pod {namespace}/{name}",
            "PATCH",
            _pod_path(namespace, name),
            body={"metadata": meta},
            content_type=MERGE_PATCH,
        )

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """POST pods/binding with the pod's UID as precondition."""
        metadata = {"name": name, "namespace": namespace, **({"uid": uid} if uid else {})}
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": metadata,
            "target": {"apiVersion": "v1", "kind": "Node", "name": node},
        }
        self._request(
            f"bind pod {namespace}/{name} to {node}",
            "POST",
            _pod_path(namespace, name) + "/binding",
            body=body,
            content_type=JSON,
        )

    def watch(self, sink: ClusterSink, stop: threading.Event) -> None:
        """Watch nodes and pods on two threads until `stop`; each relists after a gap (410) or error."""
        threads = [
            threading.Thread(
                target=self._watch_kind, args=(kind, sink, stop), name=f"watch-{kind}", daemon=True
            )
            for kind in ("nodes", "pods")
        ]
        for thread in threads:
            thread.start()
        stop.wait()
        with self._open_lock:
            for response in list(self._open):
                # Unblocks the reading thread; it sees `stop` and returns.
                try:
                    response.shutdown()
                except Exception:
                    response.close()
        for thread in threads:
            thread.join(5.0)

    def _report(self, sink: ClusterSink, kind: str, error: str | None) -> None:
        """Tell the sink about watch health; nodes and pods fail and recover independently."""
        with self._open_lock:
            if error is None:
                if self._errors.pop(kind, None) is None:
                    return
            else:
                self._errors[kind] = error
            combined = "; ".join(self._errors[k] for k in sorted(self._errors)) or None
        sink.set_watch_error(combined)

    def _page(self, kind: str, token: str | None) -> tuple[list[dict[str, Any]], str | None, str]:
        """One page of the list of `kind`: its objects cut (`watchcache.project`: only what decisions read
        outlives the page), the continue token (None on the last page) and the resourceVersion."""
        query: dict[str, Any] = {"limit": self.page_size}
        if token:
            query["continue"] = token
        accept = NODE_LIST_ACCEPT if kind == "nodes" else JSON
        fields = NODE_FIELDS if kind == "nodes" else POD_FIELDS
        doc = self._request(f"list {kind}", "GET", _PATHS[kind], query, accept=accept)
        items = [project(obj, fields) for obj in doc.get("items") or []]
        meta = doc.get("metadata") or {}
        return items, meta.get("continue") or None, str(meta.get("resourceVersion") or "")

    def _watch_kind(self, kind: str, sink: ClusterSink, stop: threading.Event) -> None:
        accept = NODE_WATCH_ACCEPT if kind == "nodes" else JSON
        upsert = sink.upsert_node if kind == "nodes" else sink.upsert_pod
        delete = sink.delete_node if kind == "nodes" else sink.delete_pod
        replace = sink.replace_nodes if kind == "nodes" else sink.replace_pods
        fields = NODE_FIELDS if kind == "nodes" else POD_FIELDS
        version: str | None = None
        backoff = 0.5
        while not stop.is_set():
            try:
                if version is None:
                    # Pages are applied as they arrive while the next is fetched (`_Listing`).
                    listing = _Listing(self, kind)
                    replace(listing)
                    version = listing.version
                query = {
                    "watch": "true",
                    "resourceVersion": version,
                    "allowWatchBookmarks": "true",
                    "timeoutSeconds": self.watch_timeout,
                }
                response = self._request(
                    f"watch {kind}",
                    "GET",
                    _PATHS[kind],
                    query,
                    accept=accept,
                    stream=True,
                    timeout=urllib3.Timeout(connect=self.timeout, read=self.watch_timeout + 30),
                )
                with self._open_lock:
                    self._open.add(response)
                self._report(sink, kind, None)
                try:
                    for line in response:
                        if stop.is_set():
                            break
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        change, obj = event.get("type"), event.get("object") or {}
                        if change == "ERROR":
                            if obj.get("code") == GONE:
                                version = None  # too old: relist
                                break
                            raise UnavailableError(f"watch {kind}: {obj.get('message')}")
                        version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
                        if change == "BOOKMARK":
                            continue
                        (delete if change == "DELETED" else upsert)(project(obj, fields))
                finally:
                    with self._open_lock:
                        self._open.discard(response)
                    response.release_conn()
                backoff = 0.5
            except Exception as exc:
                if stop.is_set():
                    return
                error = translate(exc, f"watch {kind}")
                if error.status == GONE:
                    version = None
                    continue
                self._report(sink, kind, str(error))
                log_event("watch_error", logging.WARNING, kind=kind, error=str(error), retry_in=backoff)
                stop.wait(backoff)
                backoff = min(backoff * 2, 30.0)


def _node_path(name: str) -> str:
    return f"{_PATHS['nodes']}/{quote(name)}"


def _pod_path(namespace: str, name: str) -> str:
    return f"/api/v1/namespaces/{quote(namespace)}/pods/{quote(name)}"


class _Listing:
    """The objects of one paged LIST, cut, in order, for one pass (`ClusterSink.replace_nodes` and
    `replace_pods` take them as they come); `version` is the list's resourceVersion once they are all in.

    A thread of its own fetches each next page while the reader works on the one before, so a real API
    server's time per page (reading etcd, encoding) overlaps the extender's parsing rather than adding to
    it. At most two pages wait. An error fetching a page reaches the reader; a reader that stops early
    stops the fetching.
    """

    _DONE = object()

    def __init__(self, source: KubeCluster, kind: str) -> None:
        self.source = source
        self.kind = kind
        self.version = ""
        self._pages: queue.Queue[Any] = queue.Queue(maxsize=2)
        self._quit = threading.Event()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        fetcher = threading.Thread(target=self._fetch, name=f"list-{self.kind}", daemon=True)
        fetcher.start()
        try:
            while True:
                page = self._pages.get()
                if page is self._DONE:
                    return
                if isinstance(page, BaseException):
                    raise page
                yield from page
        finally:
            # Not joined: a fetch under way ends with its request (the client's timeout) and then stops.
            self._quit.set()

    def _fetch(self) -> None:
        token: str | None = None
        try:
            while True:
                items, token, version = self.source._page(self.kind, token)
                if not self._put(items):
                    return
                if token is None:
                    self.version = version
                    self._put(self._DONE)
                    return
        except Exception as exc:
            self._put(exc)

    def _put(self, item: Any) -> bool:
        """Hand `item` to the reader; False once the reader has stopped."""
        while not self._quit.is_set():
            try:
                self._pages.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False
