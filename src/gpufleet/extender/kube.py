"""`ClusterSource` over the `kubernetes` Python client (tested with client 37 against API servers 1.20+).

Every call uses `_preload_content=False` and parses the JSON itself: objects stay plain dicts (the
form the scheduler sends, cheaper than the client's models), cut to the fields decisions read as each list
page or watch event arrives (`watchcache.project`), watch streams are read line by line, and
`create_namespaced_pod_binding` works against 1.20 (the client's model chokes on its Status reply).
Patches are JSON merge patches; `metadata.resourceVersion` in a patch is the API server's optimistic
concurrency precondition (409 on mismatch) and `metadata.uid` cannot change (422 on mismatch).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

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
MERGE_PATCH = "application/merge-patch+json"
# Nodes are read as metadata only (the extender reads names, labels and annotations: NODE_FIELDS), as
# client-go's metadata informers do: the API server leaves out status (images, conditions, node info),
# about half of a Node's JSON. Plain JSON comes second, for a server that cannot convert; `project` reads
# either. Lists answer PartialObjectMetadataList, watch events carry PartialObjectMetadata (meta.k8s.io/v1,
# served since Kubernetes 1.15; checked against the lab's 1.20 API server). The header is a default header
# of a client of its own per use: every supported version of the kubernetes client lets default headers
# win over the Accept it sets per call (a per-call `_headers` argument exists only from version 36).
_METADATA = "application/json;as=PartialObjectMetadata{};g=meta.k8s.io;v=v1,application/json"
NODE_LIST_ACCEPT = _METADATA.format("List")
NODE_WATCH_ACCEPT = _METADATA.format("")


def translate(exc: BaseException, what: str) -> ApiError:
    """Map a client exception onto the extender's ApiError kinds."""
    from kubernetes.client.exceptions import ApiException

    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ApiException):
        status = int(exc.status or 0)
        message = exc.reason or ""
        with contextlib.suppress(ValueError, AttributeError):
            message = json.loads(exc.body or "{}").get("message") or message
        text = f"{what}: {status} {message}".strip()
        if status == 409:
            return ConflictError(text)
        if status == 404:
            return NotFoundError(text)
        if status == 0 or status == 429 or status >= 500:
            return UnavailableError(text, status or None)
        return InvalidError(text, status)
    # urllib3's connection, timeout and protocol errors, and OSError underneath them.
    return UnavailableError(f"{what}: {type(exc).__name__}: {exc}")


class KubeCluster:
    """Reads, writes and watches through one `kubernetes.client.ApiClient`."""

    def __init__(
        self, api_client: Any, timeout: float = 10.0, watch_timeout: int = 300, page_size: int = 500
    ) -> None:
        from kubernetes import client

        self.core = client.CoreV1Api(api_client)
        # Used by the nodes' watch thread alone.
        self._node_reads = {
            use: client.CoreV1Api(client.ApiClient(api_client.configuration, "Accept", accept))
            for use, accept in (("list", NODE_LIST_ACCEPT), ("watch", NODE_WATCH_ACCEPT))
        }
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

    def _json(self, what: str, call: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, Any]:
        try:
            response = call(*args, _preload_content=False, _request_timeout=self.timeout, **kwargs)
            data = response.data
        except Exception as exc:
            raise translate(exc, what) from None
        try:
            doc = json.loads(data) if data else {}
        except ValueError:
            raise UnavailableError(f"{what}: reply is not JSON") from None
        return doc if isinstance(doc, dict) else {}

    # ------------------------------------------------------------------ ClusterSource

    def get_node(self, name: str) -> dict[str, Any]:
        """GET the node."""
        return self._json(f"get node {name}", self.core.read_node, name)

    def patch_node_annotations(
        self, name: str, annotations: Mapping[str, str | None], resource_version: str
    ) -> dict[str, Any]:
        """Merge-patch annotations with the resourceVersion precondition."""
        body = {"metadata": {"resourceVersion": resource_version, "annotations": dict(annotations)}}
        return self._json(f"patch node {name}", self.core.patch_node, name, body, _content_type=MERGE_PATCH)

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """GET the pod."""
        return self._json(f"get pod {namespace}/{name}", self.core.read_namespaced_pod, name, namespace)

    def list_pods_on_node(self, node: str) -> list[dict[str, Any]]:
        """LIST pods with spec.nodeName=node (no resourceVersion: a quorum read)."""
        doc = self._json(
            f"list pods on {node}",
            self.core.list_pod_for_all_namespaces,
            field_selector=f"spec.nodeName={node}",
        )
        return list(doc.get("items") or [])

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
        return self._json(
            f"patch pod {namespace}/{name}",
            self.core.patch_namespaced_pod,
            name,
            namespace,
            {"metadata": meta},
            _content_type=MERGE_PATCH,
        )

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """POST pods/binding with the pod's UID as precondition."""
        from kubernetes import client

        body = client.V1Binding(
            api_version="v1",
            kind="Binding",
            metadata=client.V1ObjectMeta(name=name, namespace=namespace, uid=uid or None),
            target=client.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        self._json(
            f"bind pod {namespace}/{name} to {node}",
            self.core.create_namespaced_pod_binding,
            name,
            namespace,
            body,
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

    def _list(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        call: Callable[..., Any] = (
            self._node_reads["list"].list_node if kind == "nodes" else self.core.list_pod_for_all_namespaces
        )
        fields = NODE_FIELDS if kind == "nodes" else POD_FIELDS
        items: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            kwargs: dict[str, Any] = {"limit": self.page_size}
            if token:
                kwargs["_continue"] = token
            doc = self._json(f"list {kind}", call, **kwargs)
            # Cut page by page: only what decisions read outlives the page (watchcache.project).
            items.extend(project(obj, fields) for obj in doc.get("items") or [])
            meta = doc.get("metadata") or {}
            del doc
            token = meta.get("continue")
            if not token:
                return items, str(meta.get("resourceVersion") or "")

    def _watch_kind(self, kind: str, sink: ClusterSink, stop: threading.Event) -> None:
        # With _preload_content=False the client returns the raw urllib3 response, not its model.
        call: Callable[..., Any] = (
            self._node_reads["watch"].list_node if kind == "nodes" else self.core.list_pod_for_all_namespaces
        )
        upsert = sink.upsert_node if kind == "nodes" else sink.upsert_pod
        delete = sink.delete_node if kind == "nodes" else sink.delete_pod
        replace = sink.replace_nodes if kind == "nodes" else sink.replace_pods
        fields = NODE_FIELDS if kind == "nodes" else POD_FIELDS
        version: str | None = None
        backoff = 0.5
        while not stop.is_set():
            try:
                if version is None:
                    items, version = self._list(kind)
                    replace(items)
                try:
                    response = call(
                        watch=True,
                        resource_version=version,
                        allow_watch_bookmarks=True,
                        timeout_seconds=self.watch_timeout,
                        _preload_content=False,
                        _request_timeout=(self.timeout, self.watch_timeout + 30),
                    )
                except Exception as exc:
                    raise translate(exc, f"watch {kind}") from None
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
