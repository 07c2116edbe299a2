"""The data the resource manager works on, and the seam to GPU discovery (`DeviceSource`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Protocol

GIB = 1 << 30
MIB = 1 << 20


class TopologyLevel(IntEnum):
    """NVML's nvmlGpuTopologyLevel_t: how far apart two GPUs sit on the PCIe tree."""

    INTERNAL = 0  # same board
    SINGLE = 10  # one PCIe switch between them (PIX)
    MULTIPLE = 20  # several PCIe switches, no host bridge (PXB)
    HOSTBRIDGE = 30  # through one host bridge (PHB)
    NODE = 40  # host bridges of one NUMA node
    SYSTEM = 50  # across NUMA nodes (SYS)


@dataclass(frozen=True)
class MigDeviceInfo:
    """One MIG device (a compute instance inside a GPU instance) as NVML enumerates it."""

    uuid: str  # MIG-…
    parent: str  # the GPU's UUID
    index: int  # position among the parent's MIG device handles (nvmlDeviceGetMigDeviceHandleByIndex)
    gi: int  # GPU-instance id
    ci: int  # compute-instance id
    profile: str  # e.g. 1g.10gb (1c.3g.40gb for a compute instance smaller than its GPU instance)
    memory_bytes: int
    # nvmlDeviceGetAttributes of the MIG device under gpu-feature-discovery's names (memory, multiprocessors,
    # slices.gi, slices.ci, engines.copy/decoder/encoder/jpeg/ofa); empty where NVML did not answer.
    attributes: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as discovery reports it."""

    index: int
    uuid: str
    minor: int
    model: str
    memory_bytes: int
    cc: tuple[int, int]
    numa: int | None
    bus_id: str
    # Peer GPU UUID -> number of NVLinks joining the two (through NVSwitches: every peer reachable
    # over the fabric, counted as `nvidia-smi topo -m` shows it, e.g. NV12).
    nvlinks: Mapping[str, int] = field(default_factory=dict)
    mig_enabled: bool = False  # MIG mode current (not pending) is enabled
    mig_devices: tuple[MigDeviceInfo, ...] = ()
    mig_capable: bool = False  # nvmlDeviceGetMigMode answers at all (MIG on or off)
    pci_class: int = 0  # 24-bit PCI class from sysfs (0x030200 a 3D controller, 0x030000 VGA); 0 unknown
    virtualization_mode: int | None = None  # nvmlGpuVirtualizationMode (1 passthrough, 2 vGPU guest)
    clique: str = ""  # "<cluster uuid>.<clique id>" once the GPU is registered on an NVLink fabric

    @property
    def memory_gib(self) -> int:
        """Whole GiB of memory: the unit of the GPU-memory resource (rounded down, never promised twice)."""
        return self.memory_bytes // GIB


@dataclass(frozen=True)
class VgpuDevice:
    """A vGPU this guest sees, and the host's vGPU manager version where the PCI capability carries it."""

    bus_id: str
    host_driver_version: str = ""
    host_driver_branch: str = ""


@dataclass(frozen=True)
class NodeInventory:
    """Everything discovery knows about the node's GPUs."""

    gpus: tuple[GpuInfo, ...]
    # (uuid_a, uuid_b) -> NVML topology level, both orders present; missing pairs mean unknown.
    topology: Mapping[tuple[str, str], TopologyLevel] = field(default_factory=dict)
    driver_version: str = ""
    cuda_driver_version: int = 0  # NVML's encoding: 12020 means 12.2
    nvswitch_count: int = 0
    machine: str | None = None  # the DMI product name (/sys/class/dmi/id/product_name); None unreadable
    vgpu: tuple[VgpuDevice, ...] | None = None  # the node's vGPUs; None where discovery could not tell

    def by_uuid(self) -> dict[str, GpuInfo]:
        """Map UUID -> GPU."""
        return {g.uuid: g for g in self.gpus}

    def mig_by_uuid(self) -> dict[str, tuple[GpuInfo, MigDeviceInfo]]:
        """Map MIG device UUID -> (parent GPU, MIG device)."""
        return {m.uuid: (g, m) for g in self.gpus for m in g.mig_devices}

    def level(self, a: str, b: str) -> TopologyLevel | None:
        """Topology level between two GPUs, None when discovery could not tell."""
        return self.topology.get((a, b))


class HealthEventKind:
    """Kinds of health events a source delivers."""

    XID = "xid"
    ECC_DBE = "ecc-dbe"
    LOST = "lost"


@dataclass(frozen=True)
class HealthEvent:
    """Something NVML reported about one GPU (uuid) or all of them (uuid None)."""

    kind: str
    uuid: str | None
    code: int = 0
    detail: str = ""
    # The MIG instance an XID was aimed at (NVML's eventData gpuInstanceId / computeInstanceId); None when
    # the event concerns the whole GPU.
    gi: int | None = None
    ci: int | None = None


@dataclass(frozen=True)
class Probe:
    """The outcome of asking NVML whether a GPU is usable right now."""

    usable: bool
    detail: str = ""


class SourceUnavailable(Exception):
    """NVML (or discovery as a whole) cannot be used right now; the message says why."""


class EventStream(Protocol):
    """Blocking access to a source's health events."""

    def wait(self, timeout_s: float) -> Sequence[HealthEvent]:
        """Block until events arrive or `timeout_s` passes (then return an empty sequence)."""

    def close(self) -> None:
        """Release the underlying NVML event set."""


class DeviceSource(Protocol):
    """What the resource manager needs from GPU discovery."""

    def inventory(self) -> NodeInventory:
        """Discover the GPUs; raise SourceUnavailable when NVML cannot be used."""

    def open_events(self, uuids: Sequence[str]) -> EventStream:
        """Start receiving XID / ECC events for these GPUs; raise SourceUnavailable on failure."""

    def probe(self, uuid: str) -> Probe:
        """Check that NVML can reach and query the GPU now."""

    def close(self) -> None:
        """Release NVML."""
