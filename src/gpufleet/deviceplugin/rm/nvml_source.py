"""The production DeviceSource: GPU discovery (`gpufleet.gpu`), which alone talks to NVML and sysfs."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from gpufleet.deviceplugin.rm.model import (
    GpuInfo,
    HealthEvent,
    HealthEventKind,
    NodeInventory,
    Probe,
    SourceUnavailable,
    TopologyLevel,
)
from gpufleet.logs import log_event

_KINDS = {
    "xid": HealthEventKind.XID,
    "double-bit-ecc": HealthEventKind.ECC_DBE,
    "gpu-lost": HealthEventKind.LOST,
}


class _Events:
    """Adapts gpufleet.gpu.HealthMonitor to EventStream (one event per wait: delivered as it arrives)."""

    def __init__(self, monitor: Any) -> None:
        self.monitor = monitor

    def wait(self, timeout_s: float) -> Sequence[HealthEvent]:
        from gpufleet.gpu import NvmlError

        try:
            event = self.monitor.next_event(timeout=timeout_s)
        except NvmlError as exc:
            raise SourceUnavailable(str(exc)) from None
        if event is None:
            return []
        return [HealthEvent(_KINDS.get(event.kind, event.kind), event.uuid, int(event.code))]

    def close(self) -> None:
        self.monitor.close()


class NvmlDeviceSource:
    """GPUs, topology, events and probes through gpufleet.gpu; keeps one NVML session open."""

    def __init__(self, host_root: str | None = None) -> None:
        self.host_root = host_root
        self._session: AbstractContextManager[Any] | None = None
        self._nvml: Any = None
        self._index: dict[str, int] = {}

    def _open(self) -> Any:
        from gpufleet.gpu import NvmlError, nvml_session

        if self._nvml is None:
            session = nvml_session()
            try:
                self._nvml = session.__enter__()
            except NvmlError as exc:
                raise SourceUnavailable(str(exc)) from None
            self._session = session
        return self._nvml

    def inventory(self) -> NodeInventory:
        """Discover through NVML; SourceUnavailable (with NVML's reason) when only sysfs answered."""
        from gpufleet.gpu import SOURCE_NVML, NvmlError, discover

        facts = discover(self.host_root)
        if facts.source != SOURCE_NVML or facts.topology is None:
            raise SourceUnavailable(facts.nvml_error or "NVML not available")
        nv = self._open()
        usable = [g for g in facts.gpus if g.uuid and not g.lost]
        for gpu in facts.gpus:
            if gpu not in usable:
                log_event(
                    "gpu_skipped",
                    level="warning",
                    gpu=gpu.index,
                    bus_id=gpu.pci_bus_id,
                    reason="lost at start",
                )
        self._index = {g.uuid: g.index for g in usable if g.uuid}
        uuid_of = {g.index: str(g.uuid) for g in usable}
        gpus = []
        for g in usable:
            cc = tuple(int(x) for x in (g.compute_capability or "0.0").split(".")[:2])
            peers = facts.topology.nvlink_peers(g.index)
            gpus.append(
                GpuInfo(
                    index=g.index,
                    uuid=str(g.uuid),
                    minor=g.minor if g.minor is not None else g.index,
                    model=g.model,
                    memory_bytes=int(g.memory_total or 0),
                    cc=(cc[0], cc[1]) if len(cc) == 2 else (0, 0),
                    numa=g.numa_node if g.numa_node is not None and g.numa_node >= 0 else None,
                    bus_id=g.pci_bus_id,
                    nvlinks={uuid_of[i]: n for i, n in peers.items() if i in uuid_of},
                )
            )
        # The matrix shows NV# where NVLink joins a pair and hides the PCIe level underneath, which the
        # preferred-allocation tie-breaks need: ask for it directly.
        topology: dict[tuple[str, str], TopologyLevel] = {}
        for a in gpus:
            for b in gpus:
                if a.index < b.index:
                    try:
                        level = nv.topology_level(a.index, b.index)
                    except NvmlError:
                        level = None
                    if level is not None:
                        topology[(a.uuid, b.uuid)] = topology[(b.uuid, a.uuid)] = TopologyLevel(level)
        cuda = facts.driver.cuda_driver_version or "0.0"
        major, _, minor = cuda.partition(".")
        return NodeInventory(
            gpus=tuple(gpus),
            topology=topology,
            driver_version=facts.driver.userspace_version or facts.driver.kernel_module_version or "",
            cuda_driver_version=int(major) * 1000 + int(minor or 0) * 10,
            nvswitch_count=facts.nvswitch_count,
        )

    def open_events(self, uuids: Sequence[str]) -> _Events:
        """A health monitor on these GPUs (events from now on)."""
        from gpufleet.gpu import Gpu, HealthMonitor, NvmlError

        nv = self._open()
        watched = [Gpu(index=self._index[u], pci_bus_id="", model="", device_id=0, uuid=u) for u in uuids]
        try:
            return _Events(HealthMonitor(nv, watched, wait_slice=1.0))
        except NvmlError as exc:
            raise SourceUnavailable(str(exc)) from None

    def probe(self, uuid: str) -> Probe:
        """Usable when NVML reads the GPU at its index and it still has this UUID."""
        from gpufleet.gpu import GpuError

        try:
            nv = self._open()
            answered = nv.probe(self._index[uuid])
        except (GpuError, SourceUnavailable) as exc:
            return Probe(False, str(exc))
        if answered != uuid:
            return Probe(False, f"index {self._index[uuid]} now holds {answered}")
        return Probe(True)

    def close(self) -> None:
        """End the NVML session."""
        if self._session is not None:
            with contextlib.suppress(Exception):
                self._session.__exit__(None, None, None)
        self._session = self._nvml = None
