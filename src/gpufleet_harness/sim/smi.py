"""`gpufleet-sim-smi`: an nvidia-smi stand-in for simulated hosts, built on pynvml via gpufleet.gpu.

It answers the invocations gpufleet's roles, validation suites and operators use, in nvidia-smi's
formats: `-L`, `--query-gpu=... --format=csv[,noheader][,nounits]`, `topo -m`, `--version`,
`--gpu-reset -i N` (`-r`) and the default summary. Failures exit with nvidia-smi's codes, which are
NVML's return codes (nvidia-smi(1), RETURN VALUE): 9 when the driver is not loaded, 12 when
libnvidia-ml cannot be loaded, 255 otherwise. Every banner says the GPUs are simulated.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from gpufleet import __version__
from gpufleet.gpu import (
    HOST_ROOT_ENV,
    Gpu,
    Nvml,
    NvmlDriverLibraryMismatch,
    NvmlDriverNotLoaded,
    NvmlError,
    NvmlLibraryNotFound,
    NvmlNoPermission,
    NvmlOperatingSystemBlocked,
    NvmlUnavailable,
    nvml_bus_id,
    nvml_session,
)
from gpufleet.gpu import pci as pci_scan
from gpufleet.gpu.cli import format_topology
from gpufleet.gpu.topology import build

BANNER = f"gpufleet simulated nvidia-smi (gpufleet {__version__}): these GPUs are simulated"

# What nvidia-smi prints for the failures scripts look for; the text is matched by existing tooling.
DRIVER_NOT_LOADED = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)
LIBRARY_NOT_FOUND = (
    "NVIDIA-SMI couldn't find libnvidia-ml.so library in your system. Please make sure that the NVIDIA "
    "Display Driver is properly installed and present in your system.\n"
    "Please also try adding directory that contains libnvidia-ml.so to your system PATH."
)
EXIT_BAD_ARGUMENT = 2
EXIT_NOT_FOUND = 6
EXIT_GPU_LOST = 15
EXIT_OTHER = 255


def failure(err: NvmlError) -> tuple[str, int]:
    """(message, exit code) nvidia-smi gives when NVML fails with `err`."""
    if isinstance(err, NvmlDriverNotLoaded):
        return DRIVER_NOT_LOADED, 9
    if isinstance(err, (NvmlLibraryNotFound, NvmlUnavailable)):
        return LIBRARY_NOT_FOUND, 12
    if isinstance(err, NvmlOperatingSystemBlocked):
        return "Failed to initialize NVML: GPU access blocked by the operating system", 17
    if isinstance(err, NvmlDriverLibraryMismatch):
        return "Failed to initialize NVML: Driver/library version mismatch", 18
    if isinstance(err, NvmlNoPermission):
        return "Failed to initialize NVML: Insufficient Permissions", 4
    return f"Failed to initialize NVML: {err}", EXIT_OTHER


@dataclass
class Row:
    """One GPU with the raw NVML values the formats need beyond gpufleet's Gpu."""

    gpu: Gpu
    pci_device_id: int | None = None  # NVML's pciDeviceId: device << 16 | vendor
    pci_subsystem_id: int | None = None
    memory_used: int | None = None
    memory_free: int | None = None
    mig_devices: list[MigRow] | None = None  # in MIG device order


@dataclass
class MigRow:
    """One MIG device of a GPU, as `-L` and the summary's MIG table show it."""

    profile: str  # "1g.10gb", or "1c.3g.40gb" for a compute instance smaller than its GPU instance
    uuid: str  # MIG-...
    gi: int | None = None  # GPU-instance id
    ci: int | None = None  # compute-instance id
    memory_used: int | None = None  # bytes
    memory_total: int | None = None


def host_root() -> Path:
    """Where sysfs is (NUMA and CPU affinity): $GPUFLEET_HOST_ROOT, else the sim root's host/, else /."""
    if os.environ.get(HOST_ROOT_ENV):
        return Path(os.environ[HOST_ROOT_ENV])
    sim_root = os.environ.get("GPUFLEET_SIM_ROOT")
    return Path(sim_root) / "host" if sim_root else Path("/")


