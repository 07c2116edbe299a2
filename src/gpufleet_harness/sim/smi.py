"""`gpufleet-sim-smi`: an nvidia-smi stand-in for simulated hosts, built on pynvml via gpufleet.gpu.

It answers the invocations gpufleet's roles, validation suites and operators use, in the layouts nvidia-smi
580.159.04 printed on a real H200 (tests/realgpu/h200-580.159.04/smi*.txt): the default summary, `-L`,
`--query-gpu=... --format=csv[,noheader][,nounits]`, `topo -m` (with the escapes that underline its header),
`-q` and `-q -x` (smi_query), `mig -lgip` / `-lgipp` / `-lgi`, `--version`, and `--gpu-reset -i N` (`-r`).
Failures exit with nvidia-smi's codes, which are NVML's return codes (nvidia-smi(1), RETURN VALUE): 9 when
the driver is not loaded, 12 when libnvidia-ml cannot be loaded, 255 otherwise. The outputs people read (the
summary, `-q`, `--version`) say on stderr that the GPUs are simulated; stdout keeps the real layout.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
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
from gpufleet.gpu.topology import build
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import smi_query
from gpufleet_harness.sim.smi_query import Reader

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
SIM_DEFAULT_ROOT = "/etc/gpufleet-sim"  # the simulated library's root without GPUFLEET_SIM_ROOT (sim.h)
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
    reader: Reader | None = None  # the GPU's other NVML getters (None: the GPU is lost)


@dataclass
class MigRow:
    """One MIG device of a GPU, as `-L` and the summary's MIG table show it."""

    profile: str  # "1g.10gb", or "1c.3g.40gb" for a compute instance smaller than its GPU instance
    uuid: str  # MIG-...
    gi: int | None = None  # GPU-instance id
    ci: int | None = None  # compute-instance id
    memory_used: int | None = None  # bytes
    memory_total: int | None = None
    attributes: Any = None  # nvmlDeviceGetAttributes: engines, slices, SMs


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
        row.reader = Reader(self.nv.nv, handle)
        pci = self.nv.call(f"GPU {gpu.index}", self.nv.nv.nvmlDeviceGetPciInfo, handle)
        # nvidia-smi 580 counts the driver's reservation apart (nvmlMemory_v2_t): "Used" is what clients use.
        memory = smi_query._memory_v2(row.reader) or self.nv.call(
            f"GPU {gpu.index}", self.nv.nv.nvmlDeviceGetMemoryInfo, handle)
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
            found.append(MigRow(profile, uuid, int(gi), int(ci), int(memory.used), int(memory.total),
                                Reader(nv, mig).get("nvmlDeviceGetAttributes")))
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
    "vbios_version": Field(lambda r, s: _read(r, "nvmlDeviceGetVbiosVersion")),
    "pstate": Field(lambda r, s: _pstate(_read(r, "nvmlDeviceGetPerformanceState"))),
    "clocks.max.sm": Field(lambda r, s: _read(r, "nvmlDeviceGetMaxClockInfo", 1), "MHz"),
    "clocks.max.graphics": Field(lambda r, s: _read(r, "nvmlDeviceGetMaxClockInfo", 0), "MHz"),
    "clocks.max.memory": Field(lambda r, s: _read(r, "nvmlDeviceGetMaxClockInfo", 2), "MHz"),
    "power.limit": Field(lambda r, s: _watts(_read(r, "nvmlDeviceGetPowerManagementLimit")), "W"),
    "power.draw": Field(lambda r, s: _watts(_read(r, "nvmlDeviceGetPowerUsage")), "W"),
    "temperature.gpu": Field(lambda r, s: _read(r, "nvmlDeviceGetTemperature", 0)),
    "utilization.gpu": Field(lambda r, s: _util(r), "%"),
    "ecc.mode.current": Field(lambda r, s: _enabled(_first(_read(r, "nvmlDeviceGetEccMode")))),
    "fabric.state": Field(lambda r, s: _fabric(r)[0]),
    "fabric.status": Field(lambda r, s: _fabric(r)[1]),
}
# nvidia-smi accepts these alternative names for the same properties.
ALIASES = {
    "gpu_name": "name",
    "gpu_uuid": "uuid",
    "gpu_serial": "serial",
    "gpu_bus_id": "pci.bus_id",
    "persistence-mode": "persistence_mode",
}


