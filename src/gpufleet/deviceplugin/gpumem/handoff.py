"""Which pod a GPU-memory Allocate belongs to, decided without guessing (docs/handoff.md).

`decide` is pure: given the node's bind-lock annotation, the pods bound to the node and the number of
GiB the kubelet asked for, it names exactly one (pod, container) or raises HandoffError saying why.
`MemoryHandoff` wraps it with the API reads and writes, one Allocate at a time.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from gpufleet.deviceplugin.api import pb
from gpufleet.deviceplugin.gpumem.resolver import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    LOCK_ANNOTATION,
    PodResolver,
    PodView,
)
from gpufleet.deviceplugin.metrics import Metrics
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions, memory_response
from gpufleet.deviceplugin.rm.errors import DeviceUnhealthy, HandoffError
from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.deviceplugin.rm.model import GpuInfo
from gpufleet.logs import log_event

_TERMINAL_PHASES = {"Succeeded", "Failed"}


@dataclass(frozen=True)
class NodeLock:
    """The node's bind-lock: which pod the extender bound last, until when the lock holds."""

    uid: str
    pod: str  # namespace/name, for messages
    expires: float

    def live(self, now: float) -> bool:
        """Whether the lock still holds at `now` (unix seconds)."""
        return now < self.expires


@dataclass(frozen=True)
class ContainerAssignment:
    """One container's share: GiB in total, spread evenly over `gpus`."""

    name: str
    gib: int
    gpus: tuple[str, ...]


@dataclass(frozen=True)
class Decision:
    """The container an Allocate is for, and whether it is its pod's last GPU-memory container."""

    pod: PodView
    container: ContainerAssignment
    allocated: tuple[str, ...]  # containers allocated before this one
    last: bool


def parse_lock(value: str | None) -> NodeLock | None:
    """`"<uid> <namespace>/<name> <expires-unix-seconds>"` → NodeLock; None when absent."""
    if not value:
        return None
    parts = value.split()
    if len(parts) != 3 or "/" not in parts[1]:
        raise HandoffError(f"{LOCK_ANNOTATION} is malformed: {value!r}")
    try:
        expires = float(parts[2])
    except ValueError:
        raise HandoffError(f"{LOCK_ANNOTATION} has a bad expiry: {value!r}") from None
    return NodeLock(parts[0], parts[1], expires)


def parse_assignment(pod: PodView) -> tuple[str, list[ContainerAssignment]] | None:
    """(node, containers) from the pod's assignment annotation; None when the pod has none."""
    raw = pod.annotations.get(ASSIGNMENT_ANNOTATION)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
        containers = [
            ContainerAssignment(str(c["name"]), int(c["gpu_mem_gib"]), tuple(str(g) for g in c["gpus"]))
            for c in doc["containers"]
        ]
        return str(doc["node"]), containers
    except (ValueError, KeyError, TypeError) as exc:
        raise HandoffError(f"pod {pod.ref}: {ASSIGNMENT_ANNOTATION} is malformed ({exc!r})") from None


def allocated_of(pod: PodView) -> tuple[str, ...]:
    """Container names the device plugin already allocated for this pod."""
    raw = pod.annotations.get(ALLOCATED_ANNOTATION, "")
    return tuple(n for n in raw.split(",") if n)


def pending_of(pod: PodView) -> list[ContainerAssignment]:
    """The pod's assigned containers not yet allocated, in admission order."""
    parsed = parse_assignment(pod)
    if parsed is None:
        return []
    done = set(allocated_of(pod))
    return [c for c in parsed[1] if c.name not in done]


