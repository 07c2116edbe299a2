"""Which pod a GPU-memory Allocate belongs to, decided without guessing (docs/handoff.md).

`decide` is pure: given the node's bind-lock annotation, the pods bound to the node and the number of
GiB the kubelet asked for, it names exactly one (pod, container) or raises HandoffError saying why.
`MemoryHandoff` wraps it with the node's read, the view of its pods and the writes, one Allocate at a
time. The annotations' formats are defined in `gpufleet.handoff`; their parse errors become HandoffError
here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.deviceplugin.api import pb
from gpufleet.deviceplugin.gpumem.resolver import PodResolver, PodsView, PodView
from gpufleet.deviceplugin.metrics import Metrics
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions, memory_response
from gpufleet.deviceplugin.rm.errors import DeviceUnhealthy, HandoffError
from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.deviceplugin.rm.model import GpuInfo
from gpufleet.handoff import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    BIND_LOCK_ANNOTATION,
    GPU_MEM_RESOURCE,
    Assignment,
    BindLock,
    ContainerAssignment,
    format_allocated,
    parse_allocated,
)
from gpufleet.logs import log_event

_TERMINAL_PHASES = {"Succeeded", "Failed"}
VIEW_WAIT_S = 10.0  # how long an Allocate waits for the node's pod view to show what it needs


@dataclass(frozen=True)
class Decision:
    """The container an Allocate is for, and whether it is its pod's last GPU-memory container."""

    pod: PodView
    container: ContainerAssignment
    allocated: tuple[str, ...]  # containers allocated before this one
    last: bool


def lock_of(value: str | None) -> BindLock | None:
    """The node's bind-lock from its annotation value; None when absent, HandoffError when malformed."""
    if not value:
        return None
    try:
        return BindLock.parse(value)
    except ValueError as exc:
        raise HandoffError(f"malformed lock: {exc}") from None


def assignment_of(pod: PodView) -> Assignment | None:
    """The pod's assignment annotation; None when the pod has none, HandoffError when malformed."""
    raw = pod.annotations.get(ASSIGNMENT_ANNOTATION)
    if raw is None:
        return None
    try:
        return Assignment.from_json(raw)
    except ValueError as exc:
        raise HandoffError(f"pod {pod.ref}: {ASSIGNMENT_ANNOTATION} is malformed ({exc})") from None


def allocated_of(pod: PodView) -> tuple[str, ...]:
    """Container names the device plugin already allocated for this pod."""
    try:
        return parse_allocated(pod.annotations.get(ALLOCATED_ANNOTATION))
    except ValueError as exc:
        raise HandoffError(f"pod {pod.ref}: {ALLOCATED_ANNOTATION} is malformed ({exc})") from None


def pending_of(pod: PodView) -> tuple[ContainerAssignment, ...]:
    """The pod's assigned containers not yet allocated, in admission order."""
    assignment = assignment_of(pod)
    if assignment is None:
        return ()
    return assignment.pending(allocated_of(pod))


def waiting_pods(node: str, pods: Sequence[PodView], resource: str = GPU_MEM_RESOURCE) -> dict[str, PodView]:
    """The pods on `node` an Allocate could be for, by UID: live pods with assigned containers not yet
    allocated, and pods not yet started that ask for `resource` but carry no assignment (bound without the
    extender: the kubelet admits them too, and the plugin cannot tell their Allocate from the holder's)."""
    out = {}
    for p in pods:
        if p.node != node or p.phase in _TERMINAL_PHASES:
            continue
        if pending_of(p) or (resource in p.requests and p.phase == "Pending" and assignment_of(p) is None):
            out[p.uid] = p
    return out