def _read(row: Row, name: str, *args: Any) -> Any:
    return None if row.reader is None else row.reader.get(name, *args)


def _first(value: Any) -> Any:
    return None if value is None else value[0]


def _pstate(value: int | None) -> str | None:
    return None if value is None else f"P{value}"


def _watts(milliwatts: int | None) -> str | None:
    return None if milliwatts is None else f"{milliwatts / 1000:.2f}"


def _util(row: Row) -> int | None:
    util = _read(row, "nvmlDeviceGetUtilizationRates")
    return None if util is None else int(util.gpu)


# A GPU whose fabric query works but that is in no NVSwitch fabric says "N/A" (not "[N/A]"): recorded.
_FABRIC_STATES = {0: "N/A", 1: "Not Started", 2: "In Progress", 3: "Completed"}


def _fabric(row: Row) -> tuple[str | None, str | None]:
    """(fabric.state, fabric.status): None ([N/A]) where the query is not supported."""
    if row.reader is None:
        return None, None
    info = row.reader.struct("c_nvmlGpuFabricInfo_v3_t", "nvmlDeviceGetGpuFabricInfoV",
                             "nvmlGpuFabricInfo_v3")
    if info is None:
        return None, None
    if info.state == 0:
        return "N/A", "N/A"
    return _FABRIC_STATES.get(info.state, "N/A"), "Success" if info.status == 0 else "Not Ready"


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


WIDE_RULE = "+" + "-" * 89 + "+"
GPU_RULE = "+" + "-" * 41 + "+" + "-" * 24 + "+" + "-" * 22 + "+"
GPU_HEADER = [
    "| GPU  Name                 Persistence-M | Bus-Id          Disp.A | Volatile Uncorr. ECC |",
    "| Fan  Temp   Perf          Pwr:Usage/Cap |           Memory-Usage | GPU-Util  Compute M. |",
    "|                                         |                        |               MIG M. |",
    "|" + "=" * 41 + "+" + "=" * 24 + "+" + "=" * 22 + "|",
]
PROCESS_HEADER = [
    WIDE_RULE,
    f"| {'Processes:':<88}|",
    "|  GPU   GI   CI              PID   Type   Process name                        GPU Memory |",
    "|        ID   ID                                                               Usage      |",
    "|" + "=" * 89 + "|",
]
NO_PROCESSES = f"|  {'No running processes found':<87}|"
PROCESS_NAME_WIDTH = 37


def process_table(rows: list[Row]) -> list[str]:
    """The summary's processes: one line per compute process of the GPUs shown (nvidia-smi 580's columns:
    GPU, GI and CI ids, PID, type, name, memory), or "No running processes found"."""
    found = [(row.gpu.index, p) for row in rows if row.reader is not None
             for p in smi_query.processes(row.reader)]
    lines = [*PROCESS_HEADER]
    for index, p in found:
        name = p.name or "N/A"
        if len(name) > PROCESS_NAME_WIDTH:  # nvidia-smi keeps a long name's end: "...bin/python"
            name = "..." + name[-(PROCESS_NAME_WIDTH - 3):]
        memory = "N/A" if p.used_bytes is None else f"{p.used_bytes // _MIB:>5}MiB"
        lines.append(f"|{index:>5}{_id(p.gi):>6}{_id(p.ci):>5}{p.pid:>16}{'C':>7}   "
                     f"{name:<{PROCESS_NAME_WIDTH}} {memory:<9}|")
    if not found:
        lines.append(NO_PROCESSES)
    lines.append(WIDE_RULE)
    return lines


def timestamp() -> str:
    return time.strftime("%a %b %d %H:%M:%S %Y")


