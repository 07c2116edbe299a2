"""How the hand-off reads and writes pods and the node (docs/handoff.md, "Reading the node's pods").

The plugin reads its Node (the bind-lock) with a GET, and keeps the pods bound to its node in a view
(:class:`NodePods`) that one watch feeds: ``fieldSelector=spec.nodeName=<node>``, the watch the kubelet
itself holds, served from the API server's watch cache. An ``Allocate`` reads no pods from the API server;
it waits until the view shows the lock holder bound, and, after recording ``allocated``, until the view has
reached that write's resourceVersion (``MemoryHandoff``).

Implementations of :class:`PodResolver`: the Kubernetes API (:class:`KubernetesPodResolver`), and an
in-memory API server with resourceVersions (:class:`InMemoryCluster`) for tests and benches, whose views can
be held back to play a watch that lags.
"""

from __future__ import annotations

import copy
import itertools
import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpufleet.deviceplugin.rm.errors import HandoffError
from gpufleet.handoff import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION, BIND_LOCK_ANNOTATION, lock_held_by
from gpufleet.logs import log_event

_RELEASE_ATTEMPTS = 5
# The annotations the hand-off reads; a view keeps only these of each pod.
_KEPT_ANNOTATIONS = (ASSIGNMENT_ANNOTATION, ALLOCATED_ANNOTATION)
GONE = 410  # a watch's resourceVersion is older than the API server's window: list again


@dataclass(frozen=True)
class PodView:
    """The parts of a pod the hand-off reads; ``requests``: every resource name its containers ask for."""

    uid: str
    namespace: str
    name: str
    node: str
    phase: str = "Pending"
    annotations: Mapping[str, str] = field(default_factory=dict)
    requests: frozenset[str] = frozenset()

    @property
    def ref(self) -> str:
        """namespace/name."""
        return f"{self.namespace}/{self.name}"


def pod_view(obj: Mapping[str, Any]) -> PodView:
    """A PodView of a pod as the API serves it (JSON); ValueError when it lacks a uid or a name."""
    meta = obj.get("metadata") or {}
    spec = obj.get("spec") or {}
    uid, name = meta.get("uid"), meta.get("name")
    if not uid or not name:
        raise ValueError("pod without metadata.uid or metadata.name")
    annotations = meta.get("annotations") or {}
    requests: set[str] = set()
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        resources = container.get("resources") or {}
        for kind in ("limits", "requests"):
            requests.update(resources.get(kind) or {})
    return PodView(
        str(uid),
        str(meta.get("namespace") or ""),
        str(name),
        str(spec.get("nodeName") or ""),
        str((obj.get("status") or {}).get("phase") or "Pending"),
        {k: str(annotations[k]) for k in _KEPT_ANNOTATIONS if k in annotations},
        frozenset(requests),
    )


def version_of(raw: Any, what: str) -> int:
    """A resourceVersion as the integer the API server's own watch cache compares; HandoffError otherwise."""
    try:
        return int(str(raw))
    except ValueError:
        raise HandoffError(f"{what}: resourceVersion {raw!r} is not an integer") from None


@dataclass(frozen=True)
class NodeRead:
    """The node as one GET returned it: its annotations and resourceVersion."""

    annotations: Mapping[str, str]
    version: str


@dataclass(frozen=True)
class PodsView:
    """The pods bound to one node as the view holds them: every change to them up to resourceVersion
    ``version`` is in ``pods``. ``synced``: a first list arrived; ``error``: the watch's last failure."""

    pods: tuple[PodView, ...]
    version: int
    synced: bool
    error: str = ""

    def get(self, uid: str) -> PodView | None:
        """The pod with this UID, if the view has it."""
        return next((p for p in self.pods if p.uid == uid), None)