class Session:
    """What one invocation reads from NVML, read once."""

    def __init__(self, nv: Nvml) -> None:
        self.nv = nv
        self.gpus = nv.gpus(pci_scan.scan(host_root()))
        self.driver_version = nv.driver_version()
        self.cuda_version = nv.cuda_driver_version() or "N/A"
        self.nvml_version = nv.nvml_version()
        self.rows = [self._row(gpu) for gpu in self.gpus]

    def _row(self, gpu: Gpu) -> Row:
        row = Row(gpu)
        if gpu.lost:
            return row
        handle = self.nv.handle(gpu.index)
        pci = self.nv.call(f"GPU {gpu.index}", self.nv.nv.nvmlDeviceGetPciInfo, handle)
        memory = self.nv.call(f"GPU {gpu.index}", self.nv.nv.nvmlDeviceGetMemoryInfo, handle)
        row.pci_device_id, row.pci_subsystem_id = int(pci.pciDeviceId), int(pci.pciSubSystemId)
        row.memory_used, row.memory_free = int(memory.used), int(memory.free)
        row.mig_devices = self._mig_devices(handle)
        return row

    def _mig_devices(self, handle: Any) -> list[MigRow]:
        """The GPU's MIG devices, walked as NVML consumers do: indexes 0..max-1, NOT_FOUND skipped."""
        nv = self.nv.nv
        try:
            current, _ = nv.nvmlDeviceGetMigMode(handle)
            if current != nv.NVML_DEVICE_MIG_ENABLE:
                return []
            count = nv.nvmlDeviceGetMaxMigDeviceCount(handle)
        except nv.NVMLError:
            return []
        found = []
        for i in range(count):
            try:
                mig = nv.nvmlDeviceGetMigDeviceHandleByIndex(handle, i)
                name, uuid = nv.nvmlDeviceGetName(mig), nv.nvmlDeviceGetUUID(mig)
                gi, ci = nv.nvmlDeviceGetGpuInstanceId(mig), nv.nvmlDeviceGetComputeInstanceId(mig)
                memory = nv.nvmlDeviceGetMemoryInfo(mig)
            except nv.NVMLError:
                continue
            name, uuid = (v.decode() if isinstance(v, bytes) else v for v in (name, uuid))
            profile = name.rsplit(" MIG ", 1)[-1]
            found.append(MigRow(profile, uuid, int(gi), int(ci), int(memory.used), int(memory.total)))
        return found

    def select(self, ids: str | None) -> list[Row]:
        """Rows named by `-i`: indices, UUIDs or PCI bus ids, comma-separated; all when None.

        A MIG UUID names its parent GPU with that MIG device only: what a container given MIG devices
        sees (the lab image's nvidia-smi passes the container's NVIDIA_VISIBLE_DEVICES here, in place of
        the NVIDIA container toolkit)."""
        if ids is None:
            return self.rows
        wanted = [part.strip() for part in ids.split(",") if part.strip()]
        chosen: list[Row] = []
        for want in wanted:
            if want.startswith("MIG-"):
                row = next((r for r in self.rows for m in r.mig_devices or () if m.uuid == want), None)
                if row is None:
                    return []
                mig = [m for m in row.mig_devices or () if m.uuid == want]
                seen = next((i for i, c in enumerate(chosen) if c.gpu.index == row.gpu.index), None)
                if seen is None:
                    chosen.append(replace(row, mig_devices=mig))
                else:
                    chosen[seen].mig_devices = [*(chosen[seen].mig_devices or ()), *mig]
                continue
            for row in self.rows:
                gpu = row.gpu
                if want in (str(gpu.index), gpu.uuid) or _same_bus(want, gpu.pci_bus_id):
                    chosen.append(row)
                    break
            else:
                return []
        return chosen


def _same_bus(text: str, bus_id: str) -> bool:
    try:
        return pci_scan.normalize_bus_id(text) == bus_id
    except ValueError:
        return False


# -- --query-gpu ----------------------------------------------------------------------------------------

_MIB = 1 << 20
NA = "[N/A]"


