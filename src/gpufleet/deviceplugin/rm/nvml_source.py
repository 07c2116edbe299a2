"""The production DeviceSource: GPU discovery (`gpufleet.gpu`), which alone talks to NVML and sysfs."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

from gpufleet.deviceplugin.rm.model import (
    GpuInfo,
    HealthEvent,
    HealthEventKind,
    MigDeviceInfo,
    NodeInventory,
    Probe,
    SourceUnavailable,
    TopologyLevel,
    VgpuDevice,
)
from gpufleet.logs import log_event

_KINDS = {
    "xid": HealthEventKind.XID,
    "double-bit-ecc": HealthEventKind.ECC_DBE,
    "gpu-lost": HealthEventKind.LOST,
}


_NO_INSTANCE = 0xFFFFFFFF  # eventData's gpuInstanceId / computeInstanceId for a whole-GPU event


def _instance_monitor(nv: Any, watched: Any) -> Any:
    """gpufleet.gpu's HealthMonitor, also keeping the MIG instance ids NVML puts in each event."""
    from gpufleet.gpu import HealthMonitor

    class InstanceMonitor(HealthMonitor):  # type: ignore[misc]
        instances: dict[int, tuple[int | None, int | None]]

        def _to_event(self, data: Any) -> Any:
            event = super()._to_event(data)
            if event is not None:
                gi = getattr(data, "gpuInstanceId", _NO_INSTANCE)
                ci = getattr(data, "computeInstanceId", _NO_INSTANCE)
                if not hasattr(self, "instances"):
                    self.instances = {}
                self.instances.clear()  # only the event being delivered matters
                self.instances[id(event)] = (
                    None if gi == _NO_INSTANCE else int(gi),
                    None if ci == _NO_INSTANCE else int(ci),
                )
            return event

    return InstanceMonitor(nv, watched, wait_slice=1.0)


# nvmlDeviceAttributes_t fields of a MIG device under gpu-feature-discovery's label names (NVIDIA's
# k8s-device-plugin v0.20.0, internal/resource/nvml-mig-device.go).
MIG_ATTRIBUTES = (
    ("memory", "memorySizeMB"),
    ("multiprocessors", "multiprocessorCount"),
    ("slices.gi", "gpuInstanceSliceCount"),
    ("slices.ci", "computeInstanceSliceCount"),
    ("engines.copy", "sharedCopyEngineCount"),
    ("engines.decoder", "sharedDecoderCount"),
    ("engines.encoder", "sharedEncoderCount"),
    ("engines.jpeg", "sharedJpegCount"),
    ("engines.ofa", "sharedOfaCount"),
)
NVML_VIRTUALIZATION_VGPU = 2  # nvmlGpuVirtualizationMode_t: a vGPU in a guest
_NO_CLUSTER = "00000000-0000-0000-0000-000000000000"


def _mig_profile(name: str) -> str:
    """The profile in a MIG device's NVML name: "NVIDIA A100-SXM4-80GB MIG 1g.10gb" -> "1g.10gb"."""
    return name.rpartition("MIG ")[2].strip()


def _mig_attributes(pynvml: Any, mig: Any, gpu: int, k: int) -> tuple[tuple[str, int], ...]:
    """A MIG device's nvmlDeviceGetAttributes under gpu-feature-discovery's names; () where NVML refuses."""
    try:
        found = pynvml.nvmlDeviceGetAttributes(mig)
    except pynvml.NVMLError as exc:
        log_event("mig_attributes_unknown", level="warning", gpu=gpu, mig_index=k, error=str(exc))
        return ()
    return tuple((name, int(getattr(found, field))) for name, field in MIG_ATTRIBUTES)


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
        gi, ci = getattr(self.monitor, "instances", {}).get(id(event), (None, None))
        return [HealthEvent(_KINDS.get(event.kind, event.kind), event.uuid, int(event.code), gi=gi, ci=ci)]

    def close(self) -> None:
        self.monitor.close()


def name_text(value: str | bytes) -> str:
    """pynvml answers str or bytes depending on its version."""
    return value.decode() if isinstance(value, bytes) else value


