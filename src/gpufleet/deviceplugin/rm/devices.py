"""Advertised devices per resource: whole GPUs, time-slicing replicas, or GiB of GPU memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum

from .health import HEALTHY, GpuHealth
from .model import GpuInfo, NodeInventory

# Separates a GPU UUID from a replica or memory-unit number in device IDs: "GPU-…::3".
ID_SEPARATOR = "::"


class ResourceKind(Enum):
    """How a resource maps devices onto GPUs."""

    GPU = "gpu"  # one device per GPU, ID = UUID
    REPLICA = "replica"  # time-slicing: N devices per GPU, ID = UUID::n
    MEMORY = "memory"  # GPU memory: one device per GiB, ID = UUID::k; the extender picks the GPU
    MIG = "mig"  # one device per MIG device (of one profile, or of any with mig_profile ""), ID = MIG-UUID


@dataclass(frozen=True)
class ResourceSpec:
    """One extended resource this plugin advertises."""

    name: str
    kind: ResourceKind
    replicas: int = 1  # REPLICA only
    mig_profile: str = ""  # MIG only: the profile served ("" = every MIG device: mig.strategy single)
    skip_mig: bool = False  # GPU only: leave out GPUs with MIG enabled (mig.strategy mixed)

    @property
    def socket_name(self) -> str:
        """Basename of this resource's socket: one socket per resource, named after it."""
        return "gpufleet-" + self.name.replace("/", "-") + ".sock"


@dataclass(frozen=True)
class PluginDevice:
    """A device as the kubelet sees it, tied to the GPU behind it."""

    id: str
    gpu: str
    healthy: bool
    numa: int | None


def device_ids(spec: ResourceSpec, gpu: GpuInfo) -> list[str]:
    """IDs this resource advertises for one GPU, in a stable order."""
    if spec.kind is ResourceKind.GPU:
        return [] if spec.skip_mig and gpu.mig_enabled else [gpu.uuid]
    if spec.kind is ResourceKind.MIG:
        return [m.uuid for m in gpu.mig_devices if not spec.mig_profile or m.profile == spec.mig_profile]
    count = spec.replicas if spec.kind is ResourceKind.REPLICA else gpu.memory_gib
    return [f"{gpu.uuid}{ID_SEPARATOR}{n}" for n in range(count)]


def gpu_of(device_id: str) -> str:
    """The GPU UUID a device ID belongs to."""
    return device_id.split(ID_SEPARATOR, 1)[0]


def build_devices(
    spec: ResourceSpec, inventory: NodeInventory, health: Mapping[str, GpuHealth]
) -> list[PluginDevice]:
    """Every device of a resource, each carrying its GPU's health and NUMA node (a MIG device: healthy when
    both it and its GPU are)."""
    out: list[PluginDevice] = []
    for gpu in inventory.gpus:
        healthy = health.get(gpu.uuid, HEALTHY).healthy
        if spec.kind is ResourceKind.MIG:
            out.extend(
                PluginDevice(i, gpu.uuid, healthy and health.get(i, HEALTHY).healthy, gpu.numa)
                for i in device_ids(spec, gpu)
            )
            continue
        out.extend(PluginDevice(i, gpu.uuid, healthy, gpu.numa) for i in device_ids(spec, gpu))
    return out
