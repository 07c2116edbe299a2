"""The service images the operator's way on a real kubelet: playbooks/images.yml (role gpufleet_images)
imports the built archives into the lab node's containerd (CRI, namespace k8s.io), and pods naming the image
the way the role's manifests do, by image ID without a registry, start from it with imagePullPolicy Never, as
does the digest name the import adds; a dockershim node's dockerd gets the same archive (docker load) and
starts it by the same ID (docs/install.md). Nothing is pulled: the nodes reach no registry."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpufleet_harness.cluster.cluster import TestCluster, legacy, wait_for_pod_phase
from gpufleet_harness.cluster.node import KubeletNode
from gpufleet_harness.release import images

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.cluster, pytest.mark.root]


def _import(node: KubeletNode, tmp_path: Path, runtime: dict[str, str]) -> dict[str, str]:
    """playbooks/images.yml for the extender's image on ``node`` (the host is this machine); its images.json
    entry."""
    out = tmp_path / "images"
    images.build(out, ("extender",))
    entry: dict[str, str] = json.loads((out / "images.json").read_text())["images"]["extender"]
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "ansible_become": False,  # root already, and no sudo on this machine
        "gpufleet_images_dir": str(out),
        "gpufleet_images_node_dir": str(tmp_path / "node-dir"),
        # only the extender this time: the plugin's image is given, so the role leaves it alone
        "gpufleet_kubernetes_device_plugin_image": "unused",
        **runtime,
    }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"gpu_nodes": {"hosts": {node.name: host}}}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")} | {"ANSIBLE_NOCOLOR": "1"}
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), "playbooks/images.yml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return entry


def _run_pods(core: k8s.CoreV1Api, node: KubeletNode, namespace: str, refs: dict[str, str]) -> None:
    """Each reference as a pod on ``node`` (imagePullPolicy Never) that prints its uid: the image's user."""
    for name, ref in refs.items():
        container = k8s.V1Container(
            name="c",
            image=ref,
            image_pull_policy="Never",
            command=["python3", "-c", "import gpufleet.extender.cli, os; print(os.getuid())"],
        )
        spec = k8s.V1PodSpec(containers=[container], node_name=node.name, restart_policy="Never")
        core.create_namespaced_pod(namespace, k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name), spec=spec))
    for name, ref in refs.items():
        pod = wait_for_pod_phase(core, name, namespace, ("Succeeded", "Failed"), 120)
        assert pod.status.phase == "Succeeded", (ref, pod.status.container_statuses)
        assert core.read_namespaced_pod_log(name, namespace).strip() == "65532"


def test_containerd_cri_starts_pods_from_the_imported_image_by_id_and_by_digest(
    kubelet_node: KubeletNode, core: k8s.CoreV1Api, namespace: str, tmp_path: Path
) -> None:
    # the node's /run is its run directory on this machine (node_init), so its containerd socket is here
    address = str(kubelet_node.run_dir / "containerd" / "containerd.sock")
    entry = _import(
        kubelet_node,
        tmp_path,
        {"gpufleet_images_runtime": "containerd", "gpufleet_images_containerd_address": address},
    )
    assert entry["digest"] in kubelet_node.ctr("images", "ls")
    _run_pods(
        core,
        kubelet_node,
        namespace,
        {"by-id": entry["id"], "by-digest": f"gpufleet/extender@{entry['digest']}"},
    )


def test_dockershim_starts_pods_from_the_loaded_image_by_id(
    core: k8s.CoreV1Api, lab: TestCluster, namespace: str, tmp_path: Path
) -> None:
    """The role's docker path under a kubelet: only 1.20 has one on dockerd (dockershim left the kubelet in
    1.24), so this runs with GPUFLEET_K8S_VERSION=1.20 and says so on the default 1.37."""
    if not legacy(lab.artifacts):
        pytest.skip(
            f"dockershim left the kubelet in 1.24; this cluster runs {lab.artifacts.git_version}"
            " (GPUFLEET_K8S_VERSION=1.20 runs this test)"
        )
    node = lab.start_kubelet_node("gf-images-docker", runtime="docker")
    try:
        entry = _import(
            node,
            tmp_path,
            {
                "gpufleet_images_runtime": "docker",
                "gpufleet_images_docker_host": f"unix://{node.docker_socket}",
            },
        )
        _run_pods(core, node, namespace, {"docker-by-id": entry["id"]})
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespaced_pod("docker-by-id", namespace, grace_period_seconds=0)
        node.stop()
        # no kubelet keeps it any more: DaemonSets of later tests must not target it
        core.delete_node(node.name)
