"""The extender's view of the cluster: nodes, GPU pods, and who holds which GiB on which GPU.

Fed by watches (it is the `ClusterSink` the cluster sources call) and by the binder's reservations. All
accounting is keyed by pod UID, and each UID contributes exactly one usage at a time — its in-process
reservation while a bind is running or settling, otherwise what its annotations and `spec.nodeName`
say — so a restart (rebuild from annotations), a replayed watch event or a bind racing its own watch
event can neither lose nor double-count an assignment.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufleet.extender.index import NodeFacts, NodeShape, Record, ShapeIds, Signatures
from gpufleet.extender.index import record as index_record
from gpufleet.extender.model import NodeInfo, node_info
from gpufleet.extender.placement import Placement, Verdict, evaluate
from gpufleet.extender.request import GpuRequest, Policy, RequestError, parse_pod, whole_gpus
from gpufleet.handoff import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    Assignment,
    ContainerAssignment,
    parse_allocated,
)
from gpufleet.logs import log_event

_TERMINAL_PHASES = ("Succeeded", "Failed")


@dataclass(slots=True)
class PodUsage:
    """What one pod holds on one node: GiB per GPU uuid and whole GPUs at kubelet-chosen positions."""

    uid: str
    key: str
    node: str
    shares: dict[str, int]
    whole: int
    containers: tuple[ContainerAssignment, ...]
    # "assigned" (bound, annotated), "binding" (annotated, Binding not seen yet), "reserved" (this
    # process is binding it), "whole" (bound, whole GPUs).
    status: str

    def same_claim(self, other: PodUsage | None) -> bool:
        """Whether `other` claims exactly the same resources (status aside)."""
        return (
            other is not None
            and other.node == self.node
            and other.shares == self.shares
            and other.whole == self.whole
        )


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


@dataclass(slots=True)
class Reservation:
    """A claim by this process's binder; authoritative until the bind settles and the watch catches up."""

    usage: PodUsage
    created: float
    in_flight: bool = True


@dataclass(slots=True)
class NodeEntry:
    """One node's GPUs and ledger, with the facts the filter and prioritize read (see `index`)."""

    name: str
    info: NodeInfo | None = None
    used: dict[str, int] = field(default_factory=dict)
    whole: int = 0
    pods: dict[str, PodUsage] = field(default_factory=dict)
    # Derived on every change of the node or its ledger (which bumps `version`).
    shape: NodeShape | None = None  # from `info` alone
    facts: NodeFacts | None = None  # `shape` with the ledger
    util: float = 0.0
    lock_uid: str = ""
    lock_expires: float = 0.0
    version: int = 0

    def refresh(self) -> None:
        """Recompute the derived facts from the node's GPUs and ledger."""
        self.version += 1
        info = self.info
        lock = info.lock if info is not None else None
        self.lock_uid, self.lock_expires = (lock.pod_uid, lock.expires) if lock is not None else ("", 0.0)
        if info is None or self.shape is None:
            self.facts, self.util = None, 0.0
            return
        self.facts = NodeFacts(self.shape, self.used)
        self.util = 0.0 if info.gpu_error else self.facts.utilization(self.whole)

    def record(self) -> Record | None:
        """The node's index record (None while the node is unknown)."""
        facts, shape = self.facts, self.shape
        if facts is None or shape is None:
            return None
        return index_record(shape, facts, self.lock_expires, self.lock_uid, self.whole)


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
    try:
        # Counted apart from the full parse: a typo in a preference annotation must not hide GPUs in use.
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
        self._current.pop((kind, key), None)

    def summary(self) -> dict[str, Any]:
        shown = sorted(self._current.items())[: self.SHOWN]
        return {
            "count": len(self._current),
            "shown": [{"kind": k, "object": key, "error": e} for (k, key), e in shown],
        }


