"""Fixtures → sim roots: expand a compact YAML machine description into what the simulator reads.

A *sim root* holds `machine.json` (fully expanded, read by the C library), `control` and `events`
(failure injection), `lib/` (the built `libnvidia-ml.so.1`), `bin/nvidia-smi` and `host/`, a view of
the host filesystem (`/sys`, `/proc`, `/dev`, the kernel log as `/dev/kmsg`) that discovery reads instead
of `/`.
See docs/simulator.md for the contract.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import reprlib
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any

from gpufleet.files import atomic_write
from gpufleet.yamlfile import YamlFileError, read_yaml
from gpufleet_harness.sim import workload

FIXTURE_DIR = Path(__file__).resolve().parent / "fixtures"
SCHEMA = 1

# nvmlDeviceArchitecture_t / nvmlBrandType_t values from nvml.h.
ARCHITECTURES = {"kepler": 2, "maxwell": 3, "pascal": 4, "volta": 5, "turing": 6, "ampere": 7, "ada": 8,
                 "hopper": 9}
BRANDS = {"quadro": 1, "tesla": 2, "nvs": 3, "geforce": 5, "titan": 6, "nvidia_rtx": 13, "nvidia": 14}

# nvmlGpuTopologyLevel_t.
TOPO_INTERNAL, TOPO_SINGLE, TOPO_MULTIPLE, TOPO_HOSTBRIDGE, TOPO_NODE, TOPO_SYSTEM = 0, 10, 20, 30, 40, 50

# nvmlEventType* bits: single/double-bit ECC, P-state, XID, clock; MIG config change on MIG GPUs.
EVENT_SBE, EVENT_DBE, EVENT_PSTATE, EVENT_XID, EVENT_CLOCK, EVENT_MIG = 0x1, 0x2, 0x4, 0x8, 0x10, 0x100

NVLINK_DEVICE_TYPE_SWITCH = 2
NVIDIA_VENDOR = 0x10DE
MIB = 1 << 20

# Every fixture names the GPU model by these fields (what NVML reports as the device's identity); a fixture
# without one is refused with the field named.
IDENTITY_FIELDS = ("name", "pci_device_id", "pci_subsystem", "architecture", "cuda_cc", "board_part_number",
                   "vbios_version")
# A GPU group's `identity:` (one GPU's recorded identity) needs these; the rest it may give are optional.
GPU_IDENTITY_REQUIRED = ("uuid", "serial")
GPU_IDENTITY_OPTIONAL = ("pdi", "module_id", "board_id", "irq")
_UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_SERIAL = re.compile(r"[0-9]{1,30}")

# PCIe link speed per generation in Mbps per lane (nvmlDeviceGetPcieSpeed; NVML_PCIE_LINK_MAX_SPEED_* is the
# generation's position in this list, 1-based).
PCIE_SPEED_MBPS = {1: 2500, 2: 5000, 3: 8000, 4: 16000, 5: 32000, 6: 64000}
# nvmlClocksEventReasonGpuIdle: an idle GPU's only clock-event reason.
CLOCK_EVENT_IDLE = 0x1

DEFAULT_DRIVER = "535.261.03"
# Recorded GPUs' nvmlDeviceGetFieldValues tables (native/fields.c; gpu.field_values): the H200 with driver
# 580.159.04 (tests/realgpu/h200-580.159.04-host4-fields/).
FIELD_TABLES = ("h200-580.159.04",)
DEFAULT_CUDA = 12020  # CUDA 12.2, what a 535 driver reports
DEFAULT_KERNEL = "6.1.0-31-amd64"  # Debian 12's kernel, which the 535 packages are built for

# Char-device majors. 195 is the NVIDIA driver's fixed major; nvidia-uvm and nvidia-nvswitch get
# dynamic majors on real hosts, these are typical values.
NVIDIA_MAJOR, UVM_MAJOR, NVSWITCH_MAJOR = 195, 510, 509
NVIDIA_CAPS_MAJOR = 508  # nvidia-caps: dynamic too (/proc/devices names it)
# The dynamic ones a fixture may set (`host.device_majors`), as a recorded host had them.
DEVICE_MAJORS = {"nvidia-uvm": UVM_MAJOR, "nvidia-nvswitch": NVSWITCH_MAJOR, "nvidia-caps": NVIDIA_CAPS_MAJOR}
# The driver's MIG capability table has a fixed shape: `config 1`, `monitor 2`, then for GPU minors 0-31,
# GPU instances 0-14: `gpuG/giI/access` followed by `gpuG/giI/ciC/access` for compute instances 0-7, minors
# counting up from 3 (the MIG user guide's sample ends at `gpu31/gi14/ci7/access 4322`).
MIG_CAP_GPUS, MIG_CAP_GIS, MIG_CAP_CIS = 32, 15, 8


def mig_minors() -> list[tuple[str, int]]:
    """/proc/driver/nvidia-caps/mig-minors as (capability, minor) pairs, in the driver's order."""
    table = [("config", 1), ("monitor", 2)]
    minor = 3
    for gpu in range(MIG_CAP_GPUS):
        for gi in range(MIG_CAP_GIS):
            table.append((f"gpu{gpu}/gi{gi}/access", minor))
            minor += 1
            for ci in range(MIG_CAP_CIS):
                table.append((f"gpu{gpu}/gi{gi}/ci{ci}/access", minor))
                minor += 1
    return table

SECURE_BOOT_VAR = "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"
DRIVER_BUILD_DATE = "Wed Jul 16 03:47:41 UTC 2025"
DEFAULT_GCC = "gcc version 12.2.0 (Debian 12.2.0-14+deb12u1) "


# Limits on what a fixture may describe: beyond them it is garbage, and expanding it would cost without bound.
MAX_FIXTURE_BYTES = 64 * 1024  # the bundled fixtures are under 3 KiB
MAX_GPUS = 128  # three times the largest bundled fixture (40); the topology table grows with the square
MAX_NUMA_NODES = 64  # one sysfs node directory each
MAX_CPUS = 8192  # Linux's largest NR_CPUS default on x86_64
MAX_NVSWITCHES = 64  # one device node and PCI device each
MAX_LINKS_PER_SWITCH = 18  # a Hopper GPU has 18 NVLinks in all
MAX_KERNEL_LOG_LINES = 10_000  # /dev/kmsg's ring holds far fewer of the driver's messages
MAX_MACHINE_JSON_BYTES = 16 << 20  # machine.json of MAX_GPUS GPUs is a few hundred KiB
_DMI_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # a file name under sys/class/dmi/id, never a path


class FixtureError(ValueError):
    """A fixture name that does not exist, or a fixture file that does not describe a machine."""


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise FixtureError(f"{what} must be an integer from {lo} to {hi}, got {reprlib.repr(value)}")
    return value


