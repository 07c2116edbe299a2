"""The validation suites' readers of nvidia-smi output on what a real H200 printed.

The recordings are tests/realgpu/h200-580.159.04/ (copied verbatim from the lead's capture of 2026-11-28 on
one H200 in a Firecracker microVM, driver 580.159.04; tests/realgpu/README.md): `smi-L.txt` (`nvidia-smi
-L`), `smi-topo.txt` (`nvidia-smi topo -m`, with the terminal escapes of its header), `smi.txt` (the summary),
`smi-query.txt` and `smi-query-nh.txt` (`--query-gpu` CSV with and without header), `dev.txt` (`ls -l
/dev/nvidia*`), `nvml-probe.json` (the MIG profiles NVML lists with MIG off). Each file ends with the
recorder's `rc=0`, which `command_output` takes off.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from gpufleet_harness.realgpu import H200, command_output, load_probe

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "validation"))

from hostcheck import SmiRow, Target, parse_query
from podcheck import PodRun
from test_2_runtime import GPU_LINE as RUNTIME_GPU_LINE
from test_4_workload import _profile_mib

UUID = "GPU-3710040f-331e-b1cd-ae09-04a71f007081"


def _device_nodes() -> list[str]:
    """What the pod's `ls /dev | grep -E "^nvidia[0-9]+$"` prints on the recorded host (from `ls -l`)."""
    names = re.findall(r"/dev/(nvidia\S*)$", command_output(H200 / "dev.txt", rc=2), re.M)
    return [n for n in names if re.fullmatch(r"nvidia[0-9]+", n)]


def test_a_gpu_pod_on_the_h200_is_read_from_its_real_output() -> None:
    """The pod script's sections filled with the real outputs (dev.txt ends rc=2: `ls` of a missing
    /dev/dri beside the device nodes, which are listed all the same)."""
    assert "\x1b[4m" in command_output(H200 / "smi-topo.txt")  # the escapes are really there
    log = (
        f"== gpus\n{command_output(H200 / 'smi-L.txt')}== rc 0\n"
        + "== devices\n" + "".join(f"{n}\n" for n in _device_nodes())
        + f"== topo\n{command_output(H200 / 'smi-topo.txt')}"
        + f"== summary\n{command_output(H200 / 'smi.txt')}== end\n"
    )  # fmt: skip
    run = PodRun(name="h200", node="h200", phase="Succeeded", pod={}, log=log).parse()
    assert run.gpus == [(0, "NVIDIA H200", UUID)]
    assert run.devices == ["nvidia0"]
    assert run.topology == {"GPU0": {"GPU0": "X"}}
    # MIG off: no MIG device in -L and the summary's GPU row is not taken for a MIG table row.
    assert run.mig_devices == [] and run.mig_memory == []


def test_the_runtime_suites_gpu_count_on_the_real_listing() -> None:
    assert len(RUNTIME_GPU_LINE.findall(command_output(H200 / "smi-L.txt"))) == 1


def test_the_query_csv_without_header() -> None:
    """smi-query-nh.txt: --query-gpu=index,name,uuid,driver_version,persistence_mode,memory.total
    --format=csv,noheader,nounits (the host suite's fields and memory.total)."""
    fields = ("index", "name", "uuid", "driver_version", "persistence_mode", "memory.total")
    assert parse_query(command_output(H200 / "smi-query-nh.txt"), fields) == [
        {"index": "0", "name": "NVIDIA H200", "uuid": UUID, "driver_version": "580.159.04",
         "persistence_mode": "Enabled", "memory.total": "143771"},
    ]  # fmt: skip
    assert parse_query(command_output(H200 / "smi-query-nh.txt"), fields[:5]) == []  # a count mismatch


def test_the_query_csv_with_header_names_and_units() -> None:
    (row,) = parse_query(command_output(H200 / "smi-query.txt"))
    assert len(row) == 17
    names = ("name", "memory.total", "compute_cap", "mig.mode.current", "fabric.state")
    assert [row[k] for k in names] == ["NVIDIA H200", "143771 MiB", "9.0", "Disabled", "N/A"]
    assert [row[k] for k in ("pci.bus_id", "clocks.max.sm", "power.limit")] == [
        "00000000:00:06.0", "1980 MHz", "700.00 W",
    ]  # fmt: skip


class _Host:
    """testinfra's Host for one command: what the real nvidia-smi printed for the host suite's query."""

    def __init__(self, stdout: str) -> None:
        self.stdout = stdout
        self.commands: list[str] = []

    def run(self, command: str) -> Any:
        self.commands.append(command)
        return SimpleNamespace(rc=0, stdout=self.stdout, stderr="")


def test_the_host_suites_query_reads_the_real_csv() -> None:
    host = _Host(command_output(H200 / "smi-query.txt"))
    result, rows = Target("h200", host, {}).smi_query
    assert result.rc == 0 and host.commands == [
        "nvidia-smi --query-gpu=index,name,uuid,driver_version,persistence_mode --format=csv,nounits"
    ]
    assert rows == [SmiRow("0", "NVIDIA H200", UUID, "580.159.04", "Enabled")]


def test_every_h200_mig_profile_passes_the_workload_suites_memory_check() -> None:
    """The MIG pod check wants a MIG device's MiB within 85-100 % of its profile's nominal GB; each of the
    seven profiles NVML lists on the real H200 with MIG off (nvidia-smi mig -lgip shows the same) does."""
    recorded = load_probe(H200)["devices"][0]["mig_profiles"].values()
    profiles = {p["ok"]["name"].removeprefix("MIG "): p["ok"]["memorySizeMB"] for p in recorded if "ok" in p}
    h200 = ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"]
    assert sorted(profiles) == h200
    outside = {n: mib for n, mib in profiles.items() if not 0.85 * _profile_mib(n) <= mib <= _profile_mib(n)}
    assert not outside