def summary(session: Session, rows: list[Row]) -> str:
    """The default output, in nvidia-smi 580's layout: versions, three lines per GPU, the MIG devices, the
    processes (the sim root's workloads)."""
    lines = [
        f"{timestamp():<31}",
        WIDE_RULE,
        f"| NVIDIA-SMI {session.driver_version:<23}Driver Version: {session.driver_version:<15}"
        f"CUDA Version: {session.cuda_version:<9}|",
        GPU_RULE,
        *GPU_HEADER,
    ]
    for row in rows:
        lines.extend(_gpu_lines(session, row))
        lines.append(GPU_RULE)
    lines.append("")
    migs = mig_table(rows)
    if migs:
        lines.extend([*migs, ""])
    lines.extend(process_table(rows))
    return "\n".join(lines) + "\n"


def _gpu_lines(session: Session, row: Row) -> list[str]:
    gpu, r = row.gpu, row.reader
    if gpu.lost or r is None:
        gone = "GPU is lost"
        return [f"|{gpu.index:>4}  {gone:<35}|{'':24}|{'ERR!':>21} |",
                f"|{'':41}|{'':24}|{'':22}|", f"|{'':41}|{'':24}|{'':22}|"]
    persist = {True: "On", False: "Off", None: "N/A"}[gpu.persistence_mode]
    display = r.get("nvmlDeviceGetDisplayActive")
    ecc = r.get("nvmlDeviceGetEccMode")
    errors = r.get("nvmlDeviceGetTotalEccErrors", 1, 0) if ecc and ecc[0] else None
    ecc_cell = "N/A" if ecc is None else (str(errors or 0) if ecc[0] else "Off")
    fan = r.get("nvmlDeviceGetFanSpeed")
    temp = r.get("nvmlDeviceGetTemperature", 0)
    perf = r.get("nvmlDeviceGetPerformanceState")
    power, cap = r.get("nvmlDeviceGetPowerUsage"), r.get("nvmlDeviceGetEnforcedPowerLimit")
    util = r.get("nvmlDeviceGetUtilizationRates")
    compute = smi_query.COMPUTE_MODES.get(r.get("nvmlDeviceGetComputeMode"), "N/A")
    mig = "N/A" if gpu.mig is None else ("Enabled" if gpu.mig.current else "Disabled")
    name = gpu.model if len(gpu.model) <= 31 else gpu.model[:28] + "..."
    used = f"{round((row.memory_used or 0) / _MIB)}MiB"
    total = f"{(gpu.memory_total or 0) // _MIB}MiB"
    return [
        f"|{gpu.index:>4}  {name:<31}{persist:<3} |{nvml_bus_id(gpu.pci_bus_id):>19} "
        f"{'Off' if not display else 'On':<3} |{ecc_cell:>21} |",
        f"| {'N/A' if fan is None else f'{fan}%':>3}  {'N/A' if temp is None else f'{temp}C':>4}    "
        f"{'P?' if perf is None else f'P{perf}':<2}{'N/A' if power is None else f'{power // 1000}W':>16} / "
        f"{'N/A' if cap is None else f'{cap // 1000}W':>5} |{used:>11} / {total:>9} |"
        f"{'N/A' if util is None else f'{util.gpu}%':>8}{compute:>13} |",
        f"|{'':41}|{'':24}|{mig:>21} |",
    ]


MIG_RULE = "+" + "-" * 18 + "+" + "-" * 34 + "+" + "-" * 11 + "+" + "-" * 23 + "+"


