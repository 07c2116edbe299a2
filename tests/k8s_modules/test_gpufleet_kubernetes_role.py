"""playbooks/kubernetes.yml (role gpufleet_kubernetes) against the lab: a GPU node group and a control-plane
group from an inventory, the device plugin DaemonSet waited for until gpu-a advertises 8 GPUs, the extender
rolled out, kube-scheduler's kubeadm manifest pointed at the generated configuration and restarted (the
kubelet's static-pod part played by StaticPodRunner); a second run changes nothing; absent undoes it all."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from labstack import REPO, SIM_DIR, LabStack, ensure_collection_link, timed

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


def _playbook(inventory: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    ensure_collection_link()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET_", "KUBECONFIG"))}
    argv = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(inventory),
        "playbooks/kubernetes.yml",
        *extra,
    ]
    return subprocess.run(
        argv,
        cwd=REPO,
        env=env | {"ANSIBLE_NOCOLOR": "1"},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )


def test_kubernetes_playbook_deploys_is_idempotent_and_removes(stack: LabStack, tmp_path: Path) -> None:
    nodes = stack.nodes()
    cp = stack.control_plane
    stack.expose_probe_port(8800)
    secure_port, health_port = free_ports(2)
    scheduler_kubeconfig = cp.kubeconfig("system:kube-scheduler")
    manifest = tmp_path / "manifests" / "kube-scheduler.yaml"
    original = write_kubeadm_manifest(manifest, scheduler_kubeconfig, secure_port)
    config_file = tmp_path / "gpufleet-scheduler-config.yaml"
    local = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    inventory = {
        "all": {
            "vars": {
                "gpufleet_kubernetes_kubeconfig": str(cp.kubeconfig()),
                "gpufleet_kubernetes_namespace": "gpufleet-role",
                "gpufleet_kubernetes_device_plugin_image": stack.image.name,
                "gpufleet_kubernetes_device_plugin_image_pull_policy": "Never",
                "gpufleet_kubernetes_device_plugin_node_selector": {"gpufleet.io/lab-gpus": "whole"},
                "gpufleet_kubernetes_device_plugin_config": {"http": {"port": 0}},
                "gpufleet_kubernetes_device_plugin_host_root": f"{SIM_DIR}/host",
                "gpufleet_kubernetes_device_plugin_host_network": True,
                "gpufleet_kubernetes_device_plugin_env": stack.pod_env(),
                "gpufleet_kubernetes_device_plugin_extra_volumes": stack.sim_volumes(),
                "gpufleet_kubernetes_extender_image": stack.image.name,
                "gpufleet_kubernetes_extender_image_pull_policy": "Never",
                "gpufleet_kubernetes_extender_replicas": 1,
                "gpufleet_kubernetes_extender_host_network": True,
                "gpufleet_kubernetes_extender_service_type": "ClusterIP",
                "gpufleet_kubernetes_extender_env": {
                    k: v for k, v in stack.pod_env().items() if k.startswith("KUBE")
                },
                "gpufleet_kubernetes_extender_node_selector": {"kubernetes.io/hostname": "gpu-a"},
                "gpufleet_kubernetes_scheduler_config_version": "v1beta1",
                "gpufleet_kubernetes_scheduler_config": {
                    "url": f"http://{nodes['gpu-a'].node.peer_ip}:8800/gpufleet",
                    "kubeconfig": str(scheduler_kubeconfig),
                    "leader_elect": False,
                    "healthz_bind_address": f"127.0.0.1:{health_port}",
                    "metrics_bind_address": f"127.0.0.1:{health_port}",
                },
                "gpufleet_kubernetes_scheduler_config_file": str(config_file),
                "gpufleet_kubernetes_scheduler_manifest": str(manifest),
                "gpufleet_kubernetes_scheduler_backup_dir": str(tmp_path / "backups"),
                "gpufleet_kubernetes_scheduler_healthz_url": f"https://127.0.0.1:{secure_port}/healthz",
            }
        },
        "gpu_nodes": {"hosts": {"gpu-a.lab.example": {**local, "gpufleet_expected_gpu_count": 8}}},
        "kube_control_plane": {"hosts": {"cp-1": {**local, "ansible_become_method": "su"}}},
    }
    path = tmp_path / "inventory.yml"
    path.write_text(yaml.safe_dump(inventory, sort_keys=False))
    runner = StaticPodRunner(manifest, cp.lab.artifacts.binary("kube-scheduler"), tmp_path).start()
    apps = k8s.AppsV1Api(cp.api_client())
    try:
        with timed(stack.timings, "kubernetes.yml: first run"):
            first = _playbook(path)
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
        node = cp.core_v1().read_node("gpu-a")
        assert node.status.allocatable["nvidia.com/gpu"] == "8"

        with timed(stack.timings, "kubernetes.yml: second run"):
            second = _playbook(path)
        assert second.returncode == 0, second.stdout[-4000:]
        assert {host: counts["changed"] for host, counts in _recap(second.stdout).items()} == {
            "gpu-a.lab.example": 0,
            "cp-1": 0,
        }, second.stdout[-3000:]
        assert runner.restarts == 1

        gone = _playbook(path, "-e", "gpufleet_kubernetes_state=absent")
        assert gone.returncode == 0, gone.stdout[-4000:]
        assert yaml.safe_load(manifest.read_text()) == yaml.safe_load(original) and not config_file.exists()
        assert "gpufleet-role" not in {n.metadata.name for n in cp.core_v1().list_namespace().items}
    finally:
        runner.stop()


CONFIG_LABEL = "nvidia.com/device-plugin.config"


def test_role_labels_each_node_with_its_configuration_and_refuses_an_unknown_name(
    stack: LabStack, tmp_path: Path
) -> None:
    """gpufleet_device_plugin_config_name (per host, then per group) picks a node's named configuration: an
    unknown name fails before anything is deployed; a known one labels gpu-a, whose plugin then advertises
    that configuration's devices; a second run changes nothing; the name taken away removes the role's label
    and gpu-a is back on the default; absent leaves no label."""
    stack.nodes()
    cp = stack.control_plane
    core = cp.core_v1()
    namespace = "gpufleet-role-named"
    config = {
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
    common = {
        "gpufleet_kubernetes_kubeconfig": str(cp.kubeconfig()),
        "gpufleet_kubernetes_namespace": namespace,
        "gpufleet_kubernetes_extender_enabled": False,
        "gpufleet_kubernetes_device_plugin_image": stack.image.name,
        "gpufleet_kubernetes_device_plugin_image_pull_policy": "Never",
        "gpufleet_kubernetes_device_plugin_node_selector": {"gpufleet.io/lab-gpus": "whole"},
        "gpufleet_kubernetes_device_plugin_config": config,
        "gpufleet_kubernetes_device_plugin_host_root": f"{SIM_DIR}/host",
        "gpufleet_kubernetes_device_plugin_host_network": True,
        "gpufleet_kubernetes_device_plugin_env": stack.pod_env(),
        "gpufleet_kubernetes_device_plugin_extra_volumes": stack.sim_volumes(),
        "gpufleet_kubernetes_device_plugin_wait_timeout": 180,
    }
    host = {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
    host |= {"gpufleet_expected_gpu_count": 8}

    def inventory(host_vars: dict[str, str], group_vars: dict[str, str]) -> Path:
        doc = {
            "all": {"vars": common},
            "gpu_nodes": {"hosts": {"gpu-a.lab.example": {**host, **host_vars}}, "vars": group_vars},
        }
        path = tmp_path / "inventory.yml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        return path

    name_var = "gpufleet_device_plugin_config_name"
    try:
        unknown = _playbook(inventory({name_var: "slised"}, {}))
        assert unknown.returncode != 0
        assert (
            f"GPU node gpu-a.lab.example: {name_var} slised is not a named configuration of the device "
            "plugin; known: sliced, whole (gpufleet_kubernetes_device_plugin_config.configs.named)"
            in unknown.stdout
        ), unknown.stdout[-3000:]
        assert namespace not in {n.metadata.name for n in core.list_namespace().items}, "deployed anyway"
        assert CONFIG_LABEL not in (core.read_node("gpu-a").metadata.labels or {})

        per_group = inventory({}, {name_var: "sliced"})
        with timed(stack.timings, "kubernetes.yml: named configuration by group"):
            first = _playbook(per_group)
        assert first.returncode == 0, first.stdout[-4000:]
        node = core.read_node("gpu-a")
        assert node.metadata.labels[CONFIG_LABEL] == "sliced"
        assert node.status.allocatable["nvidia.com/gpu"] == "16"  # the role's wait saw 8 GPUs x 2

        second = _playbook(per_group)
        assert second.returncode == 0, second.stdout[-4000:]
        assert _recap(second.stdout)["gpu-a.lab.example"]["changed"] == 0, second.stdout[-3000:]

        unset = _playbook(inventory({}, {}))
        assert unset.returncode == 0, unset.stdout[-4000:]
        node = core.read_node("gpu-a")
        assert CONFIG_LABEL not in (node.metadata.labels or {})
        assert node.status.allocatable["nvidia.com/gpu"] == "8"  # switched back live, waited for by the role

        gone = _playbook(per_group, "-e", "gpufleet_kubernetes_state=absent")
        assert gone.returncode == 0, gone.stdout[-4000:]
        assert CONFIG_LABEL not in (core.read_node("gpu-a").metadata.labels or {})
        assert namespace not in {n.metadata.name for n in core.list_namespace().items}
    finally:
        _playbook(inventory({}, {}), "-e", "gpufleet_kubernetes_state=absent")
        core.patch_node("gpu-a", {"metadata": {"labels": {CONFIG_LABEL: None}}})