def decide(
    node: str,
    lock_value: str | None,
    pods: Sequence[PodView],
    now: float,
    gib: int,
    resource: str = GPU_MEM_RESOURCE,
) -> Decision:
    """The one container this Allocate of `gib` GiB is for; HandoffError when that is not certain."""
    lock = lock_of(lock_value)
    live = [p for p in pods if p.node == node and p.phase not in _TERMINAL_PHASES]
    pending = waiting_pods(node, pods, resource)
    candidates = dict(pending)
    if lock is not None and lock.live(now):
        holder = next((p for p in live if p.uid == lock.pod_uid), None)
        if holder is not None:
            candidates[holder.uid] = holder
    if lock is None or not lock.live(now):
        state = (
            "absent"
            if lock is None
            else f"expired at {lock.expires:.0f} (held by {lock.pod_key} uid {lock.pod_uid})"
        )
        waiting = ", ".join(sorted(p.ref for p in pending.values())) or "none"
        raise HandoffError(
            f"node {node}: no pod holds {BIND_LOCK_ANNOTATION} ({state}); unallocated pods: {waiting}"
        )
    if len(candidates) != 1:
        names = ", ".join(sorted(p.ref for p in candidates.values())) or "none visible"
        raise HandoffError(
            f"node {node}: cannot tell which pod this Allocate is for: lock held by {lock.pod_key} "
            f"(uid {lock.pod_uid}), unallocated pods: {names}"
        )
    (pod,) = candidates.values()
    if pod.uid != lock.pod_uid:
        raise HandoffError(
            f"node {node}: unallocated pod {pod.ref} does not hold {BIND_LOCK_ANNOTATION} "
            f"(held by {lock.pod_key} uid {lock.pod_uid})"
        )
    assignment = assignment_of(pod)
    if assignment is None:
        raise HandoffError(f"lock holder {pod.ref} has no {ASSIGNMENT_ANNOTATION} annotation")
    if assignment.node != node:
        raise HandoffError(f"pod {pod.ref} is assigned to node {assignment.node}, not {node}")
    todo = pending_of(pod)
    if not todo:
        raise HandoffError(f"lock holder {pod.ref} has no unallocated GPU-memory container left")
    container = todo[0]
    if container.gpu_mem_gib != gib:
        raise HandoffError(
            f"pod {pod.ref} container {container.name} was assigned {container.gpu_mem_gib} GiB "
            f"but Allocate asked for {gib}"
        )
    if not container.gpus or container.gpu_mem_gib % len(container.gpus):
        raise HandoffError(
            f"pod {pod.ref} container {container.name}: {container.gpu_mem_gib} GiB cannot be split over "
            f"{len(container.gpus)} GPUs"
        )
    return Decision(pod, container, allocated_of(pod), last=len(todo) == 1)


