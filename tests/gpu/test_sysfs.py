"""PCI discovery and host facts from hand-built sysfs/procfs trees: what works before any driver exists."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from gpu_helpers import FakeHost

from gpufleet.gpu import SOURCE_SYSFS, discover, normalize_bus_id, nvml_bus_id, pci
from gpufleet.gpu.host import SECURE_BOOT_VAR, host_info, kernel_module_version, resolve_root

REPO = Path(__file__).resolve().parents[2]


def test_scan_finds_nvidia_gpus_and_nvswitches_in_bus_order(host: FakeHost) -> None:
    host.pci("0000:0f:00.0", 0x20B2, numa=1, driver="nvidia")
    host.pci("0000:07:00.0", 0x20B2, numa=0, driver="nvidia")
    host.pci("0000:c4:00.0", 0x1AF1, klass=0x068000)
    host.pci("0000:07:00.1", 0x10F8, klass=0x040300)  # HDMI audio function of a GPU
    host.pci("0000:00:1f.0", 0x1234, vendor=0x8086)  # not NVIDIA's
    devices = pci.scan(host.root)
    assert [d.bus_id for d in devices] == ["0000:07:00.0", "0000:07:00.1", "0000:0f:00.0", "0000:c4:00.0"]
    assert [d.bus_id for d in pci.gpus(devices)] == ["0000:07:00.0", "0000:0f:00.0"]
    assert [d.bus_id for d in pci.nvswitches(devices)] == ["0000:c4:00.0"]
    first = devices[0]
    assert (first.device_id, first.numa_node, first.driver) == (0x20B2, 0, "nvidia")
    assert first.model is not None and first.model.name == "NVIDIA A100-SXM4-80GB"


def test_vga_class_counts_as_gpu_and_unbound_device_has_no_driver(host: FakeHost) -> None:
    host.pci("0000:41:00.0", 0x1EB8, klass=0x030000, numa=-1)
    (gpu,) = pci.gpus(pci.scan(host.root))
    assert gpu.driver is None
    assert gpu.numa_node is None  # sysfs says -1 where the platform has no NUMA information


def test_driver_bound_to_vfio_is_reported(host: FakeHost) -> None:
    host.pci("0000:41:00.0", 0x1DB6, driver="vfio-pci")
    assert pci.scan(host.root)[0].driver == "vfio-pci"


def test_no_sysfs_means_no_devices(tmp_path: Path) -> None:
    assert pci.scan(tmp_path) == []


@pytest.mark.parametrize(
    ("device_id", "name", "cc", "arch"),
    [
        (0x20B2, "NVIDIA A100-SXM4-80GB", "8.0", "Ampere"),
        (0x20B0, "NVIDIA A100-SXM4-40GB", "8.0", "Ampere"),
        (0x20F1, "NVIDIA A100-PCIE-40GB", "8.0", "Ampere"),
        (0x2330, "NVIDIA H100 80GB HBM3", "9.0", "Hopper"),
        (0x2331, "NVIDIA H100 PCIe", "9.0", "Hopper"),
        (0x1EB8, "Tesla T4", "7.5", "Turing"),
        (0x1DB6, "Tesla V100-PCIE-32GB", "7.0", "Volta"),
        (0x1DB1, "Tesla V100-SXM2-16GB", "7.0", "Volta"),
        (0x1DB5, "Tesla V100-SXM2-32GB", "7.0", "Volta"),
        (0x27B8, "NVIDIA L4", "8.9", "Ada"),
        (0x26B9, "NVIDIA L40S", "8.9", "Ada"),
        (0x2236, "NVIDIA A10", "8.6", "Ampere"),
        (0x20B7, "NVIDIA A30", "8.0", "Ampere"),
    ],
)
def test_model_table_names_gpus_before_a_driver_exists(
    host: FakeHost, device_id: int, name: str, cc: str, arch: str
) -> None:
    host.pci("0000:07:00.0", device_id)
    (gpu,) = discover(host.root, use_nvml=False).gpus
    assert (gpu.model, gpu.compute_capability, gpu.architecture) == (name, cc, arch)
    assert gpu.memory_mib is not None and gpu.memory_mib % 1024 == 0


def test_unknown_device_is_named_by_its_id(host: FakeHost) -> None:
    host.pci("0000:07:00.0", 0xABCD)
    (gpu,) = discover(host.root, use_nvml=False).gpus
    assert gpu.model == "NVIDIA device 0xabcd"
    assert gpu.memory_mib is None and gpu.compute_capability is None


@pytest.mark.parametrize(
    ("given", "sysfs", "nvml"),
    [
        ("00000000:07:00.0", "0000:07:00.0", "00000000:07:00.0"),
        ("0000:c4:00.0", "0000:c4:00.0", "00000000:C4:00.0"),
        ("07:00.0", "0000:07:00.0", "00000000:07:00.0"),
        ("0001:BD:1F.7", "0001:bd:1f.7", "00000001:BD:1F.7"),
    ],
)
def test_bus_ids_normalize_both_ways(given: str, sysfs: str, nvml: str) -> None:
    assert normalize_bus_id(given) == sysfs
    assert nvml_bus_id(given) == nvml


def test_malformed_bus_id_is_rejected() -> None:
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalize_bus_id("GPU-1234")


def test_host_root_defaults_to_the_environment_then_slash(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_HOST_ROOT", raising=False)
    assert resolve_root() == Path("/")
    monkeypatch.setenv("GPUFLEET_HOST_ROOT", "/srv/host")
    assert resolve_root() == Path("/srv/host")
    assert resolve_root("/explicit") == Path("/explicit")


def test_discovery_without_driver_reads_sysfs_and_says_why(host: FakeHost) -> None:
    host.pci("0000:07:00.0", 0x20B2)
    host.pci("0000:c4:00.0", 0x1AF1, klass=0x068000)
    facts = discover(host.root)  # NVML is refused in this process, as on a host without pynvml
    assert facts.source == SOURCE_SYSFS
    assert facts.nvml_error and "child processes" in facts.nvml_error
    assert facts.topology is None
    assert (facts.nvswitch_count, facts.fabricmanager_required) == (1, True)
    assert not facts.driver.loaded
    d = facts.to_dict()
    assert d["gpus"][0]["uuid"] is None
    assert d["gpus"][0]["memory_mib"] == 81920
    assert d["gpus"][0]["pci_device_id"] == "0x20b2"


def test_kernel_module_version_from_sysfs_or_proc_banner(host: FakeHost) -> None:
    assert kernel_module_version(host.root) is None
    host.write(
        "/proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  Wed Jul 30 2025\nGCC version:  gcc 12\n",
    )
    assert kernel_module_version(host.root) == "535.261.03"
    host.write(
        "/proc/driver/nvidia/version",
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  550.54.14  Release Build\n",
    )
    assert kernel_module_version(host.root) == "550.54.14"
    host.write("/sys/module/nvidia/version", "535.216.03\n")
    assert kernel_module_version(host.root) == "535.216.03"


@pytest.mark.parametrize(
    ("efi", "value", "mode", "secure"),
    [
        (False, None, "bios", False),
        (True, None, "uefi", None),
        (True, 0, "uefi", False),
        (True, 1, "uefi", True),
    ],
)
def test_secure_boot_from_efivars(
    host: FakeHost, efi: bool, value: int | None, mode: str, secure: bool | None
) -> None:
    host.write("/sys/class/dmi/id/sys_vendor", "Dell Inc.\n")
    if efi:
        (host.root / "sys/firmware/efi/efivars").mkdir(parents=True)
    if value is not None:
        host.write(f"/sys/firmware/efi/efivars/{SECURE_BOOT_VAR}", b"\x06\x00\x00\x00" + bytes([value]))
    info = host_info(host.root)
    assert (info.boot_mode, info.secure_boot) == (mode, secure)


@pytest.mark.parametrize(
    ("vendor", "product", "flag", "expected"),
    [
        ("VMware, Inc.", "VMware7,1", True, "vmware"),
        ("QEMU", "Standard PC (Q35 + ICH9, 2009)", True, "qemu"),
        ("Red Hat", "KVM", True, "kvm"),
        ("Microsoft Corporation", "Virtual Machine", True, "hyperv"),
        ("Microsoft Corporation", "Surface Laptop 5", False, None),
        ("Xen", "HVM domU", True, "xen"),
        ("Supermicro", "AS -1114S-WN10RT", True, "unknown"),
        ("NVIDIA", "DGXA100 920-23687-2530-000", False, None),
    ],
)
def test_hypervisor_from_dmi_and_cpu_flag(
    host: FakeHost, vendor: str, product: str, flag: bool, expected: str | None
) -> None:
    host.write("/sys/class/dmi/id/sys_vendor", vendor + "\n")
    host.write("/sys/class/dmi/id/product_name", product + "\n")
    flags = "fpu vme de pse" + (" hypervisor" if flag else "") + " lahf_lm"
    host.write("/proc/cpuinfo", f"processor\t: 0\nflags\t\t: {flags}\n\n")
    info = host_info(host.root)
    assert info.hypervisor == expected
    assert info.virtualized == (expected is not None)


def test_nouveau_nvidia_module_kernel_release_and_device_nodes(host: FakeHost) -> None:
    host.write("/sys/module/nouveau/initstate", "live\n")
    host.write("/proc/sys/kernel/osrelease", "6.1.0-28-amd64\n")
    for name in ("nvidia10", "nvidia2", "nvidiactl", "nvidia-uvm", "null"):
        host.write(f"/dev/{name}", "")
    info = host_info(host.root)
    assert info.nouveau_loaded and not info.nvidia_module_loaded
    assert info.kernel_release == "6.1.0-28-amd64"
    assert info.device_nodes == ["nvidia2", "nvidia10", "nvidia-uvm", "nvidiactl"]


def test_discovery_code_shipped_to_ansible_targets_parses_as_python_38() -> None:
    """plugins/module_utils/gpu runs on targets as old as Python 3.8: no newer syntax there."""
    shipped = sorted((REPO / "plugins/module_utils/gpu").glob("*.py"))
    assert {p.name for p in shipped} >= {"__init__.py", "facts.py", "nvml.py", "pci.py", "host.py"}
    for path in shipped:
        assert path.is_symlink() and path.resolve().parent == REPO / "src/gpufleet/gpu"
        ast.parse(path.read_text(), filename=str(path), feature_version=(3, 8))