def mig_table(rows: list[Row]) -> list[str]:
    """The summary's "MIG devices:" table (none without MIG devices), two lines per MIG device: GPU, GPU- and
    compute-instance ids, MIG device index, memory, SMs and shared engines; then BAR1. Its layout is
    nvidia-smi's (R535-R580), not recorded on a real GPU here: the H200 ran with MIG off."""
    migs = [(row.gpu.index, k, m) for row in rows for k, m in enumerate(row.mig_devices or [])]
    if not migs:
        return []
    lines = [WIDE_RULE, f"| {'MIG devices:':<88}|", MIG_RULE,
             "| GPU  GI  CI  MIG |                     Memory-Usage |        Vol|        Shared         |",
             "|      ID  ID  Dev |                       BAR1-Usage | SM     Unc| CE ENC  DEC  OFA  JPG |",
             "|                  |                                  |        ECC|                       |",
             "|" + "=" * 18 + "+" + "=" * 34 + "+" + "=" * 11 + "+" + "=" * 23 + "|"]
    for index, k, mig in migs:
        a = mig.attributes
        memory = f"{_mib(mig.memory_used)}MiB"
        total = f"{_mib(mig.memory_total)}MiB"
        sm = "N/A" if a is None else str(a.multiprocessorCount)
        engines = ("" if a is None else f"{a.sharedCopyEngineCount:>3}{a.sharedEncoderCount:>4}"
                   f"{a.sharedDecoderCount:>5}{a.sharedOfaCount:>5}{a.sharedJpegCount:>5}")
        lines.append(f"|{index:>3}{_id(mig.gi):>5}{_id(mig.ci):>4}{k:>4}  |{memory:>20} / {total:<11}|"
                     f" {sm:<2}{'0':>7} |{engines:<22} |")
        lines.append(f"|{'':18}|{'0MiB / 0MiB':>32}  |{'':11}|{'':23}|")
        lines.append(MIG_RULE)
    return lines


def _id(value: int | None) -> str:
    return "N/A" if value is None else str(value)


def version(session: Session) -> str:
    """`--version`: NVML's version without the CUDA major before it and the patch level after."""
    parts = session.nvml_version.split(".")
    nvml = ".".join(parts[1:3]) if len(parts) >= 3 else session.nvml_version
    return (
        f"NVIDIA-SMI version  : {session.driver_version}\n"
        f"NVML version        : {nvml}\n"
        f"DRIVER version      : {session.driver_version}\n"
        f"CUDA Version        : {session.cuda_version}\n"
    )


# `topo -m`'s legend, as nvidia-smi 580 prints it (after an empty line, "Legend:" and an empty line).
TOPO_LEGEND = [
    "  X    = Self",
    "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)",
    "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA "
    "node",
    "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
    "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
    "  PIX  = Connection traversing at most a single PCIe bridge",
    "  NV#  = Connection traversing a bonded set of # NVLinks",
]
CPU_SET_WORDS = 128  # affinity masks of up to 8192 CPUs (the simulator's limit)
UNDERLINE, RESET = "\x1b[4m", "\x1b[0m"  # real nvidia-smi underlines the header even when not on a tty


def _cpulist(mask: Sequence[int], bits: int) -> str:
    """'0-15' (or '0-3,8-11') from an affinity bitmask of `bits`-bit words."""
    cpus = [w * bits + b for w, word in enumerate(mask) for b in range(bits) if word >> b & 1]
    ranges: list[list[int]] = []
    for cpu in cpus:
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges) or "N/A"


def topo_matrix(session: Session) -> str:
    """`topo -m`: the connection matrix, then CPU affinity, NUMA affinity and GPU NUMA ID from NVML (a VM's
    GPU without a sysfs NUMA node still shows NVML's node), then the legend."""
    topology = build(session.gpus, session.nv.topology_level)
    labels = [f"GPU{index}" for index in topology.indices]
    lines = ["\t" + UNDERLINE + "\t".join([*labels, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]) + RESET]
    bits = 8 * ctypes.sizeof(ctypes.c_ulong)
    for label, row, cells in zip(labels, session.rows, topology.matrix, strict=True):
        r = row.reader
        cpu_mask = None if r is None else r.get("nvmlDeviceGetCpuAffinity", CPU_SET_WORDS)
        node_mask = None if r is None else r.get("nvmlDeviceGetMemoryAffinity", 1, 0)
        cpus = _cpulist(list(cpu_mask), bits) if cpu_mask is not None else (row.gpu.local_cpulist or "N/A")
        numa = _cpulist(list(node_mask), bits) if node_mask is not None else "N/A"
        gpu_numa = None if r is None else r.get("nvmlDeviceGetNumaNodeId")
        marked = [f" {cell} " if cell == "X" else cell for cell in cells]
        # an empty cell before GPU NUMA ID, as real nvidia-smi prints it
        gpu_numa_id = "N/A" if gpu_numa is None else str(gpu_numa)
        lines.append("\t".join([label, *marked, cpus, numa, "", gpu_numa_id]))
    return "\n".join([*lines, "", "Legend:", "", *TOPO_LEGEND]) + "\n"


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
    parser.add_argument("-q", "--query", action="store_true", help="every property of the GPUs")
    parser.add_argument("-x", "--xml-format", action="store_true", help="-q as XML")
    parser.add_argument("--version", action="store_true", help="print versions")
    parser.add_argument("-r", "--gpu-reset", action="store_true", help="reset the GPUs given with -i")
    return parser


