"""NVML through pynvml: a session context manager and readers returning gpufleet's dataclasses.

pynvml is imported lazily so this package stays importable (and useful, through sysfs) on hosts
without nvidia-ml-py, such as an Ansible target before the driver role has run.
"""

from __future__ import annotations

import ctypes
import sys
import uuid as uuidlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from types import ModuleType
from typing import Any, TypeVar

from .catalog import ARCHITECTURES, gpu_model, model_name
from .device import REMOTE_GPU, REMOTE_NVSWITCH, FabricInfo, Gpu, MigMode, NvLink, gpu_from_pci
from .errors import (
    NvmlError,
    NvmlFunctionNotFound,
    NvmlGpuLost,
    NvmlNotSupported,
    NvmlUnavailable,
    nvml_error,
)
from .pci import PciDevice, normalize_bus_id

T = TypeVar("T")

# nvmlNvLinkDeviceType_t
_REMOTE_TYPES = {0: REMOTE_GPU, 1: "ibmnpu", 2: REMOTE_NVSWITCH}
# nvmlGpuFabricState_t
_FABRIC_STATES = {0: "not-supported", 1: "not-started", 2: "in-progress", 3: "completed"}
_NVML_ERROR_INVALID_ARGUMENT = 2


def load_pynvml() -> ModuleType:
    """The pynvml module, or NvmlUnavailable when nvidia-ml-py is not installed."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable(f"pynvml (nvidia-ml-py) is not installed for {sys.executable}") from exc
    return pynvml


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Nvml:
    """An initialized NVML; obtain one from `nvml_session()`. Errors are gpufleet's typed NvmlError."""

    def __init__(self, nv: ModuleType) -> None:
        self.nv = nv
        self._handles: dict[int, Any] = {}

    def call(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, with pynvml's error translated; `what` names the subject in the message."""
        try:
            return fn(*args)
        except self.nv.NVMLError as exc:
            raise nvml_error(exc, what) from None

    def optional(self, what: str, fn: Callable[..., T], *args: Any) -> T | None:
        """Like call(), but None where this GPU, driver or library lacks the feature."""
        try:
            return self.call(what, fn, *args)
        except (NvmlNotSupported, NvmlFunctionNotFound):
            return None

    # -- system -------------------------------------------------------------------------------------

    def count(self) -> int:
        """Number of GPUs NVML sees."""
        return self.call("device count", self.nv.nvmlDeviceGetCount)

    def handle(self, index: int) -> Any:
        """The NVML device handle of GPU `index` (cached for the session)."""
        if index not in self._handles:
            self._handles[index] = self.call(f"GPU {index}", self.nv.nvmlDeviceGetHandleByIndex, index)
        return self._handles[index]

    def probe(self, index: int) -> str:
        """The UUID GPU `index` answers with now: one cheap call, for health probes.

        Raises NvmlGpuLost (or another NvmlError) when the GPU cannot be reached.
        """
        return _text(self.call(f"GPU {index}", self.nv.nvmlDeviceGetUUID, self.handle(index)))

    def driver_version(self) -> str:
        """Userspace driver version, i.e. the version of the loaded libnvidia-ml."""
        return _text(self.call("driver version", self.nv.nvmlSystemGetDriverVersion))

    def nvml_version(self) -> str:
        """NVML's own version, e.g. "12.535.261.03"."""
        return _text(self.call("NVML version", self.nv.nvmlSystemGetNVMLVersion))

    def cuda_driver_version(self) -> str | None:
        """The CUDA version the driver supports, "12.2"; None when the driver cannot say."""
        version = self.optional("CUDA driver version", self.nv.nvmlSystemGetCudaDriverVersion)
        return None if version is None else f"{version // 1000}.{version % 1000 // 10}"

    # -- devices ------------------------------------------------------------------------------------

    def gpus(self, pci_devices: Sequence[PciDevice] = ()) -> list[Gpu]:
        """Every GPU, merged with what sysfs knows (`pci_devices`: NUMA node, bound driver).

        A GPU that answers GPU_IS_LOST is still listed, from sysfs, with `lost=True`: the node must
        report it rather than fail to report anything.
        """
        by_bus = {dev.bus_id: dev for dev in pci_devices}
        # NVML numbers the GPUs bound to nvidia in PCI bus order; that is how a lost GPU's index maps
        # back to its sysfs entry when NVML can no longer say where it sits.
        bound = [d for d in pci_devices if d.is_gpu and d.driver in (None, "nvidia")]
        result = []
        for index in range(self.count()):
            try:
                result.append(self.gpu(index, by_bus))
            except NvmlGpuLost:
                if index < len(bound):
                    gpu = gpu_from_pci(index, bound[index])
                else:
                    gpu = Gpu(index=index, pci_bus_id="", model="unknown", device_id=0)
                gpu.lost = True
                result.append(gpu)
        _resolve_remotes(result, pci_devices)
        return result

    def gpu(self, index: int, by_bus: dict[str, PciDevice] | None = None) -> Gpu:
        """GPU `index` as NVML describes it; sysfs (`by_bus`) adds NUMA node and bound driver."""
        nv, what = self.nv, f"GPU {index}"
        h = self.handle(index)
        pci = self.call(what, nv.nvmlDeviceGetPciInfo, h)
        bus_id = normalize_bus_id(_text(pci.busId))
        dev = (by_bus or {}).get(bus_id)
        device_id = pci.pciDeviceId >> 16  # pciDeviceId is (device << 16) | vendor
        cc = self.optional(what, nv.nvmlDeviceGetCudaComputeCapability, h)
        arch = self.optional(what, nv.nvmlDeviceGetArchitecture, h)
        model = gpu_model(device_id)
        persistence = self.optional(what, nv.nvmlDeviceGetPersistenceMode, h)
        mig = self.optional(what, nv.nvmlDeviceGetMigMode, h)
        return Gpu(
            index=index,
            pci_bus_id=bus_id,
            model=_text(self.optional(what, nv.nvmlDeviceGetName, h) or model_name(device_id)),
            device_id=device_id,
            uuid=_text(self.call(what, nv.nvmlDeviceGetUUID, h)),
            memory_total=int(self.call(what, nv.nvmlDeviceGetMemoryInfo, h).total),
            numa_node=dev.numa_node if dev else None,
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else (model.compute_capability if model else None),
            architecture=ARCHITECTURES.get(arch or -1) or (model.architecture if model else None),
            kernel_driver=dev.driver if dev else None,
            local_cpulist=dev.local_cpulist if dev else None,
            minor=self.optional(what, nv.nvmlDeviceGetMinorNumber, h),
            serial=_text(self.optional(what, nv.nvmlDeviceGetSerial, h) or "") or None,
            persistence_mode=None if persistence is None else persistence == 1,
            mig=None if mig is None else MigMode(current=mig[0] == 1, pending=mig[1] == 1),
            nvlinks=self.nvlinks(index),
            fabric=self.fabric(index),
        )

    def nvlinks(self, index: int) -> list[NvLink]:
        """The NVLinks GPU `index` has, up or down; empty where the GPU has none."""
        nv, what, h = self.nv, f"GPU {index}", self.handle(index)
        links = []
        for link in range(nv.NVML_NVLINK_MAX_LINKS):
            try:
                state = self.call(what, nv.nvmlDeviceGetNvLinkState, h, link)
            except (NvmlNotSupported, NvmlFunctionNotFound):
                continue  # no such link on this GPU (floorswept or never there)
            except NvmlError as exc:
                if exc.code == _NVML_ERROR_INVALID_ARGUMENT:
                    break  # past the last link the driver knows
                raise
            kind = self.optional(what, nv.nvmlDeviceGetNvLinkRemoteDeviceType, h, link)
            try:
                remote_bus: str | None = normalize_bus_id(
                    _text(self.call(what, nv.nvmlDeviceGetNvLinkRemotePciInfo, h, link).busId)
                )
            except (NvmlError, ValueError):
                remote_bus = None  # an inactive link may not know its peer
            links.append(
                NvLink(
                    link=link,
                    active=state == nv.NVML_FEATURE_ENABLED,
                    remote=_REMOTE_TYPES.get(kind, "unknown") if kind is not None else "unknown",
                    remote_bus_id=remote_bus,
                )
            )
        return links

    def fabric(self, index: int) -> FabricInfo | None:
        """NVSwitch fabric registration of GPU `index`; None before Hopper."""
        nv, what, h = self.nv, f"GPU {index}", self.handle(index)
        # The plain call exists from r535 on; the versioned one (r550+) only where it is missing.
        for struct_name, fn_name in (
            ("c_nvmlGpuFabricInfo_t", "nvmlDeviceGetGpuFabricInfo"),
            ("c_nvmlGpuFabricInfoV_t", "nvmlDeviceGetGpuFabricInfoV"),
        ):
            struct, fn = getattr(nv, struct_name, None), getattr(nv, fn_name, None)
            if struct is None or fn is None:
                continue
            info = struct()
            try:
                self.call(what, fn, h, ctypes.byref(info))
            except NvmlFunctionNotFound:
                continue
            except NvmlNotSupported:
                return None
            state = _FABRIC_STATES.get(info.state, "unknown")
            if state == "not-supported":
                return None
            return FabricInfo(
                state=state,
                status=int(info.status),
                clique_id=int(info.cliqueId),
                cluster_uuid=str(uuidlib.UUID(bytes=bytes(bytearray(info.clusterUuid)))),
            )
        return None

    def topology_level(self, a: int, b: int) -> int | None:
        """nvmlGpuTopologyLevel_t of the closest common PCIe ancestor of GPUs `a` and `b`."""
        try:
            return self.call(
                f"GPUs {a},{b}", self.nv.nvmlDeviceGetTopologyCommonAncestor, self.handle(a), self.handle(b)
            )
        except (NvmlNotSupported, NvmlFunctionNotFound, NvmlGpuLost):
            return None


def _resolve_remotes(gpus: list[Gpu], pci_devices: Sequence[PciDevice]) -> None:
    """Name the far end of links whose type the driver would not report, from known bus addresses."""
    gpu_buses = {gpu.pci_bus_id for gpu in gpus}
    switch_buses = {dev.bus_id for dev in pci_devices if dev.is_nvswitch}
    for gpu in gpus:
        for link in gpu.nvlinks:
            if link.remote == "unknown" and link.remote_bus_id in gpu_buses:
                link.remote = REMOTE_GPU
            elif link.remote == "unknown" and link.remote_bus_id in switch_buses:
                link.remote = REMOTE_NVSWITCH


@contextmanager
def nvml_session() -> Iterator[Nvml]:
    """Initialize NVML for the block and shut it down after; NVML reference-counts, so nesting is fine.

    Raises NvmlUnavailable, NvmlLibraryNotFound, NvmlDriverNotLoaded, ... when NVML cannot start.
    """
    nv = load_pynvml()
    try:
        nv.nvmlInit()
    except nv.NVMLError as exc:
        raise nvml_error(exc, "NVML init") from None
    try:
        yield Nvml(nv)
    finally:
        # The driver may have gone away under us (unloaded, GPU lost): nothing is left to release then.
        with suppress(nv.NVMLError):
            nv.nvmlShutdown()
