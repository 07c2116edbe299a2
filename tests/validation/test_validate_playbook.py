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

from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

REPO = Path(__file__).resolve().parents[2]
HOSTS = "sim-dgx-a100:sim-pcie-2x-t4"


def _playbook(base: Path, report: Path) -> subprocess.CompletedProcess[str]:
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
