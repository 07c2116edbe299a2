"""A process on the simulated H200 against a real H200 with one
(tests/realgpu/h200-580.159.04-host3-process/): process_check.py held a CUDA context with 1 GiB and memset it
in a loop (pid 511, "python3", 1542 MiB in the process list) and recorded NVML, nvidia-smi's summary, `-q`,
`-q -x` and `dmon -s pucvmet` meanwhile.

The simulated H200 runs the same process as a memory-bound workload (`load 0 kind membound pid 511 memory
1542 name python3`) on a frozen clock, sampled as many seconds into the load as the recording was. Layouts
are compared line for line; values where the GPU model's behaviour is what is modelled (memory and BAR1 in
use, power, clocks, utilization, the process) are the recorded ones; the values that belong to that host
(its identity, its temperatures and thresholds, its PCIe traffic) are listed with why.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

RECORDING = Path(__file__).resolve().parents[1] / "realgpu" / "h200-580.159.04-host3-process"
T0, INTO_LOAD_S = 100, 4  # the recording's readings were taken 3-6 s into the load
# The memory temperature is the host's too, within this much above this host's: the simulator follows a
# fourth H200 that ran the same memset loop at 54-55 C 4-6 s in (h200-580.159.04-host4-fields, sampled every
# 0.5 s; tests/sim/test_sim_fields_contract.py) where this one read 50-51 C, and the recorded H200s idle at
# 34-38 C (a 4 C spread).
MTEMP_HOSTS_C = 4
SMI = [sys.executable, "-m", "gpufleet_harness.sim.smi"]

# What the readings are, through the unmodified pynvml, as process_check.py took them.
READ = """
    n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
    listed = lambda procs: [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in procs]
    v3 = listed(n.nvmlDeviceGetComputeRunningProcesses_v3(h))
    u = n.nvmlDeviceGetUtilizationRates(h)
    out({"procs_v3": v3, "procs_v2": listed(n.nvmlDeviceGetComputeRunningProcesses_v2(h)),
         "names": {str(p[0]): n.nvmlSystemGetProcessName(p[0]) for p in v3},
         "mem_used": n.nvmlDeviceGetMemoryInfo(h).used,
         "bar1_used": n.nvmlDeviceGetBAR1MemoryInfo(h).bar1Used,
         "util": [u.gpu, u.memory], "clocks": {str(k): n.nvmlDeviceGetClockInfo(h, k) for k in range(4)},
         "reasons": n.nvmlDeviceGetCurrentClocksEventReasons(h), "power_mw": n.nvmlDeviceGetPowerUsage(h),
         "jpg": list(n.nvmlDeviceGetJpgUtilization(h)), "ofa": list(n.nvmlDeviceGetOfaUtilization(h)),
         "mps_procs": listed(n.nvmlDeviceGetMPSComputeRunningProcesses_v3(h)),
         "graphics_procs": listed(n.nvmlDeviceGetGraphicsRunningProcesses_v3(h))})
"""


def recorded() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads((RECORDING / "process-check.json").read_text())
    return doc


def recorded_text(name: str) -> list[str]:
    """A recorded output's lines, without the rc= line the probe appended."""
    return [line for line in (RECORDING / name).read_text().splitlines() if not line.startswith("rc=")]


Runner = Callable[..., Any]


@pytest.fixture
def busy(fresh_root: Callable[[str], Path], nvml: Runner) -> tuple[Path, dict[str, Any]]:
    """(root, idle readings): the H200 fixture running the recorded process INTO_LOAD_S into its load."""
    root = fresh_root("firecracker-vm-h200")
    simcontrol.inject(root, ["clock", str(T0)])
    before = nvml(root, READ)
    simcontrol.inject(root, ["load", "0", "kind", "membound", "pid", "511", "memory", "1542",
                             "name", "python3"])
    simcontrol.inject(root, ["clock", str(T0 + INTO_LOAD_S)])
    return root, before


