"""Discovery against every simulator fixture: sysfs in this process, NVML in a child process per root.

The expected values come from each root's machine.json (what the simulated library answers from), so
these tests hold for any fixture the simulator grows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import FIXTURES, HEALTHY, facts_in_sim, run_in_sim

from gpufleet.gpu import SOURCE_NVML, SOURCE_SYSFS, discover, normalize_bus_id
from gpufleet.gpu.facts import TOPOLOGY_SMI
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

MIB = 1 << 20
# nvmlGpuTopologyLevel_t → what nvidia-smi topo -m prints, written out independently of the code.
SMI_LEVELS = {10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}

RootFactory = Callable[[str], Path]


@pytest.fixture(scope="module")
def nvml_facts(sim_root: RootFactory) -> Callable[[str], dict[str, Any]]:
    """Facts discovered through NVML for a fixture, one child process per fixture."""
    cache: dict[str, dict[str, Any]] = {}

    def get(fixture: str) -> dict[str, Any]:
        if fixture not in cache:
            cache[fixture] = facts_in_sim(sim_root(fixture))
        return cache[fixture]

    return get


def _numa(node: int) -> int | None:
    return node if node >= 0 else None


@pytest.mark.parametrize("fixture", FIXTURES)
def test_sysfs_discovery_on_sim_root_matches_the_machine(sim_root: RootFactory, fixture: str) -> None:
    root = sim_root(fixture)
    machine = simmachine.load_machine(root)
    gpus = machine["gpus"]
    host = machine["host"]
    loaded = host["driver_loaded"]  # false where the fixture's driver failed to load (esxi-vm-small-mmio)
    facts = discover(root / "host")  # NVML is refused in this process: sysfs only
    assert facts.source == SOURCE_SYSFS
    assert [g.pci_bus_id for g in facts.gpus] == [normalize_bus_id(g["bus_id"]) for g in gpus]
    assert [g.model for g in facts.gpus] == [g["name"] for g in gpus]
    assert [g.numa_node for g in facts.gpus] == [_numa(g["numa_node"]) for g in gpus]
    assert [g.compute_capability for g in facts.gpus] == ["{}.{}".format(*g["cuda_cc"]) for g in gpus]
    assert all(g.kernel_driver == ("nvidia" if loaded else None) for g in facts.gpus)
    assert facts.nvswitch_count == len(machine["nvswitches"])
    assert facts.fabricmanager_required == bool(machine["nvswitches"])
    assert facts.driver.loaded == loaded
    assert facts.driver.kernel_module_version == (machine["kernel_module_version"] if loaded else None)
    # No EFI (secure_boot null: Firecracker boots the kernel directly) is a BIOS boot, without Secure Boot.
    assert facts.host.secure_boot == bool(host["secure_boot"])
    assert facts.host.nouveau_loaded == host["nouveau_loaded"]
    # The hypervisor is named by DMI; a guest without DMI (Firecracker) shows only the CPU's flag.
    named = (host["hypervisor"] or "").lower() if host["dmi"] else "unknown"
    assert facts.host.hypervisor == (named if host["hypervisor"] else None)
    nodes = [f"nvidia{i}" for i in range(len(gpus))] if loaded else []
    assert facts.host.device_nodes[: len(gpus)] == nodes
    # Every sim root has a kernel log; the healthy machines' has nothing to complain about.
    assert facts.kernel_log is not None and facts.kernel_log.source == "/dev/kmsg"
    if loaded and not host["kernel_log"][2:]:  # the boot banner and the driver's "loading" line only
        version, built = machine["driver_version"], simmachine.DRIVER_BUILD_DATE
        loading = f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {version}  {built}"
        if "kernel_module_banner" in simmachine.load_fixture(fixture)[1]["host"]:  # the recorded open module
            loading = f"NVRM: loading NVIDIA UNIX Open Kernel Module for x86_64  {version}  Release Build  " \
                      "(nixbld@)"
        assert facts.kernel_log.lines == [loading]
        assert facts.kernel_log_errors == [] and facts.vm_config_problems == []


@pytest.mark.parametrize("fixture", HEALTHY)
def test_nvml_discovery_on_sim_root_matches_the_machine(
    nvml_facts: Callable[[str], dict[str, Any]], sim_root: RootFactory, fixture: str
) -> None:
    machine = simmachine.load_machine(sim_root(fixture))
    facts = nvml_facts(fixture)
    assert facts["source"] == SOURCE_NVML and facts["nvml_error"] is None
    assert facts["gpu_count"] == len(machine["gpus"])
    for got, want in zip(facts["gpus"], machine["gpus"], strict=True):
        assert got["index"] == want["index"]
        assert got["uuid"] == want["uuid"]
        assert got["model"] == want["name"]
        assert got["memory_mib"] == want["memory"]["total"] // MIB
        assert got["pci_bus_id"] == normalize_bus_id(want["bus_id"])
        assert got["numa_node"] == _numa(want["numa_node"])
        assert got["compute_capability"] == "{}.{}".format(*want["cuda_cc"])
        assert got["minor"] == want["minor"]
        assert got["persistence_mode"] == (want["persistence_mode"] == 1)
        assert (got["mig_mode"] is None) == (want["mig_mode"] is None)
        assert got["nvlinks"] == got["nvlinks_active"] == len(want["nvlinks"])
        assert got["fabric_state"] == ("completed" if want["fabric"] else None)
        assert not got["lost"]
    assert facts["driver_loaded"] and not facts["driver_version_mismatch"]
    assert facts["driver_version_userspace"] == machine["driver_version"]
    assert facts["driver_version_kernel"] == machine["kernel_module_version"]
    cuda = machine["cuda_driver_version"]
    assert facts["cuda_driver_version"] == f"{cuda // 1000}.{cuda % 1000 // 10}"
    assert facts["nvswitch_count"] == len(machine["nvswitches"])
    assert facts["fabric_symptoms"] == []
    topo = facts["topology"]
    assert topo["gpus"] == list(range(len(machine["gpus"])))
    if not any(g["nvlinks"] for g in machine["gpus"]):
        # The diagonal is INTERNAL (0), which nvidia-smi prints as X.
        assert topo["matrix"] == [[SMI_LEVELS.get(lvl, "X") for lvl in row] for row in machine["topology"]]


@pytest.mark.parametrize(
    ("fixture", "label"),
    [("dgx-a100", "NV12"), ("hgx-h100", "NV18"), ("pcie-2x-t4", "NODE"), ("esxi-vm-2x-v100", "PHB")],
)
def test_topology_is_what_nvidia_smi_topo_shows(
    nvml_facts: Callable[[str], dict[str, Any]], fixture: str, label: str
) -> None:
    matrix = nvml_facts(fixture)["topology"]["matrix"]
    size = len(matrix)
    assert matrix == [["X" if i == j else label for j in range(size)] for i in range(size)]


# Discovery where the Python has no pynvml (gpu_facts with a node's system Python): the rest from sysfs.
WITHOUT_PYNVML = (
    "import json, sys; sys.modules['pynvml'] = None; from gpufleet.gpu import discover; "
    "print(json.dumps(discover().to_dict()))"
)


@pytest.mark.parametrize(("fixture", "label"), [("dgx-a100", "NV12"), ("pcie-2x-t4", "NODE")])
def test_without_pynvml_the_topology_comes_from_nvidia_smi(
    nvml_facts: Callable[[str], dict[str, Any]], sim_root: RootFactory, fixture: str, label: str
) -> None:
    run = run_in_sim(sim_root(fixture), ["-c", WITHOUT_PYNVML])
    assert run.returncode == 0, run.stderr
    facts = json.loads(run.stdout)
    assert facts["source"] == SOURCE_SYSFS and "pynvml" in facts["nvml_error"]
    assert facts["topology_source"] == TOPOLOGY_SMI and facts["topology_error"] is None
    assert facts["topology"] == nvml_facts(fixture)["topology"]
    assert facts["topology"]["matrix"][0][1] == label
    assert nvml_facts(fixture)["topology_source"] == SOURCE_NVML


def test_without_pynvml_or_driver_there_is_no_topology_and_the_reason(fresh_root: RootFactory) -> None:
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["driver", "unloaded"])
    run = run_in_sim(root, ["-c", WITHOUT_PYNVML])
    facts = json.loads(run.stdout)
    assert facts["topology"] is None and facts["topology_source"] is None
    assert "nvidia-smi topo -m exited" in facts["topology_error"], facts["topology_error"]


def test_no_driver_falls_back_to_sysfs(fresh_root: RootFactory) -> None:
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["driver", "unloaded"])
    facts = facts_in_sim(root)
    assert facts["source"] == SOURCE_SYSFS
    assert "Driver Not Loaded" in facts["nvml_error"]
    assert not facts["driver_loaded"] and facts["driver_version_kernel"] is None
    assert [g["model"] for g in facts["gpus"]] == ["Tesla T4", "Tesla T4"]
    assert all(g["uuid"] is None and g["kernel_driver"] is None for g in facts["gpus"])


def test_missing_library_falls_back_to_sysfs(fresh_root: RootFactory) -> None:
    root = fresh_root("esxi-vm-2x-v100")
    simcontrol.inject(root, ["library", "missing"])
    facts = facts_in_sim(root)
    assert facts["source"] == SOURCE_SYSFS
    assert "Not Found" in facts["nvml_error"]
    assert facts["gpu_count"] == 2 and facts["hypervisor"] == "vmware"


def test_fabricmanager_stopped_on_a100_shows_inactive_links_and_pcie_paths(fresh_root: RootFactory) -> None:
    root = fresh_root("dgx-a100")
    simcontrol.inject(root, ["fabricmanager", "stopped"])
    facts = facts_in_sim(root)
    assert facts["fabricmanager_required"]
    assert facts["fabric_symptoms"] == [f"GPU {i}: 12 of 12 NVLinks to NVSwitches inactive" for i in range(8)]
    machine = simmachine.load_machine(root)
    assert facts["topology"]["matrix"][0][1:] == [SMI_LEVELS[level] for level in machine["topology"][0][1:]]


def test_fabricmanager_stopped_on_h100_leaves_fabric_not_started(fresh_root: RootFactory) -> None:
    root = fresh_root("hgx-h100")
    simcontrol.inject(root, ["fabricmanager", "stopped"])
    facts = facts_in_sim(root)
    assert {g["fabric_state"] for g in facts["gpus"]} == {"not-started"}
    assert "GPU 0: fabric state not-started" in facts["fabric_symptoms"]
    assert "GPU 0: 18 of 18 NVLinks to NVSwitches inactive" in facts["fabric_symptoms"]


def test_lost_gpu_is_listed_as_lost_and_the_rest_still_discovered(fresh_root: RootFactory) -> None:
    root = fresh_root("dgx-a100")
    simcontrol.inject(root, ["gpu", "3", "lost"])
    facts = facts_in_sim(root)
    assert facts["source"] == SOURCE_NVML
    assert [g["lost"] for g in facts["gpus"]] == [i == 3 for i in range(8)]
    lost = facts["gpus"][3]
    assert lost["uuid"] is None and lost["pci_bus_id"] == "0000:4e:00.0"
    assert facts["topology"]["matrix"][3] == ["N/A", "N/A", "N/A", "X", "N/A", "N/A", "N/A", "N/A"]
    assert facts["topology"]["matrix"][0][1] == "NV12"


def test_vm_with_a_small_mmio_window_shows_why_its_driver_did_not_load(sim_root: RootFactory) -> None:
    """esxi-vm-small-mmio: 64bitMMIOSizeGB 16 for two 32 GB V100s; the driver refused both, did not load."""
    facts = facts_in_sim(sim_root("esxi-vm-small-mmio"))  # through NVML where it answers, as gpu_facts does
    assert facts["source"] == SOURCE_SYSFS and "Driver Not Loaded" in facts["nvml_error"]
    assert facts["hypervisor"] == "vmware" and facts["gpu_count"] == 2 and facts["device_nodes"] == []
    assert facts["kernel_log_source"] == "/dev/kmsg" and facts["kernel_log_unreadable"] is None
    assert facts["kernel_log_errors"] == [
        "NVRM: This PCI I/O region assigned to your NVIDIA device is invalid:",
        "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)",
        "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:13:00.0)",
        "NVRM: The NVIDIA probe routine failed for 2 device(s).",
        "NVRM: None of the NVIDIA devices were initialized.",
    ]
    problems = facts["vm_config_problems"]
    assert [(p["symptom"], p["gpu"], p["evidence"]) for p in problems] == [
        ("gpu_bar_unassigned", "0000:0b:00.0", "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"),
        ("gpu_bar_unassigned", "0000:13:00.0", "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:13:00.0)"),
    ]
    assert all("pciPassthru.64bitMMIOSizeGB = 128" in p["fix"] for p in problems)


def test_healthy_vm_has_a_kernel_log_and_no_vm_problems(nvml_facts: Callable[[str], dict[str, Any]]) -> None:
    facts = nvml_facts("esxi-vm-2x-v100")
    assert facts["source"] == SOURCE_NVML and facts["hypervisor"] == "vmware"
    assert (facts["kernel_log_source"], facts["kernel_log_errors"], facts["vm_config_problems"]) == (
        "/dev/kmsg", [], []
    )


def test_lost_gpu_logged_by_the_driver_is_a_vm_symptom_too(fresh_root: RootFactory) -> None:
    """The simulator's `gpu N lost` does not write the kernel log; a line written as the driver would does."""
    root = fresh_root("esxi-vm-2x-v100")
    xid = "NVRM: Xid (PCI:0000:13:00): 79, pid=2345, GPU has fallen off the bus."
    with (root / "host/dev/kmsg").open("a") as kmsg:
        kmsg.write(f"3,99,99000000,-;{xid}\n")
    facts = discover(root / "host", use_nvml=False)
    assert facts.kernel_log_errors == [xid]
    assert [(p.symptom, p.gpu) for p in facts.vm_config_problems] == [("gpu_fell_off_bus", "0000:13:00.0")]
