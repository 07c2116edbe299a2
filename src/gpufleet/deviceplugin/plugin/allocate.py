"""Building Allocate answers: environment, device nodes, mounts and CDI names for one container."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from gpufleet.deviceplugin.api import pb
from gpufleet.deviceplugin.config import Config, MountSpec
from gpufleet.deviceplugin.rm.model import GpuInfo, MigDeviceInfo
from gpufleet.logs import log_event

VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
# Device nodes every CUDA process needs besides its GPUs' own, when the driver created them.
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
# The driver's table of MIG capability minors: "gpu<minor>/gi<id>/access <cap minor>" and
# "gpu<minor>/gi<id>/ci<id>/access <cap minor>"; the device node of a capability is
# /dev/nvidia-caps/nvidia-cap<cap minor>.
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
MIG_CAP_DEVICE = "/dev/nvidia-caps/nvidia-cap{}"


class MigMinors:
    """The driver's capability table (name -> minor) of one plugin, re-read only when the file changes."""

    def __init__(self) -> None:
        self._stamp: tuple[int, int] | None = None
        self._table: dict[str, int] = {}

    def read(self, path: str) -> dict[str, int]:
        """The table at `path`; empty when it cannot be read."""
        try:
            st = os.stat(path)
        except OSError:
            return {}
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._stamp:
            return self._table
        table: dict[str, int] = {}
        try:
            with open(path) as f:
                for line in f:
                    name, _, minor = line.strip().rpartition(" ")
                    if name and minor.isdigit():
                        table[name] = int(minor)
        except OSError:
            return {}
        self._stamp, self._table = stamp, table
        return table


@dataclass(frozen=True)
class AllocateOptions:
    """The parts of the configuration Allocate needs."""

    host_root: str = "/"
    device_id_strategy: str = "uuid"
    pass_device_specs: bool = True
    driver_mounts: tuple[MountSpec, ...] = ()
    cdi_enabled: bool = False
    cdi_kind: str = "nvidia.com/gpu"
    mps: bool = False
    mps_pipe_dir: str = "/run/nvidia-mps"
    mps_log_dir: str = "/var/log/nvidia-mps"
    mps_container_pipe_dir: str = "/tmp/nvidia-mps"
    mps_container_log_dir: str = "/var/log/nvidia-mps"
    # Per plugin (one per AllocateOptions), not per process: two plugins may read different host roots.
    mig_minors: MigMinors = field(default_factory=MigMinors, compare=False, repr=False)

    @classmethod
    def from_config(cls, cfg: Config) -> AllocateOptions:
        """Take the Allocate settings from a Config."""
        return cls(
            host_root=cfg.host_root,
            device_id_strategy=cfg.allocate_device_id_strategy,
            pass_device_specs=cfg.allocate_pass_device_specs,
            driver_mounts=cfg.allocate_driver_mounts,
            cdi_enabled=cfg.allocate_cdi_enabled,
            cdi_kind=cfg.allocate_cdi_kind,
            mps=cfg.sharing_memory_mps,
            mps_pipe_dir=cfg.sharing_memory_mps_pipe_dir,
            mps_log_dir=cfg.sharing_memory_mps_log_dir,
            mps_container_pipe_dir=cfg.sharing_memory_mps_container_pipe_dir,
            mps_container_log_dir=cfg.sharing_memory_mps_container_log_dir,
        )

    def host_path(self, path: str) -> str:
        """An absolute host path as seen under the host root."""
        return os.path.join(self.host_root, path.lstrip("/"))


def gpu_response(gpus: Sequence[GpuInfo], opts: AllocateOptions) -> pb.ContainerAllocateResponse:
    """What a container needs to use exactly these GPUs."""
    resp = pb.ContainerAllocateResponse()
    ids = [str(g.index) if opts.device_id_strategy == "index" else g.uuid for g in gpus]
    resp.envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
    if opts.pass_device_specs:
        for gpu in gpus:
            _add_device(resp, opts, f"/dev/nvidia{gpu.minor}", required=True)
        for name in CONTROL_DEVICES:
            _add_device(resp, opts, f"/dev/{name}", required=False)
    return _with_mounts_and_cdi(resp, opts, ids)