class ClusterState:
    """Thread-safe cache and GPU ledger: the watch feeds it, filter/prioritize read it, bind reserves."""

    def __init__(
        self,
        lock_ttl: float = 60.0,
        reservation_ttl: float = 300.0,
        clock: Callable[[], float] = time.time,
        lock_wait: float = 0.0,
    ) -> None:
        self.lock_ttl = lock_ttl
        self.reservation_ttl = reservation_ttl
        self.clock = clock
        # > 0: binds wait up to this long for a hand-off about to finish, so such a node is no obstacle
        # to filter and prioritize (see lock_blocks).
        self.lock_wait = lock_wait
        self.lock = threading.RLock()
        self._nodes: dict[str, NodeEntry] = {}
        self._pods: dict[str, PodRecord] = {}
        self._reservations: dict[str, Reservation] = {}
        self._contrib: dict[str, PodUsage] = {}
        # UIDs whose claim is "binding" (expires with time): all a sweep needs to look at.
        self._binding: set[str] = set()
        # Every known node -> its index record, rebuilt whenever the node or its ledger changes: what
        # filter and prioritize read per candidate (see gpufleet.extender.index).
        self.index: dict[str, Record] = {}
        self.signatures = Signatures()
        # Request shapes as small ints, for the nodes' memos (gpufleet.extender.index.ShapeIds).
        self.shape_ids = ShapeIds()
        # How many known nodes have each largest healthy GPU (GiB) and each healthy GPU count: the
        # cluster-wide maxima the filter names for requests no node could ever take.
        self._largest: dict[int, int] = {}
        self._counts: dict[int, int] = {}
        self._synced: set[str] = set()
        self.watch_error: str | None = None
        self.complaints = Complaints()

    # ------------------------------------------------------------------ sink for cluster sources

    def replace_nodes(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """A full node list (initial list or relist): what is absent is gone."""
        with self.lock:
            seen = set()
            for obj in objs:
                name = self._put_node(obj)
                if name:
                    seen.add(name)
            for name in [n for n, e in self._nodes.items() if e.info is not None and n not in seen]:
                self._drop_node(name)
            self._synced.add("nodes")

    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        """A node was added or changed."""
        with self.lock:
            self._put_node(obj)

    def delete_node(self, obj: Mapping[str, Any]) -> None:
        """A node was deleted."""
        name = (obj.get("metadata") or {}).get("name")
        with self.lock:
            if name in self._nodes:
                self._drop_node(name)

    def replace_pods(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """A full pod list: rebuild every observed claim from annotations; reservations stay."""
        with self.lock:
            seen = set()
            for obj in objs:
                uid = self._put_pod(obj)
                if uid:
                    seen.add(uid)
            for uid in [u for u in self._pods if u not in seen]:
                self._forget_pod(uid)
            self._synced.add("pods")

    def upsert_pod(self, obj: Mapping[str, Any]) -> None:
        """A pod was added or changed."""
        with self.lock:
            self._put_pod(obj)

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        """A pod was deleted: its claim and any reservation for it are released."""
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        with self.lock:
            self._reservations.pop(uid, None)
            self._forget_pod(uid)

    def set_watch_error(self, message: str | None) -> None:
        """Record (or clear) the last watch failure, for /healthz and /readyz."""
        self.watch_error = message

    @property
    def synced(self) -> bool:
        """Whether both the node and the pod lists have arrived at least once."""
        return {"nodes", "pods"} <= self._synced

    # ------------------------------------------------------------------ internals

    def _entry(self, name: str) -> NodeEntry:
        entry = self._nodes.get(name)
        if entry is None:
            entry = self._nodes[name] = NodeEntry(name)
        return entry

    def _put_node(self, obj: Mapping[str, Any]) -> str | None:
        meta = obj.get("metadata") or {}
        name = meta.get("name")
        previous = self._nodes[name].info if isinstance(name, str) and name in self._nodes else None
        try:
            info = node_info(obj, previous)
        except ValueError as exc:
            if isinstance(name, str):
                self.complaints.note("node", name, str(exc))
            return None
        self.complaints.note("node", info.name, info.gpu_error)
        entry = self._entry(info.name)
        self._set_info(entry, info)
        self._refresh(entry)
        return info.name

    def _set_info(self, entry: NodeEntry, info: NodeInfo | None) -> None:
        old = entry.info
        shape = entry.shape
        if (
            info is not None
            and old is not None
            and shape is not None
            and old.gpus is info.gpus
            and old.gpu_error == info.gpu_error
            and old.sharing == info.sharing
        ):
            entry.info = info  # same GPUs (only the lock or other metadata changed): same shape
            return
        if old is not None:
            self._tally(old, -1)
        entry.info = info
        if info is None:
            entry.shape = None
        else:
            self._tally(info, 1)
            entry.shape = NodeShape(info, self.signatures.id(info.kinds))

    def _tally(self, info: NodeInfo, delta: int) -> None:
        for counts, value in (
            (self._largest, max((g.memory_gib for g in info.healthy), default=0)),
            (self._counts, len(info.healthy)),
        ):
            left = counts.get(value, 0) + delta
            if left > 0:
                counts[value] = left
            else:
                counts.pop(value, None)

    def maxima(self) -> tuple[int, int]:
        """The largest healthy GPU (GiB) and the most healthy GPUs on one node, over known nodes."""
        with self.lock:
            return max(self._largest, default=0), max(self._counts, default=0)

    def _refresh(self, entry: NodeEntry) -> None:
        entry.refresh()
        record = entry.record()
        if record is not None:
            self.index[entry.name] = record
        else:
            self.index.pop(entry.name, None)

    def _drop_node(self, name: str) -> None:
        self.complaints.forget("node", name)
        entry = self._nodes[name]
        self._set_info(entry, None)
        self._refresh(entry)
        if not entry.pods:
            del self._nodes[name]

    def _put_pod(self, obj: Mapping[str, Any]) -> str | None:
        record = pod_record(obj)
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        if record is not None and uid:
            self.complaints.note("pod", uid, _complaint(record))
        if record is None or not uid:
            if uid in self._pods:
                self._forget_pod(uid)
            return None
        self._pods[uid] = record
        reservation = self._reservations.get(uid)
        if reservation is not None and not reservation.in_flight and record.node_name:
            # Bound and visible: from here on the annotations are the record, not our memory.
            del self._reservations[uid]
        self._apply(uid)
        return uid

    def _forget_pod(self, uid: str) -> None:
        self.complaints.forget("pod", uid)
        self._pods.pop(uid, None)
        self._apply(uid)

    def _observed(self, record: PodRecord, now: float) -> PodUsage | None:
        if record.terminal:
            return None
        shares: dict[str, int] = {}
        containers: tuple[ContainerAssignment, ...] = ()
        node: str | None = None
        status = "whole"
        assignment = record.assignment
        if assignment is not None:
            if record.node_name == assignment.node:
                status = "assigned"
            elif record.node_name is None and now < assignment.ts + self.lock_ttl:
                # Annotated but the Binding is not visible (yet): a bind is running somewhere, or died
                # after annotating. Count it until the lock it held would have expired.
                status = "binding"
            if status != "whole":
                node, shares, containers = assignment.node, assignment.shares(), assignment.containers
        whole = record.whole if record.node_name else 0
        if whole:
            if node is not None and node != record.node_name:
                shares, containers = {}, ()
            node = record.node_name
        if node is None:
            return None
        return PodUsage(record.uid, record.key, node, shares, whole, containers, status)

    def _effective(self, uid: str) -> PodUsage | None:
        reservation = self._reservations.get(uid)
        if reservation is not None:
            return reservation.usage
        record = self._pods.get(uid)
        return self._observed(record, self.clock()) if record is not None else None

    def _apply(self, uid: str) -> None:
        """Make the ledger hold exactly the effective claim of `uid`."""
        new = self._effective(uid)
        old = self._contrib.get(uid)
        if old is new or (
            new is not None and new.same_claim(old) and old is not None and old.status == new.status
        ):
            return
        touched: set[str] = set()
        if old is not None:
            entry = self._nodes.get(old.node)
            if entry is not None:
                for uuid, gib in old.shares.items():
                    left = entry.used.get(uuid, 0) - gib
                    if left > 0:
                        entry.used[uuid] = left
                    else:
                        entry.used.pop(uuid, None)
                entry.whole -= old.whole
                entry.pods.pop(uid, None)
                touched.add(old.node)
            del self._contrib[uid]
        if new is not None:
            entry = self._entry(new.node)
            for uuid, gib in new.shares.items():
                entry.used[uuid] = entry.used.get(uuid, 0) + gib
            entry.whole += new.whole
            entry.pods[uid] = new
            self._contrib[uid] = new
            touched.add(new.node)
        if new is not None and new.status == "binding":
            self._binding.add(uid)
        else:
            self._binding.discard(uid)
        for name in touched:
            entry = self._nodes[name]
            self._refresh(entry)
            if entry.info is None and not entry.pods:
                del self._nodes[name]

    # ------------------------------------------------------------------ queries

    def entry(self, name: str) -> NodeEntry | None:
        """The node's entry (call with `lock` held to read it consistently)."""
        return self._nodes.get(name)

    def entries(self) -> dict[str, NodeEntry]:
        """All entries (call with `lock` held)."""
        return self._nodes

    def own_usage(self, uid: str) -> PodUsage | None:
        """The claim a pod already holds (a retried bind, a stale annotation)."""
        return self._contrib.get(uid) if uid else None

    def ledger(self, node: str, exclude_uid: str) -> tuple[dict[str, int], int]:
        """A copy of the node's GiB per GPU and whole GPUs held, leaving out one pod's own claim."""
        with self.lock:
            entry = self._nodes.get(node)
            used = dict(entry.used) if entry else {}
            whole = entry.whole if entry else 0
            own = self.own_usage(exclude_uid)
            if own is not None and own.node == node:
                for uuid, gib in own.shares.items():
                    used[uuid] = used.get(uuid, 0) - gib
                whole -= own.whole
            return used, whole

    def lock_blocks(self, node: str, lock_uid: str, lock_expires: float, uid: str, now: float) -> bool:
        """Whether the node's bind-lock keeps pod `uid` off the node now.

        A live lock of another pod blocks, unless binds wait for locks (`lock_wait` > 0) and this one is
        about to go: its holder is bound to the node (the device plugin releases the lock when the
        kubelet admits the pod) or its bind started less than `lock_wait` ago (it is still running). A
        lock left by a bind that died, or by a pod the kubelet never admits, blocks until it expires.
        Real schedulers requeue a pod that no node accepts for a minute or more and do not wake it when
        a lock goes away, so a short wait inside bind beats a refusal by far.
        """
        if not lock_uid or lock_expires <= now or lock_uid == uid:
            return False
        if self.lock_wait <= 0:
            return True
        with self.lock:
            holder = self._pods.get(lock_uid)
            if holder is not None and holder.node_name == node and not holder.terminal:
                return False
        taken = lock_expires - self.lock_ttl
        return now - taken >= self.lock_wait

    def evaluate(self, req: GpuRequest, info: NodeInfo, policy: Policy, now: float) -> Verdict:
        """Decide `info` for `req` against the ledger, leaving out what `req`'s own pod already holds."""
        lock = info.lock
        if lock is not None and not self.lock_blocks(info.name, lock.pod_uid, lock.expires, req.uid, now):
            info = dataclasses.replace(info, lock=None)
        with self.lock:
            entry = self._nodes.get(info.name)
            used: Mapping[str, int] = entry.used if entry else {}
            whole = entry.whole if entry else 0
            own = self.own_usage(req.uid)
            if own is not None and own.node == info.name:
                used = {u: g - own.shares.get(u, 0) for u, g in used.items()}
                whole -= own.whole
            return evaluate(info, used, whole, req, policy, now)

    # ------------------------------------------------------------------ reservations (binder)

    def reserve(self, req: GpuRequest, node: str, placement: Placement, now: float) -> PodUsage:
        """Claim `placement` for the pod; replaces any claim the pod had."""
        shares: dict[str, int] = {}
        for container in placement.containers:
            for uuid, gib in container.shares().items():
                shares[uuid] = shares.get(uuid, 0) + gib
        usage = PodUsage(req.uid, req.key, node, shares, placement.whole, placement.containers, "reserved")
        with self.lock:
            self._reservations[req.uid] = Reservation(usage, now)
            self._apply(req.uid)
        return usage

    def plan_and_reserve(self, req: GpuRequest, info: NodeInfo, policy: Policy, now: float) -> Verdict:
        """Evaluate and, if it fits, reserve — atomically, so two binds in this process cannot share GiB."""
        with self.lock:
            verdict = self.evaluate(req, info, policy, now)
            if verdict.placement is not None:
                self.reserve(req, info.name, verdict.placement, now)
            return verdict

    def release(self, uid: str) -> None:
        """Drop the pod's reservation (bind failed); its observed claim, if any, applies again."""
        with self.lock:
            if self._reservations.pop(uid, None) is not None:
                self._apply(uid)

    def settle(self, uid: str) -> None:
        """The bind succeeded: keep the reservation only until the watch shows the pod bound."""
        with self.lock:
            reservation = self._reservations.get(uid)
            if reservation is None:
                return
            reservation.in_flight = False
            record = self._pods.get(uid)
            if record is not None and record.node_name:
                del self._reservations[uid]
                self._apply(uid)

    def sweep(self) -> list[str]:
        """Expire time-bound claims: stale "binding" annotations and settled reservations never confirmed."""
        now = self.clock()
        dropped = []
        with self.lock:
            for uid, reservation in list(self._reservations.items()):
                if not reservation.in_flight and now - reservation.created > self.reservation_ttl:
                    del self._reservations[uid]
                    dropped.append(uid)
                    self._apply(uid)
            for uid in list(self._binding):
                self._apply(uid)
        return dropped

    def reservation_count(self) -> int:
        """How many reservations are held (in flight or settling)."""
        with self.lock:
            return len(self._reservations)

    # ------------------------------------------------------------------ inspection

    def inspect_node(self, name: str) -> dict[str, Any] | None:
        """One node's GPUs, memory used/free and which pods hold what (JSON-ready)."""
        with self.lock:
            entry = self._nodes.get(name)
            if entry is None:
                return None
            return self._describe(entry)

    def inspect(self) -> dict[str, Any]:
        """Every node plus cluster totals (JSON-ready)."""
        with self.lock:
            nodes = {name: self._describe(e) for name, e in sorted(self._nodes.items())}
            unassigned = sorted(
                r.key
                for r in self._pods.values()
                if r.node_name
                and not r.terminal
                and r.request is not None
                and r.request.kind == "mem"
                and (r.assignment is None or r.assignment.node != r.node_name)
            )
            return {
                "synced": self.synced,
                "watch_error": self.watch_error,
                "reservations": len(self._reservations),
                "totals": self.totals(),
                # GPU-memory pods bound without (or against) an assignment: the device plugin refuses them.
                "unassigned_gpu_mem_pods": unassigned,
                # Watched pods and nodes whose GPU request or annotations cannot be read (logged once each).
                "rejected_objects": self.complaints.summary(),
                "nodes": nodes,
            }

    def totals(self) -> dict[str, int]:
        """Cluster-wide GPU and memory figures."""
        with self.lock:
            gpus = healthy = mem = used = 0
            for entry in self._nodes.values():
                if entry.info is None:
                    continue
                for gpu in entry.info.gpus:
                    gpus += 1
                    if gpu.healthy:
                        healthy += 1
                        mem += gpu.memory_gib
                        used += min(gpu.memory_gib, entry.used.get(gpu.uuid, 0))
            return {
                "nodes": sum(1 for e in self._nodes.values() if e.info is not None),
                "gpus": gpus,
                "healthy_gpus": healthy,
                "memory_gib": mem,
                "memory_used_gib": used,
                "pods": len(self._contrib),
            }

    def _describe(self, entry: NodeEntry) -> dict[str, Any]:
        info = entry.info
        per_gpu: dict[str, list[dict[str, Any]]] = {}
        for usage in entry.pods.values():
            for container in usage.containers:
                for uuid, gib in container.shares().items():
                    per_gpu.setdefault(uuid, []).append(
                        {
                            "pod": usage.key,
                            "uid": usage.uid,
                            "container": container.name,
                            "gib": gib,
                            "status": usage.status,
                        }
                    )
        gpus = []
        known = set()
        for gpu in info.gpus if info else ():
            known.add(gpu.uuid)
            used = entry.used.get(gpu.uuid, 0)
            gpus.append(
                {
                    "index": gpu.index,
                    "uuid": gpu.uuid,
                    "model": gpu.model,
                    "memory_gib": gpu.memory_gib,
                    "cc": f"{gpu.cc[0]}.{gpu.cc[1]}",
                    "healthy": gpu.healthy,
                    "used_gib": used,
                    "free_gib": max(0, gpu.memory_gib - used) if gpu.healthy else 0,
                    "pods": per_gpu.get(gpu.uuid, []),
                }
            )
        lock = info.lock if info else None
        return {
            "known": info is not None,
            "sharing": bool(info and info.sharing),
            "mps": bool(info and info.mps),
            "error": info.gpu_error if info else "node not in the extender's cache",
            "bind_lock": (
                {
                    "pod": lock.pod_key,
                    "uid": lock.pod_uid,
                    "expires": lock.expires,
                    "live": lock.live(self.clock()),
                }
                if lock
                else None
            ),
            "gpus": gpus,
            # Claims on GPUs the node no longer publishes (replaced or renamed cards).
            "orphans": {u: per_gpu[u] for u in per_gpu if u not in known},
            "whole_gpus_held": entry.whole,
            "whole_gpu_pods": sorted(u.key for u in entry.pods.values() if u.whole),
            "utilization": round(entry.util, 4),
        }