def _topo_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvidia-smi topo", description=BANNER)
    parser.add_argument("-m", "--matrix", action="store_true", help="print the GPU connection matrix")
    return parser


# `dmon`'s metric groups (-s), each a list of (column, unit, value from a GPU's Reader or None → "-"), as
# nvidia-smi 580 printed them on the H200 (tests/realgpu/h200-580.159.04/dmon.txt, `-s pucvmet`; with a
# process running: h200-580.159.04-host3-process/dmon-busy.txt).
def _dmon_power(r: Reader) -> list[Any]:
    power = r.get("nvmlDeviceGetPowerUsage")
    return [None if power is None else power // 1000, r.get("nvmlDeviceGetTemperature", 0),
            r.field(smi_query.FI_MEMORY_TEMP)]


def _dmon_util(r: Reader) -> list[Any]:
    util = r.get("nvmlDeviceGetUtilizationRates")
    return [None if util is None else util.gpu, None if util is None else util.memory,
            *(_first(r.get(f"nvmlDevice{engine}Utilization")) for engine in ("GetEncoder", "GetDecoder",
                                                                               "GetJpg", "GetOfa"))]


def _dmon_violations(r: Reader) -> list[Any]:
    reasons = r.get("nvmlDeviceGetCurrentClocksEventReasons")
    if reasons is None:
        return [None, None]
    # the share of the sample the power cap (resp. a thermal slowdown) held the clocks: all or nothing here
    return [100 if reasons & smi_query.SW_POWER_CAP else 0,
            1 if reasons & (smi_query.SW_THERMAL | smi_query.HW_THERMAL) else 0]


