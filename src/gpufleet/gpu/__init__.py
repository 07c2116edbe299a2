"""GPU discovery: the one place that talks to NVML (through pynvml) and to sysfs.

Standard library only (pynvml is imported lazily, and optional), with relative imports throughout:
the same files are shipped to Ansible targets as the collection's module_utils (see gpu_facts).

    from gpufleet.gpu import discover, nvml_session, HealthMonitor
    facts = discover()                       # GpuFacts: gpus, driver, host, topology, kernel log, ...
    with nvml_session() as nv, HealthMonitor(nv) as monitor:
        for event in monitor.events(timeout=5):
            ...                              # HealthEvent(uuid, kind, code)
"""

from .device import FabricInfo, Gpu, MigMode, NvLink
from .errors import (
    GpuError,
    NvmlDriverLibraryMismatch,
    NvmlDriverNotLoaded,
    NvmlError,
    NvmlFunctionNotFound,
    NvmlGpuLost,
    NvmlLibraryNotFound,
    NvmlNoPermission,
    NvmlNotSupported,
    NvmlOperatingSystemBlocked,
    NvmlTimeout,
    NvmlUnavailable,
)
from .events import DOUBLE_BIT_ECC, GPU_LOST, XID, HealthEvent, HealthMonitor
from .facts import SOURCE_NVML, SOURCE_SYSFS, DriverInfo, GpuFacts, VmConfigProblem, discover
from .host import HOST_ROOT_ENV, HostInfo, KernelLog, read_kernel_log, resolve_root
from .nvml import Nvml, nvml_session
from .pci import PciDevice, normalize_bus_id, nvml_bus_id
from .topology import Topology

__all__ = [
    "DOUBLE_BIT_ECC",
    "GPU_LOST",
    "HOST_ROOT_ENV",
    "SOURCE_NVML",
    "SOURCE_SYSFS",
    "XID",
    "DriverInfo",
    "FabricInfo",
    "Gpu",
    "GpuError",
    "GpuFacts",
    "HealthEvent",
    "HealthMonitor",
    "HostInfo",
    "KernelLog",
    "MigMode",
    "NvLink",
    "Nvml",
    "NvmlDriverLibraryMismatch",
    "NvmlDriverNotLoaded",
    "NvmlError",
    "NvmlFunctionNotFound",
    "NvmlGpuLost",
    "NvmlLibraryNotFound",
    "NvmlNoPermission",
    "NvmlNotSupported",
    "NvmlOperatingSystemBlocked",
    "NvmlTimeout",
    "NvmlUnavailable",
    "PciDevice",
    "Topology",
    "VmConfigProblem",
    "discover",
    "normalize_bus_id",
    "nvml_bus_id",
    "nvml_session",
    "read_kernel_log",
    "resolve_root",
]
