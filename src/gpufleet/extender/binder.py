"""The bind verb: take the node's turn and bind-lock, annotate the pod, create the Binding.

Order and guarantees (docs/handoff.md, docs/extender.md):
1. the pod's reservation: the one filter decided for this node, else planned now in this process's ledger,
   atomically with the fit check (no two local decisions or binds share GiB);
2. queue for the node's turn in this process (first come, first served, up to `bind_wait`);
3. wait, through the watch, for another pod's hand-off on the node about to finish (up to `lock_wait`),
   then take the node's `gpufleet.io/bind-lock` with the Node's resourceVersion as precondition (no two
   replicas hand off on one node at once; a 409 means the cache was behind: read the node, retry);
4. write the pod's `gpufleet.io/assignment` (UID and resourceVersion preconditions), and wait until this
   process's own watch shows that write. Every pod write of every earlier bind to the node came before its
   bind-lock was released, so before ours was taken: the watch, which delivers changes in order, now holds
   all of them. Fit again against that view and the Node as locked (GPU health) — exact, without a list of
   the node's pods — and re-annotate if the GPUs must change;
5. create the Binding (UID precondition).
Any failure undoes what was done, in reverse, and returns an error: the scheduler retries; a pod is never
placed on GPUs that were not re-checked under the lock. Whole-GPU pods need neither lock nor annotation:
the kubelet picks their devices.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import Callable

from gpufleet.extender.bindlocks import DECIDED, SETTLED, ReservationsFull
from gpufleet.extender.cluster import (
    ApiError,
    ClusterSource,
    ConflictError,
    NotFoundError,
    UnavailableError,
)
from gpufleet.extender.metrics import Metrics
from gpufleet.extender.model import NodeInfo, node_info
from gpufleet.extender.placement import Placement, evaluate
from gpufleet.extender.request import GpuRequest, Policy, RequestError, parse_pod
from gpufleet.extender.state import ClusterState
from gpufleet.handoff import (
    ASSIGNMENT_ANNOTATION,
    BIND_LOCK_ANNOTATION,
    Assignment,
    BindLock,
    ContainerAssignment,
)
from gpufleet.logs import log_event

LOCK_ATTEMPTS = 3
# A bind refused because the extender's view was behind (another replica's bind, a conflict, a slow watch) is
# for a pod that fit when filter decided it and will fit again at once. kube-scheduler 1.20 parks a pod whose
# bind failed in its unschedulable queue for 60-90 s, and nothing about nodes moves it back; an update of the
# pod itself moves it to the active queue at once. So after such a refusal the extender writes this
# annotation on the pod (its value: the reason and the time), REQUEUE_DELAY seconds later, when the scheduler
# has parked the pod. Not after "node busy": there the node's hand-offs are the limit, and a pod back at once
# only meets the same queue (measured: in a 1,000-pod burst at capacity, six times the refusals and three
# times the API server's CPU).
REFUSED_ANNOTATION = "gpufleet.io/bind-refused"
REQUEUE_REASONS = frozenset({"no_fit", "stale", "conflict", "lock_conflict", "lock_expired", "watch_lag"})
REQUEUE_DELAY = 0.5
# Most seconds a bind waits for its own watch to show the assignment it wrote (usually milliseconds).
WATCH_WAIT = 5.0
# Seconds kept between a write of this bind and its bind-lock's expiry: a bind that slow gives up rather than
# write after the lock may have gone to another pod.
LOCK_MARGIN = 2.0


class _AlreadyBound(Exception):
    """The pod turned out to be bound to the node already: an earlier attempt's reply was lost."""


