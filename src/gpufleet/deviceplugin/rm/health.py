"""Per-GPU health as a small state machine, free of threads and NVML so it can be tested exhaustively.

States and transitions (documented in docs/deviceplugin.md, "Health"):

- Healthy --critical XID / double-bit ECC--> Unhealthy(awaiting reset)
- any     --probe fails / GPU lost-------->  Unhealthy(unreachable)
- Unhealthy(unreachable) --probe succeeds--> Healthy            (the GPU came back: reset, re-attach)
- Unhealthy(awaiting reset) --probe succeeds--> unchanged        (it never went away, so nothing was reset)

A critical XID leaves a GPU that still answers queries but must not take new work; only a reset clears
that, and a reset makes the GPU unreachable for a moment, which the probe observes. Recovery therefore
requires seeing the GPU unreachable and then reachable again; queries that merely keep working, or the
passing of time, never clear an XID.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from .model import HealthEvent, HealthEventKind, Probe

# XIDs that signal application errors rather than a broken GPU (the same set NVIDIA's plugin skips):
# 13 graphics engine exception, 31 GPU memory page fault, 43 GPU stopped processing, 45 preemptive
# cleanup, 68 video processor exception, 109 context switch timeout.
DEFAULT_IGNORED_XIDS: frozenset[int] = frozenset({13, 31, 43, 45, 68, 109})


@dataclass(frozen=True)
class GpuHealth:
    """Health of one GPU; `reason` says why it is unhealthy."""

    healthy: bool = True
    reason: str = ""
    # True once the GPU has been seen unreachable since it went unhealthy: the next successful
    # probe then means it came back.
    unreachable_seen: bool = False


HEALTHY = GpuHealth()


@dataclass(frozen=True)
class Transition:
    """A health change for one GPU, for logs and metrics."""

    uuid: str
    before: GpuHealth
    after: GpuHealth


class HealthTracker:
    """Applies events and probe results to per-GPU health; returns what changed."""

    def __init__(self, uuids: Iterable[str], ignored_xids: Iterable[int] = DEFAULT_IGNORED_XIDS) -> None:
        self.ignored_xids = frozenset(ignored_xids)
        self._state: dict[str, GpuHealth] = {u: HEALTHY for u in uuids}

    def get(self, uuid: str) -> GpuHealth:
        """Current health of a GPU (unknown GPUs count as healthy: they are not advertised anyway)."""
        return self._state.get(uuid, HEALTHY)

    def snapshot(self) -> dict[str, GpuHealth]:
        """A copy of every GPU's health."""
        return dict(self._state)

    def on_event(self, event: HealthEvent) -> list[Transition]:
        """Apply an NVML event; an event without a UUID applies to every GPU."""
        targets = list(self._state) if event.uuid is None else [event.uuid]
        if event.kind == HealthEventKind.XID:
            if event.code in self.ignored_xids:
                return []
            return self._mark(targets, f"XID {event.code}" + (f": {event.detail}" if event.detail else ""))
        if event.kind == HealthEventKind.ECC_DBE:
            return self._mark(targets, "double-bit ECC error")
        if event.kind == HealthEventKind.LOST:
            return self._unreachable(targets, event.detail or "GPU lost")
        return []

    def on_probe(self, uuid: str, probe: Probe) -> list[Transition]:
        """Apply a probe result for one GPU."""
        if uuid not in self._state:
            return []
        if not probe.usable:
            return self._unreachable([uuid], probe.detail or "NVML cannot query the GPU")
        before = self._state[uuid]
        if before.healthy or not before.unreachable_seen:
            return []
        self._state[uuid] = HEALTHY
        return [Transition(uuid, before, HEALTHY)]

    def clear(self, uuids: Iterable[str]) -> list[Transition]:
        """Make these (MIG devices of a GPU that was reset) healthy again."""
        changes = []
        for uuid in uuids:
            before = self._state.get(uuid)
            if before is not None and not before.healthy:
                self._state[uuid] = HEALTHY
                changes.append(Transition(uuid, before, HEALTHY))
        return changes

    def _mark(self, uuids: list[str], reason: str) -> list[Transition]:
        changes = []
        for uuid in uuids:
            before = self._state.get(uuid)
            if before is None:
                continue
            # Already unhealthy: keep the first reason, and keep the "seen unreachable" mark, since an
            # XID reported while the GPU is gone (e.g. 79, fallen off the bus) belongs to the same
            # failure that the coming reset clears.
            after = GpuHealth(False, reason, False) if before.healthy else before
            if after != before:
                self._state[uuid] = after
                changes.append(Transition(uuid, before, after))
        return changes

    def _unreachable(self, uuids: list[str], reason: str) -> list[Transition]:
        changes = []
        for uuid in uuids:
            before = self._state.get(uuid)
            if before is None or before.unreachable_seen:
                # Already known gone: the probe and NVML's own lost event report one failure in different
                # words; keep the first reason rather than announcing each rewording as a change.
                continue
            after = GpuHealth(False, reason, True)
            if after != before:
                self._state[uuid] = after
                changes.append(Transition(uuid, before, after))
        return changes