def decide(node: str, lock_value: str | None, pods: Sequence[PodView], now: float, gib: int) -> Decision:
    """The one container this Allocate of `gib` GiB is for; HandoffError when that is not certain."""
    lock = parse_lock(lock_value)
    live = [p for p in pods if p.node == node and p.phase not in _TERMINAL_PHASES]
    pending = {p.uid: p for p in live if pending_of(p)}
    candidates = dict(pending)
    if lock is not None and lock.live(now):
        holder = next((p for p in live if p.uid == lock.uid), None)
        if holder is not None:
            candidates[holder.uid] = holder
    if lock is None or not lock.live(now):
        state = (
            "absent" if lock is None else f"expired at {lock.expires:.0f} (held by {lock.pod} uid {lock.uid})"
        )
        waiting = ", ".join(sorted(p.ref for p in pending.values())) or "none"
        raise HandoffError(
            f"node {node}: no pod holds {LOCK_ANNOTATION} ({state}); unallocated pods: {waiting}"
        )
    if len(candidates) != 1:
        names = ", ".join(sorted(p.ref for p in candidates.values())) or "none visible"
        raise HandoffError(
            f"node {node}: cannot tell which pod this Allocate is for: lock held by {lock.pod} "
            f"(uid {lock.uid}), unallocated pods: {names}"
        )
    (pod,) = candidates.values()
    if pod.uid != lock.uid:
        raise HandoffError(
            f"node {node}: unallocated pod {pod.ref} does not hold {LOCK_ANNOTATION} "
            f"(held by {lock.pod} uid {lock.uid})"
        )
    parsed = parse_assignment(pod)
    if parsed is None:
        raise HandoffError(f"lock holder {pod.ref} has no {ASSIGNMENT_ANNOTATION} annotation")
    assigned_node, _ = parsed
    if assigned_node != node:
        raise HandoffError(f"pod {pod.ref} is assigned to node {assigned_node}, not {node}")
    todo = pending_of(pod)
    if not todo:
        raise HandoffError(f"lock holder {pod.ref} has no unallocated GPU-memory container left")
    container = todo[0]
    if container.gib != gib:
        raise HandoffError(
            f"pod {pod.ref} container {container.name} was assigned {container.gib} GiB "
            f"but Allocate asked for {gib}"
        )
    if not container.gpus or container.gib % len(container.gpus):
        raise HandoffError(
            f"pod {pod.ref} container {container.name}: {container.gib} GiB cannot be split over "
            f"{len(container.gpus)} GPUs"
        )
    return Decision(pod, container, allocated_of(pod), last=len(todo) == 1)


class MemoryHandoff:
    """Answers GPU-memory Allocates from the extender's assignment, one at a time."""

    def __init__(
        self,
        resolver: PodResolver,
        node: str,
        gpus: Callable[[], Mapping[str, GpuInfo]],
        health: Callable[[], Mapping[str, GpuHealth]],
        opts: AllocateOptions,
        metrics: Metrics | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.resolver = resolver
        self.node = node
        self.gpus = gpus
        self.health = health
        self.opts = opts
        self.metrics = metrics or Metrics()
        self.clock = clock
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

    def _allocate(self, gib: int) -> pb.ContainerAllocateResponse:
        lock_value = self.resolver.node_annotations(self.node).get(LOCK_ANNOTATION)
        decision = decide(self.node, lock_value, self.resolver.pods_on_node(self.node), self.clock(), gib)
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
        per_gpu = decision.container.gib // len(chosen)
        too_big = [g.uuid for g in chosen if per_gpu > g.memory_gib]
        if too_big:
            raise HandoffError(
                f"pod {decision.pod.ref}: {per_gpu} GiB exceeds the memory of GPU {too_big[0]}"
            )
        response = memory_response(chosen, decision.container.gib, self.opts)
        # Record before answering: if the write fails the kubelet rejects the pod, which is safe; an
        # unrecorded allocation would make the next Allocate ambiguous.
        self.resolver.set_allocated(decision.pod, ",".join((*decision.allocated, decision.container.name)))
        if decision.last:
            self.resolver.release_lock(self.node, decision.pod.uid)
        log_event(
            "gpu_memory_allocated",
            pod=decision.pod.ref,
            uid=decision.pod.uid,
            container=decision.container.name,
            gib=decision.container.gib,
            gpus=",".join(decision.container.gpus),
            lock_released=decision.last,
        )
        return response