def _dmon_memory(r: Reader) -> list[Any]:
    memory, bar1 = smi_query._memory_v2(r), r.get("nvmlDeviceGetBAR1MemoryInfo")
    cc = r.get("nvmlDeviceGetConfComputeMemSizeInfo")
    return [None if memory is None else round(memory.used / _MIB),
            None if bar1 is None else bar1.bar1Used // _MIB,
            None if cc is None else cc.protectedMemSizeKib // 1024]


def _dmon_errors(r: Reader) -> list[Any]:
    # volatile single-bit (corrected) and double-bit (uncorrected) ECC errors, PCIe replays
    return [r.get("nvmlDeviceGetTotalEccErrors", 0, 0), r.get("nvmlDeviceGetTotalEccErrors", 1, 0),
            r.get("nvmlDeviceGetPcieReplayCounter")]


def _dmon_pcie(r: Reader) -> list[Any]:
    rx, tx = r.get("nvmlDeviceGetPcieThroughput", 1), r.get("nvmlDeviceGetPcieThroughput", 0)
    return [None if rx is None else rx // 1000, None if tx is None else tx // 1000]


DMON_GROUPS: dict[str, tuple[list[tuple[str, str]], Callable[[Reader], list[Any]]]] = {
    "p": ([("pwr", "W"), ("gtemp", "C"), ("mtemp", "C")], _dmon_power),
    "u": ([("sm", "%"), ("mem", "%"), ("enc", "%"), ("dec", "%"), ("jpg", "%"), ("ofa", "%")], _dmon_util),
    "c": ([("mclk", "MHz"), ("pclk", "MHz")],
          lambda r: [r.get("nvmlDeviceGetClockInfo", 2), r.get("nvmlDeviceGetClockInfo", 0)]),
    "v": ([("pviol", "%"), ("tviol", "bool")], _dmon_violations),
    "m": ([("fb", "MB"), ("bar1", "MB"), ("ccpm", "MB")], _dmon_memory),
    "e": ([("sbecc", "errs"), ("dbecc", "errs"), ("pci", "errs")], _dmon_errors),
    "t": ([("rxpci", "MB/s"), ("txpci", "MB/s")], _dmon_pcie),
}
DMON_ORDER = "pucvmet"


def dmon_header(metrics: str) -> list[str]:
    """dmon's two header lines for the metric groups in `metrics` (printed in nvidia-smi's order)."""
    columns = [c for g in DMON_ORDER if g in metrics for c in DMON_GROUPS[g][0]]
    return ["# gpu" + "".join(f" {name:>6}" for name, _ in columns) + " ",
            "# Idx" + "".join(f" {unit:>6}" for _, unit in columns) + " "]


def dmon_line(row: Row, metrics: str) -> str:
    """One sample of one GPU: each value right-aligned in 6 columns, "-" where NVML has none."""
    if row.reader is None:
        values: list[Any] = [None] * sum(len(DMON_GROUPS[g][0]) for g in DMON_ORDER if g in metrics)
    else:
        values = [v for g in DMON_ORDER if g in metrics for v in DMON_GROUPS[g][1](row.reader)]
    return f"{row.gpu.index:>5}" + "".join(f" {'-' if v is None else v:>6}" for v in values) + " "


def _dmon_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvidia-smi dmon", description=BANNER)
    parser.add_argument("-i", "--id", help="GPU indices, UUIDs or PCI bus ids, comma-separated")
    parser.add_argument("-s", "--select", default="puc",
                        help=f"metric groups, any of {DMON_ORDER} (default puc)")
    parser.add_argument("-c", "--count", type=int, help="samples to print (default: until interrupted)")
    parser.add_argument("-d", "--delay", type=float, default=1.0, help="seconds between samples (default 1)")
    return parser


def dmon(session: Session, rows: list[Row], metrics: str, count: int | None, delay: float) -> None:
    """`dmon`: the header, then a line per GPU every `delay` seconds, `count` times (or until interrupted),
    written as they are taken."""
    for line in dmon_header(metrics):
        print(line, flush=True)
    taken = 0
    while count is None or taken < count:
        if taken:
            time.sleep(delay)
        for row in rows:
            print(dmon_line(row, metrics), flush=True)
        taken += 1


def _mig_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nvidia-smi mig", description=BANNER)
    parser.add_argument("-i", "--id", help="GPU indices, UUIDs or PCI bus ids, comma-separated")
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("-lgip", "--list-gpu-instance-profiles", action="store_true",
                      help="GPU instance profiles")
    what.add_argument("-lgipp", "--list-gpu-instance-possible-placements", action="store_true",
                      help="their possible placements")
    what.add_argument("-lgi", "--list-gpu-instances", action="store_true", help="GPU instances")
    return parser


@dataclass
class Output:
    """What one invocation prints: stdout, the exit code, and whether it is for people (the banner saying
    the GPUs are simulated then goes to stderr)."""

    text: str
    code: int = 0
    for_people: bool = False


def part_numbers() -> dict[str, str]:
    """GPU part numbers by UUID, from the sim root's machine.json (the root the library reads: the
    environment's, else its default). No NVML getter answers the part number, which the real nvidia-smi
    prints (2335-895-A1 on the recorded H200); {} where the machine cannot be read: N/A, as before."""
    root = os.environ.get("GPUFLEET_SIM_ROOT") or SIM_DEFAULT_ROOT
    try:
        gpus = simmachine.load_machine(root)["gpus"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {g["uuid"]: g["gpu_part_number"] for g in gpus if isinstance(g, dict) and g.get("gpu_part_number")}


def _query(session: Session, rows: list[Row], xml: bool) -> str:
    parts = part_numbers()
    gpus = [smi_query.QueryGpu(nvml_bus_id(row.gpu.pci_bus_id), row.reader, parts.get(row.gpu.uuid or ""))
            for row in rows]  # fmt: skip
    major = int(session.nvml_version.split(".")[0]) if session.nvml_version[:1].isdigit() else 0
    render = smi_query.query_xml if xml else smi_query.query_text
    return render(timestamp(), session.driver_version, session.cuda_version, major, gpus)


def _mig(session: Session, args: argparse.Namespace) -> Output:
    rows = session.select(args.id)
    if not rows:
        return Output("No devices were found\n", EXIT_NOT_FOUND)
    gpus = [smi_query.MigGpu(row.gpu.index, row.reader) for row in rows
            if row.reader is not None and row.gpu.mig is not None]
    if not gpus:
        return Output("No MIG-supported devices found.\n", EXIT_NOT_FOUND)
    if args.list_gpu_instance_profiles:
        return Output(smi_query.list_gpu_instance_profiles(gpus))
    if args.list_gpu_instance_possible_placements:
        return Output(smi_query.list_gpu_instance_placements(gpus))
    return Output(smi_query.list_gpu_instances(gpus))


def run(argv: Sequence[str]) -> Output:
    """What one invocation prints; main() writes it."""
    command = argv[0] if argv and argv[0] in ("topo", "mig", "dmon") else None
    parser = {"topo": _topo_parser, "mig": _mig_parser, "dmon": _dmon_parser}.get(command or "", _parser)()
    args = parser.parse_args(list(argv[1:] if command else argv))
    if command == "topo" and not args.matrix:
        return Output(parser.format_usage(), EXIT_BAD_ARGUMENT)
    if command == "dmon":
        unknown = sorted(set(args.select) - set(DMON_ORDER))
        if unknown or (args.count is not None and args.count < 1) or args.delay < 0:
            return Output(f"dmon: -s takes letters of {DMON_ORDER}, -c a count of 1 or more and -d seconds; "
                          f"got -s {args.select} -c {args.count} -d {args.delay}\n", EXIT_BAD_ARGUMENT)
    names: list[str] = []
    fmt: set[str] = set()
    if not command and args.query_gpu is not None:
        names = [name.strip() for name in args.query_gpu.split(",") if name.strip()]
        for name in names:
            if ALIASES.get(name, name) not in FIELDS:
                return Output(f'Field "{name}" is not a valid field to query.\n', EXIT_BAD_ARGUMENT)
        options = [part.strip() for part in (args.format or "").split(",")]
        if options[0] != "csv":
            return Output('"--format=csv" is required with --query-gpu.\n', EXIT_BAD_ARGUMENT)
        fmt = set(options[1:])
    try:
        with nvml_session() as nv:
            session = Session(nv)
            if command == "topo":
                return Output(topo_matrix(session))
            if command == "mig":
                return _mig(session, args)
            if command == "dmon":
                rows = session.select(args.id)
                if not rows:
                    return Output("No devices were found\n", EXIT_NOT_FOUND)
                with contextlib.suppress(KeyboardInterrupt):  # how dmon without -c ends
                    dmon(session, rows, args.select, args.count, args.delay)
                return Output("")
            if args.version:
                return Output(version(session), for_people=True)
            if args.gpu_reset and args.id is None:
                return Output("Option -r/--gpu-reset requires -i/--id to name the GPU(s).\n",
                              EXIT_BAD_ARGUMENT)
            rows = session.select(args.id)
            if not rows:
                return Output("No devices were found\n", EXIT_NOT_FOUND)
            if args.gpu_reset:
                return Output(*gpu_reset(rows))
            # Like nvidia-smi, report the healthy GPUs and fail with NVML's GPU_IS_LOST code.
            code = EXIT_GPU_LOST if any(row.gpu.lost for row in rows) else 0
            if names:
                return Output(query_gpu(session, rows, names, fmt), code)
            if args.list_gpus:
                return Output(list_gpus(rows), code)
            if args.query or args.xml_format:
                return Output(_query(session, rows, args.xml_format), code, for_people=not args.xml_format)
            return Output(summary(session, rows), code, for_people=True)
    except NvmlError as err:
        message, code = failure(err)
        return Output(message + "\n", code)


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point of `gpufleet-sim-smi` (installed as ROOT/bin/nvidia-smi on simulated hosts)."""
    out = run(sys.argv[1:] if argv is None else argv)
    if out.for_people:
        sys.stderr.write(BANNER + "\n")
    sys.stdout.write(out.text)
    return out.code


if __name__ == "__main__":
    sys.exit(main())
