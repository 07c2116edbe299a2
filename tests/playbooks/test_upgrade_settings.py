"""playbooks/upgrade_driver.yml takes its settings where docs/roles.md says (issue 30 item 7).

Ansible sizes a play's batches (``serial``) before inventory variables apply: a ``gpufleet_upgrade_batch``
set only in group_vars used to be ignored without a word (batches of one), and the playbook's own ``vars:``
overrode ``gpufleet_upgrade_ready_timeout`` from the inventory and hard-coded the drain timeout. The runs
below use local hosts and an unknown tag, so only the ``always`` tasks (the batch check, fact gathering) run:
nothing on this machine is touched.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from playbookrun import REPO, local_inventory, playbook

UPGRADE = "playbooks/upgrade_driver.yml"
CHECK = "Refuse a gpufleet_upgrade_batch that only the inventory sets (it would be ignored)"
PREFIXES = ("gpufleet_", "esxi_", "nvidia_", "gpu_host_prep_")  # the names an operator sets
VARIABLES_CHECK = "Check that every gpufleet variable the inventory and -e set is one gpufleet reads"
BATCH_CHECK = "Check that the rollout's batches have the size asked for"
ROLLOUT = "Upgrade the NVIDIA driver and fabric manager, one batch of hosts at a time"


def test_a_batch_size_set_only_in_the_inventory_is_refused_before_any_host_is_touched(tmp_path: Path) -> None:
    inventory = local_inventory(tmp_path / "inv", ["up-a", "up-b", "up-c"], {"gpufleet_upgrade_batch": 2})
    refused = playbook(UPGRADE, inventory, "--tags", "gpufleet-none")
    assert refused.rc != 0, refused.explain()
    result = refused.results(CHECK)["up-a"]
    assert result["failed"]
    assert result["msg"].startswith(
        "gpufleet_upgrade_batch is 2 for up-a, but this rollout's batches hold 1 host(s): Ansible sizes"
    )
    assert "pass -e gpufleet_upgrade_batch=2" in result["msg"] and "Nothing has been touched" in result["msg"]
    assert refused.plays() == [VARIABLES_CHECK, BATCH_CHECK]

    # as an extra var it is the batch size: 3 hosts in batches of 2, the check play ended after one batch
    honoured = playbook(UPGRADE, inventory, "--tags", "gpufleet-none", "-e", "gpufleet_upgrade_batch=2")
    assert honoured.rc == 0, honoured.explain()
    plays = honoured.plays()
    assert plays.count(ROLLOUT) == 2 and plays.count(BATCH_CHECK) == 1
    rollout = [p for p in honoured.report["plays"] if p["play"]["name"] == ROLLOUT]
    batches = [sorted(p["tasks"][0]["hosts"]) for p in rollout]
    assert batches == [["up-a", "up-b"], ["up-c"]]

    # no batch size anywhere: batches of one, nothing refused
    plain_inventory = local_inventory(tmp_path / "plain", ["up-a", "up-b"])
    plain = playbook(UPGRADE, plain_inventory, "--tags", "gpufleet-none")
    assert plain.rc == 0 and plain.plays().count(ROLLOUT) == 2, plain.explain()


def test_no_play_variable_overrides_a_setting_the_inventory_documents() -> None:
    """A play's ``vars:`` win over the inventory: none may carry a name inventory/example documents as a
    setting (before: upgrade_driver.yml's gpufleet_upgrade_ready_timeout and the undocumented, hard-coded
    gpufleet_upgrade_drain_timeout)."""
    documented = (REPO / "inventory/example/group_vars/all.yml").read_text()
    documented += (REPO / "inventory/example/hosts.yml").read_text()
    shadowing = []
    for path in [REPO / "site.yml", *sorted((REPO / "playbooks").glob("*.yml"))]:
        for play in yaml.safe_load(path.read_text()) or []:
            for name in play.get("vars") or {}:
                if name.startswith(PREFIXES) and re.search(rf"(?<!\w){re.escape(name)}(?!\w)", documented):
                    shadowing.append(f"{path.name}: {play.get('name')}: {name}")
    assert not shadowing, shadowing
    assert "gpufleet_upgrade_drain_timeout: 600" in documented  # a documented setting now
    upgrade = (REPO / UPGRADE).read_text()
    assert "gpufleet_upgrade_drain_timeout | default(600)" in upgrade
    assert "gpufleet_upgrade_ready_timeout | default(600)" in upgrade
