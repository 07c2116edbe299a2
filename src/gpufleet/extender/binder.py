"""The bind verb: reserve GPUs, take the node's bind-lock, annotate the pod, create the Binding.

Order and guarantees (docs/handoff.md, docs/extender.md):
1. reserve in this process's ledger, atomically with the fit check (no two local binds share GiB), then
   queue for the node's in-process mutex (filter and prioritize see the reservation meanwhile);
2. take the node's `gpufleet.io/bind-lock` with the Node's resourceVersion as precondition (no two
   replicas hand off on one node at once; a live lock held by another pod means "node busy", unless
   that hand-off is about to finish: then the bind waits up to `lock_wait` seconds for it);
3. re-check the fit against a quorum list of the node's pods — our cache may lag another replica's
   binds, the API cannot — and against the Node just read (GPU health may have changed);
4. write the pod's `gpufleet.io/assignment` (UID precondition), then create the Binding (UID precondition).
Any failure undoes what was done, in reverse, and returns an error: the scheduler retries; a pod is never
placed on GPUs that were not re-checked under the lock. Whole-GPU pods need neither lock nor annotation:
the kubelet picks their devices.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable

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
from gpufleet.extender.watchcache import pod_record
from gpufleet.handoff import ASSIGNMENT_ANNOTATION, BIND_LOCK_ANNOTATION, Assignment, BindLock
from gpufleet.logs import log_event

LOCK_ATTEMPTS = 3
# Seconds between reads of a node while waiting for another pod's hand-off to release its bind-lock.
LOCK_POLL = 0.1


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
        self._mutexes: dict[str, threading.Lock] = {}
        self._mutexes_guard = threading.Lock()

    def _acquire_node(self, node: str) -> threading.Lock:
        """The node's in-process mutex, acquired (release it); BindError after `bind_wait` seconds."""
        with self._mutexes_guard:
            mutex = self._mutexes.setdefault(node, threading.Lock())
        if not mutex.acquire(timeout=self.bind_wait):
            raise BindError(
                f"node {node} busy: another bind to it is still running in this extender", "node_busy"
            )
        return mutex

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

    def _read_pod(self, namespace: str, name: str, uid: str) -> tuple[GpuRequest, str | None, str]:
        """The pod as stored now: its request, current node and resourceVersion.

        Read fresh rather than from the cache: a retried bind whose first reply was lost must see that
        the pod is already bound, and the annotation patch is made conditional on this version.
        """
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

    def _bind(self, namespace: str, name: str, uid: str, node: str) -> Placement | None:
        if not self.state.synced:
            raise BindError("extender cache not synced yet; retry", "not_synced")
        req, bound_to, pod_version = self._read_pod(namespace, name, uid)
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
            entry = self.state.entry(node)
            info = entry.info if entry else None
        if info is None:
            raise BindError(f"node {node} is not in the extender's cache", "unknown_node")
        # Reserve before queueing for the node: filter and prioritize count this pod from now on, so the
        # scheduler, which decides the next pods while earlier binds still run, does not send the node more
        # than it holds. The cached lock may be stale; the lock is taken against the API below, which decides.
        verdict = self.state.plan_and_reserve(req, dataclasses.replace(info, lock=None), policy, self.clock())
        if verdict.placement is None:
            raise BindError(f"node {node}: {verdict.reason}", "no_fit")
        placement = verdict.placement
        try:
            mutex = self._acquire_node(node)
        except BindError:
            self.state.release(req.uid)
            raise
        try:
            locked = annotated = False
            try:
                if req.kind == "mem":
                    fresh = self._take_lock(node, req)
                    locked = True
                    placement = self._recheck(req, fresh, policy)
                    assignment = Assignment(node, placement.containers, self.clock())
                    try:
                        self.cluster.patch_pod_annotations(
                            req.namespace,
                            req.name,
                            uid,
                            {ASSIGNMENT_ANNOTATION: assignment.to_json()},
                            resource_version=pod_version,
                        )
                    except ApiError as exc:
                        raise BindError(f"cannot annotate pod {req.key}: {exc}", _api_reason(exc)) from None
                    annotated = True
                self._create_binding(req, uid, node)
            except Exception as exc:
                # When the Binding's outcome is unknown it may have happened: then the device plugin
                # needs both the lock and the annotation, so leave them to expire on their own.
                keep = isinstance(exc, BindError) and exc.reason == "outcome_unknown"
                self._undo(req, uid, node, locked and not keep, annotated and not keep)
                if isinstance(exc, BindError):
                    raise
                log_event("bind_crashed", logging.ERROR, exc=exc, pod=req.key, node=node)
                raise BindError(f"internal error binding {req.key}: {exc!r}", "internal") from exc
            self.state.settle(req.uid)
            return placement
        finally:
            mutex.release()

    def _take_lock(self, node: str, req: GpuRequest) -> NodeInfo:
        """Write our bind-lock on the node (resourceVersion precondition); return the node as locked.

        Another pod's live lock fails the bind at once, unless its hand-off is about to finish
        (`ClusterState.lock_blocks`): then the node is read again every `LOCK_POLL` seconds for up to
        `lock_wait` seconds, holding this bind's reservation and the node's mutex meanwhile.
        """
        deadline = time.monotonic() + self.lock_wait
        conflicts = 0
        waited = False
        while True:
            try:
                info = node_info(self.cluster.get_node(node))
            except NotFoundError:
                raise BindError(f"node {node} no longer exists", "unknown_node") from None
            except ApiError as exc:
                raise BindError(f"cannot read node {node}: {exc}", _api_reason(exc)) from None
            now = self.clock()
            lock = info.lock
            if lock is not None and lock.live(now) and lock.pod_uid != req.uid:
                if time.monotonic() < deadline and not self.state.lock_blocks(
                    node, lock.pod_uid, lock.expires, req.uid, now
                ):
                    if not waited:
                        waited = True
                        self.metrics.inc("gpufleet_extender_lock_waits_total")
                    time.sleep(LOCK_POLL)
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
                # Someone wrote the node since we read it: a kubelet status update or another binder.
                self.metrics.inc("gpufleet_extender_lock_conflicts_total")
                conflicts += 1
                if conflicts >= LOCK_ATTEMPTS:
                    raise BindError(
                        f"node {node} kept changing while taking its bind-lock; retry", "lock_conflict"
                    ) from None
                continue
            except ApiError as exc:
                raise BindError(f"cannot lock node {node}: {exc}", _api_reason(exc)) from None
            return node_info(updated)

    def _recheck(self, req: GpuRequest, fresh: NodeInfo, policy: Policy) -> Placement:
        """Under the lock, fit again against the API's pods on the node and the Node just read."""
        try:
            pods = self.cluster.list_pods_on_node(fresh.name)
        except ApiError as exc:
            raise BindError(f"cannot list pods on node {fresh.name}: {exc}", _api_reason(exc)) from None
        api_used: dict[str, int] = {}
        api_whole = 0
        for obj in pods:
            record = pod_record(obj)
            if record is None or record.uid == req.uid or record.terminal:
                continue
            if record.assignment is not None and record.assignment.node == fresh.name:
                waiting = [c.name for c in record.assignment.pending(record.allocated)]
                if waiting:
                    # Its lock expired before the device plugin allocated it; the plugin refuses any
                    # other pod's Allocate while one is pending, so binding ours now would only fail.
                    raise BindError(
                        f"node {fresh.name} busy: {record.key} is bound but its GPU-memory "
                        f"containers {', '.join(waiting)} are not allocated yet",
                        "node_busy",
                    )
                for uuid, gib in record.assignment.shares().items():
                    api_used[uuid] = api_used.get(uuid, 0) + gib
            api_whole += record.whole
        with self.state.lock:
            used, whole = self.state.ledger(fresh.name, req.uid)
            # The stricter of both views: the cache knows in-flight claims the API does not show yet,
            # the API knows other replicas' binds the cache may not have seen.
            combined = {u: max(used.get(u, 0), api_used.get(u, 0)) for u in used.keys() | api_used.keys()}
            verdict = evaluate(fresh, combined, max(whole, api_whole), req, policy, self.clock())
            if verdict.placement is None:
                raise BindError(f"node {fresh.name} no longer fits: {verdict.reason}", "stale")
            own = self.state.own_usage(req.uid)
            if own is None or own.containers != verdict.placement.containers:
                # The plan made from the cache was wrong: another replica's bind, or changed GPU health.
                self.metrics.inc("gpufleet_extender_recheck_replans_total")
                self.state.reserve(req, fresh.name, verdict.placement, self.clock())
            return verdict.placement

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


def _api_reason(exc: ApiError) -> str:
    if isinstance(exc, UnavailableError):
        return "api_unavailable"
    if isinstance(exc, ConflictError):
        return "conflict"
    if isinstance(exc, NotFoundError):
        return "not_found"
    return "api"
