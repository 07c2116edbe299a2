"""The resource manager: devices per resource, their health over time, and request validation.

One background thread owns every health decision after start-up. It blocks in the NVML event set's wait
(XIDs and double-bit ECC errors arrive as they happen); the only timer is a low-rate probe of each GPU,
which is how a lost GPU is noticed without an event and how a reset GPU is seen coming back. Probes run
through watchdog.Sampler with a deadline per GPU: a GPU whose NVML call does not return is marked
unhealthy after `probe_timeout_s`, its call is abandoned on a worker thread, and the thread goes back to
the other GPUs' events and probes; the GPU is probed again once that call returns.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from gpufleet.deviceplugin.metrics import Metrics
from gpufleet.deviceplugin.rm.devices import PluginDevice, ResourceSpec, build_devices, device_ids, gpu_of
from gpufleet.deviceplugin.rm.errors import DeviceUnhealthy, InvalidRequest, NotReady
from gpufleet.deviceplugin.rm.health import DEFAULT_IGNORED_XIDS, GpuHealth, HealthTracker, Transition
from gpufleet.deviceplugin.rm.model import (
    DeviceSource,
    EventStream,
    GpuInfo,
    HealthEvent,
    HealthEventKind,
    MigDeviceInfo,
    NodeInventory,
    Probe,
    SourceUnavailable,
)
from gpufleet.deviceplugin.rm.preferred import preferred_allocation
from gpufleet.deviceplugin.watchdog import Outcome, Sampler, Wording
from gpufleet.logs import log_event

# Longest single NVML event wait: bounds how long stop() waits for the thread, not how fast events arrive.
_WAIT_SLICE_S = 0.5
# How many IDs an error message lists before it summarises.
_LISTED = 5


@dataclass(frozen=True)
class HealthSettings:
    """Health-checking knobs (see the `health:` config section)."""

    enabled: bool = True
    ignored_xids: frozenset[int] = DEFAULT_IGNORED_XIDS
    probe_interval_s: float = 5.0
    # How long one GPU's probe may take before the GPU counts as hung (unhealthy, unreachable).
    probe_timeout_s: float = 5.0


@dataclass(frozen=True)
class StartSettings:
    """What to do when NVML is unusable at start (see `nvml:` config)."""

    fail_fast: bool = False
    retry_interval_s: float = 10.0


@dataclass
class _State:
    inventory: NodeInventory | None = None
    tracker: HealthTracker = field(default_factory=lambda: HealthTracker([]))
    version: int = 0
    last_error: str = ""
    known: dict[str, frozenset[str]] = field(default_factory=dict)  # resource -> device IDs
    mig: dict[str, tuple[GpuInfo, MigDeviceInfo]] = field(default_factory=dict)  # MIG UUID -> both


class ResourceManager:
    """Devices, health and request checks for the resources this plugin serves."""

    def __init__(
        self,
        source: DeviceSource,
        resources: Sequence[ResourceSpec],
        health: HealthSettings | None = None,
        start: StartSettings | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.source = source
        self.resources = {r.name: r for r in resources}
        self.health = health or HealthSettings()
        self.start_settings = start or StartSettings()
        self.metrics = metrics or Metrics()
        self._state = _State(tracker=HealthTracker([], self.health.ignored_xids))
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._events: EventStream | None = None
        self._pending: list[HealthEvent] = []  # drained from a replaced event set, not yet applied
        self._unwatched: frozenset[str] = frozenset()  # hung GPUs the current event set leaves out
        self._last_xid: dict[str, int] = {}  # GPU UUID -> its last XID, ignored ones too (telemetry)
        self._prober: Sampler[str, Probe] = Sampler(
            source.probe,
            self.health.probe_timeout_s,
            Wording("health", "marked unhealthy; the other GPUs go on", "probed again next round"),
        )

    # ----- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Discover GPUs (raising SourceUnavailable when fail-fast) and start the health thread."""
        try:
            self._discover()
        except SourceUnavailable as exc:
            if self.start_settings.fail_fast:
                raise
            log_event(
                "nvml_unavailable",
                level="warning",
                error=str(exc),
                action="advertising zero devices, retrying",
                retry_s=self.start_settings.retry_interval_s,
            )
        self._thread = threading.Thread(target=self._run, name="gpufleet-health", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the health thread and release NVML."""
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._events:
            self._events.close()
            self._events = None
        self.source.close()

    def set_resources(self, resources: Sequence[ResourceSpec]) -> None:
        """Serve these resources from now on (the node's named configuration changed). Discovery and the
        health of every GPU are kept; only the devices each resource is made of are worked out anew."""
        specs = {r.name: r for r in resources}
        with self._lock:
            state = self._state
            gpus = state.inventory.gpus if state.inventory is not None else ()
            known = {n: frozenset(d for g in gpus for d in device_ids(spec, g)) for n, spec in specs.items()}
            self.resources = specs
            self._state = replace(state, known=known, version=state.version + 1)
        self._notify()

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback` (from the health thread) after every device or health change."""
        with self._lock:
            self._listeners.append(callback)

    # ----- queries ---------------------------------------------------------------------------------

    @property
    def version(self) -> int:
        """Increases on every change of devices or health."""
        return self._state.version

    @property
    def ready(self) -> bool:
        """True once GPUs have been discovered."""
        return self._state.inventory is not None

    @property
    def last_error(self) -> str:
        """Why discovery last failed (empty when it did not)."""
        return self._state.last_error

    def inventory(self) -> NodeInventory:
        """The discovered GPUs (empty until discovery succeeds)."""
        return self._state.inventory or NodeInventory(gpus=())

    def last_xids(self) -> dict[str, int] | None:
        """The last XID each GPU reported since start, by UUID (GPUs without one are absent); None while no
        event set watches for XIDs (health checks off, or NVML's events unavailable): then nobody knows."""
        if not self.health.enabled or self._events is None:
            return None
        with self._lock:
            return dict(self._last_xid)

    def gpu_health(self) -> dict[str, GpuHealth]:
        """Health of every GPU by UUID."""
        with self._lock:
            return self._state.tracker.snapshot()

    def devices(self, resource: str) -> tuple[int, list[PluginDevice]]:
        """(version, devices) of one resource, consistent with each other."""
        with self._lock:
            state = self._state
            if state.inventory is None:
                return state.version, []
            return state.version, build_devices(
                self.resources[resource], state.inventory, state.tracker.snapshot()
            )

    def check_request(self, resource: str, ids: Sequence[str], require_healthy: bool = True) -> list[GpuInfo]:
        """The GPUs behind one container's device IDs, in index order; raise a RequestError if refused."""
        # Called on the event loop for every Allocate: no copies of per-GPU state, only lookups of the
        # requested IDs (the state object is replaced, never mutated, on rediscovery).
        with self._lock:
            state = self._state
        inventory = state.inventory
        known = state.known.get(resource, frozenset())
        if inventory is None:
            raise NotReady(f"GPUs not discovered yet: {state.last_error or 'NVML unavailable'}")
        if not ids:
            raise InvalidRequest("container request has no device IDs")
        if len(ids) > len(known):
            raise InvalidRequest(
                f"{len(ids)} device IDs requested but {resource} has only {len(known)} devices"
            )
        dupes = sorted(d for d, n in Counter(ids).items() if n > 1)
        if dupes:
            raise InvalidRequest(f"duplicate device IDs: {_listing(dupes)}")
        unknown = [d for d in ids if d not in known]
        if unknown:
            raise InvalidRequest(f"unknown {resource} device(s): {_listing(unknown)}")
        chosen = {gpu_of(d) for d in ids}
        with self._lock:
            health = {u: state.tracker.get(u) for u in chosen}
        for u in chosen & state.mig.keys():  # a MIG device: unhealthy when it or its GPU is
            parent = state.mig[u][0].uuid
            with self._lock:
                whole = state.tracker.get(parent)
            if not whole.healthy:
                health[u] = whole
        sick = [d for d in ids if not health[gpu_of(d)].healthy]
        if sick and require_healthy:
            gpus: dict[str, object] = {u: g.index for u, g in inventory.by_uuid().items()}
            for u, (g, m) in state.mig.items():
                gpus[u] = f"{g.index} MIG {m.profile} gi {m.gi} ci {m.ci}"
            reasons = {gpu_of(d): health[gpu_of(d)].reason for d in sick}
            detail = "; ".join(f"{gpus[u]} ({u}): {r}" for u, r in reasons.items())
            raise DeviceUnhealthy(f"unhealthy device(s) {_listing(sick)}; GPU {detail}")
        parents = chosen | {state.mig[u][0].uuid for u in chosen & state.mig.keys()}
        return [g for g in inventory.gpus if g.uuid in parents]

    def mig_devices(self, ids: Sequence[str]) -> list[tuple[GpuInfo, MigDeviceInfo]]:
        """(parent GPU, MIG device) of each MIG device ID, in the order given (IDs checked beforehand)."""
        mig = self._state.mig
        return [mig[d] for d in ids]

    def preferred(self, resource: str, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
        """GetPreferredAllocation for one container (raises PreferenceError on impossible input)."""
        return preferred_allocation(self.resources[resource], self.inventory(), available, must, size)

    # ----- health thread ---------------------------------------------------------------------------

    def _discover(self) -> None:
        try:
            inventory = self.source.inventory()
        except SourceUnavailable as exc:
            self._state.last_error = str(exc)
            raise
        with self._lock:
            mig = inventory.mig_by_uuid()
            self._state = _State(
                inventory=inventory,
                tracker=HealthTracker([g.uuid for g in inventory.gpus] + list(mig), self.health.ignored_xids),
                mig=mig,
                version=self._state.version + 1,
                # Allocate checks IDs against this on every call; GPU-memory nodes have thousands.
                known={
                    name: frozenset(d for g in inventory.gpus for d in device_ids(spec, g))
                    for name, spec in self.resources.items()
                },
            )
        log_event(
            "gpus_discovered",
            count=len(inventory.gpus),
            driver=inventory.driver_version,
            models=",".join(sorted({g.model for g in inventory.gpus})),
        )
        self._notify()

    def _run(self) -> None:
        next_probe = 0.0
        while not self._stop.is_set():
            if self._state.inventory is None:
                try:
                    self._discover()
                except SourceUnavailable as exc:
                    log_event("nvml_unavailable", level="warning", error=str(exc), action="retrying")
                    self._stop.wait(self.start_settings.retry_interval_s)
                continue
            if not self.health.enabled:
                self._stop.wait(3600)
                continue
            now = time.monotonic()
            if now >= next_probe:
                self._probe_all()
                next_probe = now + self.health.probe_interval_s
            while self._pending:
                self._apply_event(self._pending.pop(0))
            if self._events is None and not self._open_events():
                self._stop.wait(min(self.health.probe_interval_s, max(0.0, next_probe - time.monotonic())))
                continue
            assert self._events is not None
            try:
                events = self._events.wait(min(_WAIT_SLICE_S, max(0.0, next_probe - time.monotonic())))
            except SourceUnavailable as exc:
                # The event set broke (driver gone, GPU lost mid-wait): find out who is affected now,
                # then rebuild the event set once NVML answers again.
                log_event("health_events_failed", level="warning", error=str(exc))
                self._events.close()
                self._events = None
                next_probe = 0.0
                continue
            for event in events:
                self._apply_event(event)

    def _refresh_events(self) -> None:
        """A GPU came back: event sets stop watching lost GPUs, so watch it again with a new set. Also
        called when a GPU hangs, for a set without it.

        Done before anyone hears of the recovery, and gap-free: the new set exists before the old one
        is drained and closed, so an event lands in at least one of them (a duplicate XID is harmless).
        """
        if self._events is None:
            return  # the loop opens a fresh set anyway
        old = self._events
        if not self._open_events():
            self._events = old
            return
        while drained := old.wait(0.001):
            self._pending.extend(drained)
        old.close()

    def _open_events(self) -> bool:
        # A hung GPU would hang its registration too: it is watched again once it answers (a recovery
        # refreshes the event set).
        hung = frozenset(self._prober.hung())
        watched = [g.uuid for g in self.inventory().gpus if g.uuid not in hung]
        try:
            self._events = self.source.open_events(watched)
        except SourceUnavailable as exc:
            log_event("health_events_unavailable", level="warning", error=str(exc), fallback="probe only")
            return False
        self._unwatched = hung
        return True

    def _unwatch_hung(self) -> None:
        """A GPU hangs: leave it out of the event set. The set is opened afresh whenever a watched GPU is
        lost (and on every recovery), and registering the hung GPU again would hang this thread."""
        if self._events is not None and not self._prober.hung().keys() <= self._unwatched:
            self._refresh_events()

    def _apply_event(self, event: HealthEvent) -> None:
        index = self._index(event.uuid)
        self.metrics.inc("gpufleet_dp_health_events_total", kind=event.kind, code=str(event.code))
        ignored = event.kind == HealthEventKind.XID and event.code in self.health.ignored_xids
        if event.kind == HealthEventKind.XID and event.uuid is not None:
            with self._lock:
                self._last_xid[event.uuid] = event.code
        log_event(
            "health_event", kind=event.kind, gpu=index, uuid=event.uuid, code=event.code, ignored=ignored
        )
        with self._lock:
            changes = [c for e in self._mig_targets(event) for c in self._state.tracker.on_event(e)]
        if event.uuid is not None and not ignored:
            # A critical XID often means the GPU is gone (79: fallen off the bus): look now, before
            # anyone is told, so the lost state is on record even if a reset follows at once.
            changes += self._probe_changes(event.uuid)
        self._changed(changes)

    def _mig_targets(self, event: HealthEvent) -> list[HealthEvent]:
        """An XID aimed at a MIG instance, addressed to that MIG device (or to every MIG device of the GPU
        instance when NVML names no compute instance); whole-GPU events, and instances this plugin does not
        know, stay on the GPU (which makes all its MIG devices unhealthy)."""
        if event.uuid is None or event.gi is None:
            return [event]
        gpu = self.inventory().by_uuid().get(event.uuid)
        hit = [
            m.uuid
            for m in (gpu.mig_devices if gpu else ())
            if m.gi == event.gi and (event.ci is None or m.ci == event.ci)
        ]
        if not hit:
            return [replace(event, gi=None, ci=None)]
        return [replace(event, uuid=u) for u in hit]

    def _probe_all(self) -> None:
        uuids = [gpu.uuid for gpu in self.inventory().gpus]
        outcomes = self._prober.round(uuids)
        self._unwatch_hung()
        self._changed([c for u in uuids for c in self._probe_applied(u, outcomes.get(u))])

    def _probe_changes(self, uuid: str) -> list[Transition]:
        outcome = self._prober.round([uuid]).get(uuid)
        self._unwatch_hung()
        return self._probe_applied(uuid, outcome)

    def _probe_applied(self, uuid: str, outcome: Outcome[Probe] | None) -> list[Transition]:
        if outcome is None or outcome.problem or outcome.sample is None:
            # Hung past the deadline (or the probe itself failed): as unreachable as a lost GPU.
            result = Probe(False, outcome.problem if outcome else "no probe result")
        else:
            result = outcome.sample
        with self._lock:
            changes = self._state.tracker.on_probe(uuid, result)
            if any(c.after.healthy for c in changes):
                # The GPU came back from a reset, which also cleared whatever its MIG devices had.
                gpu = self._state.inventory.by_uuid().get(uuid) if self._state.inventory else None
                changes += self._state.tracker.clear(m.uuid for m in (gpu.mig_devices if gpu else ()))
            return changes

    def _changed(self, changes: list[Transition]) -> None:
        if not changes:
            return
        with self._lock:
            self._state.version += 1
        if any(c.after.healthy for c in changes):
            self._refresh_events()
        for change in changes:
            self.metrics.inc(
                "gpufleet_dp_health_transitions_total", to="healthy" if change.after.healthy else "unhealthy"
            )
            log_event(
                "gpu_health_changed",
                level="info" if change.after.healthy else "warning",
                gpu=self._index(change.uuid),
                uuid=change.uuid,
                healthy=change.after.healthy,
                reason=change.after.reason or change.before.reason,
            )
        self._notify()

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception as exc:  # a broken listener must not stop health checking
                log_event("listener_failed", level="error", error=repr(exc))

    def _index(self, uuid: str | None) -> int | str:
        if uuid is None:
            return "all"
        gpu = self.inventory().by_uuid().get(uuid)
        return gpu.index if gpu else "?"


def _listing(ids: Sequence[str]) -> str:
    shown = ", ".join(ids[:_LISTED])
    return shown if len(ids) <= _LISTED else f"{shown} and {len(ids) - _LISTED} more"
