"""`gpufleet-sim-burn`: a GPU burner for simulated GPUs. While it runs, the GPUs it was given are busy.

A test pod runs it where a real one would run a CUDA job: it keeps the GPUs named by
``NVIDIA_VISIBLE_DEVICES`` (what the device plugin's Allocate set; ``--devices`` overrides) busy for its
lifetime by registering one workload per GPU in the sim root (``$GPUFLEET_SIM_ROOT``, the lab's NVIDIA
runtime mounts it into GPU containers), so NVML, nvidia-smi and exporters see 100 % utilization, the power
at its cap (``--kind compute``, matrix products, the default; ``--kind membound``: a memset loop, memory 100 %
busy below the cap), the process and its memory, until it exits (``--seconds``, SIGTERM, SIGINT). Without
``--seconds`` the workloads hold a lease of LEASE_S that it renews every RENEW_S, so a burner killed with
SIGKILL leaves its GPUs idle within the lease, as a dead process frees a real GPU.

A MIG device (``MIG-...``) makes its parent GPU busy in proportion to its compute slices, with the process
in that MIG device. Exit codes: 0 done or stopped, 1 the workload was refused (out of memory, no writable
workloads directory), 2 bad arguments or no GPU to burn.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from gpufleet_harness.sim import workload

DEFAULT_ROOT = "/etc/gpufleet-sim"  # where the lab's hosts and GPU containers have the simulated driver
LEASE_S = 15.0
RENEW_S = 5.0
MIG_COMPUTE_SLICES = 7  # the compute slices of a whole A100/H100/H200


class BurnError(Exception):
    """What stops the burner before it starts, with the exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Target:
    """One GPU to keep busy: its index, the share of it, and the MIG device's instance ids if any."""

    gpu: int
    share: float = 1.0
    mig: tuple[int, int] | None = None
    label: str = ""


class _Attributes(ctypes.Structure):  # nvmlDeviceAttributes_t
    _fields_ = [(name, ctypes.c_uint) for name in (
        "multiprocessorCount", "sharedCopyEngineCount", "sharedDecoderCount", "sharedEncoderCount",
        "sharedJpegCount", "sharedOfaCount", "gpuInstanceSliceCount", "computeInstanceSliceCount")] + [
        ("memorySizeMB", ctypes.c_ulonglong)]


def _mig_target(nvml: ctypes.CDLL, uuid: str) -> Target:
    mig, parent = ctypes.c_void_p(), ctypes.c_void_p()
    index, gi, ci, attrs = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint(), _Attributes()
    if (nvml.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(mig))
            or nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig, ctypes.byref(parent))
            or nvml.nvmlDeviceGetIndex(parent, ctypes.byref(index))
            or nvml.nvmlDeviceGetGpuInstanceId(mig, ctypes.byref(gi))
            or nvml.nvmlDeviceGetComputeInstanceId(mig, ctypes.byref(ci))
            or nvml.nvmlDeviceGetAttributes_v2(mig, ctypes.byref(attrs))):
        raise BurnError(f"MIG device {uuid} is not on this machine")
    share = min(1.0, attrs.computeInstanceSliceCount / MIG_COMPUTE_SLICES)
    return Target(index.value, share, (gi.value, ci.value), uuid)


def _mig_targets(root: Path, uuids: list[str]) -> dict[str, Target]:
    """MIG UUIDs → their parent GPU and instance, through the root's NVML (as CUDA asks the driver)."""
    if not uuids:
        return {}
    os.environ["GPUFLEET_SIM_ROOT"] = str(root)
    try:
        nvml = ctypes.CDLL(str(root / "lib" / "libnvidia-ml.so.1"))
    except OSError as err:
        raise BurnError(f"MIG devices need the simulated NVML of {root}: {err}") from None
    if nvml.nvmlInit_v2() != 0:
        raise BurnError(f"the simulated NVML of {root} does not initialize (is its driver loaded?)")
    try:
        return {uuid: _mig_target(nvml, uuid) for uuid in uuids}
    finally:
        nvml.nvmlShutdown()