class NodePods:
    """The pods bound to one node, as a watch delivers them (or the in-memory API server); waitable."""

    def __init__(self, node: str) -> None:
        self.node = node
        self._cond = threading.Condition()
        self._pods: dict[str, PodView] = {}
        self._version = 0
        self._synced = False
        self._error = ""

    # ----- fed by the watch ------------------------------------------------------------------------

    def replace(self, pods: Iterable[PodView], version: int) -> None:
        """A list's answer: exactly these pods, as of ``version``."""
        with self._cond:
            self._pods = {p.uid: p for p in pods if p.node == self.node}
            self._version = version
            self._synced = True
            self._error = ""
            self._cond.notify_all()

    def apply(self, kind: str, pod: PodView, version: int) -> None:
        """One watch event (ADDED, MODIFIED or DELETED) at ``version``."""
        with self._cond:
            if kind != "DELETED" and pod.node == self.node:
                self._pods[pod.uid] = pod
            else:
                self._pods.pop(pod.uid, None)
            self._version = max(self._version, version)
            self._error = ""
            self._cond.notify_all()

    def advance(self, version: int) -> None:
        """A bookmark: nothing changed up to ``version``."""
        with self._cond:
            self._version = max(self._version, version)
            self._cond.notify_all()

    def failed(self, error: str) -> None:
        """The watch broke; what the view holds stays true up to its version."""
        with self._cond:
            self._error = error
            self._cond.notify_all()

    # ----- read by the hand-off --------------------------------------------------------------------

    def snapshot(self) -> PodsView:
        """The view now."""
        with self._cond:
            return self._snapshot()

    def wait(self, until: Callable[[PodsView], bool], timeout: float) -> PodsView:
        """The first view (synced) for which ``until`` holds, or the last one after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                view = self._snapshot()
                left = deadline - time.monotonic()
                if (view.synced and until(view)) or left <= 0:
                    return view
                self._cond.wait(left)

    def _snapshot(self) -> PodsView:
        return PodsView(tuple(self._pods.values()), self._version, self._synced, self._error)


class Conflict(Exception):
    """A write's resourceVersion precondition failed (HTTP 409)."""


class PodResolver(Protocol):
    """API access the hand-off needs."""

    def read_node(self, node: str) -> NodeRead:
        """The node as the API server has it now (a GET)."""
        ...

    def node_pods(self, node: str) -> NodePods:
        """The view of the pods bound to the node (started on the first call)."""
        ...

    def set_allocated(self, pod: PodView, value: str | None) -> int:
        """Write (None: remove) the pod's `allocated` annotation; the write's resourceVersion."""
        ...

    def release_lock(self, node: str, uid: str, seen: NodeRead | None = None) -> None:
        """Remove the node's bind-lock if, and only if, `uid` holds it (resourceVersion precondition; `seen`:
        the node as last read, tried first)."""
        ...

    def close(self) -> None:
        """Stop the views' watches."""
        ...


