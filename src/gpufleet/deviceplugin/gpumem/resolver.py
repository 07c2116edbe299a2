"""How the hand-off reads and writes pods and the node: a small interface, a Kubernetes API
implementation, and an in-memory one (a toy API server with resourceVersions) for tests and benches."""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpufleet.deviceplugin.rm.errors import HandoffError
from gpufleet.handoff import ALLOCATED_ANNOTATION, BIND_LOCK_ANNOTATION, lock_held_by

_RELEASE_ATTEMPTS = 5


@dataclass(frozen=True)
class PodView:
    """The parts of a pod the hand-off reads."""

    uid: str
    namespace: str
    name: str
    node: str
    phase: str = "Pending"
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def ref(self) -> str:
        """namespace/name."""
        return f"{self.namespace}/{self.name}"


class Conflict(Exception):
    """A write's resourceVersion precondition failed (HTTP 409)."""


class PodResolver(Protocol):
    """API access the hand-off needs."""

    def node_annotations(self, node: str) -> Mapping[str, str]:
        """The node's annotations."""
        ...

    def pods_on_node(self, node: str) -> list[PodView]:
        """Pods bound to the node (spec.nodeName)."""
        ...

    def set_allocated(self, pod: PodView, value: str) -> None:
        """Write the pod's `allocated` annotation."""
        ...

    def release_lock(self, node: str, uid: str) -> None:
        """Remove the node's bind-lock if, and only if, it is held by `uid` (resourceVersion precondition)."""
        ...


class InMemoryCluster:
    """Nodes and pods with annotations and resourceVersions: enough API server for hand-off tests."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._rv = itertools.count(1)
        self.nodes: dict[str, dict[str, Any]] = {}
        self.pods: dict[str, dict[str, Any]] = {}  # uid -> pod

    def add_node(self, name: str) -> None:
        """Create a node without annotations."""
        with self._lock:
            self.nodes[name] = {"annotations": {}, "rv": next(self._rv)}

    def add_pod(
        self,
        uid: str,
        namespace: str,
        name: str,
        node: str = "",
        annotations: Mapping[str, str] | None = None,
    ) -> None:
        """Create a pod (unbound when node is empty)."""
        with self._lock:
            self.pods[uid] = {
                "namespace": namespace,
                "name": name,
                "node": node,
                "phase": "Pending",
                "annotations": dict(annotations or {}),
                "rv": next(self._rv),
            }

    def read_node(self, name: str) -> tuple[dict[str, str], int]:
        """(annotations, resourceVersion)."""
        with self._lock:
            node = self.nodes[name]
            return dict(node["annotations"]), node["rv"]

    def patch_node_annotations(
        self, name: str, changes: Mapping[str, str | None], rv: int | None = None
    ) -> int:
        """Apply annotation changes (None deletes); with `rv`, fail with Conflict unless it is current."""
        with self._lock:
            node = self.nodes[name]
            if rv is not None and rv != node["rv"]:
                raise Conflict(f"node {name}: resourceVersion {rv} is stale (now {node['rv']})")
            _apply(node["annotations"], changes)
            node["rv"] = next(self._rv)
            return node["rv"]

    def patch_pod_annotations(self, uid: str, changes: Mapping[str, str | None]) -> None:
        """Apply annotation changes to a pod."""
        with self._lock:
            pod = self.pods[uid]
            _apply(pod["annotations"], changes)
            pod["rv"] = next(self._rv)

    def bind(self, uid: str, node: str) -> None:
        """Set the pod's node (the Binding)."""
        with self._lock:
            self.pods[uid]["node"] = node
            self.pods[uid]["rv"] = next(self._rv)

    def pod(self, uid: str) -> PodView:
        """One pod."""
        with self._lock:
            return _view(uid, self.pods[uid])

    # ----- PodResolver ---------------------------------------------------------------------------------

    def node_annotations(self, node: str) -> Mapping[str, str]:
        """The node's annotations."""
        return self.read_node(node)[0]

    def pods_on_node(self, node: str) -> list[PodView]:
        """Pods bound to the node."""
        with self._lock:
            return [_view(uid, p) for uid, p in self.pods.items() if p["node"] == node]

    def set_allocated(self, pod: PodView, value: str) -> None:
        """Write the pod's allocated annotation."""
        self.patch_pod_annotations(pod.uid, {ALLOCATED_ANNOTATION: value})

    def release_lock(self, node: str, uid: str) -> None:
        """Remove the lock if `uid` holds it, with the resourceVersion precondition and retries."""
        for _ in range(_RELEASE_ATTEMPTS):
            annotations, rv = self.read_node(node)
            if not lock_held_by(annotations.get(BIND_LOCK_ANNOTATION), uid):
                return
            try:
                self.patch_node_annotations(node, {BIND_LOCK_ANNOTATION: None}, rv)
                return
            except Conflict:
                continue
        raise HandoffError(
            f"node {node}: could not release {BIND_LOCK_ANNOTATION} after {_RELEASE_ATTEMPTS} conflicts"
        )