def _enabled(value: bool | None) -> str:
    return NA if value is None else ("Enabled" if value else "Disabled")


def _mib(value: int | None) -> int | None:
    return None if value is None else value // _MIB


def _hex(value: int | None, width: int) -> str:
    return NA if value is None else f"0x{value:0{width}X}"


@dataclass(frozen=True)
class Field:
    """A --query-gpu property: its value from a row (None → [N/A]) and its unit, if any."""

    value: Callable[[Row, Session], Any]
    unit: str | None = None


FIELDS: dict[str, Field] = {
    "index": Field(lambda r, s: r.gpu.index),
    "name": Field(lambda r, s: r.gpu.model),
    "uuid": Field(lambda r, s: r.gpu.uuid),
    "serial": Field(lambda r, s: r.gpu.serial),
    "count": Field(lambda r, s: len(s.gpus)),
    "driver_version": Field(lambda r, s: s.driver_version),
    "compute_cap": Field(lambda r, s: r.gpu.compute_capability),
    "memory.total": Field(lambda r, s: _mib(r.gpu.memory_total), "MiB"),
    "memory.used": Field(lambda r, s: _mib(r.memory_used), "MiB"),
    "memory.free": Field(lambda r, s: _mib(r.memory_free), "MiB"),
    "pci.bus_id": Field(lambda r, s: nvml_bus_id(r.gpu.pci_bus_id) if r.gpu.pci_bus_id else None),
    "pci.domain": Field(lambda r, s: _hex(int(r.gpu.pci_bus_id[:4], 16), 4) if r.gpu.pci_bus_id else None),
    "pci.bus": Field(lambda r, s: _hex(int(r.gpu.pci_bus_id[5:7], 16), 2) if r.gpu.pci_bus_id else None),
    "pci.device": Field(lambda r, s: _hex(int(r.gpu.pci_bus_id[8:10], 16), 2) if r.gpu.pci_bus_id else None),
    "pci.device_id": Field(lambda r, s: _hex(r.pci_device_id, 8) if r.pci_device_id is not None else None),
    "pci.sub_device_id": Field(
        lambda r, s: _hex(r.pci_subsystem_id, 8) if r.pci_subsystem_id is not None else None
    ),
    "persistence_mode": Field(lambda r, s: _enabled(r.gpu.persistence_mode)),
    "mig.mode.current": Field(lambda r, s: _enabled(r.gpu.mig.current) if r.gpu.mig else None),
    "mig.mode.pending": Field(lambda r, s: _enabled(r.gpu.mig.pending) if r.gpu.mig else None),
}
# nvidia-smi accepts these alternative names for the same properties.
ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_serial": "serial",
    "gpu_bus_id": "pci.bus_id",
    "persistence-mode": "persistence_mode",
}


def query_gpu(session: Session, rows: list[Row], names: list[str], fmt: set[str]) -> str:
    """CSV for `--query-gpu`; `fmt` holds the --format options after `csv`."""
    fields = [FIELDS[ALIASES.get(name, name)] for name in names]
    lines = []
    if "noheader" not in fmt:
        pairs = zip(names, fields, strict=True)
        lines.append(", ".join(f"{name} [{field.unit}]" if field.unit else name for name, field in pairs))
    for row in rows:
        if row.gpu.lost:
            lines.append(lost_line(row.gpu))
            continue
        cells = []
        for field in fields:
            value = field.value(row, session)
            if value is None:
                value = NA
            elif field.unit and "nounits" not in fmt and value != NA:
                value = f"{value} {field.unit}"
            cells.append(str(value))
        lines.append(", ".join(cells))
    return "\n".join(lines) + "\n"


# -- the other outputs ----------------------------------------------------------------------------------


def lost_line(gpu: Gpu) -> str:
    """What nvidia-smi prints in place of a GPU that fell off the bus."""
    where = nvml_bus_id(gpu.pci_bus_id) if gpu.pci_bus_id else str(gpu.index)
    return (
        f"Unable to determine the device handle for GPU{where}: GPU is lost. "
        "Reboot the system to recover this GPU"
    )


