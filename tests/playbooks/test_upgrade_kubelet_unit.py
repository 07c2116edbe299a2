"""playbooks/upgrade_driver.yml refuses a kubelet unit that systemd does not know, before any host is touched.

After the reboot the rollout tells the restarted kubelet's first Node status by the start time of the unit
``gpufleet_upgrade_kubelet_service`` names (``kubelet`` by default). A wrong name used to show only as a wait
for that start time that ran to ``gpufleet_upgrade_ready_timeout``, with the host already drained and
rebooted. Here a real systemd (a booted test host) judges the name. The host is declared a node of a cluster
through the preflight's registered result, so only the unit check runs (its tag), and nothing is installed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from playbookrun import playbook

from gpufleet_harness.testhosts import images
from gpufleet_harness.testhosts.podman import ensure_containers_conf
from gpufleet_harness.testhosts.workspace import missing_tools

pytestmark = [pytest.mark.root, pytest.mark.xdist_group("molecule")]

UPGRADE = "playbooks/upgrade_driver.yml"
PYTHON = "/usr/bin/python3"  # the test host's
REFUSE = "Refuse a kubelet unit that systemd does not know"
# gpufleet_upgrade_k8s_member is the preflight's own registered result (so the variable check is told to let
# it through): as an extra var it wins over the register.
AS_A_NODE = json.dumps({"gpufleet_kubernetes_kubeconfig": "/nonexistent/kubeconfig",
                        "gpufleet_upgrade_k8s_member": {"resources": [{"kind": "Node"}]},
                        "gpufleet_unknown_variables_allowed": ["gpufleet_upgrade_k8s_member"]})  # fmt: skip


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    if os.geteuid() != 0 or missing_tools():
        pytest.fail(f"needs root and the test-host tools (missing: {missing_tools()})", pytrace=False)
    with images.scratch_host("gpufleet-kunit", "--network=none", boot=True) as name:
        yield name


def _inventory(directory: Path, host: str, **hostvars: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    connection = {"ansible_connection": "gpufleet.nvidia.podman", "ansible_python_interpreter": PYTHON}
    doc = {"gpu_nodes": {"hosts": {host: connection | hostvars}}}
    (directory / "hosts.yml").write_text(yaml.safe_dump(doc))
    return directory


@pytest.fixture
def _podman_conf(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTAINERS_CONF", str(ensure_containers_conf()))


@pytest.mark.usefixtures("_podman_conf")
def test_an_unknown_kubelet_unit_is_refused_before_any_host_is_touched(host: str, tmp_path: Path) -> None:
    inventory = _inventory(tmp_path / "wrong", host, gpufleet_upgrade_kubelet_service="kubelet-typo")
    refused = playbook(UPGRADE, inventory, "--tags", "gpufleet-upgrade-kubelet-unit", "-e", AS_A_NODE)
    assert refused.rc != 0, refused.explain()
    result = refused.results(REFUSE)[host]
    assert result["failed"], result
    assert "its kubelet unit 'kubelet-typo' is not-found to systemd; expected a loaded unit" in result["msg"]
    assert "Set gpufleet_upgrade_kubelet_service" in result["msg"]
    assert "No host has been touched" in result["msg"]
    assert "Upgrade the NVIDIA driver and fabric manager, one batch of hosts at a time" not in refused.plays()

    # a unit this host's systemd has loaded passes, and the rollout's play starts
    inventory = _inventory(tmp_path / "right", host, gpufleet_upgrade_kubelet_service="systemd-journald")
    passed = playbook(UPGRADE, inventory, "--tags", "gpufleet-upgrade-kubelet-unit", "-e", AS_A_NODE)
    assert passed.rc == 0, passed.explain()
    assert not passed.results(REFUSE)[host].get("failed"), passed.explain()
    assert "Upgrade the NVIDIA driver and fabric manager, one batch of hosts at a time" in passed.plays()

    # a host that is not a node of the cluster is not asked about a kubelet at all
    alone = playbook(UPGRADE, inventory, "--tags", "gpufleet-upgrade-kubelet-unit")
    assert alone.rc == 0, alone.explain()
    assert alone.results(REFUSE)[host].get("skipped"), alone.explain()