def _number(value: Any, what: str, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not lo <= value <= hi:
        raise FixtureError(f"{what} must be a number from {lo:g} to {hi:g}, got {reprlib.repr(value)}")
    return float(value)


def _text(value: Any, what: str) -> str:
    # YAML reads 550.54 as a number: numbers are text here, collections are not (str() of an alias bomb
    # would never end).
    if isinstance(value, bool) or not isinstance(value, str | int | float):
        raise FixtureError(f"{what} must be text, got {reprlib.repr(value)}")
    return str(value)


def _mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise FixtureError(f"{what} must be a mapping, got {reprlib.repr(value)}")
    return value


def _list(value: Any, what: str, most: int) -> list[Any]:
    if not isinstance(value, list) or len(value) > most:
        raise FixtureError(f"{what} must be a list of at most {most} items, got {reprlib.repr(value)}")
    return value


# ---------------------------------------------------------------------------------------------- fixtures

def fixture_names() -> list[str]:
    """Names of the bundled fixtures, sorted."""
    return sorted(p.stem for p in FIXTURE_DIR.glob("*.yaml"))


def fixture_path(fixture: str | os.PathLike[str]) -> Path:
    """Resolve a bundled fixture name or a path to a YAML file."""
    p = Path(fixture)
    candidate = FIXTURE_DIR / f"{fixture}.yaml"
    try:
        if p.suffix in (".yaml", ".yml") and p.is_file():
            return p
        if candidate.is_file():
            return candidate
    except (OSError, ValueError):  # a name too long for the file system, a NUL byte
        pass
    raise FixtureError(f"unknown fixture {reprlib.repr(str(fixture))}; known: {', '.join(fixture_names())}")


def load_fixture(fixture: str | os.PathLike[str]) -> tuple[str, dict[str, Any]]:
    """Read a fixture; returns (name, parsed YAML)."""
    path = fixture_path(fixture)
    try:
        data = read_yaml(path, MAX_FIXTURE_BYTES)
    except YamlFileError as exc:
        raise FixtureError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or "gpu" not in data or "gpus" not in data:
        raise FixtureError(f"{path}: a fixture needs 'gpu' (the model) and 'gpus' (the layout)")
    return path.stem, data


def fixture_description(fixture: str) -> str:
    """The one-line `description:` of a fixture."""
    return str(load_fixture(fixture)[1].get("description", ""))


# ---------------------------------------------------------------------------------------------- expansion

def _digest(*parts: object) -> bytes:
    # Derived from fixture name + position only, so every materialization of a fixture agrees.
    return hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()


def _uuid_text(raw: bytes) -> str:
    h = raw[:16].hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def gpu_uuid(fixture: str, index: int) -> str:
    """Deterministic `GPU-…` UUID of GPU `index` of a fixture."""
    return "GPU-" + _uuid_text(_digest(fixture, "gpu", index))


def gpu_serial(fixture: str, index: int) -> str:
    """Deterministic 13-digit board serial of GPU `index` of a fixture."""
    return "1" + str(int.from_bytes(_digest(fixture, "serial", index)[:8], "big") % 10**12).zfill(12)


def bus_id(domain: int, bus: int, device: int = 0, function: int = 0) -> str:
    """NVML's bus id form: 8-digit domain, upper-case hex (`00000000:07:00.0`)."""
    return f"{domain:08X}:{bus:02X}:{device:02X}.{function:X}"


def sysfs_name(nvml_bus_id: str) -> str:
    """sysfs's form of a bus id: 4-digit domain, lower case (`0000:07:00.0`)."""
    dom, rest = nvml_bus_id.split(":", 1)
    return f"{int(dom, 16):04x}:{rest.lower()}"


def _layout(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flatten the fixture's GPU groups into one entry per GPU, in NVML index order."""
    out: list[dict[str, Any]] = []
    for n, g in enumerate(_list(groups, "gpus", MAX_GPUS)):
        g = _mapping(g, f"gpus[{n}]")
        if "buses" in g:
            buses = _list(g["buses"], f"gpus[{n}].buses", MAX_GPUS)
        else:
            first = _int(g["first_bus"], f"gpus[{n}].first_bus", 0, 255)
            step = _int(g.get("bus_step", 1), f"gpus[{n}].bus_step", 1, 255)
            buses = [first + k * step for k in range(_int(g["count"], f"gpus[{n}].count", 0, MAX_GPUS))]
        identity = _group_identity(g.get("identity"), n, len(buses))
        for b in buses:
            out.append({"bus": _int(b, f"gpus[{n}] bus", 0, 255),
                        "device": _int(g.get("device", 0), f"gpus[{n}].device", 0, 31),
                        "identity": identity,
                        "domain": _int(g.get("domain", 0), f"gpus[{n}].domain", 0, 0xFFFF),
                        "numa": _int(g.get("numa", 0), f"gpus[{n}].numa", -1, MAX_NUMA_NODES - 1),
                        "host_bridge": _switch(g.get("host_bridge"), f"gpus[{n}].host_bridge"),
                        "pcie_switch": _switch(g.get("pcie_switch"), f"gpus[{n}].pcie_switch")})
    if len(out) > MAX_GPUS:
        raise FixtureError(f"{len(out)} GPUs; a fixture describes at most {MAX_GPUS}")
    if len({(slot["domain"], slot["bus"], slot["device"]) for slot in out}) != len(out):
        raise FixtureError("two GPUs share a PCI bus")
    return out


def _group_identity(value: Any, n: int, count: int) -> dict[str, Any] | None:
    """A group's `identity:`: one recorded GPU's uuid and serial, optionally pdi, module_id, board_id, irq."""
    if value is None:
        return None
    what = f"gpus[{n}].identity"
    ident = _mapping(value, what)
    if count != 1:
        raise FixtureError(f"{what} describes one GPU; the group has {count}")
    unknown = sorted(set(ident) - set(GPU_IDENTITY_REQUIRED) - set(GPU_IDENTITY_OPTIONAL))
    if unknown:
        raise FixtureError(f"{what}: unknown field(s) {', '.join(map(str, unknown))}; known: "
                           f"{', '.join(GPU_IDENTITY_REQUIRED + GPU_IDENTITY_OPTIONAL)}")
    for key in GPU_IDENTITY_REQUIRED:
        if key not in ident:
            raise FixtureError(f"{what}.{key} is missing: a recorded GPU's identity needs "
                               f"{' and '.join(GPU_IDENTITY_REQUIRED)}")
    uuid, serial = _text(ident["uuid"], f"{what}.uuid"), _text(ident["serial"], f"{what}.serial")
    if not _UUID.fullmatch(uuid):
        raise FixtureError(f"{what}.uuid must look like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx (lower-case "
                           f"hex), got {reprlib.repr(uuid)}")
    if not _SERIAL.fullmatch(serial):
        raise FixtureError(f"{what}.serial must be digits, got {reprlib.repr(serial)}")
    out: dict[str, Any] = {"uuid": uuid, "serial": serial}
    limits = {"pdi": (0, 2**63 - 1), "module_id": (0, 255), "board_id": (0, 2**32 - 1), "irq": (0, 2**32 - 1)}
    for key, (lo, hi) in limits.items():
        if key in ident:
            out[key] = _int(ident[key], f"{what}.{key}", lo, hi)
    return out


def _switch(value: Any, what: str) -> int | str | None:
    """A host bridge or PCIe switch label: compared for equality only."""
    return None if value is None else _text(value, what)


def topology_level(a: dict[str, Any], b: dict[str, Any]) -> int:
    """nvmlGpuTopologyLevel_t between two GPUs of a layout (same GPU → INTERNAL)."""
    if a is b:
        return TOPO_INTERNAL
    if a["pcie_switch"] is not None and a["pcie_switch"] == b["pcie_switch"]:
        return TOPO_SINGLE
    if a["host_bridge"] is not None and a["host_bridge"] == b["host_bridge"]:
        return TOPO_HOSTBRIDGE
    if a["numa"] >= 0 and a["numa"] == b["numa"]:
        return TOPO_NODE
    return TOPO_SYSTEM


def _numa_cpus(cpus: int, nodes: int) -> list[list[int]]:
    # Contiguous blocks per node: enough for affinity masks; real SMT siblings interleave, nobody here cares.
    per = cpus // nodes
    return [[n * per, (n + 1) * per - 1] for n in range(nodes)]


def module_banner(host: dict[str, Any], kmod: str) -> str:
    """The kernel module's banner, "NVIDIA UNIX x86_64 Kernel Module  <version>  <date>" (the proprietary
    module), or the fixture's `host.kernel_module_banner` as a host recorded it (the open module says
    "NVIDIA UNIX Open Kernel Module for x86_64  <version>  Release Build  (<builder>)  ")."""
    banner = host.get("kernel_module_banner")
    if banner is None:
        return f"NVIDIA UNIX x86_64 Kernel Module  {kmod}  {DRIVER_BUILD_DATE}"
    text = _text(banner, "host.kernel_module_banner")
    if kmod not in text or "\n" in text:
        raise FixtureError(f"host.kernel_module_banner must be one line naming the module version {kmod}, "
                           f"got {reprlib.repr(text)}")
    return text


def proc_version(host: dict[str, Any], kmod: str) -> str:
    """/proc/driver/nvidia/version: the module's banner and the compiler that built it."""
    gcc = _text(host.get("kernel_module_gcc", DEFAULT_GCC), "host.kernel_module_gcc")
    return f"NVRM version: {module_banner(host, kmod)}\nGCC version:  {gcc}\n"


def kernel_log(host: dict[str, Any], kmod: str) -> list[str]:
    """The kernel messages of the simulated boot: the kernel's banner, the driver's when it loaded, and the
    fixture's `host.kernel_log` lines (verbatim; a message may hold newlines, as one printk can)."""
    release = str(host.get("kernel_release", DEFAULT_KERNEL))
    lines = [f"Linux version {release} (simulated by gpufleet)"]
    if bool(host.get("driver_loaded", True)):
        # nv.c's "NVRM: loading %s" with the module's banner, as /proc/driver/nvidia/version shows it.
        lines.append(f"NVRM: loading {module_banner(host, kmod)}")
    extra = _list(host.get("kernel_log") or [], "host.kernel_log", MAX_KERNEL_LOG_LINES)
    lines += [_text(line, "host.kernel_log line").rstrip("\n") for line in extra]
    return lines


def expand(fixture: str | os.PathLike[str]) -> dict[str, Any]:
    """Expand a fixture into the full machine.json document (schema 1); FixtureError naming the first
    problem when the fixture is not a machine (missing or mistyped fields, values beyond the limits)."""
    name, fx = load_fixture(fixture)
    try:
        return _expand(name, fx)
    except FixtureError as exc:
        raise FixtureError(f"{name}: {exc}") from None
    except KeyError as exc:
        raise FixtureError(f"{name}: missing or unknown {reprlib.repr(exc.args[0])}") from None
    except (TypeError, ValueError) as exc:  # a field of the wrong shape (a number where a pair belongs)
        raise FixtureError(f"{name}: not a machine description: {reprlib.repr(str(exc))}") from None


# MIG GPU-instance profiles per model, as `nvidia-smi mig -lgip` lists them in NVIDIA's MIG user guide:
# (NVML_GPU_INSTANCE_PROFILE_* index, profile id, name, compute slices, memory slices per placement
# (`placement.size`), instances, SMs, copy engines, decoders, encoders, JPEG, OFA, memory MiB (the
# guide's GiB figure times 1024), placement starts). Eight memory slices, seven compute slices on both.
_MigRow = tuple[int, int, str, int, int, int, int, int, int, int, int, int, int, tuple[int, ...]]
MIG_PROFILES: dict[str, list[_MigRow]] = {
    "a100-sxm4-80gb": [
        (0, 19, "1g.10gb", 1, 1, 7, 14, 1, 0, 0, 0, 0, 9728, (0, 1, 2, 3, 4, 5, 6)),
        (7, 20, "1g.10gb+me", 1, 1, 1, 14, 1, 1, 0, 1, 1, 9728, (0, 1, 2, 3, 4, 5, 6)),
        (9, 15, "1g.20gb", 1, 2, 4, 14, 1, 1, 0, 0, 0, 19968, (0, 2, 4, 6)),
        (1, 14, "2g.20gb", 2, 2, 3, 28, 2, 1, 0, 0, 0, 19968, (0, 2, 4)),
        (2, 9, "3g.40gb", 3, 4, 2, 42, 3, 2, 0, 0, 0, 40192, (0, 4)),
        (3, 5, "4g.40gb", 4, 4, 1, 56, 4, 2, 0, 0, 0, 40192, (0,)),
        (4, 0, "7g.80gb", 7, 8, 1, 98, 7, 5, 0, 1, 1, 80640, (0,)),
    ],
    "h100-80gb": [
        (0, 19, "1g.10gb", 1, 1, 7, 16, 1, 1, 0, 1, 0, 9984, (0, 1, 2, 3, 4, 5, 6)),
        (7, 20, "1g.10gb+me", 1, 1, 1, 16, 1, 1, 0, 1, 1, 9984, (0, 1, 2, 3, 4, 5, 6)),
        (9, 15, "1g.20gb", 1, 2, 4, 26, 1, 1, 0, 1, 0, 20096, (0, 2, 4, 6)),
        (1, 14, "2g.20gb", 2, 2, 3, 32, 2, 2, 0, 2, 0, 20096, (0, 2, 4)),
        (2, 9, "3g.40gb", 3, 4, 2, 60, 3, 3, 0, 3, 0, 40448, (0, 4)),
        (3, 5, "4g.40gb", 4, 4, 1, 64, 4, 4, 0, 4, 0, 40448, (0,)),
        (4, 0, "7g.80gb", 7, 8, 1, 132, 8, 7, 0, 7, 1, 81152, (0,)),
    ],
    # Recorded: `nvidia-smi mig -lgip` / `-lgipp` and NVML's profile infos of a real H200 with MIG off
    # (tests/realgpu/h200-580.159.04/smi-mig-lgip.txt, smi-mig-lgipp.txt, nvml-probe.json).
    "h200-141gb": [
        (0, 19, "1g.18gb", 1, 1, 7, 16, 1, 1, 0, 1, 0, 16384, (0, 1, 2, 3, 4, 5, 6)),
        (7, 20, "1g.18gb+me", 1, 1, 1, 16, 1, 1, 0, 1, 1, 16384, (0, 1, 2, 3, 4, 5, 6)),
        (9, 15, "1g.35gb", 1, 2, 4, 26, 1, 1, 0, 1, 0, 33280, (0, 2, 4, 6)),
        (1, 14, "2g.35gb", 2, 2, 3, 32, 2, 2, 0, 2, 0, 33280, (0, 2, 4)),
        (2, 9, "3g.71gb", 3, 4, 2, 60, 3, 3, 0, 3, 0, 71424, (0, 4)),
        (3, 5, "4g.71gb", 4, 4, 1, 64, 4, 4, 0, 4, 0, 71424, (0,)),
        (4, 0, "7g.141gb", 7, 8, 1, 132, 8, 7, 0, 7, 1, 143360, (0,)),
    ],
}
_MIG_KEYS = ("profile", "id", "name", "slices", "size", "instances", "sm", "ce", "dec", "enc", "jpeg", "ofa",
             "memory_mib", "placements")


def mig_profiles(table: str) -> list[dict[str, Any]]:
    """A MIG profile table as machine.json carries it."""
    if table not in MIG_PROFILES:
        raise FixtureError(f"gpu.mig_profiles must be one of {sorted(MIG_PROFILES)}, "
                           f"got {reprlib.repr(table)}")
    return [dict(zip(_MIG_KEYS, (*row[:-1], list(row[-1])), strict=True)) for row in MIG_PROFILES[table]]


def _model(fx: dict[str, Any], name: str) -> dict[str, Any]:
    """The fixture's `gpu` mapping; `like: OTHER` starts from bundled fixture OTHER's `gpu` (keys given here
    win). Every IDENTITY_FIELDS key must be there in the end, and the memory size (memory_mib or _bytes)."""
    model = dict(_mapping(fx["gpu"], "gpu"))
    like = model.pop("like", None)
    if like is not None:
        other = _text(like, "gpu.like")
        if other == name or not (FIXTURE_DIR / f"{other}.yaml").is_file():
            raise FixtureError(f"gpu.like must name another bundled fixture ({', '.join(fixture_names())}), "
                               f"got {reprlib.repr(other)}")
        base = _mapping(load_fixture(other)[1]["gpu"], f"{other}: gpu")
        if "like" in base:
            raise FixtureError(f"gpu.like: {other} itself uses `like`; name the fixture it copies")
        model = {**base, **model}
    for key in IDENTITY_FIELDS:
        if key not in model:
            raise FixtureError(f"gpu.{key} is missing: every fixture names the GPU's identity "
                               f"({', '.join(IDENTITY_FIELDS)} and memory_mib or memory_bytes)")
    if "memory_mib" not in model and "memory_bytes" not in model:
        raise FixtureError("gpu.memory_mib (or gpu.memory_bytes) is missing: the GPU's memory size is part "
                           "of its identity")
    return model


def _memory(model: dict[str, Any]) -> tuple[int, int]:
    """(total, reserved) bytes: `memory_bytes`/`reserved_bytes` as recorded, else `memory_mib`/`reserved_mib`
    in MiB."""
    if "memory_bytes" in model:
        total = _int(model["memory_bytes"], "gpu.memory_bytes", MIB, 1 << 44)
    else:
        total = _int(model["memory_mib"], "gpu.memory_mib", 1, 1 << 24) * MIB
    if "reserved_bytes" in model:
        reserved = _int(model["reserved_bytes"], "gpu.reserved_bytes", 0, total)
    else:
        reserved = _int(model.get("reserved_mib", 0), "gpu.reserved_mib", 0, total // MIB) * MIB
    return total, reserved


def _since(arch: int, first: str, value: Any) -> Any:
    """`value` on architectures from `first` on, else None (the getter answers NOT_SUPPORTED)."""
    return value if arch >= ARCHITECTURES[first] else None


def _expand(name: str, fx: dict[str, Any]) -> dict[str, Any]:
    host = dict(_mapping(fx.get("host") or {}, "host"))
    model = _model(fx, name)
    driver = _text(host.get("driver_version", DEFAULT_DRIVER), "host.driver_version")
    kmod = _text(host.get("kernel_module_version") or driver, "host.kernel_module_version")
    layout = _layout(fx["gpus"])
    nvsw = _mapping(fx.get("nvswitch") or {}, "nvswitch")
    sw_buses = [_int(b, "nvswitch bus", 0, 255)
                for b in _list(nvsw.get("buses", []), "nvswitch.buses", MAX_NVSWITCHES)]
    sw_ids = [bus_id(0, b) for b in sw_buses]
    links = _list(nvsw.get("links_per_switch", []), "nvswitch.links_per_switch", MAX_NVSWITCHES)
    links_per_switch = [_int(n, "nvswitch.links_per_switch", 0, MAX_LINKS_PER_SWITCH) for n in links]
    sw_device_id = _int(nvsw["pci_device_id"], "nvswitch.pci_device_id", 0, 0xFFFF) if sw_buses else 0
    if len(links_per_switch) != len(sw_buses):
        raise FixtureError("nvswitch.links_per_switch must have one entry per switch bus")
    fabric = fx.get("fabric")
    fabric = None if fabric is None else _mapping(fabric, "fabric")
    arch_name = _text(model["architecture"], "gpu.architecture").lower()
    if arch_name not in ARCHITECTURES:
        raise FixtureError(f"gpu.architecture must be one of {', '.join(ARCHITECTURES)}, "
                           f"got {reprlib.repr(arch_name)}")
    arch = ARCHITECTURES[arch_name]
    brand = BRANDS[_text(model.get("brand", "nvidia"), "gpu.brand").lower()]
    ecc = bool(model.get("ecc", True))
    mig = bool(model.get("mig_capable", False))
    profiles = mig_profiles(_text(model.get("mig_profiles"), "gpu.mig_profiles")) if mig else []
    # Ampere applies a MIG mode change at the next GPU reset; Hopper and later without one.
    mig_reset = arch < ARCHITECTURES["hopper"]
    events = EVENT_PSTATE | EVENT_XID | EVENT_CLOCK | (EVENT_SBE | EVENT_DBE if ecc else 0) | (
        EVENT_MIG if mig else 0)
    if "supported_events" in model:  # the recorded mask (nvmlDeviceGetSupportedEventTypes)
        events = _int(model["supported_events"], "gpu.supported_events", 0, 2**63 - 1)
    sub_vendor, sub_device = (_int(v, "gpu.pci_subsystem", 0, 0xFFFF) for v in model["pci_subsystem"])
    device_id = _int(model["pci_device_id"], "gpu.pci_device_id", 0, 0xFFFF)
    cuda_cc = [_int(v, "gpu.cuda_cc", 0, 99) for v in _list(model["cuda_cc"], "gpu.cuda_cc", 2)]
    clocks_mhz = _mapping(model.get("clocks_mhz") or {}, "gpu.clocks_mhz")
    clocks = {k: _int(v, f"gpu.clocks_mhz.{k}", 0, 100_000) for k, v in clocks_mhz.items()}
    max_clocks = {k: clocks.get(k, 1000) for k in ("graphics", "sm", "memory", "video")}
    idle_doc = _mapping(model.get("idle_clocks_mhz") or {}, "gpu.idle_clocks_mhz")
    idle = {"graphics": 210, "sm": 210, "memory": max_clocks["memory"],
            "video": min(555, max_clocks["video"])}
    for k, v in idle_doc.items():
        if k not in idle:
            raise FixtureError(f"gpu.idle_clocks_mhz: graphics, sm, memory or video, got {reprlib.repr(k)}")
        idle[k] = _int(v, f"gpu.idle_clocks_mhz.{k}", 0, max_clocks[k])  # never above the maximum
    # The clocks a GPU offers (nvmlDeviceGetSupported{Memory,Graphics}Clocks): its memory clocks, and for
    # each the graphics clocks from the maximum down to the idle clock in `graphics_clock_step_mhz` steps
    # (the recorded H200: 3201 and 2201 MHz memory, 1980 to 345 MHz graphics in 15 MHz steps).
    mem_doc = _list(model.get("supported_memory_clocks_mhz", [max_clocks["memory"]]),
                    "gpu.supported_memory_clocks_mhz", 8)
    step = _int(model.get("graphics_clock_step_mhz", 15), "gpu.graphics_clock_step_mhz", 1, 1000)
    supported_clocks = {
        "memory": [_int(v, "gpu.supported_memory_clocks_mhz", 1, max_clocks["memory"]) for v in mem_doc],
        "graphics": list(range(max_clocks["graphics"], idle["graphics"] - 1, -step))[:256],
    }
    power_limit_mw = _int(model.get("power_limit_w", 300), "gpu.power_limit_w", 1, 100_000) * 1000
    power_min_mw = _int(model.get("power_min_w", power_limit_mw // 2000), "gpu.power_min_w", 1,
                        power_limit_mw // 1000) * 1000
    idle_power_mw = model.get("idle_power_mw")
    if idle_power_mw is not None:
        idle_power_mw = _int(idle_power_mw, "gpu.idle_power_mw", 1, power_limit_mw)
    idle_temp = _int(model.get("idle_temperature_c", 30), "gpu.idle_temperature_c", 0, 120)
    # The memory's own sensor (HBM boards): nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP); absent or null
    # answers NOT_SUPPORTED, as GDDR boards do.
    idle_mem_temp = model.get("idle_memory_temperature_c")
    if idle_mem_temp is not None:
        idle_mem_temp = _int(idle_mem_temp, "gpu.idle_memory_temperature_c", 0, 120)

    # How nvmlDeviceGetFieldValues answers (native/fields.c): a recorded model's table, or (absent) the rules
    # written before any recording.
    field_values = model.get("field_values")
    if field_values is not None and field_values not in FIELD_TABLES:
        raise FixtureError(f"gpu.field_values must be one of {', '.join(FIELD_TABLES)} (a recorded GPU's "
                           f"field table), got {reprlib.repr(field_values)}")
    # The memory's own power reading (field POWER_AVERAGE at scope MEMORY): idle, and at 100 % memory
    # utilization; absent: NOT_SUPPORTED, as the simulator answered before.
    mem_power = model.get("memory_power_w")
    if mem_power is not None:
        mem_power_doc = _mapping(mem_power, "gpu.memory_power_w")
        mem_power = {k: round(_number(mem_power_doc.get(k), f"gpu.memory_power_w.{k}", 0, 1000) * 1000)
                     for k in ("idle", "busy")}
        if mem_power["busy"] < mem_power["idle"]:
            raise FixtureError(f"gpu.memory_power_w.busy ({mem_power['busy'] / 1000:g} W) is below its idle "
                               f"({mem_power['idle'] / 1000:g} W)")

    def idle_mw(i: int) -> int:
        base = idle_power_mw if idle_power_mw is not None else power_limit_mw * 15 // 100
        return int(min(base + 1000 * (i % 7), power_limit_mw))
    total, reserved = _memory(model)
    bar1_mib = model.get("bar1_mib", 256 if arch < ARCHITECTURES["ampere"] else 131072)
    bar1_total = _int(bar1_mib, "gpu.bar1_mib", 1, 1 << 24) * MIB
    bar1_used = _int(model.get("bar1_used_bytes", 2 * MIB), "gpu.bar1_used_bytes", 0, bar1_total)
    max_gen = _int(model.get("pcie_generation", 5 if arch >= ARCHITECTURES["hopper"] else
                             4 if arch >= ARCHITECTURES["ampere"] else 3), "gpu.pcie_generation", 1, 6)
    width = _int(model.get("pcie_width", 16), "gpu.pcie_width", 1, 32)
    gsp = bool(model.get("gsp_firmware", arch >= ARCHITECTURES["hopper"]))
    dmi_doc = _mapping(host.get("dmi") or {}, "host.dmi")
    dmi = {_text(k, "host.dmi key"): _text(v, f"host.dmi.{k}") for k, v in dmi_doc.items()}
    for key in dmi:
        if not _DMI_NAME.fullmatch(key):
            raise FixtureError(f"host.dmi keys are sysfs file names like sys_vendor, got {reprlib.repr(key)}")
    clique = None if fabric is None else _int(fabric["clique_id"], "fabric.clique_id", 0, 2**31 - 1)
    fabric_uuid = _uuid_text(_digest(name, "fabric"))
    if fabric is not None:
        gpu_fabric: dict[str, Any] | None = {"cluster_uuid": fabric_uuid, "clique_id": clique}
    else:
        # Hopper and later answer the fabric query on every board: without an NVSwitch fabric the state is
        # NVML_GPU_FABRIC_STATE_NOT_SUPPORTED (as the H200 recording shows); older GPUs lack the call.
        gpu_fabric = _since(arch, "hopper", {})

    gpus: list[dict[str, Any]] = []
    for i, slot in enumerate(layout):
        nvlinks = []
        for s, n in enumerate(links_per_switch):
            nvlinks += [{"remote_bus_id": sw_ids[s], "remote_device_type": NVLINK_DEVICE_TYPE_SWITCH}] * n
        ident = slot["identity"] or {}
        pdi_default = int.from_bytes(_digest(name, "pdi", i)[:8], "big") >> 1  # 63 bits: a JSON integer
        gpus.append({
            "index": i,
            "minor": i,
            "uuid": ident.get("uuid", gpu_uuid(name, i)),
            "serial": ident.get("serial", gpu_serial(name, i)),
            "name": _text(model["name"], "gpu.name"),
            "brand": brand,
            "architecture": arch,
            "cuda_cc": cuda_cc,
            "bus_id": bus_id(slot["domain"], slot["bus"], slot["device"]),
            "pci": {"domain": slot["domain"], "bus": slot["bus"], "device": slot["device"],
                    "device_id": (device_id << 16) | NVIDIA_VENDOR,
                    "subsystem_id": (sub_device << 16) | sub_vendor},
            "memory": {"total": total, "reserved": reserved, "used": 0},
            "bar1": {"total": bar1_total, "used": bar1_used},
            "numa_node": slot["numa"],
            # The GPU's *own* memory NUMA node (coherent platforms such as Grace Hopper). None on x86
            # PCIe/SXM boxes, where real NVML answers nvmlDeviceGetNumaNodeId with NOT_SUPPORTED.
            "gpu_numa_node": None,
            "persistence_mode": 1,
            "mig_mode": {"current": 0, "pending": 0} if mig else None,
            "mig": {"reset_required": mig_reset, "profiles": profiles} if mig else None,
            "ecc": ecc,
            "nvlinks": nvlinks,
            "fabric": gpu_fabric,
            "board_part_number": _text(model["board_part_number"], "gpu.board_part_number"),
            "gpu_part_number": _text(model.get("gpu_part_number", ""), "gpu.gpu_part_number"),
            "vbios_version": _text(model["vbios_version"], "gpu.vbios_version"),
            "inforom_image_version": _text(model.get("inforom_image_version", "G500.0200.00.03"),
                                           "gpu.inforom_image_version"),
            "inforom_ecc_version": _text(model.get("inforom_ecc_version", "6.16"), "gpu.inforom_ecc_version"),
            # Board id: the same for GPUs behind one PLX; real boards show bus << 8 | device (0x6 at 00:06.0).
            "board_id": ident.get("board_id", slot["bus"] << 8 | slot["device"]),
            "module_id": ident.get("module_id", i + 1),
            "irq": ident.get("irq", 80 + 8 * i),
            "pdi": ident.get("pdi", pdi_default),
            "memory_bus_width": _int(model["memory_bus_width"], "gpu.memory_bus_width", 1, 1 << 16)
            if "memory_bus_width" in model else None,
            "cuda_cores": _int(model["cuda_cores"], "gpu.cuda_cores", 1, 1 << 20) if "cuda_cores" in model
            else None,
            "fans": _int(model.get("fans", 0), "gpu.fans", 0, 16),
            "display_mode": 1 if model.get("display_mode", False) else 0,
            "gsp_firmware": gsp,
            "pcie": {"max_generation": max_gen, "generation": max_gen, "max_width": width, "width": width,
                     "speed_mbps": PCIE_SPEED_MBPS[max_gen], "tx_kbps": 700 + 50 * (i % 5),
                     "rx_kbps": 500 + 30 * (i % 5)},
            # Getters that older generations lack (per nvml.h's "For <arch> or newer"): null → NOT_SUPPORTED.
            "c2c_enabled": _since(arch, "hopper", 0),
            "conf_compute": _since(arch, "ampere", {"protected_kib": 0}),
            "platform_info": _since(arch, "hopper", {"host_id": 1}),
            "addressing_mode": _since(arch, "turing", 0),
            "repair_status": _since(arch, "ampere", [0, 0]),
            "remapped_rows": _since(arch, "ampere", [0, 0, 0, 0]),
            "energy": _since(arch, "volta", True),
            "clock_event_reasons": CLOCK_EVENT_IDLE,
            "power_limit_mw": power_limit_mw,
            "power_min_mw": power_min_mw,
            "power_usage_mw": idle_mw(i),
            # How workloads move its power, clocks and temperature (native/load.c, workload.py).
            "load": workload.derive_params(idle_mw(i), power_limit_mw),
            "temperature_c": idle_temp + i % 6,
            "memory_temperature_c": None if idle_mem_temp is None else idle_mem_temp + i % 6,
            "memory_power_mw": mem_power,
            "field_values": field_values,
            "performance_state": 0,
            "clocks": idle,
            "max_clocks": max_clocks,
            "supported_clocks": supported_clocks,
            "supported_events": events,
        })
    topology = [[topology_level(a, b) for b in layout] for a in layout]
    nodes = _int(host.get("numa_nodes", 1), "host.numa_nodes", 1, MAX_NUMA_NODES)
    cpus = _int(host.get("cpus", 32), "host.cpus", nodes, MAX_CPUS)  # at least one per NUMA node
    if any(slot["numa"] >= nodes for slot in layout):
        raise FixtureError(f"a GPU's numa is beyond host.numa_nodes ({nodes})")
    secure_boot, hypervisor = host.get("secure_boot"), host.get("hypervisor")
    if secure_boot is not None and not isinstance(secure_boot, bool):
        raise FixtureError(f"host.secure_boot must be true, false or absent, got {reprlib.repr(secure_boot)}")
    fabricmanager = host.get("fabricmanager", "running" if sw_buses else None)
    if fabricmanager not in (None, "running", "stopped"):  # a line of the control file: never free text
        raise FixtureError(f"host.fabricmanager: running or stopped, got {reprlib.repr(fabricmanager)}")
    cuda = _int(host.get("cuda_driver_version", DEFAULT_CUDA), "host.cuda_driver_version", 1000, 99_999)
    branch = host.get("driver_branch")
    majors = _mapping(host.get("device_majors") or {}, "host.device_majors")
    unknown = sorted(set(majors) - set(DEVICE_MAJORS))
    if unknown:
        raise FixtureError(f"host.device_majors: {', '.join(map(str, unknown))} unknown; known: "
                           f"{', '.join(DEVICE_MAJORS)}")
    return {
        "schema": SCHEMA,
        "name": name,
        "description": _text(fx.get("description", ""), "description"),
        "driver_version": driver,
        "kernel_module_version": kmod,
        # NVML's version is the CUDA major before the driver's (12.535.261.03, 13.580.159.04).
        "nvml_version": f"{cuda // 1000}.{driver}",
        "cuda_driver_version": cuda,
        "driver_branch": None if branch is None else _text(branch, "host.driver_branch"),
        "fabricmanager_required": bool(sw_buses),
        "host": {
            "kernel_release": _text(host.get("kernel_release", DEFAULT_KERNEL), "host.kernel_release"),
            "driver_loaded": bool(host.get("driver_loaded", True)),
            "nouveau_loaded": bool(host.get("nouveau_loaded", False)),
            "secure_boot": secure_boot,
            "hypervisor": None if hypervisor is None else _text(hypervisor, "host.hypervisor"),
            "dmi": dmi,
            "cpus": cpus,
            "numa_nodes": nodes,
            "fabricmanager": fabricmanager,
            "kernel_log": kernel_log(host, kmod),
            "proc_version": proc_version(host, kmod),
            "device_majors": {k: _int(majors.get(k, v), f"host.device_majors.{k}", 1, 4095)
                              for k, v in DEVICE_MAJORS.items()},
            "modeset": bool(host.get("modeset", True)),
        },
        "numa_cpus": _numa_cpus(cpus, nodes),
        "gpus": gpus,
        "topology": topology,
        "nvswitches": [{"bus_id": b, "device_id": (sw_device_id << 16) | NVIDIA_VENDOR} for b in sw_ids],
    }


# ---------------------------------------------------------------------------------------------- writing

def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cpulist(lo: int, hi: int) -> str:
    return f"{lo}-{hi}" if hi > lo else str(lo)


def _dev_node(path: Path, major: int, minor: int) -> bool:
    """Create a char device node; fall back to an empty regular file where mknod is refused."""
    if path.exists() or path.is_symlink():
        path.unlink()
    try:
        os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
        os.chmod(path, 0o666)  # mknod's mode is filtered by the umask; the real nodes are 0666
        return True
    except (PermissionError, OSError):
        path.touch()
        return False


def _pci_device(devices: Path, nvml_bus_id: str, *, device: int, klass: int, subsystem: tuple[int, int],
                numa: int, cpulist: str) -> Path:
    d = devices / sysfs_name(nvml_bus_id)
    d.mkdir(parents=True, exist_ok=True)
    for fname, val in (("vendor", f"0x{NVIDIA_VENDOR:04x}"), ("device", f"0x{device:04x}"),
                       ("class", f"0x{klass:06x}"), ("subsystem_vendor", f"0x{subsystem[0]:04x}"),
                       ("subsystem_device", f"0x{subsystem[1]:04x}"), ("numa_node", str(numa)),
                       ("local_cpulist", cpulist)):
        _write(d / fname, val + "\n")
    return d


def set_driver_files(root: Path, machine: dict[str, Any], loaded: bool) -> None:
    """Create or remove what a loaded nvidia.ko shows in host/ (module, proc entry, driver links)."""
    host = root / "host"
    module = host / "sys/module/nvidia"
    proc = host / "proc/driver/nvidia"
    drivers = host / "sys/bus/pci/drivers/nvidia"
    devices = host / "sys/bus/pci/devices"
    bound = [g["bus_id"] for g in machine["gpus"]] + [s["bus_id"] for s in machine["nvswitches"]]
    if not loaded:
        for d in (module, proc, drivers):
            shutil.rmtree(d, ignore_errors=True)
        for b in bound:
            link = devices / sysfs_name(b) / "driver"
            if link.is_symlink():
                link.unlink()
        return
    kmod = machine["kernel_module_version"]
    _write(module / "version", kmod + "\n")
    host = machine["host"]
    _write(proc / "version", host.get("proc_version") or proc_version({}, kmod))
    for g in machine["gpus"]:
        _write(proc / "gpus" / sysfs_name(g["bus_id"]) / "information", gpu_information(machine, g))
    drivers.mkdir(parents=True, exist_ok=True)
    for b in bound:
        link = devices / sysfs_name(b) / "driver"
        if not link.is_symlink():
            # From sys/bus/pci/devices/<id>/ two levels up is sys/bus/pci/.
            link.symlink_to("../../drivers/nvidia")
        dl = drivers / sysfs_name(b)
        if not dl.is_symlink():
            dl.symlink_to(f"../../devices/{sysfs_name(b)}")


def gpu_information(machine: dict[str, Any], g: dict[str, Any]) -> str:
    """/proc/driver/nvidia/gpus/<bus id>/information, in the driver's layout (the H200 recording's: Hopper
    DMA-addresses 52 bits, earlier GPUs 47; "GPU Firmware" appears where the GSP firmware runs)."""
    dma_bits = 52 if g["architecture"] >= ARCHITECTURES["hopper"] else 47
    lines = [f"Model: \t\t {g['name']}", f"IRQ:   \t\t {g.get('irq', 0)}", f"GPU UUID: \t {g['uuid']}",
             f"Video BIOS: \t {g['vbios_version'].lower()}", "Bus Type: \t PCIe",
             f"DMA Size: \t {dma_bits} bits", f"DMA Mask: \t {hex((1 << dma_bits) - 1)}",
             f"Bus Location: \t {sysfs_name(g['bus_id'])}", f"Device Minor: \t {g['minor']}"]
    if g.get("gsp_firmware"):
        lines.append(f"GPU Firmware: \t {machine['kernel_module_version']}")
    lines.append("GPU Excluded:\t No")
    return "\n".join(lines) + "\n"


def set_library_files(root: Path, present: bool, library: Path | None = None) -> None:
    """Install or remove the simulated libnvidia-ml.so.1 under lib/ and host/usr/lib.

    Removing leaves an empty `lib/libnvidia-ml.so.1`: LD_LIBRARY_PATH finds it first and dlopen fails
    ("file too short"), so pynvml raises NVMLError_LibraryNotFound even on build machines where a real
    libnvidia-ml1 is installed in the system library path.
    """
    lib = root / "lib" / "libnvidia-ml.so.1"
    stash = root / "lib" / ".libnvidia-ml.so.1.target"
    hostlib = root / "host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"
    lib.parent.mkdir(parents=True, exist_ok=True)
    hostlib.parent.mkdir(parents=True, exist_ok=True)
    if present:
        target = str(library) if library else (stash.read_text().strip() if stash.exists() else "")
        if not target:
            raise FileNotFoundError(f"{root}: no library recorded; run `gpufleet sim materialize` again")
        stash.write_text(target + "\n")
        for p in (lib, hostlib):
            if p.exists() or p.is_symlink():
                p.unlink()
            p.symlink_to(target)
        so = root / "lib" / "libnvidia-ml.so"
        if not so.is_symlink():
            so.symlink_to("libnvidia-ml.so.1")
    else:
        for p in (lib, hostlib):
            if p.exists() or p.is_symlink():
                p.unlink()
        lib.touch()


def write_control(root: Path, *, driver_loaded: bool, fabricmanager: str | None, lost: set[int],
                  clock_ms: int | None = None, hung: dict[int, int] | None = None,
                  driver_hung: int | None = None) -> None:
    """Write the whole control state (see docs/simulator.md, "control"). `hung` (GPU → until) and
    `driver_hung` (until; None: not hung) give the CLOCK_REALTIME ms until which calls block (0: until
    released)."""
    lines = [f"driver {'loaded' if driver_loaded else 'unloaded'}"]
    if driver_hung is not None:
        lines.append(f"driver hung {driver_hung}" if driver_hung else "driver hung")
    if fabricmanager:
        lines.append(f"fabricmanager {fabricmanager}")
    lines += [f"gpu {i} lost" for i in sorted(lost)]
    for i, until in sorted((hung or {}).items()):
        lines.append(f"gpu {i} hung {until}" if until else f"gpu {i} hung")
    if clock_ms is not None:
        lines.append(f"clock {clock_ms}")
    atomic_write(root / "control", "\n".join(lines) + "\n")


# "<device name>: ..." of dev_printk, for which the kernel adds SUBSYSTEM/DEVICE to the record's dictionary.
_DEV_PRINTK = re.compile(r"^\S+ ([0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]): ")


def kmsg_records(lines: list[str]) -> str:
    """`lines` as /dev/kmsg hands them out (Documentation/ABI/testing/dev-kmsg): "prio,seq,usec,flags;text"
    with non-printable bytes (a message's own newlines) as \\xNN, and " KEY=value" dictionary lines."""
    out = []
    for seq, line in enumerate(lines):
        # Facility 0 (kernel); level 3 (err) for the driver's complaints, 4 (warning) for the driver core's
        # "probe of ... failed", 6 (info) for the rest (banners, the PCI core's pci_info lines).
        if line.startswith("NVRM: ") and not line.startswith("NVRM: loading "):
            prio = 3
        elif "failed with error" in line:
            prio = 4
        else:
            prio = 6
        text = "".join(chr(b) if 32 <= b < 127 and b != 0x5C else f"\\x{b:02x}" for b in line.encode())
        out.append(f"{prio},{seq},{seq * 250_000 + 1000},-;{text}\n")
        device = _DEV_PRINTK.match(line)
        if device:
            out.append(f" SUBSYSTEM=pci\n DEVICE=+pci:{device.group(1)}\n")
    return "".join(out)


def _write_host(root: Path, m: dict[str, Any]) -> dict[str, int]:
    host = root / "host"
    h = m["host"]
    devices = host / "sys/bus/pci/devices"
    cpus = m["numa_cpus"]
    nodes = host / "sys/devices/system/node"
    for n, (lo, hi) in enumerate(cpus):
        _write(nodes / f"node{n}" / "cpulist", _cpulist(lo, hi) + "\n")
    _write(nodes / "online", _cpulist(0, len(cpus) - 1) + "\n")
    _write(host / "sys/devices/system/cpu/online", _cpulist(0, h["cpus"] - 1) + "\n")
    for g in m["gpus"]:
        numa = g["numa_node"]
        cpulist = _cpulist(*cpus[numa]) if 0 <= numa < len(cpus) else _cpulist(0, h["cpus"] - 1)
        sub = g["pci"]["subsystem_id"]
        # 0x030200: "3D controller", how datacenter GPUs without display outputs enumerate.
        _pci_device(devices, g["bus_id"], device=g["pci"]["device_id"] >> 16, klass=0x030200,
                    subsystem=(sub & 0xFFFF, sub >> 16), numa=numa, cpulist=cpulist)
    for s in m["nvswitches"]:
        # NVSwitches are PCI bridges of class 0x068000 ("Bridge: other") bound to nvidia.ko too.
        _pci_device(devices, s["bus_id"], device=s["device_id"] >> 16, klass=0x068000,
                    subsystem=(NVIDIA_VENDOR, 0x1626), numa=0, cpulist=_cpulist(*cpus[0]))
    dmi = host / "sys/class/dmi/id"
    for k, v in h["dmi"].items():
        _write(dmi / k, f"{v}\n")
    if h["secure_boot"] is not None:
        # efivarfs layout: 4 bytes of attributes (NV|BS|RT = 0x06) then the 1-byte value.
        efivars = host / "sys/firmware/efi/efivars"
        efivars.mkdir(parents=True, exist_ok=True)
        value = b"\x01" if h["secure_boot"] else b"\x00"
        (efivars / SECURE_BOOT_VAR).write_bytes(b"\x06\x00\x00\x00" + value)
    if h["nouveau_loaded"]:
        _write(host / "sys/module/nouveau/initstate", "live\n")
    flags = "fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr sse"
    if h["hypervisor"]:
        flags += " hypervisor"
    cpuinfo = [f"processor\t: {c}\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\n"
               for c in range(min(h["cpus"], 4))]
    _write(host / "proc/cpuinfo", "".join(cpuinfo))
    _write(host / "proc/sys/kernel/osrelease", h["kernel_release"] + "\n")
    set_driver_files(root, m, h["driver_loaded"])

    dev = host / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    # The kernel log, as a regular file discovery reads like /dev/kmsg (a real one is char device 1:11).
    _write(dev / "kmsg", kmsg_records(h.get("kernel_log") or []))
    made = {"char": 0, "file": 0}
    if not h["driver_loaded"]:
        return made  # the module never loaded (fixture driver_loaded: false): no /dev/nvidia* nodes

    def node(name: str, major: int, minor: int) -> None:
        made["char" if _dev_node(dev / name, major, minor) else "file"] += 1

    majors = {**DEVICE_MAJORS, **h.get("device_majors", {})}
    for g in m["gpus"]:
        node(f"nvidia{g['minor']}", NVIDIA_MAJOR, g["minor"])
    node("nvidiactl", NVIDIA_MAJOR, 255)
    if h.get("modeset", True):  # nvidia-modeset.ko (a host without it, as the recorded VM, has no node)
        node("nvidia-modeset", NVIDIA_MAJOR, 254)
    node("nvidia-uvm", majors["nvidia-uvm"], 0)
    node("nvidia-uvm-tools", majors["nvidia-uvm"], 1)
    for i, _ in enumerate(m["nvswitches"]):
        node(f"nvidia-nvswitch{i}", majors["nvidia-nvswitch"], i)
    if m["nvswitches"]:
        node("nvidia-nvswitchctl", majors["nvidia-nvswitch"], 255)
    mig_minors_file = host / "proc/driver/nvidia-caps/mig-minors"
    mig_minors_file.unlink(missing_ok=True)
    mig_gpus = {g["minor"] for g in m["gpus"] if g.get("mig")}
    if mig_gpus:
        # MIG-capable GPUs: the capability table, and the capability nodes of their instances (a real host
        # gets these from nvidia-modprobe as instances appear; here every possible one of these GPUs).
        table = mig_minors()
        _write(mig_minors_file, "".join(f"{name} {minor}\n" for name, minor in table))
        (dev / "nvidia-caps").mkdir(exist_ok=True)
        for name, minor in table:
            gpu = name.partition("/")[0]
            if name in ("config", "monitor") or (gpu.startswith("gpu") and int(gpu[3:]) in mig_gpus):
                node(f"nvidia-caps/nvidia-cap{minor}", majors["nvidia-caps"], minor)
    return made


def _write_smi_wrapper(root: Path) -> None:
    # The interpreter is baked in so the wrapper works from any PATH; the root defaults to this one.
    script = (
        "#!/bin/sh\n"
        "# nvidia-smi stand-in for a gpufleet sim root: runs gpufleet-sim-smi against this root.\n"
        f': "${{GPUFLEET_SIM_ROOT:={root}}}"\n'
        f': "${{LD_LIBRARY_PATH:={root}/lib}}"\n'
        f': "${{GPUFLEET_HOST_ROOT:={root}/host}}"\n'
        "export GPUFLEET_SIM_ROOT LD_LIBRARY_PATH GPUFLEET_HOST_ROOT\n"
        f'exec {sys.executable} -m gpufleet_harness.sim.smi "$@"\n'
    )
    path = root / "bin" / "nvidia-smi"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    path.chmod(0o755)


def materialize(fixture: str | os.PathLike[str], root: str | os.PathLike[str], *,
                library: Path | None = None, build: bool = True) -> Path:
    """Expand `fixture` into a fresh sim root at `root` (replacing an existing one); returns the root.

    `library` is the built libnvidia-ml.so.1 to link under lib/; by default it is built (cached).
    """
    from gpufleet_harness.sim import build as simbuild

    root = Path(root).resolve()
    m = expand(fixture)
    if library is None and build:
        library = simbuild.build_library()
    if root.exists():
        if not (root / "machine.json").exists() and any(root.iterdir()):
            raise FileExistsError(f"{root} exists, is not empty and is not a sim root; not replacing it")
        shutil.rmtree(root)
    root.mkdir(parents=True)
    atomic_write(root / "machine.json", json.dumps(m, indent=1) + "\n")
    h = m["host"]
    write_control(root, driver_loaded=h["driver_loaded"], fabricmanager=h["fabricmanager"], lost=set())
    (root / "events").write_text("")
    # Workloads (workload.py): a directory, so that containers can be given it writable in a read-only root.
    (root / workload.DIR).mkdir()
    if library is not None:
        set_library_files(root, True, Path(library))
    _write_host(root, m)
    _write_smi_wrapper(root)
    return root


def load_machine(root: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a sim root's machine.json; FixtureError when it is not a machine document."""
    path = Path(root) / "machine.json"
    try:
        with path.open("rb") as fh:
            raw = fh.read(MAX_MACHINE_JSON_BYTES + 1)
    except FileNotFoundError:
        raise FileNotFoundError(f"{root} is not a sim root (no machine.json)") from None
    if len(raw) > MAX_MACHINE_JSON_BYTES:
        raise FixtureError(f"{path}: larger than {MAX_MACHINE_JSON_BYTES} bytes; not a machine")
    try:
        doc = json.loads(raw)
    except RecursionError:
        raise FixtureError(f"{path}: nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8
        raise FixtureError(f"{path}: not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA or not isinstance(doc.get("gpus"), list):
        raise FixtureError(f"{path}: not a schema {SCHEMA} machine document")
    return doc


def default_root(fixture: str) -> Path:
    """Where `gpufleet sim env FIXTURE` puts a root: $XDG_RUNTIME_DIR or /tmp, per user and fixture."""
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    return Path(base) / f"gpufleet-sim-{os.getuid()}" / Path(fixture).stem


def sim_env(root: str | os.PathLike[str], base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that point NVML consumers at a sim root (see docs/simulator.md)."""
    root = Path(root).resolve()
    base = dict(os.environ if base is None else base)
    path = base.get("PATH", os.defpath)
    return {
        "GPUFLEET_SIM_ROOT": str(root),
        "LD_LIBRARY_PATH": ":".join(p for p in (str(root / "lib"), base.get("LD_LIBRARY_PATH")) if p),
        "GPUFLEET_HOST_ROOT": str(root / "host"),
        "PATH": f"{root / 'bin'}:{path}",
    }
