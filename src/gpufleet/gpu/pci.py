"""NVIDIA devices on the PCI bus, read from sysfs: works before any NVIDIA driver exists."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from .catalog import NVIDIA_VENDOR_ID, GpuModel, gpu_model
from .host import host_path, read_int, read_text

# PCI class codes (24-bit class/subclass/prog-if), compared without the prog-if byte.
_CLASS_VGA = 0x0300
_CLASS_3D = 0x0302
_CLASS_BRIDGE_OTHER = 0x0680  # how NVSwitches present themselves

_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{1,2}):([0-9a-fA-F]{1,2})\.([0-7])$")


def normalize_bus_id(bus_id: str) -> str:
    """The Linux sysfs spelling `dddd:bb:dd.f` (lower case) of any PCI address NVML or sysfs gives.

    NVML says `00000000:07:00.0` (32-bit domain, upper case); sysfs and the kubelet say `0000:07:00.0`.
    """
    match = _BUS_ID.match(bus_id.strip())
    if not match:
        raise ValueError(f"not a PCI bus id: {bus_id!r}")
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):04x}:{int(bus, 16):02x}:{int(device, 16):02x}.{function}"


def nvml_bus_id(bus_id: str) -> str:
    """NVML's and nvidia-smi's spelling `00000000:07:00.0` of a PCI address."""
    domain, bus, rest = normalize_bus_id(bus_id).split(":")
    return f"{int(domain, 16):08X}:{bus.upper()}:{rest.upper()}"


@dataclass(frozen=True)
class PciDevice:
    """One NVIDIA PCI function as sysfs shows it."""

    bus_id: str  # normalized, e.g. "0000:07:00.0"
    device_id: int  # 16-bit PCI device ID, e.g. 0x20b2
    class_code: int  # 24-bit PCI class, e.g. 0x030200
    subsystem_vendor: int | None
    subsystem_device: int | None
    numa_node: int | None  # None where the platform has no NUMA information (sysfs says -1)
    driver: str | None  # bound kernel driver: "nvidia", "vfio-pci", "nouveau", or None
    local_cpulist: str | None  # CPUs near the device, e.g. "0-31,64-95"

    @property
    def is_gpu(self) -> bool:
        """A display or 3D controller: a GPU."""
        return self.class_code >> 8 in (_CLASS_VGA, _CLASS_3D)

    @property
    def is_nvswitch(self) -> bool:
        """An NVSwitch (it shows up as a bridge of class "other")."""
        return self.class_code >> 8 == _CLASS_BRIDGE_OTHER

    @property
    def model(self) -> GpuModel | None:
        """The GPU model the device ID names, if the table knows it."""
        return gpu_model(self.device_id) if self.is_gpu else None


def read_device(root: Path, bus_id: str) -> PciDevice | None:
    """The NVIDIA device at `bus_id`, or None when absent or not NVIDIA's."""
    base = host_path(root, f"/sys/bus/pci/devices/{bus_id}")
    if read_int(base / "vendor", 16) != NVIDIA_VENDOR_ID:
        return None
    numa = read_int(base / "numa_node")
    try:
        driver: str | None = os.path.basename(os.readlink(base / "driver"))
    except OSError:
        driver = None
    return PciDevice(
        bus_id=normalize_bus_id(bus_id),
        device_id=read_int(base / "device", 16) or 0,
        class_code=read_int(base / "class", 16) or 0,
        subsystem_vendor=read_int(base / "subsystem_vendor", 16),
        subsystem_device=read_int(base / "subsystem_device", 16),
        numa_node=numa if numa is not None and numa >= 0 else None,
        driver=driver,
        local_cpulist=read_text(base / "local_cpulist") or None,
    )


def scan(root: Path) -> list[PciDevice]:
    """Every NVIDIA PCI function under `root`, in bus order (the order NVML numbers GPUs in)."""
    try:
        names = os.listdir(host_path(root, "/sys/bus/pci/devices"))
    except OSError:
        return []
    found = (read_device(root, name) for name in names if _BUS_ID.match(name))
    return sorted((dev for dev in found if dev is not None), key=lambda dev: dev.bus_id)


def gpus(devices: list[PciDevice]) -> list[PciDevice]:
    """The GPUs among `devices`."""
    return [dev for dev in devices if dev.is_gpu]


def nvswitches(devices: list[PciDevice]) -> list[PciDevice]:
    """The NVSwitches among `devices`."""
    return [dev for dev in devices if dev.is_nvswitch]
