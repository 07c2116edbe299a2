"""gpufleet-sim-smi: nvidia-smi's formats and exit codes, on simulated hosts."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from gpu_helpers import facts_in_sim, smi

from gpufleet.gpu import NvmlDriverNotLoaded, NvmlGpuLost, NvmlLibraryNotFound, NvmlUnavailable
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim.smi import DRIVER_NOT_LOADED, LIBRARY_NOT_FOUND, failure

RootFactory = Callable[[str], Path]


def test_list_gpus_in_nvidia_smi_format(sim_root: RootFactory) -> None:
    root = sim_root("dgx-a100")
    gpus = simmachine.load_machine(root)["gpus"]
    proc = smi(root, "-L")
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == [f"GPU {g['index']}: {g['name']} (UUID: {g['uuid']})" for g in gpus]


def test_query_gpu_csv_with_header_and_units(sim_root: RootFactory) -> None:
    root = sim_root("dgx-a100")
    gpu0 = simmachine.load_machine(root)["gpus"][0]
    fields = "index,name,uuid,memory.total,pci.bus_id,driver_version,compute_cap,pci.device_id"
    fields += ",mig.mode.current"
    proc = smi(root, f"--query-gpu={fields}", "--format=csv")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert lines[0] == (
        "index, name, uuid, memory.total [MiB], pci.bus_id, driver_version, compute_cap, pci.device_id, "
        "mig.mode.current"
    )
    assert lines[1] == (
        f"0, NVIDIA A100-SXM4-80GB, {gpu0['uuid']}, 81920 MiB, 00000000:07:00.0, 535.261.03, 8.0, "
        "0x20B210DE, Disabled"
    )
    assert len(lines) == 9


def test_query_gpu_noheader_nounits_and_na_for_unsupported(sim_root: RootFactory) -> None:
    root = sim_root("pcie-2x-t4")
    fields = "index,memory.total,mig.mode.current,persistence_mode"
    proc = smi(root, f"--query-gpu={fields}", "--format=csv,noheader,nounits")
    assert proc.returncode == 0
    assert proc.stdout.splitlines() == ["0, 15360, [N/A], Enabled", "1, 15360, [N/A], Enabled"]


def test_select_gpus_by_index_uuid_or_bus_id(sim_root: RootFactory) -> None:
    root = sim_root("dgx-a100")
    uuid5 = simmachine.load_machine(root)["gpus"][5]["uuid"]
    proc = smi(root, "-i", f"1,{uuid5},0000:bd:00.0", "--query-gpu=index", "--format=csv,noheader")
    assert proc.stdout.splitlines() == ["1", "5", "7"]
    assert smi(root, "-i", "42", "-L").returncode == 6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--query-gpu=index,bogus", "--format=csv"], 'Field "bogus" is not a valid field to query.'),
        (["--query-gpu=index"], "--format=csv"),
    ],
)
def test_bad_query_exits_2(sim_root: RootFactory, args: list[str], message: str) -> None:
    proc = smi(sim_root("pcie-2x-t4"), *args)
    assert proc.returncode == 2
    assert message in proc.stdout


def test_topo_matrix_matches_discovery_with_affinity_columns(sim_root: RootFactory) -> None:
    root = sim_root("dgx-a100")
    proc = smi(root, "topo", "-m")
    assert proc.returncode == 0
    # nvidia-smi underlines the header with terminal escapes, even into a pipe (the H200 recording)
    assert proc.stdout.startswith("\t\x1b[4mGPU0\t") and proc.stdout.splitlines()[0].endswith("\x1b[0m")
    rows = [re.sub(r"\x1b\[[0-9]*m", "", line).split("\t") for line in proc.stdout.splitlines()[:9]]
    assert rows[0] == ["", *[f"GPU{i}" for i in range(8)], "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"]
    matrix = facts_in_sim(root)["topology"]["matrix"]
    for i, row in enumerate(rows[1:]):
        assert row[0] == f"GPU{i}"
        assert [cell.strip() for cell in row[1:9]] == matrix[i]
        assert row[1 + i] == " X "
        assert row[10] == ("0" if i < 4 else "1")  # NUMA affinity
        assert row[11:] == ["", "N/A"]  # an empty cell before GPU NUMA ID, as the real one prints
        assert re.fullmatch(r"\d+-\d+", row[9])  # CPU affinity from NVML, as the device's local_cpulist
    assert "Legend:" in proc.stdout
    assert smi(root, "topo").returncode == 2


def test_version_and_summary_say_they_are_simulated(sim_root: RootFactory) -> None:
    """On stderr: stdout keeps nvidia-smi's layout (tests/sim/test_sim_smi_recorded.py)."""
    root = sim_root("hgx-h100")
    version = smi(root, "--version")
    assert version.returncode == 0
    assert "gpufleet simulated nvidia-smi" in version.stderr
    assert "DRIVER version      : 535.261.03" in version.stdout
    assert "NVML version        : 535.261" in version.stdout
    assert "CUDA Version        : 12.2" in version.stdout
    summary = smi(root)
    assert summary.returncode == 0
    assert "gpufleet simulated nvidia-smi" in summary.stderr and "simulated" not in summary.stdout
    assert "simulated" not in smi(root, "-L").stderr  # outputs for scripts stay quiet
    assert "Driver Version: 535.261.03" in summary.stdout and "CUDA Version: 12.2" in summary.stdout
    assert summary.stdout.count("NVIDIA H100 80GB HBM3") == 8
    assert len(re.findall(r"\|\s+0MiB /  81559MiB \|", summary.stdout)) == 8  # right-aligned in its cell


def test_driver_not_loaded_exits_9_and_missing_library_12(fresh_root: RootFactory) -> None:
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["driver", "unloaded"])
    for args in (["-L"], ["--version"], ["topo", "-m"]):
        proc = smi(root, *args)
        assert (proc.returncode, proc.stdout.strip()) == (9, DRIVER_NOT_LOADED)
    simcontrol.inject(root, ["driver", "loaded"])
    simcontrol.inject(root, ["library", "missing"])
    proc = smi(root, "-L")
    assert (proc.returncode, proc.stdout.strip()) == (12, LIBRARY_NOT_FOUND)


def test_lost_gpu_is_named_and_exits_15(fresh_root: RootFactory) -> None:
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["gpu", "1", "lost"])
    proc = smi(root, "-L")
    assert proc.returncode == 15
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("GPU 0: Tesla T4 (UUID: GPU-")
    assert lines[1].startswith("Unable to determine the device handle for GPU00000000:C1:00.0: GPU is lost.")


def test_failure_mapping_follows_nvidia_smi_exit_codes() -> None:
    assert failure(NvmlDriverNotLoaded("x")) == (DRIVER_NOT_LOADED, 9)
    assert failure(NvmlLibraryNotFound("x")) == (LIBRARY_NOT_FOUND, 12)
    assert failure(NvmlUnavailable("x")) == (LIBRARY_NOT_FOUND, 12)
    message, code = failure(NvmlGpuLost("GPU 0: GPU is lost"))
    assert (message, code) == ("Failed to initialize NVML: GPU 0: GPU is lost", 255)


def test_sim_root_nvidia_smi_finds_its_host_tree_without_environment(sim_root: RootFactory) -> None:
    root = sim_root("pcie-2x-t4")
    env = {"PATH": os.environ["PATH"], "HOME": os.environ.get("HOME", "/")}
    proc = subprocess.run(
        [str(root / "bin/nvidia-smi"), "topo", "-m"], env=env, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1].split("\t") == ["GPU0", " X ", "NODE", "0-63", "0", "", "N/A"]
