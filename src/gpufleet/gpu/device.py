"""The GPU as every gpufleet component sees it, whichever source (NVML or sysfs) described it."""

from __future__ import annotations

from dataclasses import dataclass, field

from .catalog import gpu_model, model_name
from .pci import PciDevice

MIB = 1 << 20
GIB = 1 << 30

REMOTE_GPU = "gpu"
REMOTE_NVSWITCH = "nvswitch"


@dataclass
class NvLink:
    """One NVLink of a GPU; `link` is its number, `remote` what sits at the other end."""

    link: int
    active: bool
    remote: str  # REMOTE_GPU, REMOTE_NVSWITCH, "ibmnpu" or "unknown"
    remote_bus_id: str | None = None  # normalized PCI address of the peer, when the driver reports it


@dataclass
class MigMode:
    """MIG (multi-instance GPU) mode; a pending change applies at the next GPU reset."""

    current: bool
    pending: bool


@dataclass
class FabricInfo:
    """NVSwitch fabric registration of a GPU (Hopper and later), as fabricmanager leaves it."""

    state: str  # "not-supported", "not-started", "in-progress", "completed"
    status: int  # nvmlReturn_t of the registration; meaningful once completed (0 = success)
    clique_id: int
    cluster_uuid: str


@dataclass
class Gpu:
    """One GPU. Fields NVML alone can give are None when only sysfs was read."""

    index: int
    pci_bus_id: str  # normalized, e.g. "0000:07:00.0"
    model: str  # NVML's name, e.g. "NVIDIA A100-SXM4-80GB"
    device_id: int  # 16-bit PCI device ID
    uuid: str | None = None
    memory_total: int | None = None  # bytes; from sysfs, the model's nominal size
    numa_node: int | None = None
    compute_capability: str | None = None  # "8.0"
    architecture: str | None = None  # "Ampere"
    kernel_driver: str | None = None  # driver bound in sysfs: "nvidia", "vfio-pci", ...
    local_cpulist: str | None = None
    minor: int | None = None  # N of /dev/nvidiaN
    serial: str | None = None
    persistence_mode: bool | None = None
    mig: MigMode | None = None  # None: MIG not supported
    nvlinks: list[NvLink] = field(default_factory=list)
    fabric: FabricInfo | None = None  # None: fabric info not supported (pre-Hopper)
    lost: bool = False  # NVML answers GPU_IS_LOST for it: fallen off the bus, needs a reset

    @property
    def memory_mib(self) -> int | None:
        """Total memory in MiB, as nvidia-smi prints it."""
        return None if self.memory_total is None else self.memory_total // MIB

    @property
    def active_nvlinks(self) -> list[NvLink]:
        """The links that are up."""
        return [link for link in self.nvlinks if link.active]


def gpu_from_pci(index: int, dev: PciDevice) -> Gpu:
    """A Gpu described from sysfs and the model table only (no driver needed)."""
    model = gpu_model(dev.device_id)
    return Gpu(
        index=index,
        pci_bus_id=dev.bus_id,
        model=model_name(dev.device_id),
        device_id=dev.device_id,
        memory_total=model.memory_gib * GIB if model else None,
        numa_node=dev.numa_node,
        compute_capability=model.compute_capability if model else None,
        architecture=model.architecture if model else None,
        kernel_driver=dev.driver,
        local_cpulist=dev.local_cpulist,
    )
