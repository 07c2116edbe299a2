"""The nvidia-smi stand-in prints the recorded H200's shapes: the same lines, columns, field names and order
as nvidia-smi 580.159.04 printed them (tests/realgpu/h200-580.159.04/smi*.txt), with the simulated H200's
values.

What is compared: the layout always (column positions, field names and nesting, order); the values that
identify the GPU or its configuration; not the values that legitimately differ between two reads (the
time, power, PCIe throughput, temperatures, or what the simulated NVML does not answer and prints N/A).
"""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufleet_harness.sim import machine as simmachine

RECORDING = Path(__file__).resolve().parents[1] / "realgpu" / "h200-580.159.04"
Roots = Callable[[str], Path]


def recorded(name: str) -> str:
    """A recorded output without the recorder's trailing `rc=N` line."""
    return re.sub(r"rc=\d+\n\Z", "", (RECORDING / name).read_text())


def smi(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """The sim root's own bin/nvidia-smi, as a host's PATH finds it."""
    return subprocess.run([str(root / "bin/nvidia-smi"), *args], capture_output=True, text=True, timeout=60,
                          check=False, env={"PATH": "/usr/bin:/bin"})


@pytest.fixture(scope="module")
def h200(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from gpufleet_harness.sim import build as simbuild

    return simmachine.materialize("firecracker-vm-h200", tmp_path_factory.mktemp("smi") / "root",
                                  library=simbuild.build_library())


# -- outputs with nothing that moves: the same bytes -----------------------------------------------------


@pytest.mark.parametrize(("name", "args"), [
    ("smi-L.txt", ["-L"]),
    ("smi-topo.txt", ["topo", "-m"]),
    ("smi-mig-lgip.txt", ["mig", "-lgip"]),
    ("smi-mig-lgipp.txt", ["mig", "-lgipp"]),
    ("smi-mig-lgi.txt", ["mig", "-lgi"]),
    ("smi-version.txt", ["--version"]),
    ("smi-query.txt", ["--query-gpu=index,name,uuid,driver_version,persistence_mode,memory.total,pci.bus_id,"
                       "mig.mode.current,compute_cap,vbios_version,serial,pstate,clocks.max.sm,power.limit,"
                       "ecc.mode.current,fabric.state,fabric.status", "--format=csv"]),
    ("smi-query-nh.txt", ["--query-gpu=index,name,uuid,driver_version,persistence_mode,memory.total",
                          "--format=csv,noheader,nounits"]),
])
def test_output_is_the_recorded_one(h200: Path, name: str, args: list[str]) -> None:
    proc = smi(h200, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout == recorded(name)


def test_topo_header_carries_the_real_escapes(h200: Path) -> None:
    """Real nvidia-smi underlines the matrix header with ESC[4m ... ESC[0m even into a file (the recording
    was taken into one), and leaves an empty cell before GPU NUMA ID."""
    first, second = recorded("smi-topo.txt").splitlines()[:2]
    assert first.startswith("\t\x1b[4mGPU0") and first.endswith("\x1b[0m")
    assert second.split("\t")[-2:] == ["", "N/A"]
    assert smi(h200, "topo", "-m").stdout.splitlines()[:2] == [first, second]


# -- the summary: layout, identity -----------------------------------------------------------------------


def _cells(line: str) -> list[str]:
    return line.split("|")


def test_summary_has_the_recorded_layout(h200: Path) -> None:
    want = recorded("smi.txt").splitlines()
    proc = smi(h200)
    got = proc.stdout.splitlines()
    assert "simulated" in proc.stderr and "simulated" not in proc.stdout
    assert len(got) == len(want)
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}", got[0])  # the time, padded alike
    for n, (g, w) in enumerate(zip(got[1:], want[1:], strict=True), start=1):
        assert len(g) == len(w), (n, g, w)
        assert [i for i, c in enumerate(g) if c in "|+"] == [i for i, c in enumerate(w) if c in "|+"], (n, g)
        if not re.search(r"\d+W|\d+C|\d+%|\d+MiB", w):  # rules, headers, the process table: the same text
            assert g == w, (n, g, w)
    # the GPU's cells: every token ends where the real one does (right-aligned) and identity values match
    for n in (8, 9, 10):
        for gc, wc in zip(_cells(got[n]), _cells(want[n]), strict=True):
            assert [m.end() for m in re.finditer(r"\S+", gc)] == [m.end() for m in re.finditer(r"\S+", wc)], n
    identity = ("NVIDIA H200", "On", "00000000:00:06.0 Off", "P0", "700W", "143771MiB", "Default", "Disabled")
    for token in identity:
        assert token in "\n".join(got[8:11])


# -- -q: field names, nesting and order; identity values -------------------------------------------------

IDENTITY_FIELDS = {
    "Driver Version", "CUDA Version", "Attached GPUs", "Product Name", "Product Brand",
    "Product Architecture", "Display Attached", "Display Active", "Persistence Mode", "Addressing Mode",
    "Serial Number", "GPU UUID", "GPU PDI", "Minor Number", "VBIOS Version", "MultiGPU Board", "Board ID",
    "Board Part Number", "GPU Part Number", "Module Id", "Image Version", "OEM Object", "ECC Object",
    "GPU C2C Mode", "Virtualization Mode", "GSP Firmware Version",
    "Bus", "Device", "Domain", "Device Id", "Bus Id", "Sub System Id", "Base Classcode", "Sub Classcode",
    "Compute Mode", "Current Power Limit", "Default Power Limit", "Min Power Limit", "Max Power Limit",
    "Performance State", "Idle",
}


def _q_fields(text: str) -> list[tuple[int, str, str | None]]:
    """(indent, label, value or None for a heading) per line; the value column is checked too."""
    out = []
    for line in text.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if len(line) > 56 and line[55:57] == ": ":
            out.append((indent, line[:55].strip(), line[57:]))
        else:
            assert ":" not in line[:55] or line.startswith("GPU ") or "===" in line, line
            out.append((indent, line.strip() if not line.startswith("GPU 0") else "GPU <bus id>", None))
    return out


def test_query_has_the_recorded_fields_in_order(h200: Path) -> None:
    want = _q_fields(recorded("smi-q.txt"))
    proc = smi(h200, "-q")
    assert proc.returncode == 0 and "simulated" in proc.stderr
    got = _q_fields(proc.stdout)
    assert [(i, label) for i, label, _ in got] == [(i, label) for i, label, _ in want]
    differ = {label: (g, w) for (_, label, g), (_, _, w) in zip(got, want, strict=True)
              if label in IDENTITY_FIELDS and g != w}
    assert differ == {}
    assert (len(want), sum(v is None for *_, v in want)) == (253, 47)  # fields, headings (not vacuous)
    assert sum(label in IDENTITY_FIELDS for _, label, _ in want) == 45  # identity values compared
    assert ("GPU Part Number", "2335-895-A1") in [(label, v) for _, label, v in got]


def _xml_tags(text: str) -> list[tuple[int, str]]:
    """(depth, tag) of every element in document order, with the repeated supported clocks counted once."""
    root = ET.fromstring(text)
    out: list[tuple[int, str]] = []

    def walk(e: ET.Element, depth: int) -> None:
        if not (out and out[-1] == (depth, e.tag) and e.tag.startswith("supported_")):
            out.append((depth, e.tag))
        for child in e:
            walk(child, depth + 1)

    walk(root, 0)
    return out


def test_query_xml_has_the_recorded_elements_in_order(h200: Path) -> None:
    want_text = recorded("smi-qx.txt")
    proc = smi(h200, "-q", "-x")
    assert proc.returncode == 0 and proc.stderr == ""
    assert proc.stdout.splitlines()[:3] == want_text.splitlines()[:3]  # declaration, DTD, root
    assert _xml_tags(proc.stdout) == _xml_tags(want_text)
    got, want = ET.fromstring(proc.stdout), ET.fromstring(want_text)
    assert got.find("gpu").attrib == want.find("gpu").attrib == {"id": "00000000:00:06.0"}
    for path in ("driver_version", "cuda_version", "attached_gpus", "gpu/product_name", "gpu/uuid",
                 "gpu/serial", "gpu/pdi", "gpu/board_id", "gpu/board_part_number", "gpu/gpu_part_number",
                 "gpu/vbios_version",
                 "gpu/mig_mode/current_mig",
                 "gpu/pci/pci_device_id", "gpu/pci/pci_sub_system_id", "gpu/fb_memory_usage/total",
                 "gpu/fb_memory_usage/reserved", "gpu/bar1_memory_usage/total", "gpu/bar1_memory_usage/used",
                 "gpu/gpu_virtualization_mode/virtualization_mode", "gpu/max_clocks/sm_clock",
                 "gpu/gpu_power_readings/max_power_limit", "gpu/platformInfo/module_id", "gpu/fabric/state"):
        assert got.findtext(path) == want.findtext(path), path
    clocks = [[e.text for e in m.iter()] for m in got.iter("supported_mem_clock")]
    assert clocks == [[e.text for e in m.iter()] for m in want.iter("supported_mem_clock")]


# -- other fixtures: the same shapes ---------------------------------------------------------------------


@pytest.mark.parametrize("fixture", ["dgx-a100", "hgx-h200", "pcie-2x-t4"])
def test_every_fixture_prints_the_same_shapes(sim_root: Roots, fixture: str) -> None:
    root = sim_root(fixture)
    gpus = simmachine.load_machine(root)["gpus"]
    summary = smi(root).stdout.splitlines()
    assert {len(line) for line in summary[1:] if line} == {91}
    assert len(summary) == 1 + 7 + 4 * len(gpus) + 1 + 7
    q = _q_fields(smi(root, "-q").stdout)
    want = [(i, label) for i, label, _ in _q_fields(recorded("smi-q.txt"))]
    per_gpu = [(i, label) for i, label, _ in q]
    assert per_gpu[:5] == want[:5] and per_gpu[5:] == want[5:] * len(gpus)  # the log's head, then each GPU
    assert _xml_tags(smi(root, "-q", "-x").stdout)[1:6] == _xml_tags(recorded("smi-qx.txt"))[1:6]


def test_mig_listing_needs_a_mig_gpu_and_names_the_profiles(sim_root: Roots) -> None:
    t4 = smi(sim_root("pcie-2x-t4"), "mig", "-lgip")
    assert (t4.returncode, t4.stdout) == (6, "No MIG-supported devices found.\n")
    a100 = smi(sim_root("dgx-a100"), "mig", "-lgipp", "-i", "3").stdout.splitlines()
    assert a100[0] == "GPU  3 Profile ID 19 Placements: {0,1,2,3,4,5,6}:1"
    assert a100[-1] == "GPU  3 Profile ID  0 Placement : {0}:8"