class InMemoryCluster:
    """Nodes and pods with annotations and resourceVersions: enough API server for hand-off tests.

    Node views get every change at once, unless :meth:`hold` holds a node's back (a watch that lags)
    until :meth:`deliver`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._rv = itertools.count(1)
        self._last = 0
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}  # uid -> pod
        self._views: dict[str, NodePods] = {}
        self._held: dict[str, list[tuple[str, PodView, int]]] = {}
        self.writes = 0  # pod writes (set_allocated), for tests that count API calls
        self.node_reads = 0

    def _next(self) -> int:
        self._last = next(self._rv)
        return self._last

    def add_node(self, name: str) -> None:
        """Create a node without annotations."""
        with self._lock:
            self.nodes[name] = {"annotations": {}, "rv": self._next()}

    def add_pod(
        self,
        uid: str,
        namespace: str,
        name: str,
        node: str = "",
        annotations: Mapping[str, str] | None = None,
        requests: Iterable[str] = (),
    ) -> None:
        """Create a pod (unbound when node is empty) whose containers ask for `requests`."""
        with self._lock:
            self.pods[uid] = {
                "namespace": namespace,
                "name": name,
                "node": node,
                "phase": "Pending",
                "annotations": dict(annotations or {}),
                "requests": frozenset(requests),
                "rv": self._next(),
            }
            self._changed(uid, "ADDED")

    def read_node(self, name: str) -> NodeRead:
        """The node's annotations and resourceVersion."""
        with self._lock:
            self.node_reads += 1
            node = self.nodes[name]
            return NodeRead(dict(node["annotations"]), str(node["rv"]))

    def node_annotations(self, node: str) -> Mapping[str, str]:
        """The node's annotations."""
        return self.read_node(node).annotations

    def patch_node_annotations(
        self, name: str, changes: Mapping[str, str | None], rv: int | str | None = None
    ) -> int:
        """Apply annotation changes (None deletes); with `rv`, fail with Conflict unless it is current."""
        with self._lock:
            node = self.nodes[name]
            if rv is not None and int(rv) != node["rv"]:
                raise Conflict(f"node {name}: resourceVersion {rv} is stale (now {node['rv']})")
            _apply(node["annotations"], changes)
            node["rv"] = self._next()
            return int(node["rv"])

    def patch_pod_annotations(self, uid: str, changes: Mapping[str, str | None]) -> int:
        """Apply annotation changes to a pod; its new resourceVersion."""
        with self._lock:
            pod = self.pods[uid]
            _apply(pod["annotations"], changes)
            pod["rv"] = self._next()
            self._changed(uid, "MODIFIED")
            return int(pod["rv"])

    def bind(self, uid: str, node: str) -> None:
        """Set the pod's node (the Binding)."""
        with self._lock:
            self.pods[uid]["node"] = node
            self.pods[uid]["rv"] = self._next()
            self._changed(uid, "MODIFIED")

    def set_phase(self, uid: str, phase: str) -> None:
        """Set the pod's phase (the kubelet's status update)."""
        with self._lock:
            self.pods[uid]["phase"] = phase
            self.pods[uid]["rv"] = self._next()
            self._changed(uid, "MODIFIED")

    def delete_pod(self, uid: str) -> None:
        """Delete the pod."""
        with self._lock:
            view = _view(uid, self.pods[uid])
            del self.pods[uid]
            self._emit(view.node, "DELETED", view, self._next())

    def pod(self, uid: str) -> PodView:
        """One pod."""
        with self._lock:
            return _view(uid, self.pods[uid])

    # ----- views and their lag ---------------------------------------------------------------------

    def hold(self, node: str) -> None:
        """From now on, keep the node's view where it is: changes queue until :meth:`deliver`."""
        with self._lock:
            self._held.setdefault(node, [])

    def deliver(self, node: str, count: int | None = None) -> None:
        """Hand the node's view `count` (all: None) of the held changes, in order; all: stop holding."""
        with self._lock:
            queue = self._held.get(node, [])
            now, rest = (queue, []) if count is None else (queue[:count], queue[count:])
            if count is None:
                self._held.pop(node, None)
            else:
                self._held[node] = rest
            view = self._views.get(node)
            for kind, pod, rv in now:
                if view is not None:
                    view.apply(kind, pod, rv)

    def _changed(self, uid: str, kind: str) -> None:
        view = _view(uid, self.pods[uid])
        rv = int(self.pods[uid]["rv"])
        for node in self._views:
            # Every view sees the change: one whose node the pod is not on drops it (the pod left).
            self._emit(node, kind, view, rv)

    def _emit(self, node: str, kind: str, pod: PodView, rv: int) -> None:
        target = self._views.get(node)
        if target is None:
            return
        if node in self._held:
            self._held[node].append((kind, pod, rv))
        else:
            target.apply(kind, pod, rv)

    # ----- PodResolver -------------------------------------------------------------------------------

    def node_pods(self, node: str) -> NodePods:
        """The node's view, listed now and kept current (unless held)."""
        with self._lock:
            if node not in self._views:
                view = NodePods(node)
                view.replace([_view(u, p) for u, p in self.pods.items() if p["node"] == node], self._last)
                self._views[node] = view
            return self._views[node]

    def set_allocated(self, pod: PodView, value: str | None) -> int:
        """Write the pod's allocated annotation; its new resourceVersion."""
        with self._lock:
            self.writes += 1
            return self.patch_pod_annotations(pod.uid, {ALLOCATED_ANNOTATION: value})

    def release_lock(self, node: str, uid: str, seen: NodeRead | None = None) -> None:
        """Remove the lock if `uid` holds it, with the resourceVersion precondition and retries."""
        for _ in range(_RELEASE_ATTEMPTS):
            current = seen or self.read_node(node)
            seen = None
            if not lock_held_by(current.annotations.get(BIND_LOCK_ANNOTATION), uid):
                return
            try:
                self.patch_node_annotations(node, {BIND_LOCK_ANNOTATION: None}, current.version)
                return
            except Conflict:
                continue
        raise HandoffError(
            f"node {node}: could not release {BIND_LOCK_ANNOTATION} after {_RELEASE_ATTEMPTS} conflicts"
        )

    def close(self) -> None:
        """Nothing runs in the background."""


def _apply(target: dict[str, str], changes: Mapping[str, str | None]) -> None:
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


def _view(uid: str, pod: Mapping[str, Any]) -> PodView:
    return PodView(
        uid,
        pod["namespace"],
        pod["name"],
        pod["node"],
        pod["phase"],
        copy.deepcopy(pod["annotations"]),
        pod.get("requests", frozenset()),
    )


class KubernetesPodResolver:
    """PodResolver over the Kubernetes API (the `kubernetes` client's CoreV1Api).

    Replies are read as JSON, not as the client's models: a burst of Allocates on many nodes (the burst
    bench plays 50 plugins in one process) would spend more CPU building models than on the calls."""

    def __init__(self, core_v1: Any, timeout: float = 10.0, watch_s: int = 300, retry_s: float = 1.0) -> None:
        self.api = core_v1
        self.timeout = timeout
        self.watch_s = watch_s
        self.retry_s = retry_s
        self._watches: dict[str, _NodeWatch] = {}
        self._lock = threading.Lock()

    def read_node(self, node: str) -> NodeRead:
        """GET the node."""
        try:
            doc = _json(self.api.read_node(node, _preload_content=False, _request_timeout=self.timeout))
        except Exception as exc:
            raise HandoffError(f"cannot read node {node}: {_reason(exc)}") from None
        meta = doc.get("metadata") or {}
        return NodeRead(dict(meta.get("annotations") or {}), str(meta.get("resourceVersion") or ""))

    def node_pods(self, node: str) -> NodePods:
        """The node's view; its watch starts on the first call."""
        with self._lock:
            if node not in self._watches:
                watch = _NodeWatch(self, node)
                self._watches[node] = watch
                watch.start()
            return self._watches[node].view

    def set_allocated(self, pod: PodView, value: str | None) -> int:
        """Patch the pod's allocated annotation; the UID precondition guards against a re-created namesake."""
        body = {"metadata": {"uid": pod.uid, "annotations": {ALLOCATED_ANNOTATION: value}}}
        try:
            reply = self.api.patch_namespaced_pod(
                pod.name, pod.namespace, body, _preload_content=False, _request_timeout=self.timeout
            )
            doc = _json(reply)
        except Exception as exc:
            raise HandoffError(f"cannot record allocation on pod {pod.ref}: {_reason(exc)}") from None
        return version_of((doc.get("metadata") or {}).get("resourceVersion"), f"pod {pod.ref}")

    def release_lock(self, node: str, uid: str, seen: NodeRead | None = None) -> None:
        """Remove the node's lock if `uid` holds it; resourceVersion precondition, re-read on 409."""
        for _ in range(_RELEASE_ATTEMPTS):
            current = seen or self.read_node(node)
            seen = None
            if not lock_held_by(current.annotations.get(BIND_LOCK_ANNOTATION), uid):
                return
            body = {
                "metadata": {"resourceVersion": current.version, "annotations": {BIND_LOCK_ANNOTATION: None}}
            }
            try:
                self.api.patch_node(node, body, _preload_content=False, _request_timeout=self.timeout).read()
                return
            except Exception as exc:
                if getattr(exc, "status", None) == 409:
                    continue
                raise HandoffError(
                    f"cannot release {BIND_LOCK_ANNOTATION} on node {node}: {_reason(exc)}"
                ) from None
        raise HandoffError(
            f"node {node}: could not release {BIND_LOCK_ANNOTATION} after {_RELEASE_ATTEMPTS} conflicts"
        )

    def close(self) -> None:
        """Stop every node's watch."""
        with self._lock:
            watches, self._watches = list(self._watches.values()), {}
        for watch in watches:
            watch.stop()


class _NodeWatch:
    """Lists and watches the pods bound to one node into a NodePods, until stopped.

    The first list takes whatever the watch cache holds (resourceVersion 0); a list after a gap (410) asks
    for at least the view's version (NotOlderThan), so the view never goes back. Both are answered from the
    watch cache, never from etcd."""

    def __init__(self, owner: KubernetesPodResolver, node: str) -> None:
        self.owner = owner
        self.node = node
        self.view = NodePods(node)
        self._stop = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._run, name=f"gpufleet-pods-{node}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        response = self._response
        if response is not None:
            try:
                response.shutdown()  # unblocks the reading thread (urllib3 2.3+)
            except Exception:
                response.close()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        selector = f"spec.nodeName={self.node}"
        version = ""
        listed = False
        while not self._stop.is_set():
            try:
                if not listed:
                    version = self._list(selector, version)
                    listed = True
                version, listed = self._watch(selector, version)
            except Exception as exc:  # API away, timeouts, a broken stream: watch again after a pause
                if self._stop.is_set():
                    return
                if getattr(exc, "status", None) == GONE:
                    listed = False
                    continue
                error = _reason(exc)
                self.view.failed(error)
                log_event(
                    "pod_watch_failed", level="warning", node=self.node, error=error[:300],
                    retry_s=self.owner.retry_s,
                )  # fmt: skip
                self._stop.wait(self.owner.retry_s)

    def _list(self, selector: str, version: str) -> str:
        extra = {"resource_version_match": "NotOlderThan"} if version else {}
        reply = self.owner.api.list_pod_for_all_namespaces(
            field_selector=selector,
            resource_version=version or "0",
            _preload_content=False,
            _request_timeout=self.owner.timeout,
            **extra,
        )
        doc = _json(reply)
        listed = str((doc.get("metadata") or {}).get("resourceVersion") or "")
        pods = []
        for item in doc.get("items") or []:
            try:
                pods.append(pod_view(item))
            except ValueError:
                continue
        self.view.replace(pods, version_of(listed, f"pods on node {self.node}"))
        return listed

    def _watch(self, selector: str, version: str) -> tuple[str, bool]:
        """Follow the watch from `version` until it ends; (the last version seen, whether still listed)."""
        owner = self.owner
        self._response = owner.api.list_pod_for_all_namespaces(
            field_selector=selector,
            resource_version=version,
            watch=True,
            allow_watch_bookmarks=True,
            timeout_seconds=owner.watch_s,
            _preload_content=False,
            _request_timeout=(owner.timeout, owner.watch_s + 30),
        )
        try:
            for event in _events(self._response):
                if self._stop.is_set():
                    return version, True
                kind, obj = str(event.get("type")), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == GONE:
                        return version, False
                    raise HandoffError(f"watch error {obj.get('code')}: {obj.get('message')}")
                raw = (obj.get("metadata") or {}).get("resourceVersion")
                rv = version_of(raw, f"pods on node {self.node}")
                if kind == "BOOKMARK":
                    self.view.advance(rv)
                else:
                    try:
                        self.view.apply(kind, pod_view(obj), rv)
                    except ValueError:
                        self.view.advance(rv)
                version = str(raw)
        finally:
            response, self._response = self._response, None
            response.release_conn()
        return version, True


def _events(response: Any) -> Iterator[dict[str, Any]]:
    """The JSON objects of a watch stream, one per line."""
    pending = b""
    for chunk in response.stream(65536, decode_content=True):
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)
    if pending.strip():
        yield json.loads(pending)


def _json(response: Any) -> dict[str, Any]:
    data = response.data
    doc = json.loads(data) if data else {}
    return doc if isinstance(doc, dict) else {}


def _reason(exc: BaseException) -> str:
    status = getattr(exc, "status", None)
    return f"HTTP {status} {getattr(exc, 'reason', '')}".strip() if status else repr(exc)
