"""The extender's view of the cluster: nodes, GPU pods, and who holds which GiB on which GPU.

`ClusterState` puts three parts behind one lock: the watch cache (`watchcache`: Nodes and GPU pods as
last watched), the GPU ledger (`ledger`: one claim per pod UID, summed per node and GPU, and the index
filter and prioritize read) and this process's reservations with the bind-lock rule (`bindlocks`). It is
the `ClusterSink` the cluster sources call and the binder's way to reserve. Each UID contributes exactly
one claim at a time — its reservation while a bind is running or settling, otherwise what its
annotations and `spec.nodeName` say — so a restart (rebuild from annotations), a replayed watch event or
a bind racing its own watch event can neither lose nor double-count an assignment.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from gpufleet.extender import inspection
from gpufleet.extender.bindlocks import BINDING, DECIDED, BindLocks, Reservation
from gpufleet.extender.index import Record, Signatures
from gpufleet.extender.ledger import GpuLedger, NodeEntry, PodUsage, observed_claim
from gpufleet.extender.model import NodeInfo, node_info
from gpufleet.extender.placement import Placement, RequestPlan, Verdict, evaluate
from gpufleet.extender.request import GpuRequest, Policy
from gpufleet.extender.watchcache import Complaints, PodRecord, WatchCache

T = TypeVar("T")


class _Waiters:
    """Threads waiting for a change of a node or pod in the cache, woken by the watch (`fire`) rather than
    by polling the API. Call with the state's lock held."""

    def __init__(self) -> None:
        self._events: dict[Hashable, list[threading.Event]] = {}

    def add(self, key: Hashable) -> threading.Event:
        event = threading.Event()
        self._events.setdefault(key, []).append(event)
        return event

    def fire(self, key: Hashable) -> None:
        for event in self._events.pop(key, ()):
            event.set()


