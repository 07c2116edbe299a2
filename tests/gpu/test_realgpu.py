"""Discovery on what a real H200 answered: `nvidia-smi topo -m` as it printed it (terminal escapes and all),
NVML's recorded answers through the unmodified discovery code, and the vGPU reading of PCI configuration
spaces (recorded: a passthrough GPU; the vGPU shape built here to the layout the parser documents).

Recordings: tests/realgpu/h200-580.159.04/, copied verbatim from the lead's capture of 2026-11-28
(tests/realgpu/README.md); `command_output` takes off the recorder's closing `rc=0`.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gpufleet.gpu import discover, pci
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


# ----- vGPU: the PCI vendor capability ---------------------------------------------------------------------


def _config(capabilities: list[bytes], status: int = 0x10) -> bytes:
    """A 256-byte configuration space holding `capabilities` chained from 0x40 (each: id, next, rest)."""
    space = bytearray(256)
    space[0:2] = b"\xde\x10"
    space[0x06] = status
    pos = 0x40
    space[0x34] = pos if capabilities else 0
    for n, cap in enumerate(capabilities):
        following = pos + 0x20 if n + 1 < len(capabilities) else 0
        space[pos : pos + len(cap)] = cap[:1] + bytes([following]) + cap[2:]
        pos = following
    return bytes(space)


POWER = bytes([0x01, 0, 8, 0, 0, 0, 0, 0])


def _vgpu_capability(records: bytes) -> bytes:
    body = b"VF" + records
    return bytes([0x09, 0, 3 + len(body)]) + body


def test_a_vgpu_capability_names_the_host_driver() -> None:
    version_record = bytes([0, 22]) + b"550.54.10\0" + b"r550_00\0\0\0"
    config = _config([POWER, _vgpu_capability(bytes([7, 4, 0, 0]) + version_record)])
    found = pci.vgpu_capability("0000:02:00.0", pci.vendor_capability(config))
    assert found == pci.VgpuCapability("0000:02:00.0", "550.54.10", "r550_00")
    # Signature without a version record: a vGPU, host unknown.
    bare = pci.vgpu_capability("x", pci.vendor_capability(_config([_vgpu_capability(bytes([7, 0]))])))
    assert bare == pci.VgpuCapability("x")


def test_configuration_spaces_without_a_vgpu() -> None:
    assert pci.vendor_capability(_config([POWER])) is None
    assert pci.vendor_capability(_config([POWER], status=0)) is None  # no capability list at all
    other = bytes([0x09, 0, 8]) + b"XYZ\0\0"  # vendor-specific, not a vGPU's
    assert pci.vgpu_capability("x", pci.vendor_capability(_config([other]))) is None
    looped = bytearray(_config([POWER]))
    looped[0x41] = 0x40  # the chain points at itself
    assert pci.vendor_capability(bytes(looped)) is None
    with pytest.raises(ValueError, match="64 bytes of PCI configuration space, 256 needed"):
        pci.vendor_capability(_config([POWER])[:64])  # what an unprivileged reader gets


def test_vgpus_of_a_host_root(tmp_path: Path) -> None:
    """Every NVIDIA function's configuration space is read; one short read and nobody can tell."""
    root = realgpu.host_root(tmp_path / "host", H200)
    devices = pci.scan(root)
    entry = root / "sys/bus/pci/devices/0000:00:06.0/config"
    entry.write_bytes(_config([POWER]))
    assert pci.vgpus(root, devices) == []
    entry.write_bytes(_config([POWER, _vgpu_capability(bytes([7, 0]))]))
    assert pci.vgpus(root, devices) == [pci.VgpuCapability("0000:00:06.0")]
    entry.write_bytes(_config([POWER])[:64])
    assert pci.vgpus(root, devices) is None
