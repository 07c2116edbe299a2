"""playbooks/kubernetes.yml (role gpufleet_kubernetes) against the lab: a GPU node group and a control-plane
group from an inventory, the device plugin DaemonSet waited for until gpu-a advertises 8 GPUs, the extender
rolled out, kube-scheduler's kubeadm manifest pointed at the generated configuration and restarted (the
kubelet's static-pod part played by StaticPodRunner); the node's named device plugin configuration picked by
gpufleet_device_plugin_config_name; a second run changes nothing; absent undoes it all.

One test, one inventory: each kubernetes.yml run costs ~15-25 CPU-s on the shared lab, so the named
configuration rides on the deploy test's runs instead of five runs of its own (session 10)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from labstack import SIM_DIR, LabStack, scheduler_config_options, timed
from modargs import kubernetes_yml

from gpufleet_harness.cluster.process import free_ports
from gpufleet_harness.cluster.staticpod import StaticPodRunner, write_kubeadm_manifest

pytestmark = pytest.mark.cluster


def _recap(output: str) -> dict[str, dict[str, int]]:
    """PLAY RECAP per host: {host: {ok, changed, failed, ...}}."""
    recap = {}
    for line in output.split("PLAY RECAP", 1)[-1].splitlines():
        match = re.match(r"^(\S+)\s+:\s+(.*)$", line)
        if match:
            recap[match.group(1)] = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(2))}
    return recap


CONFIG_LABEL = "nvidia.com/device-plugin.config"
NAME_VAR = "gpufleet_device_plugin_config_name"
# labels off: the plugin must not publish gpufleet.io/gpu-sharing over the lab's own node labels
PLUGIN_CONFIG = {
    "http": {"port": 0},
    "labels": {"enabled": False},
    "configs": {
        "default": "whole",
        "named": {
            "whole": {},
            "sliced": {"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 2}}},
        },
    },
}


def test_kubernetes_playbook_deploys_is_idempotent_and_removes(stack: LabStack, tmp_path: Path) -> None:
    """An unknown configuration name fails before anything is deployed; the name set per group labels gpu-a,
    whose plugin then advertises that configuration's devices (8 GPUs x 2), the RuntimeClass nvidia is made,
    and the extender and the scheduler configuration roll out; a second run changes nothing; the name taken
    away removes the role's label and gpu-a is back on the default, live; absent undoes it all and leaves no
    label."""
    nodes = stack.nodes()
    cp = stack.control_plane
    core = cp.core_v1()
    stack.expose_probe_port(8800)
    secure_port, health_port = free_ports(2)
    scheduler_kubeconfig = cp.kubeconfig("system:kube-scheduler")
    manifest = tmp_path / "manifests" / "kube-scheduler.yaml"
    original = write_kubeadm_manifest(
        manifest, scheduler_kubeconfig, secure_port, cp.cluster.artifacts.git_version
    )
    config_version, health_options = scheduler_config_options(cp, health_port)
    config_file = tmp_path / "gpufleet-scheduler-config.yaml"
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    common = {
        "gpufleet_kubernetes_kubeconfig": str(cp.kubeconfig()),
        "gpufleet_kubernetes_namespace": "gpufleet-role",
        "gpufleet_kubernetes_device_plugin_image": stack.image.name,
        "gpufleet_kubernetes_device_plugin_image_pull_policy": "Never",
        "gpufleet_kubernetes_device_plugin_node_selector": {"gpufleet.io/lab-gpus": "whole"},
        "gpufleet_kubernetes_device_plugin_config": PLUGIN_CONFIG,
        "gpufleet_kubernetes_device_plugin_host_root": f"{SIM_DIR}/host",
        "gpufleet_kubernetes_device_plugin_host_network": True,
        "gpufleet_kubernetes_device_plugin_env": stack.pod_env(),
        "gpufleet_kubernetes_device_plugin_extra_volumes": stack.sim_volumes(),
        "gpufleet_kubernetes_device_plugin_wait_timeout": 180,
        "gpufleet_kubernetes_extender_image": stack.image.name,
        "gpufleet_kubernetes_extender_image_pull_policy": "Never",
        "gpufleet_kubernetes_extender_replicas": 1,
        "gpufleet_kubernetes_extender_host_network": True,
        "gpufleet_kubernetes_extender_service_type": "ClusterIP",
        "gpufleet_kubernetes_extender_env": {
            k: v for k, v in stack.pod_env().items() if k.startswith("KUBE")
        },
        "gpufleet_kubernetes_extender_node_selector": {"kubernetes.io/hostname": "gpu-a"},
        "gpufleet_kubernetes_scheduler_config_version": config_version,
        "gpufleet_kubernetes_scheduler_config": {
            "url": f"http://{nodes['gpu-a'].node.peer_ip}:8800/gpufleet",
            "kubeconfig": str(scheduler_kubeconfig),
            "leader_elect": False,
            **health_options,
        },
        "gpufleet_kubernetes_scheduler_config_file": str(config_file),
        "gpufleet_kubernetes_scheduler_manifest": str(manifest),
        "gpufleet_kubernetes_scheduler_backup_dir": str(tmp_path / "backups"),
        "gpufleet_kubernetes_scheduler_healthz_url": f"https://127.0.0.1:{secure_port}/healthz",
    }
    gpu_host = {**local, "gpufleet_expected_gpu_count": 8}

    def inventory(host_vars: dict[str, str], group_vars: dict[str, str]) -> Path:
        doc = {
            "all": {"vars": common},
            "gpu_nodes": {"hosts": {"gpu-a.lab.example": {**gpu_host, **host_vars}}, "vars": group_vars},
            "kube_control_plane": {"hosts": {"cp-1": {**local, "ansible_become_method": "su"}}},
        }
        path = tmp_path / "inventory.yml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    def labelled() -> str | None:
        return (core.read_node("gpu-a").metadata.labels or {}).get(CONFIG_LABEL)

    runner = StaticPodRunner(manifest, cp.cluster.artifacts.binary("kube-scheduler"), tmp_path).start()
    apps = k8s.AppsV1Api(cp.api_client())
    removed = False
    try:
        unknown = kubernetes_yml(inventory({NAME_VAR: "slised"}, {}))
        assert unknown.returncode != 0
        assert (
            f"GPU node gpu-a.lab.example: {NAME_VAR} slised is not a named configuration of the device "
            "plugin; known: sliced, whole (gpufleet_kubernetes_device_plugin_config.configs.named)"
            in unknown.stdout
        ), unknown.stdout[-3000:]
        namespaces = {n.metadata.name for n in core.list_namespace().items}
        assert "gpufleet-role" not in namespaces, "deployed anyway"
        assert labelled() is None and manifest.read_text() == original and runner.restarts == 0

        per_group = inventory({}, {NAME_VAR: "sliced"})
        with timed(stack.timings, "kubernetes.yml: first run, named configuration by group"):
            first = kubernetes_yml(per_group)
        assert first.returncode == 0, first.stdout[-4000:]
        ds = apps.read_namespaced_daemon_set("gpufleet-device-plugin", "gpufleet-role")
        assert ds.status is not None and ds.status.number_available == 1
        assert (
            getattr(
                apps.read_namespaced_deployment("gpufleet-extender", "gpufleet-role").status,
                "ready_replicas",
                0,
            )
            == 1
        )
        assert f"--config={config_file}" in runner.argv() and runner.restarts == 1
        runtime_class = k8s.NodeV1Api(cp.api_client()).read_runtime_class("nvidia")  # the role's default
        assert runtime_class.handler == "nvidia"
        node = core.read_node("gpu-a")
        assert node.metadata.labels[CONFIG_LABEL] == "sliced"
        assert node.status.allocatable["nvidia.com/gpu"] == "16"  # the role's wait saw 8 GPUs x 2

        with timed(stack.timings, "kubernetes.yml: second run"):
            second = kubernetes_yml(per_group)
        assert second.returncode == 0, second.stdout[-4000:]
        assert {host: counts["changed"] for host, counts in _recap(second.stdout).items()} == {
            "gpu-a.lab.example": 0,
            "cp-1": 0,
        }, second.stdout[-3000:]
        assert runner.restarts == 1

        unset = kubernetes_yml(inventory({}, {}))
        assert unset.returncode == 0, unset.stdout[-4000:]
        assert labelled() is None
        # switched back live, waited for by the role; nothing else moved
        assert core.read_node("gpu-a").status.allocatable["nvidia.com/gpu"] == "8"
        assert runner.restarts == 1

        gone = kubernetes_yml(per_group, "-e", "gpufleet_kubernetes_state=absent")
        removed = gone.returncode == 0
        assert removed, gone.stdout[-4000:]
        assert yaml.safe_load(manifest.read_text()) == yaml.safe_load(original) and not config_file.exists()
        assert "gpufleet-role" not in {n.metadata.name for n in core.list_namespace().items}
        assert labelled() is None
        runtime_classes = k8s.NodeV1Api(cp.api_client()).list_runtime_class().items
        assert "nvidia" not in {rc.metadata.name for rc in runtime_classes}
    finally:
        if not removed:
            kubernetes_yml(inventory({}, {}), "-e", "gpufleet_kubernetes_state=absent")
        core.patch_node("gpu-a", {"metadata": {"labels": {CONFIG_LABEL: None}}})
        runner.stop()
