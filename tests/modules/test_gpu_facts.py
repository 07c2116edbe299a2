"""gpu_facts through ansible-playbook: playbooks/facts.yml on inventory/sim, every fixture at once.

Two playbook runs in all (each pays Ansible's start-up): the project's facts playbook in check mode
over every simulated host plus one without a driver, and the module's options on one host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from labstack import ensure_collection_link

from gpufleet.gpu import normalize_bus_id
from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
FIXTURES = simmachine.fixture_names()
# The fixtures whose NVIDIA driver is loaded (esxi-vm-small-mmio's failed to load: its own test below).
HEALTHY = [f for f in FIXTURES if simmachine.expand(f)["host"]["driver_loaded"]]
NO_DRIVER_HOST = "sim-dgx-a100-nodriver"
SMALL_MMIO = "esxi-vm-small-mmio"

Run = tuple[subprocess.CompletedProcess[str], Path]


def playbook(*args: str) -> subprocess.CompletedProcess[str]:
    """ansible-playbook from the repository root, so ansible.cfg applies."""
    ensure_collection_link()
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    for name in ("GPUFLEET_SIM_ROOT", "GPUFLEET_HOST_ROOT", "GPUFLEET_SIM_BASE"):
        env.pop(name, None)  # only the inventory's settings may reach the modules
    argv = [str(ANSIBLE_PLAYBOOK), *args]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


@pytest.fixture(scope="module")
def sim_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every fixture materialized under one base, as inventory/sim expects, plus a driverless DGX."""
    base = tmp_path_factory.mktemp("sim")
    library = simbuild.build_library()
    for fixture in FIXTURES:
        simmachine.materialize(fixture, base / fixture, library=library)
    simmachine.materialize("dgx-a100", base / "nodriver", library=library)
    simcontrol.inject(base / "nodriver", ["driver", "unloaded"])
    return base