def _with_mounts_and_cdi(
    resp: pb.ContainerAllocateResponse, opts: AllocateOptions, ids: Sequence[str]
) -> pb.ContainerAllocateResponse:
    """What every container response carries besides its devices: the driver mounts and the CDI names."""
    for mount in opts.driver_mounts:
        resp.mounts.add(
            container_path=mount.container_path,
            host_path=opts.host_path(mount.host_path),
            read_only=mount.read_only,
        )
    if opts.cdi_enabled:
        for device_id in ids:
            resp.cdi_devices.add(name=f"{opts.cdi_kind}={device_id}")
    return resp


def mig_response(
    devices: Sequence[tuple[GpuInfo, MigDeviceInfo]], opts: AllocateOptions
) -> pb.ContainerAllocateResponse:
    """What a container needs to use exactly these MIG devices: NVIDIA_VISIBLE_DEVICES with their MIG-UUIDs
    (index strategy: <GPU index>:<MIG device index>), the parent GPUs' device nodes, the control devices,
    and the access capability nodes of each device's GPU instance and compute instance."""
    resp = pb.ContainerAllocateResponse()
    if opts.device_id_strategy == "index":
        ids = [f"{gpu.index}:{mig.index}" for gpu, mig in devices]
    else:
        ids = [mig.uuid for _gpu, mig in devices]
    resp.envs[VISIBLE_DEVICES_ENV] = ",".join(ids)
    if opts.pass_device_specs:
        minors = opts.mig_minors.read(opts.host_path(MIG_MINORS))
        for minor in dict.fromkeys(gpu.minor for gpu, _mig in devices):
            _add_device(resp, opts, f"/dev/nvidia{minor}", required=True)
        for name in CONTROL_DEVICES:
            _add_device(resp, opts, f"/dev/{name}", required=False)
        for gpu, mig in devices:
            for cap in (f"gpu{gpu.minor}/gi{mig.gi}/access", f"gpu{gpu.minor}/gi{mig.gi}/ci{mig.ci}/access"):
                if cap not in minors:
                    log_event("mig_capability_missing", level="warning", capability=cap, table=MIG_MINORS)
                    continue
                _add_device(resp, opts, MIG_CAP_DEVICE.format(minors[cap]), required=True)
    return _with_mounts_and_cdi(resp, opts, ids)


def memory_response(gpus: Sequence[GpuInfo], gib: int, opts: AllocateOptions) -> pb.ContainerAllocateResponse:
    """A GPU-memory share of `gib` GiB spread evenly over `gpus`; under MPS the share is enforced."""
    resp = gpu_response(gpus, opts)
    if opts.mps:
        per_gpu = gib // len(gpus)
        resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(f"{g.uuid}={per_gpu}G" for g in gpus)
        # Compute share follows the memory share, so a 4 GiB slice of an 80 GiB GPU gets 5% of its SMs
        # (rounded up; at least 1%).
        smallest = min(g.memory_gib for g in gpus) or 1
        percent = max(1, min(100, math.ceil(100 * per_gpu / smallest)))
        resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percent)
        resp.envs["CUDA_MPS_PIPE_DIRECTORY"] = opts.mps_container_pipe_dir
        resp.envs["CUDA_MPS_LOG_DIRECTORY"] = opts.mps_container_log_dir
        resp.mounts.add(
            container_path=opts.mps_container_pipe_dir,
            host_path=opts.host_path(opts.mps_pipe_dir),
            read_only=False,
        )
        resp.mounts.add(
            container_path=opts.mps_container_log_dir,
            host_path=opts.host_path(opts.mps_log_dir),
            read_only=False,
        )
    return resp


def _add_device(resp: pb.ContainerAllocateResponse, opts: AllocateOptions, path: str, required: bool) -> None:
    host = opts.host_path(path)
    if os.path.exists(host):
        resp.devices.add(container_path=path, host_path=host, permissions="rw")
    elif required:
        # Without the node the runtime would fail the container with a vaguer error; NVIDIA's runtime
        # hook may still create it from NVIDIA_VISIBLE_DEVICES, so this is a warning, not a refusal.
        log_event("device_node_missing", level="warning", path=host)
