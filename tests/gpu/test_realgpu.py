"""Discovery on what a real H200 answered: `nvidia-smi topo -m` as it printed it (terminal escapes and all),
and NVML's recorded answers through the unmodified discovery code.

Recordings: tests/realgpu/h200-580.159.04/, copied verbatim from the lead's capture of 2026-11-28
(tests/realgpu/README.md); `command_output` takes off the recorder's closing `rc=0`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpufleet.gpu import discover
from gpufleet.gpu import nvml as gpu_nvml
from gpufleet.gpu.topology import from_nvidia_smi, parse_matrix
from gpufleet_harness import realgpu

H200 = realgpu.H200


def test_the_real_topology_matrix_is_read() -> None:
    """One GPU, its affinity columns (`0-15`, NUMA `0`, GPU NUMA ID `N/A`) ignored, the legend not a row."""
    text = realgpu.command_output(H200 / "smi-topo.txt")
    assert text.startswith("\t\x1b[4mGPU0\tCPU Affinity")
    topo = parse_matrix(text)
    assert (topo.indices, topo.matrix, topo.nvlinks) == ([0], [["X"]], [[0]])


def test_the_real_topology_through_nvidia_smi_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`from_nvidia_smi` runs `nvidia-smi topo -m` from PATH: here a stand-in printing the recorded bytes."""
    recorded = tmp_path / "topo.txt"
    recorded.write_text(realgpu.command_output(H200 / "smi-topo.txt"))
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\n[ "$1 $2" = "topo -m" ] || exit 2\nexec cat {recorded}\n')
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert from_nvidia_smi().matrix == [["X"]]


def test_discovery_on_the_recorded_nvml_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gpufleet gpu facts`' discovery on NVML's recorded answers: what the real run printed. (The replay
    loads no NVML library, so it may run in the test process: conftest's refusal is lifted for it.)"""
    replay = realgpu.replay_pynvml(realgpu.load_probe(H200))
    monkeypatch.setattr(gpu_nvml, "load_pynvml", lambda: replay)
    facts = discover(realgpu.host_root(tmp_path / "host", H200), with_kernel_log=False)
    assert facts.source == "nvml", facts.nvml_error
    (gpu,) = facts.gpus
    assert (gpu.model, gpu.memory_mib, gpu.compute_capability, gpu.architecture) == (
        "NVIDIA H200", 143771, "9.0", "Hopper",
    )  # fmt: skip
    assert (gpu.pci_bus_id, gpu.device_id, gpu.numa_node, gpu.kernel_driver) == (
        "0000:00:06.0",
        0x2335,
        None,
        "nvidia",
    )
    assert (gpu.persistence_mode, gpu.mig.current if gpu.mig else None, gpu.nvlinks, gpu.fabric) == (
        True,
        False,
        [],
        None,
    )
    assert (facts.driver.userspace_version, facts.driver.cuda_driver_version) == ("580.159.04", "13.0")
    assert facts.driver.nvml_version == "13.580.159.04" and facts.nvswitch_count == 0