def targets(root: Path, devices: str) -> list[Target]:
    """The GPUs `devices` names (NVIDIA_VISIBLE_DEVICES' forms: all, indices, GPU-/MIG- UUIDs), in order."""
    try:
        machine = json.loads((root / "machine.json").read_text())
    except (OSError, ValueError) as err:
        raise BurnError(f"{root} is not a sim root ({err}); set GPUFLEET_SIM_ROOT or --root") from None
    gpus = machine.get("gpus") or []
    words = [w.strip() for w in devices.split(",") if w.strip()]
    if not words or words[0] in ("none", "void"):
        raise BurnError(f"no GPU to burn: NVIDIA_VISIBLE_DEVICES / --devices is {devices!r}")
    if words == ["all"]:
        return [Target(i, label=str(i)) for i in range(len(gpus))]
    migs = _mig_targets(root, [w for w in words if w.startswith("MIG-")])
    chosen = []
    for word in words:
        if word in migs:
            chosen.append(migs[word])
            continue
        index = next((i for i, g in enumerate(gpus) if word in (str(i), g.get("uuid"))), None)
        if index is None:
            where = f"{machine.get('name')}: GPUs 0-{len(gpus) - 1}"
            raise BurnError(f"GPU {word!r} is not on this machine ({where})")
        chosen.append(Target(index, label=word))
    return chosen


class Burner:
    """The workloads of one burner: started together, renewed together, stopped together."""

    def __init__(self, root: Path, chosen: list[Target], *, util: int, mem_util: int | None, memory_mib: int,
                 seconds: float | None, name: str, kind: str = workload.COMPUTE) -> None:
        self.root, self.chosen, self.seconds = root, chosen, seconds
        self.util, self.mem_util, self.memory_mib, self.name = util, mem_util, memory_mib, name
        self.kind = kind
        self.ids: dict[int, int] = {}  # target position → its current workload id

    def _start(self, k: int) -> workload.Load:
        t = self.chosen[k]
        util = round(self.util * t.share)
        mem_util = None if self.mem_util is None else round(self.mem_util * t.share)
        load = workload.start(self.root, t.gpu, util=util, mem_util=mem_util, memory_mib=self.memory_mib,
                              name=self.name, seconds=self.seconds or LEASE_S, mig=t.mig, kind=self.kind)
        self.ids[k] = load.id
        return load

    def start(self) -> list[workload.Load]:
        started = []
        try:
            for k in range(len(self.chosen)):
                started.append(self._start(k))
        except workload.WorkloadError:
            self.stop()
            raise
        return started

    def renew(self) -> None:
        """Extend the leases; a workload whose lease ran out (the burner was stopped) starts anew."""
        renewed = {ld.id for ld in workload.renew(self.root, self.ids.values(), round(LEASE_S * 1000))}
        for k, load_id in list(self.ids.items()):
            if load_id not in renewed:
                self._start(k)

    def stop(self) -> None:
        if self.ids:
            workload.stop(self.root, ids=self.ids.values())
            self.ids.clear()


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpufleet-sim-burn", description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", help="GPUs to burn: all, indices or UUIDs, comma-separated "
                                     "(default: $NVIDIA_VISIBLE_DEVICES)")
    p.add_argument("--root", help=f"the sim root (default: $GPUFLEET_SIM_ROOT, else {DEFAULT_ROOT})")
    p.add_argument("--util", type=int, default=100, help="GPU utilization, %% (default 100)")
    p.add_argument("--memory-util", type=int,
                   help="memory-copy utilization, %% (default: a quarter of --util, all of it for membound)")
    p.add_argument("--kind", choices=workload.KINDS, default=workload.COMPUTE,
                   help="compute: matrix products, held by the power cap (default); membound: a memset loop")
    p.add_argument("--memory", type=int, default=1024, metavar="MIB",
                   help="GPU memory to hold per GPU (1024)")
    p.add_argument("--seconds", type=float, help="run this long (default: until SIGTERM or SIGINT)")
    p.add_argument("--name", default="gpufleet-sim-burn", help="the process name NVML reports")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root = Path(args.root or os.environ.get("GPUFLEET_SIM_ROOT") or DEFAULT_ROOT)
    devices = args.devices if args.devices is not None else os.environ.get("NVIDIA_VISIBLE_DEVICES", "")
    if args.seconds is not None and args.seconds <= 0:
        print(f"gpufleet-sim-burn: --seconds must be positive, got {args.seconds}", file=sys.stderr)
        return 2
    done = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: done.set())
    try:
        burner = Burner(root, targets(root, devices), util=args.util, mem_util=args.memory_util,
                        memory_mib=args.memory, seconds=args.seconds, name=args.name, kind=args.kind)
        for load in burner.start():
            print(f"gpufleet-sim-burn: GPU {load.gpu} busy at {load.util} % (pid {load.pid}, "
                  f"{load.memory_mib} MiB){'' if args.seconds else ' until stopped'}", flush=True)
    except BurnError as err:
        print(f"gpufleet-sim-burn: {err}", file=sys.stderr)
        return err.code
    except (workload.WorkloadError, OSError) as err:
        print(f"gpufleet-sim-burn: {err}", file=sys.stderr)
        return 1
    try:
        if args.seconds:
            done.wait(args.seconds)
        else:
            while not done.wait(RENEW_S):
                burner.renew()
    finally:
        burner.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