def smi(root: Path, *args: str) -> list[str]:
    env = {**os.environ, **simmachine.sim_env(root)}
    done = subprocess.run([*SMI, *args], env=env, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout.splitlines()


def test_nvml_reads_what_the_real_h200_read_before_and_during_the_load(busy: tuple[Path, dict],
                                                                     nvml: Runner) -> None:
    root, before = busy
    real = recorded()
    # idle: the driver's 615.06 MiB, its 1.6 MiB of BAR1, the idle video clock
    assert before["mem_used"] == real["before"]["mem_used"] == 644939776
    assert before["bar1_used"] == real["before"]["bar1_used"] == 1703936
    assert before["clocks"]["3"] == real["before"]["video_mhz"] == 765
    sim, was = nvml(root, READ), real["during"]
    # the process, its name and memory (1 GiB + the context's 518 MiB), without MIG instance ids
    assert sim["procs_v3"] == sim["procs_v2"] == was["procs_v3"] == was["procs_v2"] == [
        [511, 1616904192, 0xFFFFFFFF, 0xFFFFFFFF]]
    assert sim["names"] == was["names"] == {"511": "python3"}
    assert sim["mps_procs"] == was["mps_procs"] == [] and sim["graphics_procs"] == was["graphics_procs"] == []
    # memory in use (v1: reserved + the process + the driver's 8.8 MiB per context) and BAR1, to the byte
    assert sim["mem_used"] == was["mem_used"] == 2271084544
    assert sim["bar1_used"] == was["bar1_used"] == 1627914240
    # a memset loop: 100 % GPU and memory busy at 522.9 W, below the cap: every clock at its maximum (video
    # 1545 MHz), no clock-event reason
    assert sim["util"] == [int(v) for v in re.findall(r"(\d+) %", was["util"])] == [100, 100]
    assert sim["clocks"] == was["clocks"] == {"0": 1980, "1": 1980, "2": 3201, "3": 1545}
    assert sim["reasons"] == was["reasons"] == 0
    assert sim["power_mw"] == pytest.approx(was["power_mw"], rel=0.001)
    assert sim["jpg"] == was["jpg"] == [0, 100000] and sim["ofa"] == was["ofa"] == [0, 100000]
    # after: no process; the memory in use back at idle (the real driver kept 3.25 MiB more: not modelled)
    simcontrol.inject(root, ["idle", "0"])
    simcontrol.inject(root, ["clock", "+5"])
    after = nvml(root, READ)
    assert after["procs_v3"] == real["after"]["procs_v3"] == []
    assert after["mem_used"] == before["mem_used"]
    assert real["after"]["mem_used"] - before["mem_used"] == 13 << 18


def test_the_summary_shows_the_recorded_process_row(busy: tuple[Path, dict]) -> None:
    root, _ = busy
    sim, real = smi(root), recorded_text("smi-busy.txt")
    start = real.index("| Processes:" + " " * 78 + "|") - 1
    assert sim[sim.index(real[start + 1]) - 1:] == real[start:]  # the table, byte for byte
    # the GPU's cells: power, memory in use, utilization as recorded; the temperature is the host's
    cells = [re.sub(r"\d+C ", "NNC ", line) for line in (sim[9], real[9])]
    assert cells[0] == cells[1] == "| N/A   NNC    P0            522W /  700W |    1551MiB / 143771MiB |" \
                                   "    100%      Default |"
    assert len(sim) == len(real) and [len(line) for line in sim[1:]] == [len(line) for line in real[1:]]


# -q lines whose value is the recorded host's, not the model's: (label, why).
HOST_VALUES = {
    "Timestamp": "the time",
    "Serial Number": "the fixture is the first recorded H200, this is another one",
    "GPU UUID": "another H200",
    "GPU PDI": "another H200",
    "Module Id": "another H200",
    "GPU Part Number": "not answered by the simulated NVML (N/A)",
    "Tx Throughput": "PCIe traffic, ±2 MB/s",
    "Rx Throughput": "PCIe traffic",
    "Max": "the row-remapper histogram: not simulated",
    "High": "histogram",
    "Partial": "histogram",
    "Low": "histogram",
    "None": "histogram",
    "GPU Current Temp": "the fixture idles at 40 C (the first host), this host's idle was not recorded",
    "Memory Current Temp": "the host's: see MTEMP_HOSTS_C",
    "GPU T.Limit Temp": "temperature thresholds: not simulated",
    "GPU Shutdown T.Limit Temp": "thresholds",
    "GPU Slowdown T.Limit Temp": "thresholds",
    "GPU Max Operating T.Limit Temp": "thresholds",
    "Memory Max Operating T.Limit Temp": "thresholds",
    "Average Power Draw": "within 0.5 % (the GPU's, and the memory's: 119.03 W)",
    "Instantaneous Power Draw": "within 0.5 % (the simulated load draws evenly)",
}


def _label(line: str) -> str:
    return line.split(":", 1)[0].strip()


def _degrees(line: str) -> int:
    return int(line.rsplit(":", 1)[1].split()[0])


def _watts(line: str) -> float:
    return float(line.rsplit(":", 1)[1].split()[0])


def test_query_prints_the_recorded_process_memory_and_clock_sections(busy: tuple[Path, dict]) -> None:
    root, _ = busy
    sim, real = smi(root, "-q"), recorded_text("smi-q-busy.txt")
    assert [_label(line) for line in sim] == [_label(line) for line in real]  # field names and order
    for mine, theirs in zip(sim, real, strict=True):
        if mine == theirs:
            continue
        label = _label(mine)
        assert label in HOST_VALUES, f"-q differs from the recording: {mine!r} != {theirs!r}"
        if label in ("Average Power Draw", "Instantaneous Power Draw") and "N/A" not in mine:
            assert _watts(mine) == pytest.approx(_watts(theirs), rel=0.005), (mine, theirs)
    # the sections the model makes, line for line: memory, BAR1, utilization, clocks, the process
    for first, count in (("    FB Memory Usage", 5), ("    BAR1 Memory Usage", 4), ("    Utilization", 7),
                         ("    Clocks", 5), ("    Processes", 7)):  # fmt: skip
        k = real.index(first)
        assert sim[k:k + count] == real[k:k + count], first
    [mtemp] = [_degrees(line) for line in sim if _label(line) == "Memory Current Temp"]
    assert 50 <= mtemp <= 50 + MTEMP_HOSTS_C  # recorded 50 C


def _elements(lines: list[str]) -> list[tuple[int, str]]:
    return [(len(line) - len(line.lstrip("\t")), re.sub(r">.*", ">", line.strip())) for line in lines]


def test_query_xml_prints_the_recorded_processes(busy: tuple[Path, dict]) -> None:
    root, _ = busy
    sim, real = smi(root, "-q", "-x"), recorded_text("smi-qx-busy.txt")
    assert _elements(sim) == _elements(real)  # element names, depth and order
    k = real.index("\t\t<processes>")
    assert sim[k:k + 12] == real[k:k + 12]  # the process and the (empty) accounted processes, byte for byte
    for tag in ("fb_memory_usage", "bar1_memory_usage", "utilization", "clocks"):
        k = real.index(f"\t\t<{tag}>")
        end = real.index(f"\t\t</{tag}>", k)
        assert sim[k:end] == real[k:end], tag
    [mtemp] = [line for line in sim if line.startswith("\t\t\t<memory_temp>")]
    assert re.fullmatch(r"\t\t\t<memory_temp>5[0-4] C</memory_temp>", mtemp)  # recorded 50 C; MTEMP_HOSTS_C


def test_dmon_prints_every_column_as_recorded(busy: tuple[Path, dict]) -> None:
    """All 22 columns of `dmon -s pucvmet`: the header byte for byte, the row widths, and each value among
    the three recorded samples' (the GPU and memory temperatures are the host's: see the -q test)."""
    root, _ = busy
    sim, real = smi(root, "dmon", "-s", "pucvmet", "-c", "2", "-d", "0"), recorded_text("dmon-busy.txt")
    assert sim[:2] == real[:2]
    assert [len(line) for line in sim[2:]] == [len(real[2])] * 2
    columns = real[0].split()[1:]
    recorded_rows = [dict(zip(columns, line.split(), strict=True)) for line in real[2:]]
    row = dict(zip(columns, sim[2].split(), strict=True))
    assert len(row) == 22 and "-" not in row.values()  # every column answered, memory temperature too
    for column, value in row.items():
        if column == "gtemp":
            continue
        seen = [r[column] for r in recorded_rows]
        if column == "mtemp":  # the host's, see MTEMP_HOSTS_C
            assert min(map(int, seen)) <= int(value) <= max(map(int, seen)) + MTEMP_HOSTS_C, (value, seen)
            continue
        assert value in seen, (column, value, seen)