def list_gpus(rows: list[Row]) -> str:
    """`-L`: one line per GPU, as nvidia-smi prints it, each followed by its MIG devices
    ("  MIG 1g.10gb     Device  0: (UUID: MIG-...)")."""
    lines = []
    for row in rows:
        if row.gpu.lost:
            lines.append(lost_line(row.gpu))
            continue
        lines.append(f"GPU {row.gpu.index}: {row.gpu.model} (UUID: {row.gpu.uuid})")
        for i, mig in enumerate(row.mig_devices or []):
            lines.append(f"  MIG {mig.profile:<11} Device {i:>2}: (UUID: {mig.uuid})")
    return "\n".join(lines) + "\n"


def summary(session: Session, rows: list[Row]) -> str:
    """The default output: banner, versions, one line per GPU."""
    rule = "+" + "+".join("-" * width for width in (5, 30, 18, 23, 9, 6)) + "+"
    lines = [
        time.strftime("%a %b %d %H:%M:%S %Y"),
        BANNER,
        f"Driver Version: {session.driver_version}    CUDA Version: {session.cuda_version}    "
        f"NVML Version: {session.nvml_version}",
        rule,
        "| GPU | Name                         | Bus-Id           |          Memory-Usage | Persist | MIG  |",
        rule,
    ]
    for row in rows:
        gpu = row.gpu
        if gpu.lost:
            gone = "GPU is lost"
            lines.append(f"| {gpu.index:>3} | {gone:<28} | {'':<16} | {'':>21} | {'':<7} | {'':<4} |")
            continue
        memory = f"{_mib(row.memory_used)}MiB / {_mib(gpu.memory_total)}MiB"
        persist = {True: "On", False: "Off", None: "N/A"}[gpu.persistence_mode]
        mig = "N/A" if gpu.mig is None else ("On" if gpu.mig.current else "Off")
        lines.append(
            f"| {gpu.index:>3} | {gpu.model[:28]:<28} | {nvml_bus_id(gpu.pci_bus_id)} | {memory:>21} "
            f"| {persist:<7} | {mig:<4} |"
        )
    lines.append(rule)
    lines.extend(mig_table(rows))
    lines.append("Processes: none (simulated GPUs run no processes)")
    return "\n".join(lines) + "\n"


def mig_table(rows: list[Row]) -> list[str]:
    """The summary's "MIG devices:" table (none without MIG devices): a row per MIG device that starts as
    nvidia-smi's does, `| GPU  GI  CI  MIG | <used>MiB / <total>MiB |`, which is what scripts read."""
    migs = [(row.gpu.index, k, m) for row in rows for k, m in enumerate(row.mig_devices or [])]
    if not migs:
        return []
    rule = "+" + "+".join("-" * width for width in (18, 26, 13)) + "+"
    lines = [rule, "| MIG devices:" + " " * 47 + "|", rule,
             "| GPU  GI  CI  MIG |             Memory-Usage | Profile     |",
             "|      ID  ID  Dev |                          |             |", rule]  # fmt: skip
    for index, k, mig in migs:
        memory = f"{_mib(mig.memory_used)}MiB / {_mib(mig.memory_total)}MiB"
        ids = f"{index:>3}{_id(mig.gi):>5}{_id(mig.ci):>4}{k:>4}"
        lines.append(f"|{ids}  | {memory:>24} | {mig.profile:<11} |")
    lines.append(rule)
    return lines


def _id(value: int | None) -> str:
    return "N/A" if value is None else str(value)


def version(session: Session) -> str:
    """`--version`."""
    return (
        f"{BANNER}\n"
        f"NVIDIA-SMI version  : {session.driver_version} (simulated)\n"
        f"NVML version        : {session.nvml_version}\n"
        f"DRIVER version      : {session.driver_version}\n"
        f"CUDA Version        : {session.cuda_version}\n"
    )


def topo_matrix(session: Session) -> str:
    """`topo -m`: the connection matrix with CPU and NUMA affinity columns."""
    return format_topology(build(session.gpus, session.nv.topology_level), session.gpus)


