"""The GPU ledger: who holds which GiB on which GPU, per node, and the index filter and prioritize read.

Every claim is keyed by pod UID and each UID holds exactly one claim at a time (`apply` replaces it), so
no replayed event or racing watch can count a pod twice. Which claim a UID holds — its reservation while
a bind runs, else what its annotations say (`observed_claim`) — `ClusterState` decides; the ledger keeps
the sums, and on every change of a node or its claims rebuilds that node's index record
(`gpufleet.extender.index`). Call everything with the state's lock held.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpufleet.extender.index import NodeFacts, NodeShape, Record, ShapeIds, Signatures
from gpufleet.extender.index import record as index_record
from gpufleet.extender.model import NodeInfo
from gpufleet.extender.rules import node_utilization
from gpufleet.extender.watchcache import PodRecord
from gpufleet.handoff import ContainerAssignment


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


def observed_claim(record: PodRecord, now: float, lock_ttl: float) -> PodUsage | None:
    """The claim a pod's annotations and `spec.nodeName` make, if any.

    Annotated but not bound: a bind is running somewhere, or died after annotating; it counts ("binding")
    until the bind-lock it held would have expired (`lock_ttl` after the annotation).
    """
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
        elif record.node_name is None and now < assignment.ts + lock_ttl:
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
        self.util = 0.0 if info.gpu_error else node_utilization(self.facts.busy, self.whole, self.shape.n)

    def record(self) -> Record | None:
        """The node's index record (None while the node is unknown)."""
        facts, shape = self.facts, self.shape
        if facts is None or shape is None:
            return None
        return index_record(shape, facts, self.lock_expires, self.lock_uid, self.whole)


class GpuLedger:
    """GiB per GPU and whole GPUs held, per node, from one claim per pod UID; and the index of the nodes."""

    def __init__(self, defer_index: bool = False) -> None:
        self.entries: dict[str, NodeEntry] = {}
        # With `defer_index`, the nodes touched are only noted until `build_index`: while the first lists
        # arrive nothing reads the index, and a node with pods would otherwise be indexed once for the
        # node list and again for each of its pods.
        self._deferred: dict[str, None] | None = {} if defer_index else None  # in the order first noted
        # UID -> the claim the ledger holds for it.
        self.claims: dict[str, PodUsage] = {}
        # UIDs whose claim is "binding" (expires with time): all a sweep needs to look at.
        self.binding: set[str] = set()
        # Every known node -> its index record, rebuilt whenever the node or its ledger changes: what
        # filter and prioritize read per candidate (see gpufleet.extender.index).
        self.index: dict[str, Record] = {}
        self.signatures = Signatures()
        # Request shapes as small ints, for the nodes' memos (gpufleet.extender.index.ShapeIds); per
        # ledger, like the memos themselves.
        self.shape_ids = ShapeIds()
        # How many known nodes have each largest healthy GPU (GiB) and each healthy GPU count: the
        # cluster-wide maxima the filter names for requests no node could ever take.
        self._largest: dict[int, int] = {}
        self._counts: dict[int, int] = {}

    def _entry(self, name: str) -> NodeEntry:
        entry = self.entries.get(name)
        if entry is None:
            entry = self.entries[name] = NodeEntry(name)
        return entry

    def set_node(self, name: str, info: NodeInfo | None) -> None:
        """The node's GPUs as now published (None: the node is gone; its claims stay until their pods go)."""
        entry = self.entries.get(name)
        if entry is None:
            if info is None:
                return
            entry = self._entry(name)
        self._set_info(entry, info)
        self._refresh(entry)
        if info is None and not entry.pods:
            del self.entries[name]

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
            and old.passthrough == info.passthrough
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
        return max(self._largest, default=0), max(self._counts, default=0)

    @property
    def deferring(self) -> bool:
        """Whether the index waits for `build_index`."""
        return self._deferred is not None

    def build_index(self) -> None:
        """Index every node noted while deferring, once each; from here on every change indexes at once."""
        deferred, self._deferred = self._deferred, None
        for name in deferred or ():
            entry = self.entries.get(name)
            if entry is not None:
                self._refresh(entry)

    def _refresh(self, entry: NodeEntry) -> None:
        if self._deferred is not None:
            self._deferred[entry.name] = None
            return
        entry.refresh()
        record = entry.record()
        if record is not None:
            self.index[entry.name] = record
        else:
            self.index.pop(entry.name, None)

    def apply(self, uid: str, new: PodUsage | None) -> None:
        """Make the ledger hold exactly `new` for `uid` (None: nothing)."""
        old = self.claims.get(uid)
        if old is new or (
            new is not None and new.same_claim(old) and old is not None and old.status == new.status
        ):
            return
        touched: set[str] = set()
        if old is not None:
            entry = self.entries.get(old.node)
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
            del self.claims[uid]
        if new is not None:
            entry = self._entry(new.node)
            for uuid, gib in new.shares.items():
                entry.used[uuid] = entry.used.get(uuid, 0) + gib
            entry.whole += new.whole
            entry.pods[uid] = new
            self.claims[uid] = new
            touched.add(new.node)
        if new is not None and new.status == "binding":
            self.binding.add(uid)
        else:
            self.binding.discard(uid)
        for name in touched:
            entry = self.entries[name]
            self._refresh(entry)
            if entry.info is None and not entry.pods:
                del self.entries[name]

    def without(self, node: str, uid: str) -> tuple[dict[str, int], int]:
        """A copy of the node's GiB per GPU and whole GPUs held, leaving out `uid`'s own claim."""
        entry = self.entries.get(node)
        used = dict(entry.used) if entry else {}
        whole = entry.whole if entry else 0
        own = self.claims.get(uid) if uid else None
        if own is not None and own.node == node:
            for uuid, gib in own.shares.items():
                used[uuid] = used.get(uuid, 0) - gib
            whole -= own.whole
        return used, whole

    def totals(self) -> dict[str, int]:
        """Cluster-wide GPU and memory figures."""
        gpus = healthy = mem = used = 0
        for entry in self.entries.values():
            if entry.info is None:
                continue
            for gpu in entry.info.gpus:
                gpus += 1
                if gpu.healthy:
                    healthy += 1
                    mem += gpu.memory_gib
                    used += min(gpu.memory_gib, entry.used.get(gpu.uuid, 0))
        return {
            "nodes": sum(1 for e in self.entries.values() if e.info is not None),
            "gpus": gpus,
            "healthy_gpus": healthy,
            "memory_gib": mem,
            "memory_used_gib": used,
            "pods": len(self.claims),
        }