class NvmlDeviceSource:
    """GPUs, topology, events and probes through gpufleet.gpu; keeps one NVML session open."""

    def __init__(self, host_root: str | None = None) -> None:
        self.host_root = host_root
        self._session: AbstractContextManager[Any] | None = None
        self._nvml: Any = None
        self._index: dict[str, int] = {}
        self._opening = threading.Lock()  # the health and telemetry threads may both open it first

    def _open(self) -> Any:
        from gpufleet.gpu import NvmlError, nvml_session

        with self._opening:
            if self._nvml is None:
                session = nvml_session()
                try:
                    self._nvml = session.__enter__()
                except NvmlError as exc:
                    raise SourceUnavailable(str(exc)) from None
                self._session = session
            return self._nvml

    def nvml(self) -> Any:
        """The open NVML session (gpufleet.gpu.Nvml), for readers beside discovery (telemetry); raises
        SourceUnavailable when NVML cannot be used."""
        return self._open()

    def inventory(self) -> NodeInventory:
        """Discover through NVML; SourceUnavailable (with NVML's reason) when only sysfs answered."""
        from gpufleet.gpu import SOURCE_NVML, NvmlError, discover, pci, resolve_root
        from gpufleet.gpu.host import dmi_product_name

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
        root = resolve_root(self.host_root)
        functions = pci.scan(root)
        classes = {dev.bus_id: dev.class_code for dev in functions}
        gpus = []
        for g in usable:
            cc = tuple(int(x) for x in (g.compute_capability or "0.0").split(".")[:2])
            peers = facts.topology.nvlink_peers(g.index)
            fabric = g.fabric
            attached = (
                fabric is not None
                and fabric.state == "completed"
                and fabric.status == 0
                and fabric.cluster_uuid != _NO_CLUSTER
            )
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
                    mig_capable=g.mig is not None,
                    pci_class=classes.get(g.pci_bus_id, 0),
                    virtualization_mode=self._virtualization_mode(nv, g.index),
                    clique=f"{fabric.cluster_uuid}.{fabric.clique_id}" if fabric and attached else "",
                    **self._mig(nv, g.index, str(g.uuid)),
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
            machine=dmi_product_name(root),
            vgpu=self._vgpus(pci.vgpus(root, functions), gpus),
        )

    @staticmethod
    def _virtualization_mode(nv: Any, index: int) -> int | None:
        """nvmlDeviceGetVirtualizationMode of GPU `index`; None where NVML cannot say."""
        from gpufleet.gpu import NvmlError

        try:
            return nv.optional(f"GPU {index}", nv.nv.nvmlDeviceGetVirtualizationMode, nv.handle(index))
        except NvmlError:
            return None

    @staticmethod
    def _vgpus(found: Sequence[Any] | None, gpus: Sequence[GpuInfo]) -> tuple[VgpuDevice, ...] | None:
        """The node's vGPUs: from the PCI capabilities where this process can read them in full (they name
        the host's vGPU manager), else from NVML's virtualization mode; None where neither can tell."""
        if found is not None:
            return tuple(VgpuDevice(v.bus_id, v.host_driver_version, v.host_driver_branch) for v in found)
        if all(g.virtualization_mode is None for g in gpus):
            return None
        return tuple(VgpuDevice(g.bus_id) for g in gpus if g.virtualization_mode == NVML_VIRTUALIZATION_VGPU)

    @staticmethod
    def _mig(nv: Any, index: int, uuid: str) -> dict[str, Any]:
        """MIG mode and MIG devices of one GPU ({} without MIG): every MIG device handle NVML has, the
        indexes without one (NOT_FOUND) skipped as nvml.h says consumers should."""
        from gpufleet.gpu import NvmlError

        pynvml = nv.nv
        try:
            handle = nv.handle(index)
            current, _pending = nv.call(f"GPU {index} MIG mode", pynvml.nvmlDeviceGetMigMode, handle)
        except NvmlError:
            return {}  # NOT_SUPPORTED: no MIG on this GPU
        if int(current) != 1:
            return {}
        devices: list[MigDeviceInfo] = []
        try:
            slots = nv.call(f"GPU {index} MIG devices", pynvml.nvmlDeviceGetMaxMigDeviceCount, handle)
        except NvmlError as exc:
            log_event("mig_devices_unknown", level="warning", gpu=index, error=str(exc))
            return {"mig_enabled": True, "mig_devices": ()}
        for k in range(int(slots)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, k)
            except pynvml.NVMLError_NotFound:
                continue
            except pynvml.NVMLError as exc:
                log_event("mig_device_skipped", level="warning", gpu=index, mig_index=k, error=str(exc))
                continue
            try:
                name = pynvml.nvmlDeviceGetName(mig)
                mig_uuid = pynvml.nvmlDeviceGetUUID(mig)
                devices.append(
                    MigDeviceInfo(
                        uuid=name_text(mig_uuid),
                        parent=uuid,
                        index=k,
                        gi=int(pynvml.nvmlDeviceGetGpuInstanceId(mig)),
                        ci=int(pynvml.nvmlDeviceGetComputeInstanceId(mig)),
                        profile=_mig_profile(name_text(name)),
                        memory_bytes=int(pynvml.nvmlDeviceGetMemoryInfo(mig).total),
                        attributes=_mig_attributes(pynvml, mig, index, k),
                    )
                )
            except pynvml.NVMLError as exc:
                log_event("mig_device_skipped", level="warning", gpu=index, mig_index=k, error=str(exc))
        return {"mig_enabled": True, "mig_devices": tuple(devices)}

    def open_events(self, uuids: Sequence[str]) -> _Events:
        """A health monitor on these GPUs (events from now on)."""
        from gpufleet.gpu import Gpu, NvmlError

        nv = self._open()
        watched = [Gpu(index=self._index[u], pci_bus_id="", model="", device_id=0, uuid=u) for u in uuids]
        try:
            return _Events(_instance_monitor(nv, watched))
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