def gpu_reset(rows: list[Row]) -> tuple[str, int]:
    """`--gpu-reset -i N`: what `gpufleet sim inject ROOT gpu N reset` does (a pending MIG mode becomes
    current, the GPU's MIG instances are gone), one line per GPU as nvidia-smi prints it, then "All done."."""
    root = os.environ.get("GPUFLEET_SIM_ROOT")
    if not root:
        return "GPUFLEET_SIM_ROOT is not set: no simulated GPU to reset\n", EXIT_OTHER
    try:  # here, not at the top: hosts that carry only the stand-in's own sources (the lab's) lack it
        from gpufleet_harness.sim import control as simcontrol
    except ImportError as err:
        return f"GPU reset needs the simulator's control module on this host: {err}\n", EXIT_OTHER
    lines = []
    for row in rows:
        if row.gpu.lost:
            lines.append(lost_line(row.gpu))
            return "\n".join(lines) + "\n", EXIT_GPU_LOST
        simcontrol.inject(root, ["gpu", str(row.gpu.index), "reset"])
        lines.append(f"GPU {nvml_bus_id(row.gpu.pci_bus_id)} was successfully reset.")
    lines.append("All done.")
    return "\n".join(lines) + "\n", 0


# -- command line ---------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvidia-smi", description=BANNER, add_help=True)
    parser.add_argument("-L", "--list-gpus", action="store_true", help="list GPUs with their UUIDs")
    parser.add_argument("-i", "--id", help="GPU indices, UUIDs or PCI bus ids, comma-separated")
    parser.add_argument("--query-gpu", help="comma-separated properties to print, e.g. index,name,uuid")
    parser.add_argument("--format", help="csv[,noheader][,nounits]")
    parser.add_argument("--version", action="store_true", help="print versions")
    parser.add_argument("-r", "--gpu-reset", action="store_true", help="reset the GPUs given with -i")
    return parser


def _topo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvidia-smi topo", description=BANNER)
    parser.add_argument("-m", "--matrix", action="store_true", help="print the GPU connection matrix")
    return parser


def run(argv: Sequence[str]) -> tuple[str, int]:
    """(stdout text, exit code) for one invocation; main() prints it."""
    topo = bool(argv) and argv[0] == "topo"
    args = (_topo_parser() if topo else _parser()).parse_args(list(argv[1:] if topo else argv))
    if topo and not args.matrix:
        return _topo_parser().format_usage(), EXIT_BAD_ARGUMENT
    names: list[str] = []
    fmt: set[str] = set()
    if not topo and args.query_gpu is not None:
        names = [name.strip() for name in args.query_gpu.split(",") if name.strip()]
        for name in names:
            if ALIASES.get(name, name) not in FIELDS:
                return f'Field "{name}" is not a valid field to query.\n', EXIT_BAD_ARGUMENT
        options = [part.strip() for part in (args.format or "").split(",")]
        if options[0] != "csv":
            return '"--format=csv" is required with --query-gpu.\n', EXIT_BAD_ARGUMENT
        fmt = set(options[1:])
    try:
        with nvml_session() as nv:
            session = Session(nv)
            if topo:
                return topo_matrix(session), 0
            if args.version:
                return version(session), 0
            if args.gpu_reset and args.id is None:
                return "Option -r/--gpu-reset requires -i/--id to name the GPU(s).\n", EXIT_BAD_ARGUMENT
            rows = session.select(args.id)
            if not rows:
                return "No devices were found\n", EXIT_NOT_FOUND
            if args.gpu_reset:
                return gpu_reset(rows)
            # Like nvidia-smi, report the healthy GPUs and fail with NVML's GPU_IS_LOST code.
            code = EXIT_GPU_LOST if any(row.gpu.lost for row in rows) else 0
            if names:
                return query_gpu(session, rows, names, fmt), code
            if args.list_gpus:
                return list_gpus(rows), code
            return summary(session, rows), code
    except NvmlError as err:
        message, code = failure(err)
        return message + "\n", code


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `gpufleet-sim-smi` (installed as ROOT/bin/nvidia-smi on simulated hosts)."""
    text, code = run(sys.argv[1:] if argv is None else argv)
    sys.stdout.write(text)
    return code


if __name__ == "__main__":
    sys.exit(main())
