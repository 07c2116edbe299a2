"""playbooks/validate.yml on the simulated fleet (inventory/sim): expectations from the inventory and each
host's gpu_facts, testinfra over the hosts' own connection, the report on the controller, and the play
failing when a check fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

REPO = Path(__file__).resolve().parents[2]
HOSTS = "sim-dgx-a100:sim-pcie-2x-t4"


def _playbook(base: Path, report: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    from labstack import ensure_collection_link

    ensure_collection_link()
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")} | {"ANSIBLE_NOCOLOR": "1"}
    argv = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        "inventory/sim",
        "playbooks/validate.yml",
        "-e",
        f"gpufleet_sim_base={base}",
        "-e",
        f"gpufleet_target={HOSTS}",
        "-e",
        f"gpufleet_validation_report_dir={report}",
        "-e",
        "gpufleet_validation_suites=host",
        "-e",
        "gpufleet_driver_version=535.261.03",
        *extra,
    ]
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture
def sim_base(tmp_path: Path) -> Path:
    base = tmp_path / "sim"
    library = simbuild.build_library()
    for fixture in ("dgx-a100", "pcie-2x-t4"):
        simmachine.materialize(fixture, base / fixture, library=library)
    return base


def test_validate_playbook_passes_then_fails_naming_the_stopped_fabric_manager(
    sim_base: Path, tmp_path: Path
) -> None:
    report = tmp_path / "report"
    good = _playbook(sim_base, report)
    assert good.returncode == 0, good.stdout[-3000:]
    doc = json.loads((report / "report.json").read_text())
    assert doc["hosts"] == {"sim-dgx-a100": {"host": "PASS 8/8"}, "sim-pcie-2x-t4": {"host": "PASS 7/7"}}
    assert "validation passed" in good.stdout
    # no device plugin configuration in the inventory: whole GPUs as nvidia.com/gpu
    expected = yaml.safe_load((report / "expectations.yml").read_text())["hosts"]["sim-pcie-2x-t4"]
    assert (expected["sharing"], str(expected["replicas"]), expected["resource"]) == (
        "none",
        "1",
        "nvidia.com/gpu",
    )
    assert not expected["runtime_class"]  # nvidia is the default runtime: pods name no RuntimeClass
    assert expected["mig_strategy"] == "none"  # no MIG pods for the workload suite

    simcontrol.inject(sim_base / "dgx-a100", ["fabricmanager", "stopped"])
    bad = _playbook(sim_base, report)
    assert bad.returncode == 2, bad.stdout[-3000:]
    assert "validation failed (exit 1)" in bad.stdout
    assert "sim-dgx-a100 host/fabricmanager_active: FAILED" in bad.stdout
    doc = json.loads((report / "report.json").read_text())
    assert (
        doc["hosts"]["sim-dgx-a100"]["host"] == "FAIL 7/8"
        and doc["hosts"]["sim-pcie-2x-t4"]["host"] == "PASS 7/7"
    )


NAMED = {
    "configs": {
        "default": "whole",
        "named": {
            "whole": {},
            "sliced": {
                "sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 4, "rename": "x.io/gpu"}}
            },
        },
    }
}


def test_expectations_follow_the_device_plugin_configuration_the_host_picks(
    sim_base: Path, tmp_path: Path
) -> None:
    """The host's named configuration (gpufleet_device_plugin_config_name) is what validation expects: its
    sharing mode, time-slicing replicas and resource name; and, with runc the default runtime, the
    RuntimeClass its GPU pods name. Only the expectations are read: the cluster suite, asked for without
    gpufleet_validation_cluster, is NOT RUN, and that fails the play naming the variable (before issue 30
    it skipped and the play passed)."""
    report = tmp_path / "report"
    run = _playbook(
        sim_base, report, "-e", json.dumps({"gpufleet_kubernetes_device_plugin_config": NAMED,
                                            "gpufleet_device_plugin_config_name": "sliced",
                                            "nvidia_container_toolkit_default_runtime": False,
                                            "gpufleet_validation_suites": "cluster"}),
    )  # fmt: skip
    assert run.returncode == 2, run.stdout[-3000:]
    assert "validation could not run (exit 2); NOT RUN: cluster (the table says why" in run.stdout
    doc = json.loads((report / "report.json").read_text())
    assert doc["hosts"] == {h: {"cluster": "NOT RUN"} for h in ("sim-dgx-a100", "sim-pcie-2x-t4")}
    assert "gpufleet_validation_cluster" in doc["not_run"][0]["reason"]
    hosts = yaml.safe_load((report / "expectations.yml").read_text())["hosts"]
    found = {name: (h["sharing"], str(h["replicas"]), h["resource"]) for name, h in hosts.items()}
    assert found == dict.fromkeys(["sim-dgx-a100", "sim-pcie-2x-t4"], ("time-slicing", "4", "x.io/gpu"))
    # runc left the default by the toolkit: the GPU pods name the RuntimeClass the collection makes
    assert {h["runtime_class"] for h in hosts.values()} == {"nvidia"}
