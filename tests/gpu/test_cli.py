"""`gpufleet gpu facts|topo` on hand-built and simulated hosts."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from gpu_helpers import FakeHost, run_in_sim

from gpufleet.cli import main


def test_facts_summary_from_sysfs(host: FakeHost, capsys: pytest.CaptureFixture[str]) -> None:
    host.pci("0000:07:00.0", 0x20B2, numa=0)
    host.pci("0000:c4:00.0", 0x1AF1, klass=0x068000)
    assert main(["gpu", "facts", "--host-root", str(host.root)]) == 0
    out = capsys.readouterr().out
    assert "source:      sysfs (NVML unavailable:" in out
    assert "GPU 0   NVIDIA A100-SXM4-80GB" in out and "81920 MiB  0000:07:00.0  NUMA 0" in out
    assert "NVSwitches:  1 (fabricmanager required)" in out


def test_topo_needs_nvml(host: FakeHost, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["gpu", "topo", "--host-root", str(host.root)]) == 1
    assert "no topology: NVML is not available" in capsys.readouterr().out


def test_topo_on_a_simulated_t4_box(sim_root: Callable[[str], Path]) -> None:
    proc = run_in_sim(sim_root("pcie-2x-t4"), ["-m", "gpufleet.cli", "gpu", "topo"])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[1:3] == ["GPU0\t X \tNODE\t0-63\t0\tN/A", "GPU1\tNODE\t X \t0-63\t0\tN/A"]


def test_topo_of_the_recorded_h200_vm_gives_its_numa_affinity_as_nvidia_smi_did(
    sim_root: Callable[[str], Path],
) -> None:
    """sysfs numa_node -1 (a VM): the GPU is near every node, so NUMA Affinity is the host's online nodes,
    `0` where the real nvidia-smi printed `0` (tests/realgpu/h200-580.159.04/smi-topo.txt), not N/A."""
    proc = run_in_sim(sim_root("firecracker-vm-h200"), ["-m", "gpufleet.cli", "gpu", "topo"])
    assert proc.returncode == 0, proc.stderr
    cells = proc.stdout.splitlines()[1].split("\t")
    assert cells[:2] == ["GPU0", " X "] and cells[3] == "0"


def test_facts_summary_shows_the_vm_problems_of_an_esxi_guest(sim_root: Callable[[str], Path]) -> None:
    proc = run_in_sim(sim_root("esxi-vm-small-mmio"), ["-m", "gpufleet.cli", "gpu", "facts"])
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "source:      sysfs (NVML unavailable: NVML init: Driver Not Loaded)" in out
    assert "kernel log:  /dev/kmsg, 5 NVRM error line(s)" in out
    assert "  NVRM: BAR1 is 0M @ 0x0 (PCI:0000:13:00.0)" in out
    assert "VM config:   2 problem(s) seen from the guest" in out
    assert "  GPU 0000:0b:00.0: gpu_bar_unassigned: NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)" in out
    assert out.count("    fix:   Power the VM off and set: firmware EFI, pciPassthru.use64bitMMIO = TRUE, "
                     "pciPassthru.64bitMMIOSizeGB = 128") == 2


def test_facts_summary_of_a_healthy_esxi_guest(sim_root: Callable[[str], Path]) -> None:
    proc = run_in_sim(sim_root("esxi-vm-2x-v100"), ["-m", "gpufleet.cli", "gpu", "facts"])
    assert proc.returncode == 0, proc.stderr
    assert "kernel log:  /dev/kmsg, 0 NVRM error line(s)\nVM config:   no problem seen from the guest\n" in (
        proc.stdout
    )


def test_facts_summary_says_when_there_is_no_kernel_log(
    host: FakeHost, capsys: pytest.CaptureFixture[str]
) -> None:
    host.pci("0000:07:00.0", 0x20B2, numa=0)
    assert main(["gpu", "facts", "--host-root", str(host.root)]) == 0
    assert "kernel log:  not read (/dev/kmsg: absent; /var/log/kern.log: absent)" in capsys.readouterr().out