class NodeTurns:
    """First come, first served turns per node for this process's binds (a plain lock wakes waiters in no
    particular order: under a burst one bind could be passed over until it timed out)."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._queues: dict[str, collections.deque[threading.Event]] = {}

    def acquire(self, node: str, timeout: float) -> tuple[bool, bool]:
        """Wait for the node's turn; (got it, had to wait behind another bind)."""
        mine = threading.Event()
        with self._guard:
            line = self._queues.setdefault(node, collections.deque())
            line.append(mine)
            if len(line) == 1:
                return True, False
        if mine.wait(timeout):
            return True, True
        with self._guard:
            if mine.is_set():
                return True, True
            line = self._queues[node]
            line.remove(mine)
            if not line:
                del self._queues[node]
        return False, True

    def release(self, node: str) -> None:
        """End the turn; the next bind in line gets it."""
        with self._guard:
            line = self._queues[node]
            line.popleft()
            if line:
                line[0].set()
            else:
                del self._queues[node]


class BindError(Exception):
    """The bind did not happen; `reason` is a short label for metrics, the message is for the pod's event."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class Binder:
    """Binds pods for the scheduler; thread-safe, one in-process mutex per node."""

    def __init__(
        self,
        cluster: ClusterSource,
        state: ClusterState,
        metrics: Metrics,
        gpu_policy: Policy = Policy.BINPACK,
        lock_ttl: float = 60.0,
        bind_wait: float = 5.0,
        clock: Callable[[], float] = time.time,
        lock_wait: float = 0.0,
    ) -> None:
        self.cluster = cluster
        self.state = state
        self.metrics = metrics
        self.gpu_policy = gpu_policy
        self.lock_ttl = lock_ttl
        self.bind_wait = bind_wait
        self.clock = clock
        self.lock_wait = lock_wait
        self.turns = NodeTurns()

    def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Bind the pod to the node or raise BindError; safe to retry."""
        started = time.perf_counter()
        try:
            placement = self._bind(namespace, name, uid, node)
        except BindError as exc:
            self.metrics.inc("gpufleet_extender_binds_total", result="error", reason=exc.reason)
            log_event(
                "bind_failed",
                logging.WARNING,
                pod=f"{namespace}/{name}",
                uid=uid,
                node=node,
                reason=exc.reason,
                error=str(exc),
            )
            if exc.reason in REQUEUE_REASONS and uid:
                timer = threading.Timer(REQUEUE_DELAY, self._requeue, (namespace, name, uid, exc.reason))
                timer.daemon = True
                timer.start()
            raise
        self.metrics.inc("gpufleet_extender_binds_total", result="ok", reason="")
        self.metrics.observe("gpufleet_extender_bind_seconds", time.perf_counter() - started)
        log_event(
            "bound",
            pod=f"{namespace}/{name}",
            uid=uid,
            node=node,
            gpus=[
                {"container": c.name, "gib": c.gpu_mem_gib, "gpus": list(c.gpus)}
                for c in placement.containers
            ]
            if placement
            else None,
            whole=placement.whole if placement else None,
        )

    def _requeue(self, namespace: str, name: str, uid: str, reason: str) -> None:
        """Touch a refused pod (REFUSED_ANNOTATION) so the scheduler retries it after its backoff, not in a
        minute; best effort."""
        value = f"{reason} {self.clock():.3f}"
        try:
            self.cluster.patch_pod_annotations(namespace, name, uid, {REFUSED_ANNOTATION: value})
        except ApiError as exc:
            log_event("requeue_failed", logging.DEBUG, pod=f"{namespace}/{name}", error=str(exc))
            return
        self.metrics.inc("gpufleet_extender_requeues_total")

    def _read_pod(self, namespace: str, name: str, uid: str) -> tuple[GpuRequest, str | None, str]:
        """The pod as stored now: its request, current node and resourceVersion (a retried bind whose first
        reply was lost must see that the pod is already bound)."""
        try:
            obj = self.cluster.get_pod(namespace, name)
        except NotFoundError:
            raise BindError(f"pod {namespace}/{name} not found", "pod_gone") from None
        except ApiError as exc:
            raise BindError(f"cannot read pod {namespace}/{name}: {exc}", _api_reason(exc)) from None
        meta = obj.get("metadata") or {}
        actual = str(meta.get("uid") or "")
        if uid and actual != uid:
            raise BindError(f"pod {namespace}/{name} has UID {actual}, not {uid} (recreated)", "pod_gone")
        try:
            req = parse_pod(obj)
        except RequestError as exc:
            raise BindError(str(exc), "bad_request") from None
        return req, (obj.get("spec") or {}).get("nodeName") or None, str(meta.get("resourceVersion") or "")

    def _pod(self, namespace: str, name: str, uid: str) -> tuple[GpuRequest, str | None, str]:
        """The pod's request, node and resourceVersion: from what filter and the watch already hold when they
        know the pod (no read), else read. A stale cache costs a 409 on the annotation and a read then."""
        key = f"{namespace}/{name}"
        with self.state.lock:
            record = self.state.pod(uid) if uid else None
            reservation = self.state.reservation(uid) if uid else None
            if record is not None and record.key == key and record.resource_version:
                request = reservation.request if reservation is not None else None
                request = request or record.request
                if request is not None and request.uid == uid:
                    return request, record.node_name, record.resource_version
        return self._read_pod(namespace, name, uid)

    def _bind(self, namespace: str, name: str, uid: str, node: str) -> Placement | None:
        if not self.state.synced:
            raise BindError("extender cache not synced yet; retry", "not_synced")
        req, bound_to, pod_version = self._pod(namespace, name, uid)
        if bound_to == node:
            return None  # a retry after a lost reply: already done
        if bound_to:
            raise BindError(f"pod {req.key} is already bound to {bound_to}", "already_bound")
        uid = uid or req.uid
        if req.kind == "none":
            self._create_binding(req, uid, node)
            return None
        policy = req.gpu_policy or self.gpu_policy
        with self.state.lock:
            done = self.state.reservation(req.uid)
            if done is not None and done.stage == SETTLED and done.usage.node == node:
                return None  # this process bound it; the watch has not shown it yet
        placement = self._reserve(req, node, policy)
        # bind_wait for the turn, lock_wait for the hand-off before it: one budget, so a turn that came early
        # leaves its bind more time for that hand-off (the whole stays under the scheduler's httpTimeout).
        budget_end = time.monotonic() + self.bind_wait + self.lock_wait
        granted, queued = self.turns.acquire(node, self.bind_wait)
        if not granted:
            self.state.release(req.uid)
            raise BindError(
                f"node {node} busy: {self.bind_wait:g}s passed waiting behind other binds to it in this "
                "extender (bind_wait)",
                "node_busy",
            )
        turn = time.monotonic()
        try:
            locked = False
            written: list[str] = []  # the pod's resourceVersion after each assignment written
            try:
                if req.kind == "mem":
                    fresh, lock_expires = self._take_lock(node, req, budget_end)
                    locked = True
                    placement = self._commit(req, uid, fresh, policy, pod_version, lock_expires, written)
                    if self.clock() > lock_expires - LOCK_MARGIN:
                        raise BindError(f"bind-lock on {node} about to expire; retry", "lock_expired")
                self._create_binding(req, uid, node)
            except _AlreadyBound:
                self.state.release(req.uid)  # the watch shows it bound soon: its annotation counts then
                return None
            except Exception as exc:
                # When the Binding's outcome is unknown it may have happened: then the device plugin
                # needs both the lock and the annotation, so leave them to expire on their own.
                keep = isinstance(exc, BindError) and exc.reason == "outcome_unknown"
                self._undo(req, uid, node, locked and not keep, bool(written) and not keep)
                if isinstance(exc, BindError):
                    raise
                log_event("bind_crashed", logging.ERROR, exc=exc, pod=req.key, node=node)
                raise BindError(f"internal error binding {req.key}: {exc!r}", "internal") from exc
            self.state.settle(req.uid)
            return placement
        finally:
            if queued:
                self.state.note_handoff(time.monotonic() - turn)
            self.turns.release(node)

    def _reserve(self, req: GpuRequest, node: str, policy: Policy) -> Placement:
        """The pod's placement on `node`: the one filter decided, else planned and reserved now.

        Filter and prioritize count the pod from here on, while the bind queues: kube-scheduler decides the
        next pods while earlier binds still run, and would otherwise send a node more than it holds."""
        with self.state.lock:
            entry = self.state.entry(node)
            info = entry.info if entry else None
            reservation = self.state.reservation(req.uid)
            if info is None:
                raise BindError(f"node {node} is not in the extender's cache", "unknown_node")
            if reservation is not None and reservation.usage.node == node and reservation.stage == DECIDED:
                self.state.begin(req.uid, self.clock())
                return Placement(reservation.usage.containers, reservation.usage.whole, 0.0, 0.0, (0, 0, 0))
            try:
                verdict = self.state.plan_and_reserve(
                    req, dataclasses.replace(info, lock=None), policy, self.clock()
                )
            except ReservationsFull as exc:
                raise BindError(str(exc), "reservations_full") from None
            if verdict.placement is None:
                if reservation is not None and reservation.stage == DECIDED:
                    self.state.release(req.uid)  # decided for another node: the scheduler chose this one
                raise BindError(f"node {node}: {verdict.reason}", "no_fit")
        return verdict.placement

    def _take_lock(self, node: str, req: GpuRequest, budget_end: float) -> tuple[NodeInfo, float]:
        """Write our bind-lock on the node; return the node as locked and the lock's expiry.

        Another pod's live lock fails the bind at once, unless its hand-off is about to finish
        (`ClusterState.lock_blocks`): then the bind waits for the lock to go, up to `lock_wait`
        seconds or what its turn left of `bind_wait + lock_wait` (`budget_end`), holding its reservation and
        the node's turn meanwhile. The precondition is the Node's resourceVersion as the watch shows it; a
        409 (the watch was behind) reads the node and tries again.

        The node's watch is a stream of its own and may lag behind the pods' (an API server under load):
        once a read has shown the node newer than the cache, that read is the node as known (`known`) until
        the watch reaches it, so an older cache is neither waited on as if it had moved nor patched with (a
        certain 409). While the cache is behind, the wait ends when the watch catches up, when the lock
        holder's pod shows its containers allocated (the device plugin releases the lock next), or after
        at most a second; then the node is read once more.
        """
        deadline = max(time.monotonic() + self.lock_wait, budget_end) if self.lock_wait > 0 else 0.0
        conflicts = 0
        waited = False
        known: NodeInfo | None = None  # a read newer than the cache, until the watch reaches it
        nudged: set[str] = set()  # lock holders whose allocation already prompted a read
        while True:
            info = known if known is not None else self._cached_node(node)
            lock = info.lock
            now = self.clock()
            if lock is not None and lock.live(now) and lock.pod_uid != req.uid:
                if time.monotonic() < deadline and not self.state.lock_blocks(
                    node, lock.pod_uid, lock.expires, req.uid, now
                ):
                    if not waited:
                        waited = True
                        self.metrics.inc("gpufleet_extender_lock_waits_total")
                    moved = functools.partial(
                        self._lock_moved,
                        node,
                        lock.pod_uid,
                        info.resource_version,
                        known,
                        lock.pod_uid not in nudged,
                    )
                    self.state.wait_until(("node", node), moved, min(deadline, time.monotonic() + 1.0))
                    if known is not None:
                        with self.state.lock:
                            if self._holder_allocated(lock.pod_uid):
                                nudged.add(lock.pod_uid)
                        known = self._catch_up(node, known)
                    continue
                raise BindError(
                    f"node {node} busy: GPU-memory hand-off in progress for {lock.pod_key} "
                    f"(lock expires in {max(0, int(lock.expires - now))}s)",
                    "node_busy",
                )
            mine = BindLock(req.uid, req.key, now + self.lock_ttl)
            try:
                updated = self.cluster.patch_node_annotations(
                    node, {BIND_LOCK_ANNOTATION: mine.format()}, info.resource_version
                )
            except ConflictError:
                # Someone wrote the node since we last saw it: a kubelet status update, the device plugin
                # releasing a lock, another binder, or a write the watch has not delivered yet.
                self.metrics.inc("gpufleet_extender_lock_conflicts_total")
                conflicts += 1
                if conflicts >= LOCK_ATTEMPTS:
                    raise BindError(
                        f"node {node} kept changing while taking its bind-lock; retry", "lock_conflict"
                    ) from None
                known = self._newer_than_cache(node, self._read_node(node))
                continue
            except ApiError as exc:
                raise BindError(f"cannot lock node {node}: {exc}", _api_reason(exc)) from None
            return node_info(updated), mine.expires

    def _cached_node(self, node: str) -> NodeInfo:
        with self.state.lock:
            entry = self.state.entry(node)
            info = entry.info if entry else None
        return info if info is not None else self._read_node(node)

    def _read_node(self, node: str) -> NodeInfo:
        try:
            return node_info(self.cluster.get_node(node))
        except NotFoundError:
            raise BindError(f"node {node} no longer exists", "unknown_node") from None
        except ApiError as exc:
            raise BindError(f"cannot read node {node}: {exc}", _api_reason(exc)) from None

    def _newer_than_cache(self, node: str, read: NodeInfo) -> NodeInfo | None:
        """`read` if the cache does not hold its version (then the cache is behind it: a read of the API is
        never older than the watch), else None: the cache will do."""
        with self.state.lock:
            cached = self.state.node_info(node)
            return None if cached is not None and cached.resource_version == read.resource_version else read

    def _caught_up(self, node: str, known: NodeInfo) -> bool:
        """Whether the watch has reached `known` (a read newer than the cache): it holds that very version,
        or shows the same bind-lock `known` shows, so that every change it delivers from here on is newer
        than what the bind is waiting on (call with the state's lock held)."""
        cached = self.state.node_info(node)
        if cached is None:
            return False
        return cached.resource_version == known.resource_version or (
            known.lock is not None and cached.lock == known.lock
        )

    def _catch_up(self, node: str, known: NodeInfo) -> NodeInfo | None:
        """After a wait while the cache was behind `known`: None (use the cache) once it has caught up,
        else the node read again (once per wait)."""
        with self.state.lock:
            if self._caught_up(node, known):
                return None
        return self._newer_than_cache(node, self._read_node(node))

    def _holder_allocated(self, holder: str) -> bool:
        """Whether the watch shows every GPU-memory container of the lock holder's pod allocated: the device
        plugin releases the lock right after writing that (call with the state's lock held)."""
        record = self.state.pod(holder)
        return (
            record is not None
            and record.assignment is not None
            and not record.assignment.pending(record.allocated)
        )

    def _lock_moved(
        self, node: str, holder: str, version: str, known: NodeInfo | None = None, nudge: bool = False
    ) -> bool | None:
        """True once the watch shows the node changed since `version` or its lock no longer `holder`'s.

        With `known` (a read newer than the cache, at `version`): True once the cache has caught up with it
        (`_caught_up`), or (`nudge`) once the holder's containers are all allocated; never because an older
        cache differs."""
        info = self.state.node_info(node)
        if info is None:
            return True
        if known is not None:
            caught_up = self._caught_up(node, known) or (nudge and self._holder_allocated(holder))
            return True if caught_up else None
        if info.resource_version != version:
            return True
        if info.lock is None or info.lock.pod_uid != holder or not info.lock.live(self.clock()):
            return True
        return None

    def _commit(
        self,
        req: GpuRequest,
        uid: str,
        fresh: NodeInfo,
        policy: Policy,
        pod_version: str,
        lock_expires: float,
        written: list[str],
    ) -> Placement:
        """Annotate the pod, wait for the watch to show it, fit again against that view; the placement.

        The lock was taken at some point of the API's history; the pod write comes after it, so once this
        process's watch has delivered that write it has delivered every earlier write of every pod (a watch
        delivers changes in order): every pod another bind placed on the node before our lock is in the
        ledger. What the ledger holds beyond that (this process's reservations) only makes the check stricter.
        """
        own = self.state.own_usage(req.uid)
        if own is None or own.node != fresh.name:
            raise BindError(f"pod {req.key}: its reservation on {fresh.name} was dropped; retry", "stale")
        assignment, version = self._annotate(req, uid, fresh.name, own.containers, pod_version, lock_expires)
        written.append(version)
        shown = self.state.wait_until(
            ("pod", req.uid), lambda: self._shown(req.uid, assignment, version), time.monotonic() + WATCH_WAIT
        )
        if shown is None:
            raise BindError(
                f"the extender's watch did not show pod {req.key}'s assignment within {WATCH_WAIT:g}s; retry",
                "watch_lag",
            )
        with self.state.lock:
            waiting = self.state.handing_off(fresh.name, req.uid)
            if waiting:
                # Its lock expired before the device plugin allocated it; the plugin refuses any other pod's
                # Allocate while one is pending, so binding ours now would only fail.
                raise BindError(
                    f"node {fresh.name} busy: {waiting[0].key} is bound but its GPU-memory containers "
                    f"{', '.join(c.name for c in waiting[0].assignment.pending(waiting[0].allocated))} "  # type: ignore[union-attr]
                    "are not allocated yet",
                    "node_busy",
                )
            used, whole = self.state.ledger(fresh.name, req.uid)
            containers = own.containers
            if not _still_fits(fresh, used, whole, own.shares):
                verdict = evaluate(fresh, used, whole, req, policy, self.clock())
                if verdict.placement is None:
                    raise BindError(f"node {fresh.name} no longer fits: {verdict.reason}", "stale")
                # The plan was wrong: another replica's bind, or changed GPU health.
                self.metrics.inc("gpufleet_extender_recheck_replans_total")
                self.state.reserve(req, fresh.name, verdict.placement, self.clock())
                containers = verdict.placement.containers
            placement = Placement(containers, own.whole, 0.0, 0.0, (0, 0, 0))
        if containers != own.containers:
            written.append(self._annotate(req, uid, fresh.name, containers, version, lock_expires)[1])
        return placement

    def _annotate(
        self,
        req: GpuRequest,
        uid: str,
        node: str,
        containers: tuple[ContainerAssignment, ...],
        pod_version: str,
        lock_expires: float,
    ) -> tuple[Assignment, str]:
        """Write the pod's assignment (UID and resourceVersion preconditions); what was written and the pod's
        new resourceVersion. A 409 from a stale version is read again once: the pod may be bound already."""
        for attempt in range(2):
            if self.clock() > lock_expires - LOCK_MARGIN:
                raise BindError(f"bind-lock on {node} about to expire; retry", "lock_expired")
            assignment = Assignment(node, containers, self.clock())
            try:
                updated = self.cluster.patch_pod_annotations(
                    req.namespace, req.name, uid, {ASSIGNMENT_ANNOTATION: assignment.to_json()},
                    resource_version=pod_version,
                )  # fmt: skip
            except ConflictError:
                if attempt:
                    raise BindError(
                        f"pod {req.key} kept changing while annotating it; retry", "conflict"
                    ) from None
                _, bound_to, pod_version = self._read_pod(req.namespace, req.name, uid)
                if bound_to == node:
                    raise _AlreadyBound from None
                if bound_to:
                    raise BindError(
                        f"pod {req.key} is already bound to {bound_to}", "already_bound"
                    ) from None
                continue
            except ApiError as exc:
                raise BindError(f"cannot annotate pod {req.key}: {exc}", _api_reason(exc)) from None
            version = str((updated.get("metadata") or {}).get("resourceVersion") or "")
            return Assignment.from_json(assignment.to_json()), version
        raise AssertionError("unreachable")

    def _shown(self, uid: str, assignment: Assignment, version: str) -> bool | None:
        """True once the watch shows the pod with the assignment written (at its version or later)."""
        record = self.state.pod(uid)
        if record is not None and (record.assignment == assignment or record.resource_version == version):
            return True
        return None

    def _create_binding(self, req: GpuRequest, uid: str, node: str) -> None:
        try:
            self.cluster.bind_pod(req.namespace, req.name, uid, node)
            return
        except (UnavailableError, ConflictError) as exc:
            failure: ApiError = exc
        except ApiError as exc:
            raise BindError(f"binding {req.key} to {node} refused: {exc}", _api_reason(exc)) from None
        # Unavailable: the request may have landed before the connection failed. Conflict: maybe an
        # earlier attempt of ours landed. Either way the pod itself says what happened.
        try:
            current = self.cluster.get_pod(req.namespace, req.name)
        except ApiError:
            if isinstance(failure, UnavailableError):
                raise BindError(
                    f"binding {req.key} to {node}: outcome unknown ({failure}); "
                    "the annotation and lock expire on their own",
                    "outcome_unknown",
                ) from None
            raise BindError(f"binding {req.key} to {node} refused: {failure}", "conflict") from None
        same_pod = str((current.get("metadata") or {}).get("uid") or "") == uid
        if same_pod and (current.get("spec") or {}).get("nodeName") == node:
            return
        raise BindError(f"binding {req.key} to {node} failed: {failure}", _api_reason(failure))

    def _undo(self, req: GpuRequest, uid: str, node: str, locked: bool, annotated: bool) -> None:
        """Best effort, in reverse order; whatever cannot be undone expires (lock TTL, annotation ts)."""
        if annotated:
            try:
                # Only from a pod that is still unbound: a bound pod's assignment is the device plugin's.
                pod = self.cluster.get_pod(req.namespace, req.name)
                if not (pod.get("spec") or {}).get("nodeName"):
                    self.cluster.patch_pod_annotations(
                        req.namespace,
                        req.name,
                        uid,
                        {ASSIGNMENT_ANNOTATION: None},
                        resource_version=str(pod["metadata"].get("resourceVersion") or ""),
                    )
            except ApiError as exc:
                log_event("undo_failed", logging.WARNING, step="annotation", pod=req.key, error=str(exc))
        if locked:
            self._release_lock(node, req.uid)
        self.state.release(req.uid)

    def _release_lock(self, node: str, uid: str) -> None:
        for _ in range(LOCK_ATTEMPTS):
            try:
                info = node_info(self.cluster.get_node(node))
                if info.lock is None or info.lock.pod_uid != uid:
                    return
                self.cluster.patch_node_annotations(node, {BIND_LOCK_ANNOTATION: None}, info.resource_version)
                return
            except ConflictError:
                continue
            except ApiError as exc:
                log_event("undo_failed", logging.WARNING, step="lock", node=node, error=str(exc))
                return


def _still_fits(info: NodeInfo, used: dict[str, int], whole: int, shares: dict[str, int]) -> bool:
    """Whether GiB per GPU `shares` still fit the node as locked, next to `used` (the others' claims): each
    GPU there, healthy, not in MIG mode, with room. Anything else is for `evaluate` to say."""
    if not info.sharing or info.gpu_error or info.passthrough or whole:
        return False
    gpus = {g.uuid: g for g in info.healthy}
    return all(u in gpus and used.get(u, 0) + gib <= gpus[u].memory_gib for u, gib in shares.items())


def _api_reason(exc: ApiError) -> str:
    if isinstance(exc, UnavailableError):
        return "api_unavailable"
    if isinstance(exc, ConflictError):
        return "conflict"
    if isinstance(exc, NotFoundError):
        return "not_found"
    return "api"
