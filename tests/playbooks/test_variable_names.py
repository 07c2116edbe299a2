"""A misspelled gpufleet variable fails site.yml before anything is touched, naming the closest known one
(issue 30 item 8): gpufleet.nvidia.check_variables, run by playbooks/check_variables.yml, site.yml's first
play. Before, Ansible ignored `gpufleet_driver_verison` without a word and installed the default driver.

Known names come from the collection's files (plugins/plugin_utils/variables.py): the roles' argument specs
and defaults, and what the playbooks and roles read, less what they assign themselves.
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from labstack import ensure_collection_link
from playbookrun import REPO, Played, local_inventory, playbook

# the collection link must exist before the import (a fresh checkout has none until something creates it)
sys.path.insert(0, str(ensure_collection_link()))
from ansible_collections.gpufleet.nvidia.plugins.plugin_utils import variables

CHECK = "playbooks/check_variables.yml"
PLAY = "Check that every gpufleet variable the inventory and -e set is one gpufleet reads"
TASK = "Refuse misspelled gpufleet variables (nothing has been touched yet)"
IMPORT = {
    "name": "Every gpufleet variable set in the inventory or with -e is one gpufleet reads "
    "(a typo fails here)",
    "ansible.builtin.import_playbook": "check_variables.yml",
}
# The playbooks an operator runs on their own (docs/roles.md); check_variables.yml is the check itself.
# Local hosts are this machine: runs that get past the check must change nothing (only `always` tasks run).
SAFE = ("--check", "--tags", "gpufleet-none")
# The hyphenated names are one-line aliases of the renamed playbooks (docs/install.md), checked through them.
NOT_STAGES = {"check_variables.yml", "check-variables.yml", "upgrade-driver.yml"}
STAGES = sorted(p.name for p in (REPO / "playbooks").glob("*.yml") if p.name not in NOT_STAGES)


def _checked(run: Played) -> dict[str, Any]:
    """The check's result: it runs once (run_once), on the first host of the play."""
    ran = [r for r in run.results(TASK).values() if not r.get("skipped")]
    assert len(ran) == 1, run.explain()
    return ran[0]


def test_site_yml_checks_the_variable_names_first() -> None:
    # site.yml imports playbooks/site.yml (the collection's gpufleet.nvidia.site); its first play is the check
    top = yaml.safe_load((REPO / "site.yml").read_text())
    assert top[0]["ansible.builtin.import_playbook"] == "playbooks/site.yml"
    plays = yaml.safe_load((REPO / "playbooks/site.yml").read_text())
    assert "playbooks/" + plays[0]["ansible.builtin.import_playbook"] == CHECK
    check = yaml.safe_load((REPO / CHECK).read_text())
    # every host and localhost: --limit keeps the check (a play on localhost alone would be limited away)
    assert check[0]["hosts"] == "all:localhost" and check[0]["any_errors_fatal"] is True
    assert check[0]["tasks"][0]["tags"] == ["always"]  # also under --tags
    assert check[0]["tasks"][0]["run_once"] is True


def test_known_names_are_the_roles_arguments_and_what_the_playbooks_read() -> None:
    known = variables.known_variables(REPO)
    for spec in (REPO / "roles").glob("*/meta/argument_specs.yml"):
        for entry in yaml.safe_load(spec.read_text())["argument_specs"].values():
            assert set(entry.get("options") or {}) <= set(known), spec
    # shared settings the playbooks read, one only a role reads, the new upgrade setting
    for name in ("gpufleet_driver_version", "gpufleet_target", "gpufleet_validation_cluster",
                 "gpufleet_driver_kernel_modules", "gpufleet_upgrade_drain_timeout", "esxi_vm_name",
                 "gpufleet_unknown_variables"):  # fmt: skip
        assert name in known, name
    # what the playbooks assign themselves is no setting: an inventory value would be overridden
    for name in ("gpufleet_validation_expected", "gpufleet_upgrade_kubeconfig", "gpufleet_validation_run"):
        assert name not in known, name
    assert "gpufleet_driver_verison" not in known  # comments are not reads (check_variables.yml names it)


def _documented() -> str:
    paths = [*(REPO / "docs").glob("*.md"), *(REPO / "inventory/example").rglob("*.yml")]
    return "\n".join(p.read_text() for p in paths)


def test_every_setting_the_playbooks_and_roles_read_is_documented() -> None:
    """The check accepts every name the code reads; each that is not a role argument (those are in the
    role's README, tests/docs) must be documented in docs/ or inventory/example, so that what the check
    accepts is what an operator can look up."""
    root = REPO
    read, assigned = variables.read_and_assigned(root)
    roles = set(variables.roles(root))
    arguments = variables.role_variables(root)
    docs = _documented()
    missing = sorted(
        f"{name} (read in {where})"
        for name, where in read.items()
        if name not in assigned and name not in arguments and name not in roles
        and not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", docs)
        # partial names built in templates (gpufleet_kubernetes_runtime_class_ ~ x) are no variables
        and not any(other.startswith(name + "_") for other in arguments)
    )  # fmt: skip
    assert not missing, missing