def _apply(target: dict[str, str], changes: Mapping[str, str | None]) -> None:
    for key, value in changes.items():
        if value is None:
            target.pop(key, None)
        else:
            target[key] = value


def _view(uid: str, pod: Mapping[str, Any]) -> PodView:
    return PodView(
        uid, pod["namespace"], pod["name"], pod["node"], pod["phase"], copy.deepcopy(pod["annotations"])
    )


class KubernetesPodResolver:
    """PodResolver over the Kubernetes API (the `kubernetes` client's CoreV1Api)."""

    def __init__(self, core_v1: Any) -> None:
        self.api = core_v1

    def node_annotations(self, node: str) -> Mapping[str, str]:
        """The node's annotations."""
        return self._read_node(node)[0]

    def pods_on_node(self, node: str) -> list[PodView]:
        """Pods bound to the node, read fresh from the API server (no cache: a stale view could guess)."""
        try:
            pods = self.api.list_pod_for_all_namespaces(field_selector=f"spec.nodeName={node}").items
        except Exception as exc:
            raise HandoffError(f"cannot list pods on node {node}: {_reason(exc)}") from None
        return [
            PodView(
                p.metadata.uid,
                p.metadata.namespace,
                p.metadata.name,
                p.spec.node_name or "",
                (p.status.phase if p.status else None) or "Pending",
                dict(p.metadata.annotations or {}),
            )
            for p in pods
        ]

    def set_allocated(self, pod: PodView, value: str) -> None:
        """Patch the pod's allocated annotation; the UID precondition guards against a re-created namesake."""
        body = {"metadata": {"uid": pod.uid, "annotations": {ALLOCATED_ANNOTATION: value}}}
        try:
            self.api.patch_namespaced_pod(pod.name, pod.namespace, body)
        except Exception as exc:
            raise HandoffError(f"cannot record allocation on pod {pod.ref}: {_reason(exc)}") from None

    def release_lock(self, node: str, uid: str) -> None:
        """Remove the node's lock if `uid` holds it; resourceVersion precondition, retried on 409."""
        for _ in range(_RELEASE_ATTEMPTS):
            annotations, rv = self._read_node(node)
            if not lock_held_by(annotations.get(BIND_LOCK_ANNOTATION), uid):
                return
            body = {"metadata": {"resourceVersion": rv, "annotations": {BIND_LOCK_ANNOTATION: None}}}
            try:
                self.api.patch_node(node, body)
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

    def _read_node(self, node: str) -> tuple[dict[str, str], str]:
        try:
            obj = self.api.read_node(node)
        except Exception as exc:
            raise HandoffError(f"cannot read node {node}: {_reason(exc)}") from None
        return dict(obj.metadata.annotations or {}), obj.metadata.resource_version


def _reason(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    return f"HTTP {status} {getattr(exc, 'reason', '')}".strip() if status else repr(exc)
