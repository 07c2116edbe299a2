"""The watch cache: the Nodes and GPU pods the watches deliver, reduced to what decisions need.

Fed by `ClusterState` (the `ClusterSink` the cluster sources call). A Node becomes its `NodeInfo` (its GPUs
parsed again only when their annotation changed), a Pod its `PodRecord` (pods that touch no GPU are not
kept). What cannot be read is a complaint, logged once per object and message. No accounting here: the
GPU ledger (`ledger`) turns these records into claims.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.extender.model import NodeInfo, node_info
from gpufleet.extender.request import GpuRequest, RequestError, parse_pod, whole_gpus
from gpufleet.handoff import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION, Assignment, parse_allocated
from gpufleet.logs import log_event

_TERMINAL_PHASES = ("Succeeded", "Failed")

# What `node_info` and `pod_record` read, and nothing more. A cluster source cuts every listed or watched
# object to this before keeping it (`project`): the API serves far more (managed fields, a Node's images
# and conditions, a Pod's volumes and statuses), and a 5,000-node list held whole is most of the memory the
# extender would otherwise need. A reader that starts using another field must name it here; the tests
# check that a projected object reads the same as the whole one.
_CONTAINER_FIELDS: dict[str, Any] = {"name": True, "resources": True}
NODE_FIELDS: dict[str, Any] = {
    "metadata": {"name": True, "resourceVersion": True, "labels": True, "annotations": True},
}
POD_FIELDS: dict[str, Any] = {
    "metadata": {"name": True, "namespace": True, "uid": True, "resourceVersion": True, "annotations": True},
    "spec": {
        "nodeName": True,
        "nodeSelector": True,
        "containers": [_CONTAINER_FIELDS],
        "initContainers": [_CONTAINER_FIELDS],
    },
    "status": {"phase": True},
}


def project(value: Any, fields: Any) -> Any:
    """``value`` cut to ``fields``: a mapping keeps the keys named (``True``: the value as it is; a mapping:
    cut further; a one-item list: each item of a list cut to that item). A value of another shape than the
    fields expect is kept as it is, so the readers still see, and name, what is wrong with it."""
    if fields is True:
        return value
    if isinstance(fields, dict):
        if not isinstance(value, Mapping):
            return value
        return {key: project(value[key], sub) for key, sub in fields.items() if key in value}
    if not isinstance(value, list):
        return value
    return [project(item, fields[0]) for item in value]


@dataclass(slots=True)
class PodRecord:
    """A GPU-relevant pod as last seen from the API."""

    uid: str
    key: str
    node_name: str | None
    terminal: bool
    whole: int
    request: GpuRequest | None
    request_error: str | None
    assignment: Assignment | None
    assignment_error: str | None
    allocated: tuple[str, ...]  # containers the device plugin has allocated
    resource_version: str = ""


def pod_record(obj: Mapping[str, Any]) -> PodRecord | None:
    """Reduce a Pod to what accounting needs; None for pods that touch no GPU.

    Never raises: whatever a watched pod carries, its problems become `request_error`/`assignment_error`.
    """
    meta = _object(obj.get("metadata"))
    spec = _object(obj.get("spec"))
    status = _object(obj.get("status"))
    annotations = _object(meta.get("annotations"))
    request: GpuRequest | None = None
    request_error: str | None = None
    try:
        request = parse_pod(obj)
    except RequestError as exc:
        request_error = str(exc)
    assignment: Assignment | None = None
    assignment_error: str | None = None
    raw = annotations.get(ASSIGNMENT_ANNOTATION)
    if raw:
        try:
            assignment = Assignment.from_json(raw)
        except ValueError as exc:
            assignment_error = str(exc)
    if request is not None:
        whole = request.whole
    else:
        # Counted apart from the full parse: a typo in a preference annotation must not hide GPUs in use.
        try:
            whole = whole_gpus(spec)
        except RequestError:
            whole = 0
    relevant = (
        request_error is not None
        or raw is not None
        or whole > 0
        or (request is not None and request.kind != "none")
    )
    if not relevant:
        return None
    try:
        allocated = parse_allocated(annotations.get(ALLOCATED_ANNOTATION))
    except ValueError as exc:
        allocated = ()
        assignment_error = "; ".join(e for e in (assignment_error, str(exc)) if e)
    node_name = spec.get("nodeName")
    return PodRecord(
        uid=str(meta.get("uid") or ""),
        key=f"{meta.get('namespace') or 'default'}/{meta.get('name')}",
        node_name=node_name if isinstance(node_name, str) and node_name else None,
        terminal=status.get("phase") in _TERMINAL_PHASES,
        whole=whole,
        request=request,
        request_error=request_error,
        assignment=assignment,
        assignment_error=assignment_error,
        allocated=allocated,
        resource_version=str(meta.get("resourceVersion") or ""),
    )


def _object(value: Any) -> Mapping[str, Any]:
    """A JSON object from a watched object's field; anything else reads as empty."""
    return value if isinstance(value, Mapping) else {}