def test_a_misspelled_variable_fails_site_yml_before_any_other_play(tmp_path: Path) -> None:
    run = playbook("site.yml", REPO / "inventory/sim", "--check", "-e", "gpufleet_driver_verison=535.216.01",
                   "-e", f"gpufleet_sim_base={tmp_path}")  # fmt: skip
    assert run.rc != 0, run.explain()
    assert run.plays() == [PLAY]
    result = _checked(run)
    assert result["failed"]
    assert result["msg"].startswith("1 gpufleet variable(s) set in the inventory or with -e that gpufleet")
    assert (
        "gpufleet_driver_verison, set for every host (group all's variables or -e): no role or playbook of "
        "gpufleet reads it (did you mean gpufleet_driver_version?)"
    ) in result["msg"]
    assert "set gpufleet_unknown_variables=warn" in result["msg"]
    assert [f["name"] for f in result["unknown"]] == ["gpufleet_driver_verison"]


def test_role_prefixed_and_overridden_names_in_group_vars_are_named_and_warn_goes_on(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inv", ["gpu-1", "gpu-2"], {
        "nvidia_driver_hodl": False,              # nvidia_driver_hold
        "gpu_host_prep_allow_rebot": True,        # gpu_host_prep_allow_reboot
        "gpufleet_upgrade_kubeconfig": "/k",      # upgrade_driver.yml sets it itself
        "gpufleet_my_helper": "x",                # read by another value: not reported
        "gpufleet_kubernetes_kubeconfig": "{{ gpufleet_my_helper }}",
        "my_own_variable": 1,                     # no gpufleet prefix: not checked
    })  # fmt: skip
    refused = playbook(CHECK, inventory)
    assert refused.rc != 0, refused.explain()
    found = {f["name"]: f for f in _checked(refused)["unknown"]}
    assert sorted(found) == ["gpu_host_prep_allow_rebot", "gpufleet_upgrade_kubeconfig", "nvidia_driver_hodl"]
    assert found["nvidia_driver_hodl"]["suggestion"] == "nvidia_driver_hold"
    assert found["gpu_host_prep_allow_rebot"]["suggestion"] == "gpu_host_prep_allow_reboot"
    assert found["gpufleet_upgrade_kubeconfig"]["assigned_in"] == "playbooks/upgrade_driver.yml"
    assert found["nvidia_driver_hodl"]["hosts"] == ["gpu-1", "gpu-2", "localhost"]
    msg = _checked(refused)["msg"]
    assert (
        "gpufleet_upgrade_kubeconfig, set for every host (group all's variables or -e): "
        "playbooks/upgrade_driver.yml sets it itself, so this value is never used" in msg
    )

    warned = playbook(CHECK, inventory, "-e", "gpufleet_unknown_variables=warn")
    assert warned.rc == 0, warned.explain()
    warnings = _checked(warned)["warnings"]
    assert len(warnings) == 1 and "nvidia_driver_hodl, set for every host" in warnings[0]
    assert "did you mean nvidia_driver_hold?" in warnings[0]

    wrong_mode = playbook(CHECK, inventory, "-e", "gpufleet_unknown_variables=maybe")
    assert wrong_mode.rc != 0
    assert ("gpufleet_unknown_variables (mode) is 'maybe'; expected one of fail, warn, ignore"
            in _checked(wrong_mode)["msg"])  # fmt: skip


def _lab_inventory(directory: Path) -> Path:
    """The lab's inventory as `gpufleet lab up` writes it (hosts.yml from the lab's code, with made-up
    instance facts) beside the checked-in group_vars."""
    from gpufleet_harness.lab import lab
    from gpufleet_harness.lab.spec import LabSpec

    spec = LabSpec(state_dir=directory / "state", inventory_dir=directory)
    state = {
        "kubeconfig": "/k",
        "apiserver": {"port": 6443},
        "supervisor": {"repo": {"url": "http://127.0.0.1:1"},
                       "prometheus": {"url": "http://127.0.0.1:9090", "port": 9090}},
        "extender": {"host": "dgx-a100", "port": 8800},
        "gpufleet_image": "gpufleet-lab/gpufleet:test",
    }  # fmt: skip
    shutil.copytree(REPO / "inventory/lab/group_vars", directory / "group_vars")
    (directory / "hosts.yml").write_text(yaml.safe_dump(lab.inventory_doc(spec, state)))
    return directory


