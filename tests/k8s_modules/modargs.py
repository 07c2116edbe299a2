"""Arguments and result helpers for tests that run gpufleet's Kubernetes modules against the lab
(tests/k8s_modules; tests/validation deploys with the same lab arguments). tests/conftest.py puts this
folder on sys.path, so ``from modargs import ...`` works from any test folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kubernetes import client as k8s
from labstack import REPO, SIM_DIR, LabStack, ensure_collection_link

from gpufleet_harness.cluster.cluster import ControlPlane

DEVICE_PLUGIN = "gpufleet.nvidia.gpu_device_plugin"
EXTENDER = "gpufleet.nvidia.gpu_scheduler_extender"
# What both modules apply first, in this order; the DaemonSet or the Deployment and Service follow.
COMMON_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap")
# The modules refuse to deploy without an image (no unpullable default). Tests that only write objects, or
# never reach a node, name this one; tests whose pods run use the lab's (lab_pod_args).
OBJECTS_IMAGE = "gpufleet-test/objects-only:1"


def admin_args(stack: LabStack, name: str | None = None, **extra: Any) -> dict[str, Any]:
    """The lab's admin kubeconfig; with ``name``, that name for the objects and for their namespace (a
    namespace per test keeps tests on the shared lab apart)."""
    args: dict[str, Any] = {"kubeconfig": str(stack.control_plane.kubeconfig()), "image": OBJECTS_IMAGE}
    if name is not None:
        args |= {"name": name, "namespace": name}
    return args | extra


def token_args(control_plane: ControlPlane, token: str, **extra: Any) -> dict[str, Any]:
    """Reach the lab's API server with a bearer token instead of a kubeconfig."""
    args = {"host": control_plane.url, "api_key": token, "ca_cert": str(control_plane.ca_file)}
    return args | {"image": OBJECTS_IMAGE} | extra


def lab_pod_args(stack: LabStack) -> dict[str, Any]:
    """Pods of the gpufleet image on the lab's nodes: the image already loaded there, the node's network
    (the API through the lab's relay; ``pod_env``)."""
    return {
        "image": stack.image.name,
        "image_pull_policy": "Never",
        "host_network": True,
        "env": stack.pod_env(),
    }


def lab_plugin_args(stack: LabStack) -> dict[str, Any]:
    """gpu_device_plugin arguments that run the plugin on the lab's GPU nodes, on each node's sim root."""
    return lab_pod_args(stack) | {"host_root": f"{SIM_DIR}/host", "extra_volumes": stack.sim_volumes()}


def lab_extender_args(stack: LabStack) -> dict[str, Any]:
    """gpu_scheduler_extender arguments that run the extender on the lab's nodes (it needs only the API)."""
    args = lab_pod_args(stack)
    args["env"] = {k: v for k, v in args["env"].items() if k.startswith("KUBERNETES_")}
    return args


def object_actions(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(kind, action) of each object a module run reports, in its order."""
    return [(o["kind"], o["action"]) for o in result["objects"]]


def plain(obj: Any) -> Any:
    """A kubernetes client model as the plain JSON-like structure the API server sent."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def kubernetes_yml(inventory: Path, *extra: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    """``ansible-playbook -i INVENTORY playbooks/kubernetes.yml EXTRA`` in the checkout, as an operator runs
    it: the checkout's ansible.cfg and collection link, none of this process's Ansible, gpufleet or
    kubeconfig settings."""
    ensure_collection_link()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANSIBLE_", "GPUFLEET_", "KUBECONFIG"))}
    argv = [
        str(Path(sys.executable).parent / "ansible-playbook"),
        "-i",
        str(inventory),
        "playbooks/kubernetes.yml",
    ]
    return subprocess.run(
        [*argv, *extra], cwd=REPO, env=env | {"ANSIBLE_NOCOLOR": "1"}, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip
