"""An in-memory Kubernetes API with the semantics the extender relies on, for tests and benchmarks.

It keeps one global resourceVersion counter (as etcd does), enforces the resourceVersion precondition on
node patches and the UID precondition on pod patches and Bindings, refuses a second Binding, and delivers
watch events asynchronously through a queue per watcher — so replicas see each other's writes late,
as they would against a real API server. Faults can be injected per operation, and
`complete_allocations` plays the device plugin's part of the hand-off (docs/handoff.md, step 3).
"""

from __future__ import annotations

import collections
import copy
import queue
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.extender.cluster import (
    ApiError,
    ClusterSink,
    ConflictError,
    InvalidError,
    NotFoundError,
    UnavailableError,
)
from gpufleet.handoff import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    BIND_LOCK_ANNOTATION,
    Assignment,
    BindLock,
    format_allocated,
)

Event = tuple[str, str, dict[str, Any]]  # (kind, type, object)


@dataclass
class _Fault:
    error: ApiError
    skip: int
    land: bool


class _Watcher:
    def __init__(self) -> None:
        self.events: queue.Queue[Event] = queue.Queue()
        # Events of a lagging kind, taken off the queue but not delivered yet, oldest first.
        self.held: collections.deque[Event] = collections.deque()

    def ready(self, lagging: Collection[str]) -> Event | None:
        """The oldest held event whose kind no longer lags, taken off the held ones."""
        for event in self.held:
            if event[0] not in lagging:
                self.held.remove(event)
                return event
        return None


class InMemoryCluster:
    """A `ClusterSource` backed by dicts; thread-safe."""

    def __init__(self, clock: Callable[[], float] = time.time, latency: float = 0.0) -> None:
        self.clock = clock
        # Seconds each API call takes (outside the lock), so concurrent callers interleave as they would
        # against a real API server.
        self.latency = latency
        self._lock = threading.RLock()
        self._rv = 0
        self._nodes: dict[str, dict[str, Any]] = {}
        self._pods: dict[tuple[str, str], dict[str, Any]] = {}
        self._watchers: list[_Watcher] = []
        self._faults: dict[str, list[_Fault]] = {}
        self.unreachable = False
        # While set, watchers hold their events back: a replica whose watch lags.
        self.paused = False
        # Kinds ("node", "pod") whose watch events every watcher holds back while the others flow: the
        # API server's watches of nodes and of pods are separate streams, and under load one lags behind
        # the other. Once a kind leaves the set its held events follow, in order.
        self.lagging: set[str] = set()

    # ------------------------------------------------------------------ helpers for tests

    def _bump(self, obj: dict[str, Any]) -> None:
        self._rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self._rv)

    def _emit(self, kind: str, kind_of_change: str, obj: dict[str, Any]) -> None:
        for watcher in self._watchers:
            watcher.events.put((kind, kind_of_change, copy.deepcopy(obj)))

    def add_node(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace a node."""
        node = copy.deepcopy(dict(obj))
        with self._lock:
            self._bump(node)
            name = node["metadata"]["name"]
            change = "MODIFIED" if name in self._nodes else "ADDED"
            self._nodes[name] = node
            self._emit("node", change, node)
            return copy.deepcopy(node)

    def update_node(self, name: str, mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Change a node in place (e.g. the device plugin republishing GPUs)."""
        with self._lock:
            node = self._nodes[name]
            mutate(node)
            self._bump(node)
            self._emit("node", "MODIFIED", node)
            return copy.deepcopy(node)

    def remove_node(self, name: str) -> None:
        """Delete a node."""
        with self._lock:
            node = self._nodes.pop(name)
            self._emit("node", "DELETED", node)

    def add_pod(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Create or replace a pod."""
        pod = copy.deepcopy(dict(obj))
        meta = pod.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        with self._lock:
            self._bump(pod)
            key = (meta["namespace"], meta["name"])
            change = "MODIFIED" if key in self._pods else "ADDED"
            self._pods[key] = pod
            self._emit("pod", change, pod)
            return copy.deepcopy(pod)

    def remove_pod(self, namespace: str, name: str) -> None:
        """Delete a pod."""
        with self._lock:
            pod = self._pods.pop((namespace, name))
            self._emit("pod", "DELETED", pod)

    def set_pod_phase(self, namespace: str, name: str, phase: str) -> None:
        """Move a pod to a phase (e.g. Succeeded, which frees its GPUs)."""
        with self._lock:
            pod = self._pods[(namespace, name)]
            pod.setdefault("status", {})["phase"] = phase
            self._bump(pod)
            self._emit("pod", "MODIFIED", pod)

    def node(self, name: str) -> dict[str, Any]:
        """A copy of a node, without counting as an API call."""
        with self._lock:
            return copy.deepcopy(self._nodes[name])

    def pods(self) -> list[dict[str, Any]]:
        """Copies of every pod."""
        with self._lock:
            return [copy.deepcopy(p) for p in self._pods.values()]

    def encoded(
        self,
        kind: str,
        encode: Callable[[dict[str, Any]], str],
        keep: Callable[[dict[str, Any]], bool] | None = None,
    ) -> tuple[list[str], str]:
        """The nodes or the pods (those ``keep`` accepts), each encoded by ``encode`` while the lock is held,
        and the resourceVersion: a consistent LIST without copying every object first (an API server serves
        it from its watch cache, whose objects nobody changes in place)."""
        with self._lock:
            store = self._nodes if kind == "nodes" else self._pods
            return [encode(o) for o in store.values() if keep is None or keep(o)], str(self._rv)

    def snapshot(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
        """Nodes, pods and the resourceVersion they were read at, consistently (for a LIST)."""
        with self._lock:
            return (
                [copy.deepcopy(n) for n in self._nodes.values()],
                [copy.deepcopy(p) for p in self._pods.values()],
                str(self._rv),
            )

    def inject(self, op: str, error: ApiError, times: int = 1, skip: int = 0, land: bool = False) -> None:
        """Make `times` calls of `op` (a ClusterSource method name), after `skip` good ones, raise `error`.

        With `land`, the call takes effect before raising: a reply lost on the way back.
        """
        with self._lock:
            faults = self._faults.setdefault(op, [])
            faults.append(_Fault(error, skip, land))
            faults.extend(_Fault(error, 0, land) for _ in range(times - 1))

    def wait_delivered(self, timeout: float = 5.0) -> bool:
        """Block until every watcher has consumed every event; False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(w.events.unfinished_tasks == 0 for w in self._watchers):
                    return True
            time.sleep(0.002)
        return False

    def complete_allocations(self, node: str | None = None) -> list[str]:
        """Play the device plugin: for each live lock whose pod is bound, mark it allocated and unlock."""
        done = []
        with self._lock:
            for name, obj in self._nodes.items():
                if node is not None and name != node:
                    continue
                raw = (obj["metadata"].get("annotations") or {}).get(BIND_LOCK_ANNOTATION)
                if not raw:
                    continue
                lock = BindLock.parse(raw)
                holder = next(
                    (
                        p
                        for p in self._pods.values()
                        if p["metadata"].get("uid") == lock.pod_uid
                        and (p.get("spec") or {}).get("nodeName") == name
                    ),
                    None,
                )
                if holder is None:
                    continue
                annotations = holder["metadata"].setdefault("annotations", {})
                assignment = Assignment.from_json(annotations[ASSIGNMENT_ANNOTATION])
                annotations[ALLOCATED_ANNOTATION] = format_allocated(c.name for c in assignment.containers)
                self._bump(holder)
                self._emit("pod", "MODIFIED", holder)
                del obj["metadata"]["annotations"][BIND_LOCK_ANNOTATION]
                self._bump(obj)
                self._emit("node", "MODIFIED", obj)
                done.append(f"{holder['metadata']['namespace']}/{holder['metadata']['name']}")
        return done

    def _call(self, op: str) -> ApiError | None:
        """Apply latency and faults; returns an error to raise after the call took effect."""
        if self.latency:
            time.sleep(self.latency)
        with self._lock:
            if self.unreachable:
                raise UnavailableError(f"{op}: connection refused (simulated)")
            faults = self._faults.get(op)
            if not faults:
                return None
            if faults[0].skip:
                faults[0].skip -= 1
                return None
            fault = faults.pop(0)
            if fault.land:
                return fault.error
            raise fault.error

    # ------------------------------------------------------------------ ClusterSource

    def watch(self, sink: ClusterSink, stop: threading.Event) -> None:
        """Deliver a full list, then every change, until `stop`; stalls while `unreachable`."""
        watcher = _Watcher()
        with self._lock:
            nodes = [copy.deepcopy(n) for n in self._nodes.values()]
            pods = [copy.deepcopy(p) for p in self._pods.values()]
            self._watchers.append(watcher)
        try:
            sink.replace_nodes(nodes)
            sink.replace_pods(pods)
            failing = False
            while not stop.is_set():
                if self.unreachable:
                    if not failing:
                        sink.set_watch_error("API server unreachable (simulated)")
                        failing = True
                    stop.wait(0.01)
                    continue
                if failing:
                    sink.set_watch_error(None)
                    failing = False
                if self.paused:
                    stop.wait(0.01)
                    continue
                event = watcher.ready(self.lagging)
                if event is None:
                    try:
                        event = watcher.events.get(timeout=0.05)
                    except queue.Empty:
                        continue
                    if event[0] in self.lagging:
                        watcher.held.append(event)  # still counted as undelivered (wait_delivered)
                        continue
                kind, change, obj = event
                while self.paused and not stop.is_set():  # paused while this event was awaited
                    stop.wait(0.01)
                try:
                    if kind == "node":
                        (sink.delete_node if change == "DELETED" else sink.upsert_node)(obj)
                    else:
                        (sink.delete_pod if change == "DELETED" else sink.upsert_pod)(obj)
                finally:
                    watcher.events.task_done()
        finally:
            with self._lock:
                self._watchers.remove(watcher)

    @staticmethod
    def _done(late: ApiError | None, result: Any) -> Any:
        if late is not None:
            raise late
        return result

    def get_node(self, name: str) -> dict[str, Any]:
        """The node now."""
        late = self._call("get_node")
        with self._lock:
            if name not in self._nodes:
                raise NotFoundError(f"node {name} not found")
            return self._done(late, copy.deepcopy(self._nodes[name]))

    def patch_node_annotations(
        self, name: str, annotations: Mapping[str, str | None], resource_version: str
    ) -> dict[str, Any]:
        """Patch node annotations with a resourceVersion precondition."""
        late = self._call("patch_node_annotations")
        with self._lock:
            node = self._nodes.get(name)
            if node is None:
                raise NotFoundError(f"node {name} not found")
            if node["metadata"]["resourceVersion"] != resource_version:
                raise ConflictError(f"node {name}: the object has been modified")
            _annotate(node, annotations)
            self._bump(node)
            self._emit("node", "MODIFIED", node)
            return self._done(late, copy.deepcopy(node))

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """The pod now."""
        late = self._call("get_pod")
        with self._lock:
            pod = self._pods.get((namespace, name))
            if pod is None:
                raise NotFoundError(f"pod {namespace}/{name} not found")
            return self._done(late, copy.deepcopy(pod))

    def patch_pod_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Patch pod annotations; UID (422 on mismatch) and resourceVersion (409) preconditions."""
        late = self._call("patch_pod_annotations")
        with self._lock:
            pod = self._pods.get((namespace, name))
            if pod is None:
                raise NotFoundError(f"pod {namespace}/{name} not found")
            if uid and pod["metadata"].get("uid") != uid:
                raise InvalidError(f"pod {namespace}/{name}: metadata.uid: field is immutable", 422)
            if resource_version is not None and pod["metadata"]["resourceVersion"] != resource_version:
                raise ConflictError(f"pod {namespace}/{name}: the object has been modified")
            _annotate(pod, annotations)
            self._bump(pod)
            self._emit("pod", "MODIFIED", pod)
            return self._done(late, copy.deepcopy(pod))

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Bind: UID precondition, and only once (409 otherwise)."""
        late = self._call("bind_pod")
        with self._lock:
            pod = self._pods.get((namespace, name))
            if pod is None:
                raise NotFoundError(f"pod {namespace}/{name} not found")
            if uid and pod["metadata"].get("uid") != uid:
                raise ConflictError(
                    f"pod {namespace}/{name}: Precondition failed: UID in precondition: {uid}"
                )
            spec = pod.setdefault("spec", {})
            if spec.get("nodeName"):
                raise ConflictError(f"pod {namespace}/{name} is already assigned to node {spec['nodeName']}")
            spec["nodeName"] = node
            self._bump(pod)
            self._emit("pod", "MODIFIED", pod)
            self._done(late, None)


def _annotate(obj: dict[str, Any], annotations: Mapping[str, str | None]) -> None:
    current = obj["metadata"].setdefault("annotations", {})
    for key, value in annotations.items():
        if value is None:
            current.pop(key, None)
        else:
            current[key] = value
