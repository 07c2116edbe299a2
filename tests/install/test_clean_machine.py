"""An operator's install, on a clean machine: a fresh venv installs the built wheel (with the controller extra
from the package index) and ansible-galaxy installs the built collection into a fresh HOME; no checkout on
sys.path, no ANSIBLE_*/GPUFLEET_* variable, nothing pointing into the repository. With only those, `gpufleet
provision`, `validate` and `report` run the installed collection's playbooks against the simulated fleet
(inventory/sim's hosts on simulated GPUs, as tests/runner runs them from the checkout) and keep their state in
the operator's directory (docs/install.md)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping
from pathlib import Path

import pytest

from gpufleet_harness.release import collection
from gpufleet_harness.sim import machine as simmachine

REPO = Path(__file__).resolve().parents[2]
VERSION = "0.1.0"
FIXTURES = ("dgx-a100", "pcie-2x-t4")


class Machine:
    """The clean machine: its venv, HOME and working directory, and a clean environment."""

    def __init__(self, root: Path) -> None:
        self.root, self.venv, self.home, self.work = root, root / "venv", root / "home", root / "work"
        self.home.mkdir(parents=True)
        self.work.mkdir()

    def env(self, home: Path | None = None) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TERM", "PIP_INDEX_URL")}
        # pip's download cache is the machine's (a cache of the index, not a checkout)
        cache = {"PIP_CACHE_DIR": os.environ.get("PIP_CACHE_DIR") or str(Path.home() / ".cache" / "pip")}
        return (
            keep
            | cache
            | {
                "HOME": str(home or self.home),
                "PATH": f"{self.venv}/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                "COLUMNS": "80",
            }
        )

    def run(
        self,
        *argv: str,
        home: Path | None = None,
        timeout: float = 900,
        extra_env: Mapping[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            argv,
            cwd=self.work,
            env=self.env(home) | dict(extra_env or {}),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def _ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (
        f"{proc.args}: rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    )
    return proc


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    dist = tmp_path_factory.mktemp("dist")
    return {"wheel": collection.build_wheel(dist), "collection": collection.build(dist)}


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory, artifacts: dict[str, Path]) -> Machine:
    box = Machine(tmp_path_factory.mktemp("clean-machine"))
    _ok(
        subprocess.run(
            [sys._base_executable, "-m", "venv", str(box.venv)],
            capture_output=True,
            text=True,  # type: ignore[attr-defined]
            env=box.env(),
            check=False,
        )
    )
    _ok(box.run(f"{box.venv}/bin/pip", "install", "--quiet", f"{artifacts['wheel']}[controller]"))
    _ok(
        box.run(
            f"{box.venv}/bin/ansible-galaxy",
            "collection",
            "install",
            "--no-deps",
            str(artifacts["collection"]),
        )
    )
    return box


def test_the_collection_artifact_carries_real_files_and_the_playbooks(artifacts: dict[str, Path]) -> None:
    with tarfile.open(artifacts["collection"]) as tar:
        members = {m.name: m for m in tar.getmembers()}
        links = sorted(n for n, m in members.items() if m.issym() or m.islnk())
        assert links == []
        assert not any(n.startswith(("src/", "tests/runner", "bench/", "molecule/")) for n in members)
        for name in (
            "site",
            "facts",
            "prepare",
            "drivers",
            "runtime",
            "kubernetes",
            "images",
            "validate",
            "upgrade-driver",
            "esxi",
        ):
            assert f"playbooks/{name}.yml" in members, name
        assert "tests/sanity/ignore-2.19.txt" in members and "roles/gpufleet_images/tasks/main.yml" in members
        # each module_utils file that is a link in the checkout is that file's content in the artifact
        utils = REPO / "plugins" / "module_utils"
        linked = [p for p in utils.rglob("*.py") if p.is_symlink()]
        assert len(linked) > 10
        for path in linked:
            name = f"plugins/module_utils/{path.relative_to(utils)}"
            assert tar.extractfile(members[name]).read() == path.read_bytes(), name  # type: ignore[union-attr]
        manifest = json.load(tar.extractfile("MANIFEST.json"))  # type: ignore[arg-type]
    assert manifest["collection_info"]["version"] == VERSION
    assert "gpufleet.example" not in json.dumps(manifest)  # the placeholder repository line is gone
    assert artifacts["collection"].name == f"gpufleet-nvidia-{VERSION}.tar.gz"


def test_the_installed_wheel_and_collection_provision_and_validate_the_simulated_fleet(
    machine: Machine, sim_lib: Path
) -> None:
    # the installed package, not a checkout; the harness is not there
    where = _ok(
        machine.run(
            f"{machine.venv}/bin/python",
            "-c",
            "import gpufleet, sys; print(gpufleet.__file__); print(sys.path)",
        )
    )
    assert where.stdout.startswith(str(machine.venv)) and str(REPO) not in where.stdout
    assert machine.run(f"{machine.venv}/bin/python", "-c", "import gpufleet_harness").returncode != 0

    base = machine.root / "sim"
    for fixture in FIXTURES:
        simmachine.materialize(fixture, base / fixture, library=sim_lib)
    inventory = machine.work / "inventory"
    shutil.copytree(REPO / "inventory" / "sim", inventory)
    sim = (
        "-i",
        "inventory",
        "-e",
        f"gpufleet_sim_base={base}",
        "--limit",
        ":".join(f"sim-{f}" for f in FIXTURES),
    )

    provision = _ok(
        machine.run("gpufleet", "provision", *sim, "--check", "-e", "gpufleet_target=gpu_nodes", "--json")
    )
    doc = json.loads(provision.stdout)
    installed = machine.home / ".ansible/collections/ansible_collections/gpufleet/nvidia"
    assert doc["playbook"] == str(installed / "site.yml") and doc["exit_code"] == 0
    assert {f"sim-{f}" for f in FIXTURES} <= set(doc["hosts"])
    assert all(s["failed"] == 0 and s["unreachable"] == 0 for s in doc["hosts"].values())
    assert doc["artifact_dir"].startswith(str(machine.work / ".lab" / "runner"))

    facts = _ok(machine.run("ansible-playbook", "gpufleet.nvidia.facts", *sim))
    assert "sim-dgx-a100" in facts.stdout and "failed=0" in facts.stdout

    limit = ":".join(f"sim-{f}" for f in FIXTURES)
    validate_args = (
        "gpufleet",
        "validate",
        "-i",
        "inventory",
        "-e",
        f"gpufleet_sim_base={base}",
        "--limit",
        limit,
    )
    validate_args += ("--suites", "host", "-e", "gpufleet_driver_version=535.261.03")
    validate = _ok(machine.run(*validate_args))
    assert "result: pass (exit 0)" in validate.stdout
    report_dir = machine.work / ".lab" / "validation-report"
    assert json.loads((report_dir / "report.json").read_text())["status"] == "pass"
    shown = _ok(machine.run("gpufleet", "report"))
    assert (
        f"VALIDATION REPORT {report_dir}" in shown.stdout.replace("\n", " ") or "sim-dgx-a100" in shown.stdout
    )

    # --state-dir keeps the state elsewhere; nothing is written into the installed package
    elsewhere = machine.root / "state"
    _ok(machine.run(*validate_args, "--state-dir", str(elsewhere)))
    assert (elsewhere / "validation-report" / "report.json").is_file() and any(
        (elsewhere / "runner").iterdir()
    )
    site_packages = next((machine.venv / "lib").glob("python3*/site-packages"))
    assert not (site_packages / ".lab").exists() and not (site_packages.parent / ".lab").exists()


def test_without_the_collection_the_commands_name_the_install_command(machine: Machine) -> None:
    bare = machine.root / "bare-home"
    bare.mkdir(exist_ok=True)
    inventory = machine.work / "one.yml"
    inventory.write_text("all:\n  hosts:\n    h: {ansible_connection: local}\n")
    for command in ("provision", "validate"):
        proc = machine.run("gpufleet", command, "-i", str(inventory), home=bare)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert "the Ansible collection gpufleet.nvidia is not installed" in proc.stderr
        assert f"ansible-galaxy collection install gpufleet-nvidia-{VERSION}.tar.gz" in proc.stderr


def test_ansible_test_sanity_passes_on_the_built_artifact(artifacts: dict[str, Path]) -> None:
    """scripts/sanity --artifact: the artifact installed into an ansible_collections tree, ansible-test sanity
    there, with the ignore file the artifact itself carries (tests/sanity)."""
    proc = subprocess.run(
        [str(REPO / "scripts" / "sanity"), "--artifact", str(artifacts["collection"])],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert 'Running sanity test "validate-modules"' in proc.stdout + proc.stderr