class MemoryHandoff:
    """Answers GPU-memory Allocates from the extender's assignment, one at a time.

    Per Allocate: a GET of the node (the lock), no read of pods (the node's view, fed by a watch, is waited
    on until it shows the lock holder bound), one patch of the holder's `allocated`, then the view is waited
    on until it has reached that patch; a pod it then shows waiting besides the holder undoes the record
    and refuses (docs/handoff.md, "Reading the node's pods"). After the last container, the lock is removed.
    """

    def __init__(
        self,
        resolver: PodResolver,
        node: str,
        gpus: Callable[[], Mapping[str, GpuInfo]],
        health: Callable[[], Mapping[str, GpuHealth]],
        opts: AllocateOptions,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
        resource: str = GPU_MEM_RESOURCE,
        view_wait: float = VIEW_WAIT_S,
    ) -> None:
        self.resolver = resolver
        self.node = node
        self.gpus = gpus
        self.health = health
        self.opts = opts
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.resource = resource
        self.view_wait = view_wait
        self.pods = resolver.node_pods(node)  # starts the node's watch now, before the first Allocate
        # Read-decide-record must not interleave: the plugin is the only writer of `allocated`.
        self._lock = threading.Lock()

    def __call__(self, device_ids: list[str]) -> pb.ContainerAllocateResponse:
        """Allocate one container of len(device_ids) GiB; raises a RequestError when not certain."""
        with self._lock:
            try:
                response = self._allocate(len(device_ids))
            except Exception as exc:
                self.metrics.inc("gpufleet_dp_handoff_total", result=type(exc).__name__)
                raise
            self.metrics.inc("gpufleet_dp_handoff_total", result="ok")
            return response

    def _view(self, holder: str | None) -> PodsView:
        """The node's pods, once the view shows `holder` bound here (the kubelet has seen it bound, so the
        watch delivers it), or as they are after `view_wait` seconds."""

        def shows_holder(view: PodsView) -> bool:
            pod = view.get(holder) if holder else None
            return holder is None or (pod is not None and pod.node == self.node)

        view = self.pods.wait(shows_holder, self.view_wait if holder else 0.0)
        if not view.synced:
            raise HandoffError(
                f"node {self.node}: the plugin has not listed the node's pods yet "
                f"({view.error or 'its watch is starting'})"
            )
        return view

    def _allocate(self, gib: int) -> pb.ContainerAllocateResponse:
        node = self.resolver.read_node(self.node)
        lock_value = node.annotations.get(BIND_LOCK_ANNOTATION)
        lock, now = lock_of(lock_value), self.clock()
        view = self._view(lock.pod_uid if lock is not None and lock.live(now) else None)
        decision = decide(self.node, lock_value, view.pods, now, gib, self.resource)
        known, health = self.gpus(), self.health()
        chosen = []
        for uuid in decision.container.gpus:
            if uuid not in known:
                raise HandoffError(f"pod {decision.pod.ref}: assigned GPU {uuid} is not on node {self.node}")
            state = health.get(uuid, GpuHealth())
            if not state.healthy:
                raise DeviceUnhealthy(
                    f"pod {decision.pod.ref}: assigned GPU {uuid} is unhealthy: {state.reason}"
                )
            chosen.append(known[uuid])
        per_gpu = decision.container.gpu_mem_gib // len(chosen)
        too_big = [g.uuid for g in chosen if per_gpu > g.memory_gib]
        if too_big:
            raise HandoffError(
                f"pod {decision.pod.ref}: {per_gpu} GiB exceeds the memory of GPU {too_big[0]}"
            )
        response = memory_response(chosen, decision.container.gpu_mem_gib, self.opts)
        # Record before answering: if the write fails the kubelet rejects the pod, which is safe; an
        # unrecorded allocation would make the next Allocate ambiguous.
        written = self.resolver.set_allocated(
            decision.pod, format_allocated((*decision.allocated, decision.container.name))
        )
        self._confirm(decision, written)
        if decision.last:
            self.resolver.release_lock(self.node, decision.pod.uid, node)
        log_event(
            "gpu_memory_allocated",
            pod=decision.pod.ref,
            uid=decision.pod.uid,
            container=decision.container.name,
            gib=decision.container.gpu_mem_gib,
            gpus=",".join(decision.container.gpus),
            lock_released=decision.last,
        )
        return response

    def _confirm(self, decision: Decision, written: int) -> None:
        """Once the view has reached the plugin's own write (resourceVersion `written`), it holds every pod
        bound to the node before this Allocate arrived, the pod the kubelet is admitting included. If one
        besides the holder waits for GPU memory, the Allocate may be for it: undo the record and refuse."""
        view = self.pods.wait(lambda v: v.version >= written, self.view_wait)
        if view.version < written:
            problem = (
                f"node {self.node}: the plugin's view of the node's pods did not reach its own write to pod "
                f"{decision.pod.ref} (resourceVersion {written}, view at {view.version}) within "
                f"{self.view_wait:.0f} s ({view.error or 'the watch is behind'})"
            )
        else:
            others = sorted(
                p.ref
                for uid, p in waiting_pods(self.node, view.pods, self.resource).items()
                if uid != decision.pod.uid
            )
            if not others:
                return
            problem = (
                f"node {self.node}: cannot tell which pod this Allocate is for: lock held by "
                f"{decision.pod.ref} (uid {decision.pod.uid}), also waiting: {', '.join(others)}"
            )
        try:
            self.resolver.set_allocated(decision.pod, format_allocated(decision.allocated) or None)
        except HandoffError as exc:
            problem += f"; undoing {ALLOCATED_ANNOTATION} on {decision.pod.ref} failed: {exc}"
        raise HandoffError(problem)