@pytest.mark.parametrize("which", ["example", "sim", "lab"])
def test_the_shipped_inventories_pass(which: str, tmp_path: Path) -> None:
    inventory = _lab_inventory(tmp_path / "lab") if which == "lab" else REPO / "inventory" / which
    run = playbook(CHECK, inventory)
    assert run.rc == 0, run.explain()
    result = _checked(run)
    assert result["unknown"] == [] and result["hosts"] >= 2


@pytest.mark.parametrize("stage", STAGES)
def test_every_playbook_an_operator_runs_checks_the_names_first(stage: str) -> None:
    """upgrade_driver.yml and each stage (drivers.yml, runtime.yml, validate.yml ...) start with the check, as
    site.yml does: before, only site.yml ran it, and a misspelled -e to upgrade_driver.yml rolled the fleet
    (drain, reboot) to the default version."""
    plays = yaml.safe_load((REPO / "playbooks" / stage).read_text())
    assert plays[0] == IMPORT, f"{stage}'s first play is {plays[0]}"


@pytest.mark.parametrize("misspelled", ["gpufleet_driver_verison=535.309.01", "gpufleet_upgrade_bacth=2"])
def test_a_misspelled_variable_stops_upgrade_driver_yml_before_any_host_is_touched(
    misspelled: str, tmp_path: Path
) -> None:
    inventory = local_inventory(tmp_path / "inv", ["up-a", "up-b"])
    # check mode and an unknown tag: should the check not stop it, nothing on this machine is touched either
    run = playbook("playbooks/upgrade_driver.yml", inventory, *SAFE, "-e", misspelled)
    assert run.rc != 0, run.explain()
    assert run.plays() == [PLAY]  # not the batch check, the preflight or a rollout batch
    name = misspelled.split("=")[0]
    close = {"gpufleet_driver_verison": "gpufleet_driver_version",
             "gpufleet_upgrade_bacth": "gpufleet_upgrade_batch"}[name]  # fmt: skip
    assert f"{name}, set for every host (group all's variables or -e)" in _checked(run)["msg"]
    assert f"(did you mean {close}?)" in _checked(run)["msg"]


def test_each_stage_playbook_refuses_a_misspelled_variable_even_under_limit(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inv", ["st-a", "st-b"])
    for stage in STAGES:
        if stage == "site.yml":
            continue  # test_a_misspelled_variable_fails_site_yml_before_any_other_play
        typo = ("-e", "gpufleet_mig_enabeld=1")
        run = playbook(f"playbooks/{stage}", inventory, *SAFE, "--limit", "st-b", *typo)
        assert run.rc != 0, f"{stage}: {run.explain()}"
        assert run.plays() == [PLAY], stage
        result = run.results(TASK)  # the limited host ran it: --limit does not skip the check
        assert list(result) == ["st-b"], stage
        assert "did you mean gpufleet_mig_enabled?" in result["st-b"]["msg"], stage


def test_site_yml_checks_once_though_every_stage_imports_the_check(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inv", ["gpu-1"])
    run = playbook("site.yml", inventory, *SAFE)
    assert run.rc == 0, run.explain()
    outcomes = []
    for play in run.report["plays"]:
        for entry in play["tasks"]:
            if entry["task"]["name"] == TASK:
                outcomes.append("skipped" if entry["hosts"]["gpu-1"].get("skipped") else "checked")
    # site.yml's own import, then one per stage import (kubernetes.yml's own and its images.yml's)
    assert outcomes[0] == "checked" and set(outcomes[1:]) == {"skipped"} and len(outcomes) > 5, outcomes


def test_an_allowed_list_lets_a_scenarios_own_variables_through(tmp_path: Path) -> None:
    """The molecule upgrade scenario runs upgrade_driver.yml with its inventory, which sets the scenario's
    own gpufleet_test_repo; it names it in gpufleet_unknown_variables_allowed. Its group_vars, as
    molecule.yml gives them, pass the check; without the list they would not."""
    scenario = yaml.safe_load((REPO / "molecule/nvidia_driver_upgrade/molecule.yml").read_text())
    group_vars = scenario["provisioner"]["inventory"]["group_vars"]["all"]
    assert group_vars["gpufleet_unknown_variables_allowed"] == ["gpufleet_test_repo"]
    passed = playbook(CHECK, local_inventory(tmp_path / "with", ["upg-1"], group_vars))
    assert passed.rc == 0, passed.explain()
    without = {k: v for k, v in group_vars.items() if k != "gpufleet_unknown_variables_allowed"}
    refused = playbook(CHECK, local_inventory(tmp_path / "without", ["upg-1"], without))
    assert [f["name"] for f in _checked(refused)["unknown"]] == ["gpufleet_test_repo"], refused.explain()
    # from -e as a comma-separated string too
    allowed = "gpufleet_unknown_variables_allowed=gpufleet_test_repo,gpufleet_other"
    extra = playbook(CHECK, local_inventory(tmp_path / "without", ["upg-1"], without), "-e", allowed)
    assert extra.rc == 0, extra.explain()
