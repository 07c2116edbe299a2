"""Everything gpufleet knows about a GPU host, from NVML when a driver runs and from sysfs before."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import pci
from .device import REMOTE_NVSWITCH, Gpu, gpu_from_pci
from .errors import NvmlDriverLibraryMismatch, NvmlError
from .host import HostInfo, host_info, kernel_module_version, resolve_root
from .nvml import nvml_session
from .topology import Topology, build

SOURCE_NVML = "nvml"
SOURCE_SYSFS = "sysfs"


@dataclass
class DriverInfo:
    """The NVIDIA driver as loaded: kernel module and userspace library can differ after an upgrade."""

    loaded: bool = False
    kernel_module_version: str | None = None  # from /sys/module/nvidia or /proc/driver/nvidia
    userspace_version: str | None = None  # from NVML, i.e. libnvidia-ml
    cuda_driver_version: str | None = None  # "12.2"
    nvml_version: str | None = None
    version_mismatch: bool = False  # NVML refused to start, or the two versions differ


@dataclass
class GpuFacts:
    """The result of `discover()`."""

    source: str  # SOURCE_NVML or SOURCE_SYSFS
    host_root: str
    gpus: list[Gpu]
    nvswitch_bus_ids: list[str]
    driver: DriverInfo
    host: HostInfo
    topology: Topology | None = None  # None when NVML was not available
    nvml_error: str | None = None  # why NVML was not used, when it was not
    fabric_symptoms: list[str] = field(default_factory=list)

    @property
    def nvswitch_count(self) -> int:
        """NVSwitches seen on the PCI bus or at the far end of an NVLink."""
        linked = {
            link.remote_bus_id
            for gpu in self.gpus
            for link in gpu.nvlinks
            if link.remote == REMOTE_NVSWITCH and link.remote_bus_id
        }
        return max(len(self.nvswitch_bus_ids), len(linked))

    @property
    def fabricmanager_required(self) -> bool:
        """NVSwitch systems route NVLink traffic only once nvidia-fabricmanager has set the fabric up."""
        return self.nvswitch_count > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; this is what the gpu_facts module returns as `gpufleet_gpu`."""
        return {
            "source": self.source,
            "nvml_error": self.nvml_error,
            "host_root": self.host_root,
            "gpu_count": len(self.gpus),
            "gpu_models": dict(Counter(gpu.model for gpu in self.gpus)),
            "gpus": [_gpu_dict(gpu) for gpu in self.gpus],
            "nvswitch_count": self.nvswitch_count,
            "fabricmanager_required": self.fabricmanager_required,
            "fabric_symptoms": list(self.fabric_symptoms),
            "driver_loaded": self.driver.loaded,
            "driver_version_kernel": self.driver.kernel_module_version,
            "driver_version_userspace": self.driver.userspace_version,
            "driver_version_mismatch": self.driver.version_mismatch,
            "cuda_driver_version": self.driver.cuda_driver_version,
            "nvml_version": self.driver.nvml_version,
            "nouveau_loaded": self.host.nouveau_loaded,
            "boot_mode": self.host.boot_mode,
            "secure_boot": self.host.secure_boot,
            "hypervisor": self.host.hypervisor,
            "virtualized": self.host.virtualized,
            "kernel_release": self.host.kernel_release,
            "device_nodes": list(self.host.device_nodes),
            "topology": None
            if self.topology is None
            else {"gpus": list(self.topology.indices), "matrix": [list(r) for r in self.topology.matrix]},
        }


def _gpu_dict(gpu: Gpu) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model,
        "memory_mib": gpu.memory_mib,
        "pci_bus_id": gpu.pci_bus_id,
        "pci_device_id": f"0x{gpu.device_id:04x}",
        "numa_node": gpu.numa_node,
        "compute_capability": gpu.compute_capability,
        "architecture": gpu.architecture,
        "kernel_driver": gpu.kernel_driver,
        "minor": gpu.minor,
        "persistence_mode": gpu.persistence_mode,
        "mig_mode": None if gpu.mig is None else {"current": gpu.mig.current, "pending": gpu.mig.pending},
        "nvlinks": len(gpu.nvlinks),
        "nvlinks_active": len(gpu.active_nvlinks),
        "fabric_state": gpu.fabric.state if gpu.fabric else None,
        "lost": gpu.lost,
    }


def fabric_symptoms(gpus: list[Gpu], nvswitch_count: int) -> list[str]:
    """What an NVSwitch host shows when nvidia-fabricmanager is not running (or failed)."""
    if not nvswitch_count:
        return []
    symptoms = []
    for gpu in gpus:
        # An inactive link may not report its far end; on a switch system treat those as switch links.
        to_switch = [link for link in gpu.nvlinks if link.remote in (REMOTE_NVSWITCH, "unknown")]
        down = [link for link in to_switch if not link.active]
        if down:
            symptoms.append(
                f"GPU {gpu.index}: {len(down)} of {len(to_switch)} NVLinks to NVSwitches inactive"
            )
        if gpu.fabric and gpu.fabric.state != "completed":
            symptoms.append(f"GPU {gpu.index}: fabric state {gpu.fabric.state}")
        elif gpu.fabric and gpu.fabric.status != 0:
            symptoms.append(f"GPU {gpu.index}: fabric registration failed (NVML error {gpu.fabric.status})")
    return symptoms


def discover(
    host_root: str | os.PathLike[str] | None = None, *, use_nvml: bool = True, with_topology: bool = True
) -> GpuFacts:
    """Discover GPUs, NVSwitches, driver and host facts under `host_root` (default $GPUFLEET_HOST_ROOT or /).

    NVML is used when pynvml, libnvidia-ml and the driver all answer; otherwise the facts come from
    sysfs alone and `nvml_error` says why. Never raises for a missing driver or library.
    """
    root = resolve_root(host_root)
    devices = pci.scan(root)
    host = host_info(root)
    driver = DriverInfo(loaded=host.nvidia_module_loaded, kernel_module_version=kernel_module_version(root))
    gpus: list[Gpu] | None = None
    topology = None
    error = None
    source = SOURCE_SYSFS
    if use_nvml:
        try:
            with nvml_session() as nv:
                found = nv.gpus(devices)
                driver.userspace_version = nv.driver_version()
                driver.cuda_driver_version = nv.cuda_driver_version()
                driver.nvml_version = nv.nvml_version()
                topology = build(found, nv.topology_level) if with_topology else None
            gpus, source = found, SOURCE_NVML
            driver.loaded = True
        except NvmlDriverLibraryMismatch as exc:
            driver.version_mismatch = True
            error = str(exc)
        except NvmlError as exc:
            error = str(exc)
    if gpus is None:
        gpus = [gpu_from_pci(index, dev) for index, dev in enumerate(pci.gpus(devices))]
    if driver.kernel_module_version and driver.userspace_version:
        driver.version_mismatch = driver.kernel_module_version != driver.userspace_version
    facts = GpuFacts(
        source=source,
        host_root=str(root),
        gpus=gpus,
        nvswitch_bus_ids=[dev.bus_id for dev in pci.nvswitches(devices)],
        driver=driver,
        host=host,
        topology=topology,
        nvml_error=error,
    )
    facts.fabric_symptoms = fabric_symptoms(facts.gpus, facts.nvswitch_count)
    return facts
