"""The kernel log in discovery: reading /dev/kmsg or kern.log under a host root, NVRM errors, VM symptoms.

Crafted logs only; the message texts are the NVIDIA driver's and the kernel's (sources: gpu/facts.py).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from gpu_helpers import FakeHost

from gpufleet.gpu import discover
from gpufleet.gpu.device import Gpu
from gpufleet.gpu.facts import (
    SYMPTOM_BAR_UNASSIGNED,
    SYMPTOM_BIOS_FIRMWARE,
    SYMPTOM_FELL_OFF_BUS,
    SYMPTOM_INIT_FAILED,
    SYMPTOM_IOMMU_FAULT,
    SYMPTOM_NO_INTERRUPTS,
    interesting_kernel_line,
    kernel_log_errors,
    mmio_size_gb,
    vm_config_problems,
)
from gpufleet.gpu.host import HostInfo, kernel_messages, read_kernel_log

REPO = Path(__file__).resolve().parents[2]
GIB = 1 << 30

BAR1_HEAD = "NVRM: This PCI I/O region assigned to your NVIDIA device is invalid:"


def kmsg(*messages: str, start: int = 0) -> str:
    """Records as /dev/kmsg hands them out: newlines inside a message as \\x0a, plus dictionary lines."""
    out = []
    for seq, message in enumerate(messages, start):
        out.append(f"3,{seq},{seq * 1000},-;{message.replace(chr(10), chr(92) + 'x0a')}\n")
        out.append(" SUBSYSTEM=pci\n DEVICE=+pci:0000:0b:00.0\n")
    return "".join(out)


def vmware(boot_mode: str = "uefi") -> HostInfo:
    return HostInfo("6.1.0-31-amd64", False, False, boot_mode, False, "vmware", True)


def v100(bus: str, index: int = 0) -> Gpu:
    return Gpu(
        index=index, pci_bus_id=bus, model="Tesla V100-PCIE-32GB", device_id=0x1DB6, memory_total=32 * GIB
    )


TWO_V100 = [v100("0000:0b:00.0"), v100("0000:13:00.0", 1)]


# ------------------------------------------------------------------------------------------ parsing lines


@pytest.mark.parametrize(
    ("raw", "messages"),
    [
        # /dev/kmsg: the driver's two-line BAR message is one record, its newline escaped.
        (
            "3,812,4212345,-;" + BAR1_HEAD + "\\x0aNVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)",
            [BAR1_HEAD, "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"],
        ),
        ("6,339,5140900,-,caller=T1;NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.261.03  Wed",
         ["NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.261.03  Wed"]),
        ("4,9,10,-;a backslash \\x5c stays", ["a backslash \\ stays"]),
        (" SUBSYSTEM=pci", []),
        (" DEVICE=+pci:0000:0b:00.0", []),
        # kern.log as rsyslog writes it, with and without the printk time stamp; "#012" is a newline.
        (
            "Feb 09 15:47:06 debian kernel: [    4.123456] NVRM: GPU 0000:13:00.0: RmInitAdapter failed! "
            "(0x26:0x56:1463)",
            ["NVRM: GPU 0000:13:00.0: RmInitAdapter failed! (0x26:0x56:1463)"],
        ),
        (
            "2025-07-30T10:00:00.123456+00:00 gpu-01 kernel: " + BAR1_HEAD + "#012NVRM: BAR1 is 0M @ 0x0 "
            "(PCI:0000:13:00.0)",
            [BAR1_HEAD, "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:13:00.0)"],
        ),
        # dmesg output saved to a file: time stamps, continuation lines indented.
        ("[  194.072263] NVRM: BAR1 is 0M @ 0x0 (PCI:0002:00.0)", ["NVRM: BAR1 is 0M @ 0x0 (PCI:0002:00.0)"]),
        ("", []),
    ],
)
def test_kernel_messages_from_kmsg_records_and_syslog_lines(raw: str, messages: list[str]) -> None:
    assert kernel_messages(raw) == messages


# ------------------------------------------------------------------------------------------ reading the log


def test_kmsg_is_preferred_to_kern_log(host: FakeHost) -> None:
    failed = "NVRM: GPU 0000:0b:00.0: RmInitAdapter failed! (0x1:0x2:3)"
    host.write("/dev/kmsg", kmsg("Linux version 6.1.0", failed))
    host.write("/var/log/kern.log", "Jan 1 00:00:00 h kernel: NVRM: from kern.log\n")
    log = read_kernel_log(host.root)
    assert (log.source, log.unreadable, log.truncated) == ("/dev/kmsg", None, False)
    assert log.lines == ["Linux version 6.1.0", failed]


def test_kern_log_when_kmsg_cannot_be_read_and_only_its_last_boot(host: FakeHost) -> None:
    (host.root / "dev/kmsg").mkdir(parents=True)  # reading it fails (EISDIR), as EPERM would
    host.write(
        "/var/log/kern.log",
        "Jul 29 09:00:00 h kernel: [    0.000000] Linux version 6.1.0-30-amd64 (debian-kernel@debian.org)\n"
        "Jul 29 09:00:05 h kernel: [    5.000000] NVRM: Xid (PCI:0000:0b:00): 79, GPU has fallen off\n"
        "Jul 30 10:00:00 h kernel: [    0.000000] Linux version 6.1.0-31-amd64 (debian-kernel@debian.org)\n"
        "Jul 30 10:00:04 h systemd[1]: Started foo.service.\n"
        "Jul 30 10:00:05 h kernel: [    5.000000] NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.261\n",
    )
    log = read_kernel_log(host.root)
    assert log.source == "/var/log/kern.log"
    # The Xid was in the boot before: fixed by now, not reported. systemd's line is not the kernel's.
    assert log.lines == [
        "Linux version 6.1.0-31-amd64 (debian-kernel@debian.org)",
        "Jul 30 10:00:04 h systemd[1]: Started foo.service.",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.261",
    ]
    assert read_kernel_log(host.root, interesting_kernel_line).lines == [
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.261"
    ]


def test_no_log_says_why_for_each_path(host: FakeHost) -> None:
    log = read_kernel_log(host.root)
    assert log.source is None and log.lines == []
    assert log.unreadable == "/dev/kmsg: absent; /var/log/kern.log: absent"
    (host.root / "var/log/kern.log").mkdir(parents=True)
    assert read_kernel_log(host.root).unreadable == "/dev/kmsg: absent; /var/log/kern.log: Is a directory"


def test_only_the_tail_of_a_large_log_is_read(host: FakeHost) -> None:
    lines = [f"Jul 30 10:00:00 h kernel: NVRM: Xid (PCI:0000:0b:00): 13, line {i:05d}" for i in range(2000)]
    host.write("/var/log/kern.log", "\n".join(lines) + "\n")
    log = read_kernel_log(host.root, max_bytes=10_000)
    assert log.source == "/var/log/kern.log" and log.truncated
    assert log.lines[-1].endswith("line 01999")
    assert 100 < len(log.lines) < 200  # ~10 kB of ~70-byte lines; the first, cut one dropped
    assert all(line.startswith("NVRM: Xid") for line in log.lines)


def test_line_limit_keeps_the_latest(host: FakeHost) -> None:
    host.write("/dev/kmsg", kmsg(*[f"NVRM: message {i}" for i in range(50)]))
    log = read_kernel_log(host.root, max_lines=10)
    assert log.truncated and log.lines == [f"NVRM: message {i}" for i in range(40, 50)]


def test_a_kmsg_that_never_ends_does_not_block(host: FakeHost) -> None:
    """A FIFO whose writer stays open and silent: a blocking read would hang; this returns at once."""
    fifo = host.root / "dev/kmsg"
    fifo.parent.mkdir(parents=True)
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # keeps a writer open, as the kernel would be
    try:
        os.write(writer, kmsg("NVRM: GPU 0000:0b:00.0: RmInitAdapter failed! (0x1:0x2:3)").encode())
        started = time.monotonic()
        log = read_kernel_log(host.root, deadline_s=5)
        assert time.monotonic() - started < 2
        assert log.source == "/dev/kmsg"
        assert log.lines == ["NVRM: GPU 0000:0b:00.0: RmInitAdapter failed! (0x1:0x2:3)"]
    finally:
        os.close(writer)


def test_reading_stops_at_the_deadline(host: FakeHost) -> None:
    host.write("/dev/kmsg", kmsg(*[f"NVRM: message {i}" for i in range(20_000)]))
    assert len(read_kernel_log(host.root).lines) == 5000  # the line limit
    log = read_kernel_log(host.root, deadline_s=0)
    assert log.source == "/dev/kmsg" and log.truncated and log.lines == []


# ------------------------------------------------------------------------------------------ NVRM errors


def test_kernel_log_errors_are_the_failure_lines_of_the_driver() -> None:
    lines = [
        "Linux version 6.1.0-31-amd64",
        "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.261.03  Wed Jul 16 03:47:41 UTC 2025",
        "NVRM: GPU at PCI:0000:2b:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae",
        "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
        "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus.",
        "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
        "nvidia: probe of 0000:0b:00.0 failed with error -1",
        BAR1_HEAD,
        "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)",
        "NVRM: GPU 0000:13:00.0: RmInitAdapter failed! (0x24:0x72:1447)",
        "NVRM: GPU 0000:13:00.0: rm_init_adapter failed, device minor number 0",
        "NVRM: The NVIDIA probe routine failed for 1 device(s).",
        "NVRM: None of the NVIDIA devices were initialized.",
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu.",
    ]
    assert kernel_log_errors(lines) == [
        "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus.",
        "NVRM: GPU 0000:2b:00.0: GPU has fallen off the bus.",
        BAR1_HEAD,
        "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)",
        "NVRM: GPU 0000:13:00.0: RmInitAdapter failed! (0x24:0x72:1447)",
        "NVRM: GPU 0000:13:00.0: rm_init_adapter failed, device minor number 0",
        "NVRM: The NVIDIA probe routine failed for 1 device(s).",
        "NVRM: None of the NVIDIA devices were initialized.",
        "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu.",
    ]


def test_kernel_log_errors_keep_the_last_hundred() -> None:
    lines = [f"NVRM: Xid (PCI:0000:0b:00): 13, event {i}" for i in range(150)]
    assert kernel_log_errors(lines) == lines[-100:]


# ------------------------------------------------------------------------------------------ VM symptoms


def _symptoms(lines: list[str], gpus: list[Gpu] = TWO_V100, host: HostInfo | None = None) -> list[tuple]:
    return [(p.symptom, p.gpu, p.evidence) for p in vm_config_problems(lines, gpus, host or vmware())]


def test_bar1_not_mapped_is_a_mmio_window_too_small_with_the_size_to_set() -> None:
    lines = [
        "pci 0000:0b:00.0: BAR 1: no space for [mem size 0x800000000 64bit pref]",
        "pci 0000:0b:00.0: BAR 1: failed to assign [mem size 0x800000000 64bit pref]",
        BAR1_HEAD,
        "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)",
        "nvidia: probe of 0000:0b:00.0 failed with error -1",
        BAR1_HEAD,
        "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:13:00.0)",
    ]
    problems = vm_config_problems(lines, TWO_V100, vmware())
    # The NVRM line is the evidence; the kernel's own failure for the same BAR and the bare first line of the
    # driver's two-line message add nothing.
    assert [(p.symptom, p.gpu, p.evidence) for p in problems] == [
        (SYMPTOM_BAR_UNASSIGNED, "0000:0b:00.0", "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"),
        (SYMPTOM_BAR_UNASSIGNED, "0000:13:00.0", "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:13:00.0)"),
    ]
    first = problems[0]
    assert "pciPassthru.64bitMMIOSizeGB" in first.likely_cause and "use64bitMMIO" in first.likely_cause
    assert "pciPassthru.64bitMMIOSizeGB = 128" in first.fix  # 2 x 32 GB: 64, doubled, a power of two
    assert "firmware EFI" in first.fix and "pciPassthru.use64bitMMIO = TRUE" in first.fix
    assert "esxi_gpu_passthrough" in first.fix
    assert first.to_dict() == {
        "symptom": SYMPTOM_BAR_UNASSIGNED,
        "gpu": "0000:0b:00.0",
        "evidence": "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)",
        "likely_cause": first.likely_cause,
        "fix": first.fix,
    }


def test_kernel_bar_failures_alone_count_unless_a_later_pass_assigned_the_bar() -> None:
    lines = [
        # Newer kernels' wording; 0b's BAR1 fails for good, 13's is placed by a later pass (pci=realloc).
        "pci 0000:0b:00.0: BAR 1 [mem size 0x800000000 64bit pref]: can't assign; no space",
        "pci 0000:0b:00.0: BAR 1 [mem size 0x800000000 64bit pref]: failed to assign",
        "pci 0000:13:00.0: BAR 1 [mem size 0x800000000 64bit pref]: failed to assign",
        "pci 0000:13:00.0: BAR 1 [mem 0x7800000000-0x7fffffffff 64bit pref]: assigned",
        # Not one of this host's GPUs.
        "pci 0000:02:01.0: BAR 0 [mem size 0x00200000 64bit]: failed to assign",
    ]
    assert _symptoms(lines) == [(SYMPTOM_BAR_UNASSIGNED, "0000:0b:00.0", lines[1])]


def test_bar0_and_old_drivers_without_a_domain() -> None:
    bar0 = "NVRM: BAR0 is 0M @ 0x0 (PCI:0000:0b:00.0)"
    problems = vm_config_problems([BAR1_HEAD, bar0], TWO_V100, vmware())
    assert [(p.symptom, p.gpu) for p in problems] == [(SYMPTOM_BAR_UNASSIGNED, "0000:0b:00.0")]
    assert "register window (BAR0" in problems[0].likely_cause
    # An address the code cannot place on a GPU still counts, for no GPU in particular; so does the first line
    # of the message alone (its second lost, as a syslog relay might).
    old = "NVRM: BAR1 is 0M @ 0x0 (PCI:0002:00.0)"
    assert _symptoms([BAR1_HEAD, old]) == [(SYMPTOM_BAR_UNASSIGNED, None, old)]
    assert _symptoms([BAR1_HEAD]) == [(SYMPTOM_BAR_UNASSIGNED, None, BAR1_HEAD)]


def test_bios_firmware_is_named_as_the_cause() -> None:
    problems = vm_config_problems(
        [BAR1_HEAD, "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"], TWO_V100, vmware("bios")
    )
    assert [(p.symptom, p.gpu) for p in problems] == [
        (SYMPTOM_BIOS_FIRMWARE, None),
        (SYMPTOM_BAR_UNASSIGNED, "0000:0b:00.0"),
    ]
    assert problems[0].evidence == "boot_mode: bios (no /sys/firmware/efi), 64 GB of GPU memory"
    assert "EFI" in problems[0].likely_cause and "does not boot after the switch" in problems[0].fix
    assert "BIOS firmware" in problems[1].likely_cause


def test_bios_firmware_is_fine_for_gpus_of_16_gb_or_less() -> None:
    t4 = Gpu(index=0, pci_bus_id="0000:0b:00.0", model="Tesla T4", device_id=0x1EB8, memory_total=16 * GIB)
    assert vm_config_problems([], [t4], vmware("bios")) == []
    assert [p.symptom for p in vm_config_problems([], TWO_V100, vmware("bios"))] == [SYMPTOM_BIOS_FIRMWARE]


def test_init_failure_and_the_geforce_hint_for_drivers_before_r465() -> None:
    line = "NVRM: GPU 0000:0b:00.0: RmInitAdapter failed! (0x26:0x56:1463)"
    problems = vm_config_problems([line], TWO_V100, vmware(), "535.261.03")
    assert [(p.symptom, p.gpu, p.evidence) for p in problems] == [(SYMPTOM_INIT_FAILED, "0000:0b:00.0", line)]
    assert "hypervisor.cpuid.v0" not in problems[0].fix
    geforce = Gpu(index=0, pci_bus_id="0000:0b:00.0", model="NVIDIA device 0x1e07", device_id=0x1E07)
    old = vm_config_problems(
        ["NVRM: loading NVIDIA UNIX x86_64 Kernel Module  460.91.03  Fri Jul  2 06:04:10 UTC 2021", line],
        [geforce],
        vmware(),
    )
    assert 'hypervisor.cpuid.v0 = "FALSE"' in old[0].fix and "460.91.03 predates R465" in old[0].fix
    assert "hide_hypervisor" in old[0].fix


def test_fallen_off_the_bus_no_interrupts_and_iommu_faults() -> None:
    lines = [
        "NVRM: GPU at PCI:0000:13:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae",
        "NVRM: Xid (PCI:0000:13:00): 79, pid=1234, GPU has fallen off the bus.",
        "NVRM: GPU 0000:13:00.0: GPU has fallen off the bus.",
        "NVRM: GPU 0000:0b:00.0: No interrupts of any type are available. Cannot use this GPU.",
        "DMAR: DRHD: handling fault status reg 2",
        "DMAR: [DMA Read NO_PASID] Request device [0b:00.0] fault addr 0x7f000 [fault reason 0x06] PTE Read "
        "access is not set",
        "DMAR: [DMA Write NO_PASID] Request device [02:01.0] fault addr 0x1000 [fault reason 0x05] PTE Write "
        "access is not set",  # a NIC, not a GPU: not flagged
        "iommu ivhd0: AMD-Vi: Event logged [IO_PAGE_FAULT device=0000:13:00.0 domain=0x000d "
        "address=0xfffffff0 flags=0x0020]",
    ]
    problems = vm_config_problems(lines, TWO_V100, vmware())
    assert [(p.symptom, p.gpu, p.evidence) for p in problems] == [
        (SYMPTOM_FELL_OFF_BUS, "0000:13:00.0", lines[1]),
        (SYMPTOM_NO_INTERRUPTS, "0000:0b:00.0", lines[3]),
        (SYMPTOM_IOMMU_FAULT, "0000:0b:00.0", lines[5]),
        (SYMPTOM_IOMMU_FAULT, "0000:13:00.0", lines[7]),
    ]
    fell_off, _, dmar, _ = problems
    assert "Not a VM setting" in fell_off.likely_cause and "power-cycle the ESXi host" in fell_off.fix
    assert "vvtd.enable" in dmar.likely_cause and "DMA" in dmar.likely_cause and "iommu=pt" in dmar.fix


def test_older_fell_off_wordings_and_an_interrupt_remapping_fault() -> None:
    lines = [
        "NVRM: GPU at 0000:0b:00.0 has fallen off the bus.",
        "NVRM: The NVIDIA GPU 0000:13:00.0 (PCI ID: 10de:1db6) installed in this system has",
        "NVRM: fallen off the bus and is not responding to commands.",
        "DMAR: [INTR-REMAP] Request device [0x13:0x00.0] fault index 0x1c [fault reason 0x25] Blocked a "
        "compatibility format interrupt request",
    ]
    problems = vm_config_problems(lines, TWO_V100, vmware())
    assert [(p.symptom, p.gpu) for p in problems] == [
        (SYMPTOM_FELL_OFF_BUS, "0000:0b:00.0"),
        (SYMPTOM_IOMMU_FAULT, "0000:13:00.0"),
    ]
    assert "interrupts" in problems[1].likely_cause


def test_only_vmware_guests_with_gpus_get_vm_problems() -> None:
    lines = [BAR1_HEAD, "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"]
    kvm = HostInfo("6.1.0", False, False, "uefi", False, "kvm", True)
    bare = HostInfo("6.1.0", False, False, "bios", False, None, False)
    assert vm_config_problems(lines, TWO_V100, kvm) == []
    assert vm_config_problems(lines, TWO_V100, bare) == []
    assert vm_config_problems(lines, [], vmware()) == []
    assert vm_config_problems([], TWO_V100, vmware()) == []


@pytest.mark.parametrize(("total", "size"), [(11, 32), (16, 32), (32, 64), (48, 128), (64, 128), (80, 256)])
def test_mmio_size_rule(total: int, size: int) -> None:
    assert mmio_size_gb(total) == size


# ------------------------------------------------------------------------------------------ discovery


def test_discovery_reports_the_log_and_the_vm_problems(host: FakeHost) -> None:
    host.write("/sys/class/dmi/id/sys_vendor", "VMware, Inc.\n")
    host.write("/sys/class/dmi/id/product_name", "VMware7,1\n")
    (host.root / "sys/firmware/efi").mkdir(parents=True)
    host.pci("0000:0b:00.0", 0x1DB6, numa=-1)
    bar1 = "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"
    host.write("/dev/kmsg", kmsg("Linux version 6.1.0", f"{BAR1_HEAD}\n{bar1}"))
    d = discover(host.root).to_dict()
    assert (d["kernel_log_source"], d["kernel_log_unreadable"], d["kernel_log_truncated"]) == (
        "/dev/kmsg", None, False
    )
    assert d["kernel_log_errors"] == [BAR1_HEAD, bar1]
    (problem,) = d["vm_config_problems"]
    assert problem["symptom"] == SYMPTOM_BAR_UNASSIGNED and problem["gpu"] == "0000:0b:00.0"
    assert "pciPassthru.64bitMMIOSizeGB = 64" in problem["fix"]  # one 32 GB V100

    skipped = discover(host.root, with_kernel_log=False).to_dict()
    assert skipped["kernel_log_source"] is None and skipped["kernel_log_unreadable"] == "not read"
    assert skipped["kernel_log_errors"] == [] and skipped["vm_config_problems"] == []


def test_discovery_without_a_log_says_so(host: FakeHost) -> None:
    host.pci("0000:07:00.0", 0x20B2)
    d = discover(host.root).to_dict()
    assert d["kernel_log_source"] is None
    assert d["kernel_log_unreadable"] == "/dev/kmsg: absent; /var/log/kern.log: absent"
    assert d["kernel_log_errors"] == [] and d["vm_config_problems"] == []


def _python38() -> str | None:
    """A Python 3.8 that runs (a pyenv shim on PATH may not), or None."""
    pyenv = sorted(Path.home().glob(".pyenv/versions/3.8*/bin/python3.8"), reverse=True)
    candidates = [str(p) for p in pyenv]
    candidates += [found] if (found := shutil.which("python3.8")) else []
    for python in candidates:
        if subprocess.run([python, "-c", "pass"], capture_output=True, check=False).returncode == 0:
            return python
    return None


def test_kernel_log_discovery_runs_on_python_38(host: FakeHost, tmp_path: Path) -> None:
    """What Ansible ships (plugins/module_utils/gpu) runs on the oldest target Python, where there is one."""
    python = _python38()
    if python is None:
        pytest.skip("no Python 3.8 on this machine")
    package = tmp_path / "lib" / "gpu"
    package.mkdir(parents=True)
    for path in (REPO / "plugins/module_utils/gpu").glob("*.py"):
        shutil.copy(path.resolve(), package / path.name)
    host.write("/sys/class/dmi/id/sys_vendor", "VMware, Inc.\n")
    (host.root / "sys/firmware/efi").mkdir(parents=True)
    host.pci("0000:0b:00.0", 0x1DB6, numa=-1)
    host.write("/dev/kmsg", kmsg(BAR1_HEAD + "\nNVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"))
    code = (
        "import json, sys; from gpu.facts import discover; "
        "d = discover(sys.argv[1], use_nvml=False).to_dict(); "
        "print(json.dumps([sys.version_info[:2], d['kernel_log_source'], d['vm_config_problems'][0]['gpu']]))"
    )
    argv = [python, "-c", code, str(host.root)]
    proc = subprocess.run(argv, cwd=tmp_path / "lib", capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == '[[3, 8], "/dev/kmsg", "0000:0b:00.0"]'