@pytest.fixture(scope="module")
def facts_run(sim_base: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """playbooks/facts.yml in check mode on every simulated host; facts saved per host."""
    out = tmp_path_factory.mktemp("facts")
    extra = out / "extra-hosts.yml"
    hosts: dict[str, dict[str, str]] = {NO_DRIVER_HOST: {"gpufleet_sim_root": str(sim_base / "nodriver")}}
    # Fixtures inventory/sim does not list (yet) join its group here, with its group's variables.
    listed = yaml.safe_load((REPO / "inventory/sim/hosts.yml").read_text())["gpufleet_sim"]["hosts"]
    for fixture in FIXTURES:
        if f"sim-{fixture}" not in listed:
            hosts[f"sim-{fixture}"] = {"gpufleet_sim_fixture": fixture}
    extra.write_text(json.dumps({"gpufleet_sim": {"hosts": hosts}}))
    proc = playbook(
        "-i", "inventory/sim", "-i", str(extra), "playbooks/facts.yml", "--check",
        "-e", f"gpufleet_sim_base={sim_base}", "-e", f"gpufleet_facts_dir={out}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc, out


def _facts(out: Path, host: str) -> dict[str, Any]:
    return json.loads((out / f"{host}.json").read_text())


@pytest.mark.parametrize("fixture", HEALTHY)
def test_facts_playbook_reports_each_simulated_machine(facts_run: Run, sim_base: Path, fixture: str) -> None:
    proc, out = facts_run
    machine = simmachine.load_machine(sim_base / fixture)
    gpus = machine["gpus"]
    facts = _facts(out, f"sim-{fixture}")
    assert facts["source"] == "nvml"
    assert facts["host_root"] == str(sim_base / fixture / "host")
    assert facts["gpu_count"] == len(gpus)
    assert [g["uuid"] for g in facts["gpus"]] == [g["uuid"] for g in gpus]
    assert [g["model"] for g in facts["gpus"]] == [g["name"] for g in gpus]
    assert [g["pci_bus_id"] for g in facts["gpus"]] == [normalize_bus_id(g["bus_id"]) for g in gpus]
    assert facts["nvswitch_count"] == len(machine["nvswitches"])
    assert facts["fabricmanager_required"] == bool(machine["nvswitches"])
    assert facts["driver_version_kernel"] == facts["driver_version_userspace"] == machine["driver_version"]
    # ESXi's DMI names VMware; a Firecracker guest has no DMI, only the CPU's hypervisor flag
    hypervisor = {"esxi": "vmware", "firecracker": "unknown"}.get(fixture.split("-")[0])
    assert facts["hypervisor"] == hypervisor
    assert len(facts["topology"]["matrix"]) == len(gpus)
    assert f"{len(gpus)} GPU(s): {len(gpus)} x {gpus[0]['name']}" in proc.stdout
    # Each sim root's kernel log is read; the healthy machines' shows no driver errors, no VM problems.
    assert (facts["kernel_log_source"], facts["kernel_log_unreadable"]) == ("/dev/kmsg", None)
    assert facts["kernel_log_errors"] == [] and facts["vm_config_problems"] == []


def test_vmware_guest_with_small_mmio_window_has_its_problems_named(facts_run: Run, sim_base: Path) -> None:
    """esxi-vm-small-mmio against the healthy esxi-vm-2x-v100 (above): same VM, 64bitMMIOSizeGB too small."""
    _, out = facts_run
    facts = _facts(out, f"sim-{SMALL_MMIO}")
    assert facts["hypervisor"] == "vmware" and facts["boot_mode"] == "uefi"
    assert facts["source"] == "sysfs" and "Driver Not Loaded" in facts["nvml_error"]
    assert facts["gpu_count"] == 2 and not facts["driver_loaded"]
    assert facts["kernel_log_source"] == "/dev/kmsg"
    assert "NVRM: None of the NVIDIA devices were initialized." in facts["kernel_log_errors"]
    problems = facts["vm_config_problems"]
    machine = simmachine.load_machine(sim_base / SMALL_MMIO)
    assert [(p["symptom"], p["gpu"]) for p in problems] == [
        ("gpu_bar_unassigned", normalize_bus_id(g["bus_id"])) for g in machine["gpus"]
    ]
    for problem in problems:
        assert problem["evidence"] == f"NVRM: BAR1 is 0M @ 0x0 (PCI:{problem['gpu']})"
        assert "64-bit MMIO window" in problem["likely_cause"]
        assert "pciPassthru.use64bitMMIO = TRUE, pciPassthru.64bitMMIOSizeGB = 128" in problem["fix"]


def test_facts_playbook_topology_for_dgx_and_t4_box(facts_run: Run) -> None:
    _, out = facts_run
    dgx = _facts(out, "sim-dgx-a100")["topology"]["matrix"]
    assert dgx == [["X" if i == j else "NV12" for j in range(8)] for i in range(8)]
    assert _facts(out, "sim-pcie-2x-t4")["topology"]["matrix"] == [["X", "NODE"], ["NODE", "X"]]


def test_without_driver_the_facts_come_from_sysfs(facts_run: Run) -> None:
    proc, out = facts_run
    facts = _facts(out, NO_DRIVER_HOST)
    assert facts["source"] == "sysfs"
    assert "Driver Not Loaded" in facts["nvml_error"]
    assert not facts["driver_loaded"] and facts["driver_version_kernel"] is None
    assert facts["gpu_count"] == 8 and facts["gpu_models"] == {"NVIDIA A100-SXM4-80GB": 8}
    assert all(g["uuid"] is None and g["memory_mib"] == 81920 for g in facts["gpus"])
    assert facts["nvswitch_count"] == 6 and facts["fabricmanager_required"]
    assert facts["topology"] is None
    assert "driver: not loaded" in proc.stdout


def test_module_options_and_check_mode(sim_base: Path, tmp_path: Path) -> None:
    proc = playbook(
        "-i", "inventory/sim", "tests/modules/gpu_facts_options.yml", "--limit", "sim-hgx-h100",
        "-e", f"gpufleet_sim_base={sim_base}", "-e", f"out_dir={tmp_path}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    results = json.loads((tmp_path / "sim-hgx-h100.json").read_text())
    nvml = results["nvml"]["ansible_facts"]["gpufleet_gpu"]
    assert not results["nvml"]["changed"]
    assert nvml["source"] == "nvml" and {g["fabric_state"] for g in nvml["gpus"]} == {"completed"}
    checked = results["check_mode"]
    assert not checked["changed"] and checked["ansible_facts"]["gpufleet_gpu"] == nvml
    sysfs = results["sysfs_only"]["ansible_facts"]["gpufleet_gpu"]
    assert sysfs["source"] == "sysfs" and sysfs["nvml_error"] is None
    assert sysfs["driver_loaded"] and sysfs["driver_version_kernel"] == nvml["driver_version_kernel"]
    assert nvml["kernel_log_source"] == "/dev/kmsg"
    no_log = results["no_kernel_log"]["ansible_facts"]["gpufleet_gpu"]
    assert (no_log["kernel_log_source"], no_log["kernel_log_unreadable"]) == (None, "not read")
    assert no_log["kernel_log_errors"] == [] and no_log["vm_config_problems"] == []
    explicit = results["explicit_root"]["ansible_facts"]["gpufleet_gpu"]
    assert explicit["host_root"] == str(sim_base / "hgx-h100" / "host")
    assert explicit["source"] == "nvml" and explicit["topology"] is None
    assert [g["numa_node"] for g in explicit["gpus"]] == [g["numa_node"] for g in nvml["gpus"]]
