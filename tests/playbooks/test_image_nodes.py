"""Role gpufleet_kubernetes's node_names (roles/gpufleet_kubernetes/vars/main.yml), evaluated by Ansible:
without a registry, the Kubernetes names of the hosts role gpufleet_images imports each image on; with a
registry or an image of your own, no limit."""

from __future__ import annotations

from pathlib import Path

import yaml
from playbookrun import REPO, playbook

VARS = REPO / "roles/gpufleet_kubernetes/vars/main.yml"


def _names(tmp_path: Path, *extra: str) -> dict[str, list[str]]:
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({
        "gpu_nodes": {"hosts": {"gpu-a.example.com": {}, "gpu-b": {"gpufleet_node_name": "node-b"}}},
        "cpu_nodes": {"hosts": {"cpu-1": {}}},
        "extender_nodes": {"hosts": {"cpu-1": {}}},
    }))  # fmt: skip
    book = tmp_path / "names.yml"
    book.write_text(yaml.safe_dump([{
        "name": "The role's node names", "hosts": "localhost", "gather_facts": False,
        "vars": {"gpufleet_kubernetes_gpu_group": "gpu_nodes"},
        "tasks": [
            {"name": "Load", "ansible.builtin.include_vars": str(VARS)},
            {"name": "Names", "ansible.builtin.debug": {"msg": {
                "device-plugin": "{{ gpufleet_kubernetes_device_plugin_node_names }}",
                "extender": "{{ gpufleet_kubernetes_extender_node_names }}"}}},
        ],
    }]))  # fmt: skip
    played = playbook(str(book), inventory, *extra)
    assert played.rc == 0, played.explain()
    return played.results("Names")["localhost"]["msg"]  # type: ignore[no-any-return]


def test_without_a_registry_the_workloads_are_kept_to_the_nodes_that_got_their_image(tmp_path: Path) -> None:
    assert _names(tmp_path) == {"device-plugin": ["gpu-a", "node-b"], "extender": ["gpu-a", "node-b"]}
    moved = _names(tmp_path, "-e", "gpufleet_images_extender_group=extender_nodes")
    assert moved == {"device-plugin": ["gpu-a", "node-b"], "extender": ["cpu-1"]}
    assert _names(tmp_path, "-e", "gpufleet_images_registry=registry.test:5000") == {
        "device-plugin": [], "extender": []}  # fmt: skip
    own = _names(tmp_path, "-e", "gpufleet_kubernetes_extender_image=registry.test/e@sha256:" + "3" * 64)
    assert own == {"device-plugin": ["gpu-a", "node-b"], "extender": []}
