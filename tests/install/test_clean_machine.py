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
import yaml

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
        # the hyphenated old names are a checkout's aliases only (galaxy.yml build_ignore)
        aliases = ("playbooks/upgrade-driver.yml", "playbooks/check-variables.yml")
        assert not any(alias in members for alias in aliases)
        for name in (
            "site",
            "facts",
            "prepare",
            "drivers",
            "runtime",
            "kubernetes",
            "images",
            "validate",
            "upgrade_driver",
            "check_variables",
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


def _fleet(machine: Machine, sim_lib: Path) -> tuple[Path, Path]:
    """The simulated fleet (two fixtures) as an operator's inventory: inventory/sim's hosts, those two only,
    in gpu_nodes (the group the playbooks converge by default); returns (inventory file, sim base)."""
    base = machine.root / "sim"
    inventory = machine.work / "inventory.yml"
    if not inventory.exists():
        for fixture in FIXTURES:
            simmachine.materialize(fixture, base / fixture, library=sim_lib)
        doc = yaml.safe_load((REPO / "inventory" / "sim" / "hosts.yml").read_text())
        hosts = doc["gpufleet_sim"]["hosts"]
        doc["gpufleet_sim"]["hosts"] = {f"sim-{f}": hosts[f"sim-{f}"] for f in FIXTURES}
        doc["gpufleet_sim"]["vars"]["gpufleet_sim_base"] = str(base)
        doc["gpu_nodes"] = {"children": {"gpufleet_sim": {}}}
        inventory.write_text(yaml.safe_dump(doc, sort_keys=False))
    return inventory, base


def _plays(artifact_dir: str) -> dict[str, set[str]]:
    """Each play runner saw start, with the hosts it ran tasks on (from runner's job events); a play whose
    host pattern matched nothing has no hosts."""
    plays: dict[str, set[str]] = {}
    events = sorted(Path(artifact_dir, "job_events").glob("*.json"), key=lambda p: int(p.name.split("-")[0]))
    for path in events:
        event = json.loads(path.read_text())
        data = event.get("event_data") or {}
        if event.get("event") == "playbook_on_play_start":
            plays.setdefault(data["play"], set())
        elif event.get("event", "").startswith("runner_on_") and data.get("host"):
            plays.setdefault(data["play"], set()).add(data["host"])
    return plays


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

    inventory, _ = _fleet(machine, sim_lib)
    checks = ("-e", "gpufleet_validation_suites=host", "-e", "gpufleet_driver_version=535.261.03")
    # An operator's own project playbook, made of the collection's playbooks by name (as docs/awx.md's
    # example): the variable check, the facts of every GPU host, then validation and its report. The stages
    # that install packages (prepare, drivers, runtime) are left out: the simulated hosts are this machine.
    (machine.work / "fleet.yml").write_text(
        "---\n"
        + "".join(
            f"- name: {stage}\n  ansible.builtin.import_playbook: gpufleet.nvidia.{stage}\n"
            for stage in ("check_variables", "facts", "validate")
        )
    )
    fleet = ("-i", inventory.name, "--playbook", "fleet.yml")
    provision = _ok(machine.run("gpufleet", "provision", *fleet, *checks, "--json"))
    doc = json.loads(provision.stdout)
    assert doc["exit_code"] == 0 and doc["artifact_dir"].startswith(str(machine.work / ".lab" / "runner"))
    assert {f"sim-{f}" for f in FIXTURES} <= set(doc["hosts"])
    assert all(s["failed"] == 0 and s["unreachable"] == 0 for s in doc["hosts"].values())
    sims = {f"sim-{f}" for f in FIXTURES}
    plays = _plays(doc["artifact_dir"])
    # the variable check runs once, on the controller (an action plugin), under the play's first host
    # (check_variables.yml: hosts all:localhost, run_once, so that --limit keeps it)
    checked = plays.pop("Check that every gpufleet variable the inventory and -e set is one gpufleet reads")
    assert len(checked) == 1 and checked <= sims | {"localhost"}, checked
    assert plays == {
        "Gather GPU facts": sims,
        "Gather what validation expects of each host": sims,
        "Run the validation suites and write the report": {"localhost"},
    }, plays

    # the report is in the operator's state directory, where `gpufleet report` finds it; not in the collection
    installed = machine.home / ".ansible/collections/ansible_collections/gpufleet/nvidia"
    report_dir = machine.work / ".lab" / "validation-report"
    assert json.loads((report_dir / "report.json").read_text())["status"] == "pass"
    assert not (installed / ".lab").exists() and not (installed.parent / ".lab").exists()
    shown = _ok(machine.run("gpufleet", "report"))
    assert "VALIDATION REPORT" in shown.stdout and "sim-dgx-a100" in shown.stdout, shown.stdout

    # site.yml is the default playbook, found in the installed collection; --check with no tag but the
    # variable check's: every stage's play resolves its roles and host pattern from the artifact
    site = _ok(machine.run("gpufleet", "provision", "-i", inventory.name, "--check", "--tags", "always",
                           *checks, "--json"))  # fmt: skip
    site_doc = json.loads(site.stdout)
    assert site_doc["playbook"] == str(installed / "site.yml") and site_doc["exit_code"] == 0

    facts = _ok(machine.run("ansible-playbook", "gpufleet.nvidia.facts", "-i", inventory.name))
    assert "sim-dgx-a100" in facts.stdout and "failed=0" in facts.stdout

    validate_args = ("gpufleet", "validate", "-i", inventory.name, "--suites", "host", *checks[2:])
    validate = _ok(machine.run(*validate_args))
    assert "result: pass (exit 0)" in validate.stdout

    # --state-dir keeps the state elsewhere, provision's report included; nothing in the installed package
    elsewhere = machine.root / "state"
    _ok(machine.run(*validate_args, "--state-dir", str(elsewhere)))
    assert (elsewhere / "validation-report" / "report.json").is_file() and any(
        (elsewhere / "runner").iterdir()
    )
    other = machine.root / "state-provision"
    _ok(machine.run("gpufleet", "provision", "-i", inventory.name, "--playbook", "gpufleet.nvidia.validate",
                    *checks, "--state-dir", str(other)))  # fmt: skip
    assert (other / "validation-report" / "report.json").is_file()
    # the report names where it was read from; a long path may wrap at the terminal's width
    shown = _ok(machine.run("gpufleet", "report", "--state-dir", str(other))).stdout
    assert "state-provision" in "".join(shown.split()), shown
    site_packages = next((machine.venv / "lib").glob("python3*/site-packages"))
    assert not (site_packages / ".lab").exists() and not (site_packages.parent / ".lab").exists()


def test_every_playbook_of_the_installed_collection_runs_by_its_name(machine: Machine) -> None:
    """ansible-core refuses a hyphen in a collection resource's name, so each playbook must be named so that
    `ansible-playbook gpufleet.nvidia.<name>` finds it (upgrade_driver, check_variables)."""
    installed = machine.home / ".ansible/collections/ansible_collections/gpufleet/nvidia"
    names = sorted(p.stem for p in (installed / "playbooks").glob("*.yml"))
    assert {"site", "upgrade_driver", "check_variables", "validate", "images"} <= set(names), names
    assert [n for n in names if not n.isidentifier()] == []
    inventory = ("-i", "localhost,")
    for name in names:
        proc = machine.run("ansible-playbook", "--syntax-check", *inventory, f"gpufleet.nvidia.{name}")
        out = f"gpufleet.nvidia.{name}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
        if name == "upgrade_driver":
            # found by its name and parsed up to its first kubernetes.core task: that collection (galaxy.yml's
            # dependency) comes from Galaxy, which this machine cannot reach (installed with --no-deps)
            assert proc.returncode != 0 and f"{installed}/playbooks/upgrade_driver.yml:" in out, out
            assert "couldn't resolve module/action 'kubernetes.core.k8s_info'" in out, out
            continue
        assert proc.returncode == 0, out


def test_validation_runs_from_a_read_only_collection(machine: Machine, sim_lib: Path) -> None:
    """An execution environment installs the collection root-owned (/usr/share/ansible/collections) and runs
    the job as another user: validate.yml must write nothing inside the collection. The installed collection
    is mounted read-only (a private mount namespace) and the report lands in the current directory."""
    unshare = shutil.which("unshare")
    assert unshare, "util-linux's unshare is needed to mount the collection read-only"
    inventory, _ = _fleet(machine, sim_lib)
    installed = machine.home / ".ansible/collections/ansible_collections/gpufleet/nvidia"
    work = machine.root / "ro-work"
    work.mkdir()
    script = (
        'set -e; mount --bind "$1" "$1"; mount -o remount,bind,ro "$1"; '
        'if touch "$1/written" 2>/dev/null; then echo "collection is writable"; exit 9; fi; '
        'cd "$2"; shift 2; exec ansible-playbook "$@"'
    )
    proc = subprocess.run(
        [unshare, "--map-root-user", "--mount", "sh", "-c", script, "sh", str(installed), str(work),
         "gpufleet.nvidia.validate", "-i", str(inventory), "-e", "gpufleet_validation_suites=host",
         "-e", "gpufleet_driver_version=535.261.03"],
        cwd=work, env=machine.env(), capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}"
    assert json.loads((work / ".lab" / "validation-report" / "report.json").read_text())["status"] == "pass"
    assert not (installed / ".lab").exists()


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


def test_a_collection_of_another_version_is_named_with_both_versions(machine: Machine) -> None:
    """The installed collection found first is of another release than the wheel (its MANIFEST.json, what
    ansible-galaxy reads, says 0.0.9): the commands stop before any play, naming both versions, where the
    collection is, and the command that installs the matching one (issue 34 audit, row 3c)."""
    installed = machine.home / ".ansible/collections/ansible_collections/gpufleet/nvidia"
    other_home = machine.root / "other-version-home"
    copy = other_home / ".ansible/collections/ansible_collections/gpufleet/nvidia"
    if not copy.exists():
        shutil.copytree(installed, copy)
        manifest = json.loads((copy / "MANIFEST.json").read_text())
        manifest["collection_info"]["version"] = "0.0.9"
        (copy / "MANIFEST.json").write_text(json.dumps(manifest))
    inventory = machine.work / "one.yml"
    inventory.write_text("all:\n  hosts:\n    h: {ansible_connection: local}\n")
    for command in ("provision", "validate"):
        proc = machine.run("gpufleet", command, "-i", str(inventory), home=other_home)
        assert proc.returncode == 2, proc.stdout + proc.stderr
        assert (
            f"the Ansible collection gpufleet.nvidia at {copy} is version 0.0.9, but gpufleet is {VERSION}"
            in proc.stderr
        ), proc.stderr
        assert f"ansible-galaxy collection install --force gpufleet-nvidia-{VERSION}.tar.gz" in proc.stderr
        assert "PLAY" not in proc.stdout


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