def _complaint(record: PodRecord) -> str | None:
    """The pod's request or assignment error as one line naming the pod, or None."""
    errors = [e for e in (record.request_error, record.assignment_error) if e]
    return f"{record.key}: {'; '.join(errors)}" if errors else None


class Complaints:
    """What is wrong with watched objects, logged once per object and message, not on every event or relist.

    A hostile or broken pod is re-read on each of its updates and on every relist; its error is logged the
    first time it is seen (with the object's name) and again only when the message changes.
    """

    SHOWN = 50
    """How many complaints /inspect lists (the count is always complete)."""

    def __init__(self) -> None:
        self._current: dict[tuple[str, str], str] = {}

    def note(self, kind: str, key: str, error: str | None) -> None:
        """Record the object's current error (None: nothing wrong); log it when it is new."""
        slot = (kind, key)
        if error is None:
            self._current.pop(slot, None)
        elif self._current.get(slot) != error:
            self._current[slot] = error
            log_event("object_rejected", logging.WARNING, kind=kind, object=key, error=error)

    def forget(self, kind: str, key: str) -> None:
        """The object is gone: so is its complaint."""
        self._current.pop((kind, key), None)

    def summary(self) -> dict[str, Any]:
        """The count of complaints and the first `SHOWN` of them (JSON-ready)."""
        shown = sorted(self._current.items())[: self.SHOWN]
        return {
            "count": len(self._current),
            "shown": [{"kind": k, "object": key, "error": e} for (k, key), e in shown],
        }


class WatchCache:
    """Nodes by name and GPU pods by UID as the watches last showed them (call with the state's lock held)."""

    def __init__(self) -> None:
        self.nodes: dict[str, NodeInfo] = {}
        self.pods: dict[str, PodRecord] = {}
        # Which lists ("nodes", "pods") have arrived at least once.
        self.listed: set[str] = set()
        self.watch_error: str | None = None
        self.complaints = Complaints()

    @property
    def synced(self) -> bool:
        """Whether both the node and the pod lists have arrived at least once."""
        return self.synced_with()

    def synced_with(self, *kinds: str) -> bool:
        """Whether both lists will have arrived once `kinds` are in too."""
        return {"nodes", "pods"} <= self.listed.union(kinds)

    def put_node(self, obj: Mapping[str, Any]) -> NodeInfo | None:
        """Keep a Node as its NodeInfo; None (and a complaint) when it cannot be read."""
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        previous = self.nodes.get(name) if isinstance(name, str) else None
        try:
            info = node_info(obj, previous)
        except ValueError as exc:
            if isinstance(name, str):
                self.complaints.note("node", name, str(exc))
            return None
        self.complaints.note("node", info.name, info.gpu_error)
        self.nodes[info.name] = info
        return info

    def drop_node(self, name: str) -> None:
        """The node is gone."""
        self.complaints.forget("node", name)
        self.nodes.pop(name, None)

    def put_pod(self, obj: Mapping[str, Any]) -> tuple[str, PodRecord | None]:
        """Keep a Pod as its PodRecord: its UID and the record (None: it touches no GPU, not kept)."""
        record = pod_record(obj)
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if record is None or not uid:
            if uid in self.pods:
                self.drop_pod(uid)
            return uid, None
        self.complaints.note("pod", uid, _complaint(record))
        self.pods[uid] = record
        return uid, record

    def drop_pod(self, uid: str) -> None:
        """The pod is gone (or no longer touches a GPU)."""
        self.complaints.forget("pod", uid)
        self.pods.pop(uid, None)

    def unassigned_gpu_mem_pods(self) -> list[str]:
        """GPU-memory pods bound without (or against) an assignment: the device plugin refuses them."""
        return sorted(
            r.key
            for r in self.pods.values()
            if r.node_name
            and not r.terminal
            and r.request is not None
            and r.request.kind == "mem"
            and (r.assignment is None or r.assignment.node != r.node_name)
        )
