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


# ----- vGPU: the vendor-specific capability in the PCI configuration space -------------------------------
#
# A GPU handed to a guest as an NVIDIA vGPU carries a vendor-specific PCI capability (id 0x09) whose data
# starts with the signature "VF"; after it come records (id, length), and the record of id 0 holds the host's
# vGPU manager version and branch, 10 bytes each, NUL-padded. This is the rule NVIDIA's
# gpu-feature-discovery v0.20.0 applies (internal/vgpu), read there and written here; verified on no vGPU
# guest (the real H200 of tests/realgpu is a passthrough GPU, without the capability).

PCI_CONFIG_HEADER = 256  # the conventional configuration space; without CAP_SYS_ADMIN sysfs gives 64 bytes
_STATUS = 0x06
_STATUS_CAPABILITIES = 0x10
_CAPABILITIES_POINTER = 0x34
_CAP_VENDOR_SPECIFIC = 0x09
_VGPU_SIGNATURE = b"VF"
_VGPU_RECORDS = 5  # offset of the first record inside the capability
_VGPU_FIELD = 10  # bytes of the version and of the branch


@dataclass(frozen=True)
class VgpuCapability:
    """What a vGPU's PCI capability says about the host (empty strings where it has no version record)."""

    bus_id: str
    host_driver_version: str = ""
    host_driver_branch: str = ""


def read_config(root: Path, bus_id: str) -> bytes | None:
    """The device's PCI configuration space as sysfs gives it to this process, or None when unreadable."""
    try:
        return host_path(root, f"/sys/bus/pci/devices/{bus_id}/config").read_bytes()
    except OSError:
        return None


def vendor_capability(config: bytes) -> bytes | None:
    """The vendor-specific capability (id 0x09) of a configuration space, None when there is none.

    Raises ValueError for a configuration space shorter than its 256-byte header (what an unprivileged
    reader gets): the capability list may lie beyond what was read.
    """
    if len(config) < PCI_CONFIG_HEADER:
        raise ValueError(f"{len(config)} bytes of PCI configuration space, {PCI_CONFIG_HEADER} needed")
    if not config[_STATUS] & _STATUS_CAPABILITIES:
        return None
    seen: set[int] = set()
    pos = config[_CAPABILITIES_POINTER] & 0xFC  # the low two bits are reserved (PCI spec)
    while pos and pos not in seen and pos + 2 < len(config):
        seen.add(pos)
        cap_id, following, length = config[pos], config[pos + 1], config[pos + 2]
        if cap_id == 0xFF:  # a broken chain
            return None
        if cap_id == _CAP_VENDOR_SPECIFIC:
            return config[pos : pos + length]
        pos = following & 0xFC
    return None


def vgpu_capability(bus_id: str, capability: bytes | None) -> VgpuCapability | None:
    """The vGPU a vendor capability describes (signature "VF"), with the host's version record if any."""
    if capability is None or capability[3:5] != _VGPU_SIGNATURE:
        return None
    pos = _VGPU_RECORDS
    while pos + 1 < len(capability) and capability[pos] != 0:
        step = capability[pos + 1]
        if step == 0:  # a record of no length would never end
            return VgpuCapability(bus_id)
        pos += step
    end = pos + 2 + 2 * _VGPU_FIELD
    if pos >= len(capability) or capability[pos] != 0 or end > len(capability):
        return VgpuCapability(bus_id)
    version = capability[pos + 2 : pos + 2 + _VGPU_FIELD]
    branch = capability[pos + 2 + _VGPU_FIELD : end]
    return VgpuCapability(
        bus_id,
        version.strip(b"\0").decode("ascii", "replace"),
        branch.strip(b"\0").decode("ascii", "replace"),
    )


def vgpus(root: Path, devices: list[PciDevice]) -> list[VgpuCapability] | None:
    """The vGPUs among `devices` (every NVIDIA function, as `scan` lists them), from their configuration
    spaces; None when one of them cannot be read in full (an unprivileged process)."""
    found = []
    for dev in devices:
        config = read_config(root, dev.bus_id)
        try:
            capability = vendor_capability(config or b"")
        except ValueError:
            return None
        vgpu = vgpu_capability(dev.bus_id, capability)
        if vgpu is not None:
            found.append(vgpu)
    return found