class ClusterState:
    """Thread-safe cache and GPU ledger: the watch feeds it, filter/prioritize read it, bind reserves."""

    def __init__(
        self,
        lock_ttl: float = 60.0,
        reservation_ttl: float = 300.0,
        clock: Callable[[], float] = time.time,
        lock_wait: float = 0.0,
        defer_index: bool = False,
        decision_ttl: float = 30.0,
        max_reservations: int = 10_000,
        bind_wait: float = 5.0,
    ) -> None:
        self.clock = clock
        self.lock = threading.RLock()
        self.watch = WatchCache()
        # `defer_index`: the index is built once, when both first lists are in (GpuLedger.build_index);
        # nothing reads it before (filter, prioritize and bind wait for `synced`).
        self.gpus = GpuLedger(defer_index)
        self.locks = BindLocks(
            lock_ttl, lock_wait, reservation_ttl, decision_ttl, max_reservations, bind_wait
        )
        self._waiters = _Waiters()
        # The ledger's index and GPU kinds (gpufleet.extender.index), for tests and inspection: the
        # decisions ask `records` and `plan`.
        self.index: dict[str, Record] = self.gpus.index
        self.signatures: Signatures = self.gpus.signatures

    @property
    def lock_ttl(self) -> float:
        """How long a bind-lock lives."""
        return self.locks.lock_ttl

    @property
    def lock_wait(self) -> float:
        """How long binds wait for a hand-off about to finish (0: not at all)."""
        return self.locks.lock_wait

    @property
    def reservation_ttl(self) -> float:
        """How long a settled reservation waits for the watch to show its pod bound."""
        return self.locks.reservation_ttl

    @property
    def complaints(self) -> Complaints:
        """What is wrong with watched objects."""
        return self.watch.complaints

    @property
    def watch_error(self) -> str | None:
        """The last watch failure, if the watch has not recovered since."""
        return self.watch.watch_error

    # ------------------------------------------------------------------ sink for cluster sources

    def replace_nodes(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """A full node list (initial list or relist): what is absent is gone (`_replace`)."""
        self._replace("nodes", objs, self._put_node, self.watch.nodes, self._drop_node)

    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        """A node was added or changed."""
        with self.lock:
            self._put_node(obj)

    def delete_node(self, obj: Mapping[str, Any]) -> None:
        """A node was deleted."""
        name = (obj.get("metadata") or {}).get("name")
        with self.lock:
            if isinstance(name, str) and name in self.gpus.entries:
                self._drop_node(name)

    def replace_pods(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """A full pod list: rebuild every observed claim from annotations (`_replace`). Once it is complete,
        decided and settled reservations of pods it lacks go (`BindLocks.absent`): a pod deleted while the
        watch was down (a relist after 410 Gone or an error) sent no DELETED event. Only reservations made
        before the list began: its request starts after this (a `kube._Listing` fetches on iteration), so
        their pods existed before the list's snapshot, and one it lacks was deleted."""
        with self.lock:
            before = self.locks.serial
        listed: set[str] = set()

        def each() -> Iterator[Mapping[str, Any]]:
            for obj in objs:
                uid = (obj.get("metadata") or {}).get("uid")
                if uid:
                    listed.add(str(uid))
                yield obj

        def release_absent() -> None:
            for uid in self.locks.absent(listed, before):
                self._apply(uid)

        self._replace("pods", each(), self._put_pod, self.watch.pods, self._forget_pod, release_absent)

    def upsert_pod(self, obj: Mapping[str, Any]) -> None:
        """A pod was added or changed."""
        with self.lock:
            self._put_pod(obj)

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        """A pod was deleted: its claim and any reservation for it are released."""
        uid = str((obj.get("metadata") or {}).get("uid") or "")
        with self.lock:
            self.locks.release(uid)
            self._forget_pod(uid)

    def set_watch_error(self, message: str | None) -> None:
        """Record (or clear) the last watch failure, for /healthz and /readyz."""
        self.watch.watch_error = message

    @property
    def synced(self) -> bool:
        """Whether both the node and the pod lists have arrived at least once."""
        return self.watch.synced

    # ------------------------------------------------------------------ internals

    def _replace(
        self,
        kind: str,
        objs: Iterable[Mapping[str, Any]],
        put: Callable[[Mapping[str, Any]], str | None],
        known: Mapping[str, Any],
        drop: Callable[[str], None],
        complete: Callable[[], None] | None = None,
    ) -> None:
        """A full list of `kind`; what is absent from it is gone.

        `objs` may arrive while they are applied (a paged list, `kube._Listing`): each is put under the lock
        on its own, as a watch event would be, and the absent ones go once the list is in. A list that fails
        halfway leaves newer objects in and drops nothing; the relist that follows completes it. `complete`
        runs (under the lock) once the whole list is in."""
        seen = set()
        for obj in objs:
            with self.lock:
                key = put(obj)
            if key:
                seen.add(key)
        with self.lock:
            for key in [k for k in known if k not in seen]:
                drop(key)
            if complete is not None:
                complete()
            self._listed(kind)

    def _listed(self, kind: str) -> None:
        """A first (or later) full list of `kind` is in; the index is complete before `synced` turns true."""
        if self.gpus.deferring and self.watch.synced_with(kind):
            self.gpus.build_index()
        self.watch.listed.add(kind)

    def _put_node(self, obj: Mapping[str, Any]) -> str | None:
        info = self.watch.put_node(obj)
        if info is None:
            return None
        self.gpus.set_node(info.name, info)
        self._waiters.fire(("node", info.name))
        return info.name

    def _drop_node(self, name: str) -> None:
        self.watch.drop_node(name)
        self.gpus.set_node(name, None)
        self._waiters.fire(("node", name))

    def _put_pod(self, obj: Mapping[str, Any]) -> str | None:
        uid, record = self.watch.put_pod(obj)
        if record is None:
            if uid:
                self._apply(uid)  # it may have held a claim before this update
                self._fire_pod(uid, None)
            return None
        if record.node_name:
            # Bound and visible: from here on the annotations are the record, not our memory.
            self.locks.seen_bound(uid)
        self._apply(uid)
        self._fire_pod(uid, record)
        return uid

    def _forget_pod(self, uid: str) -> None:
        self.watch.drop_pod(uid)
        self._apply(uid)
        self._fire_pod(uid, None)

    def _fire_pod(self, uid: str, record: PodRecord | None) -> None:
        """Wake binds waiting for this pod, and for the node it is bound or assigned to."""
        self._waiters.fire(("pod", uid))
        if record is not None:
            for node in {record.node_name, record.assignment.node if record.assignment else None}:
                if node:
                    self._waiters.fire(("node", node))

    def _effective(self, uid: str) -> PodUsage | None:
        reserved = self.locks.claim(uid)
        if reserved is not None:
            return reserved
        record = self.watch.pods.get(uid)
        return observed_claim(record, self.clock(), self.lock_ttl) if record is not None else None

    def _apply(self, uid: str) -> None:
        """Make the ledger hold exactly the effective claim of `uid`."""
        self.gpus.apply(uid, self._effective(uid))

    def wait_until(self, key: Hashable, check: Callable[[], T | None], deadline: float) -> T | None:
        """`check()` (called with the lock held) once it returns something other than None, waking when the
        watch changes `key` (`("node", name)`: the node or a pod bound or assigned to it; `("pod", uid)`)
        and at least every 0.2 s (for expiries); None once the monotonic `deadline` has passed."""
        while True:
            with self.lock:
                result = check()
                if result is not None:
                    return result
                event = self._waiters.add(key)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            event.wait(min(remaining, 0.2))

    # ------------------------------------------------------------------ queries

    def entry(self, name: str) -> NodeEntry | None:
        """The node's entry (call with `lock` held to read it consistently)."""
        return self.gpus.entries.get(name)

    def records(self) -> Mapping[str, Record]:
        """Every known node's index record, by name: what the decisions read of it (call with `lock` held;
        see gpufleet.extender.index)."""
        return self.gpus.index

    def node_count(self) -> int:
        """How many nodes are indexed."""
        return len(self.gpus.index)

    def node_info(self, name: str) -> NodeInfo | None:
        """The node as last watched, parsed (call with `lock` held)."""
        entry = self.gpus.entries.get(name)
        return entry.info if entry is not None else None

    def current(self, obj: Mapping[str, Any]) -> str | None:
        """The name of a Node object whose very version (resourceVersion) the cache holds and indexes; None
        for any other (newer, unknown, unnamed) (call with `lock` held)."""
        name, entry = self._cached(obj)
        return name if entry is not None and name in self.gpus.index else None

    def parse_node(self, obj: Mapping[str, Any]) -> tuple[str, NodeInfo | None, str]:
        """A Node object's name and parsed info (the cached parse when the cache holds its resourceVersion:
        the very object `node_info` returns), or None with why it cannot be read (call with `lock` held)."""
        name, entry = self._cached(obj)
        if entry is not None:
            return name, entry.info, ""
        try:
            # A newer Node: its GPUs are parsed again only if their annotation changed.
            return name, node_info(obj, self.node_info(name)), ""
        except ValueError as exc:
            return name, None, str(exc)

    def _cached(self, obj: Mapping[str, Any]) -> tuple[str, NodeEntry | None]:
        """A Node object's name, and its entry if the cache holds this very version of it."""
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        entry = self.gpus.entries.get(name)
        if (
            entry is not None
            and entry.info is not None
            and entry.info.resource_version == str(meta.get("resourceVersion") or "")
        ):
            return name, entry
        return name, None

    def plan(self, req: GpuRequest, policy: Policy) -> RequestPlan:
        """The request as the decisions on this state's index records ask it, with the GPU policy that
        applies (call with `lock` held)."""
        return RequestPlan(req, policy, self.gpus.signatures, self.gpus.shape_ids.id, self.lock_blocks)

    def queues(self, nodes: Collection[str], locked: Iterable[str], uid: str, now: float) -> dict[str, int]:
        """The `nodes` where a new bind of pod `uid` would wait behind more hand-offs than its share of
        `bind_wait` allows (`BindLocks.busy`), with how many (`BindLocks.ahead`): only nodes with binds of
        this process queued or with a live bind-lock of another pod (`locked`, every such node of `nodes`)
        can be (call with `lock` held)."""
        ahead: dict[str, int] = {}
        locks, index = self.locks, self.gpus.index
        for name in (*locks.queued, *locked):
            if name in nodes and name not in ahead:
                r = index.get(name)
                count = locks.ahead(name, uid, r.lock_uid, r.lock_expires, now) if r else 0
                if locks.busy(count):
                    ahead[name] = count
        return ahead

    def entries(self) -> dict[str, NodeEntry]:
        """All entries (call with `lock` held)."""
        return self.gpus.entries

    def pod(self, uid: str) -> PodRecord | None:
        """The pod as last watched, if it touches a GPU (call with `lock` held)."""
        return self.watch.pods.get(uid)

    def maxima(self) -> tuple[int, int]:
        """The largest healthy GPU (GiB) and the most healthy GPUs on one node, over known nodes."""
        with self.lock:
            return self.gpus.maxima()

    def own_usage(self, uid: str) -> PodUsage | None:
        """The claim a pod already holds (a retried bind, a stale annotation)."""
        return self.gpus.claims.get(uid) if uid else None

    def ledger(self, node: str, exclude_uid: str) -> tuple[dict[str, int], int]:
        """A copy of the node's GiB per GPU and whole GPUs held, leaving out one pod's own claim."""
        with self.lock:
            return self.gpus.without(node, exclude_uid)

    def lock_blocks(self, node: str, lock_uid: str, lock_expires: float, uid: str, now: float) -> bool:
        """Whether the node's bind-lock keeps pod `uid` off the node now (`BindLocks.blocks`)."""
        if not lock_uid or lock_expires <= now or lock_uid == uid:
            return False
        with self.lock:
            return self.locks.blocks(node, lock_uid, lock_expires, uid, now, self.watch.pods.get(lock_uid))

    def evaluate(self, req: GpuRequest, info: NodeInfo, policy: Policy, now: float) -> Verdict:
        """Decide `info` for `req` against the ledger, leaving out what `req`'s own pod already holds."""
        lock = info.lock
        if lock is not None and not self.lock_blocks(info.name, lock.pod_uid, lock.expires, req.uid, now):
            info = dataclasses.replace(info, lock=None)
        with self.lock:
            entry = self.gpus.entries.get(info.name)
            used: Mapping[str, int] = entry.used if entry else {}
            whole = entry.whole if entry else 0
            own = self.own_usage(req.uid)
            if own is not None and own.node == info.name:
                used = {u: g - own.shares.get(u, 0) for u, g in used.items()}
                whole -= own.whole
            return evaluate(info, used, whole, req, policy, now)

    # ------------------------------------------------------------------ reservations (binder)

    def reserve(
        self, req: GpuRequest, node: str, placement: Placement, now: float, stage: str = BINDING
    ) -> PodUsage:
        """Claim `placement` for the pod; replaces any claim the pod had. `ReservationsFull` at the cap."""
        shares: dict[str, int] = {}
        for container in placement.containers:
            for uuid, gib in container.shares().items():
                shares[uuid] = shares.get(uuid, 0) + gib
        usage = PodUsage(req.uid, req.key, node, shares, placement.whole, placement.containers, "reserved")
        with self.lock:
            self.locks.reserve(usage, now, stage, req if stage == DECIDED else None)
            self._apply(req.uid)
        return usage

    def plan_and_reserve(
        self, req: GpuRequest, info: NodeInfo, policy: Policy, now: float, stage: str = BINDING
    ) -> Verdict:
        """Evaluate and, if it fits, reserve — atomically, so two decisions or binds in this process cannot
        share GiB. `ReservationsFull` at the cap."""
        with self.lock:
            verdict = self.evaluate(req, info, policy, now)
            if verdict.placement is not None:
                self.reserve(req, info.name, verdict.placement, now, stage)
            return verdict

    def reservation(self, uid: str) -> Reservation | None:
        """The pod's reservation in this process, if any (call with `lock` held to use it)."""
        return self.locks.get(uid)

    def begin(self, uid: str, now: float) -> None:
        """A bind starts on the pod's decided reservation."""
        with self.lock:
            self.locks.begin(uid, now)

    def note_handoff(self, seconds: float) -> None:
        """A bind that queued behind another on its node held its turn this long (see `BindLocks`)."""
        with self.lock:
            self.locks.note_handoff(seconds)

    def handing_off(self, node: str, uid: str) -> list[PodRecord]:
        """Other live pods bound to `node` whose GPU-memory containers the device plugin has not all
        allocated yet, as last watched (call with `lock` held): while one is, the plugin refuses every
        other pod's Allocate on the node."""
        entry = self.gpus.entries.get(node)
        out = []
        for other in entry.pods if entry is not None else ():
            record = self.watch.pods.get(other)
            if (
                other != uid
                and record is not None
                and record.node_name == node
                and not record.terminal
                and record.assignment is not None
                and record.assignment.node == node
                and record.assignment.pending(record.allocated)
            ):
                out.append(record)
        return out

    def release(self, uid: str) -> None:
        """Drop the pod's reservation (bind failed); its observed claim, if any, applies again."""
        with self.lock:
            if self.locks.release(uid):
                self._apply(uid)

    def settle(self, uid: str) -> None:
        """The bind succeeded: keep the reservation only until the watch shows the pod bound."""
        with self.lock:
            record = self.watch.pods.get(uid)
            if self.locks.settle(uid, record is not None and bool(record.node_name), self.clock()):
                self._apply(uid)

    def sweep(self) -> list[str]:
        """Expire time-bound claims: stale "binding" annotations, settled reservations never confirmed and
        decided ones never bound."""
        now = self.clock()
        with self.lock:
            dropped = self.locks.expired(now)
            for uid in dropped:
                self._apply(uid)
            for uid in list(self.gpus.binding):
                self._apply(uid)
        return dropped

    def reservation_count(self, stage: str | None = None) -> int:
        """How many reservations are held (decided, binding or settled; or of one `stage`)."""
        with self.lock:
            if stage is None:
                return len(self.locks.reservations)
            return sum(1 for r in self.locks.reservations.values() if r.stage == stage)

    # ------------------------------------------------------------------ inspection

    def inspect_node(self, name: str) -> dict[str, Any] | None:
        """One node's GPUs, memory used/free and which pods hold what (JSON-ready)."""
        with self.lock:
            entry = self.gpus.entries.get(name)
            return inspection.node(entry, self.clock()) if entry is not None else None

    def inspect(self) -> dict[str, Any]:
        """Every node plus cluster totals (JSON-ready)."""
        with self.lock:
            return inspection.cluster(self.watch, self.gpus, self.locks, self.clock())

    def totals(self) -> dict[str, int]:
        """Cluster-wide GPU and memory figures."""
        with self.lock:
            return self.gpus.totals()
