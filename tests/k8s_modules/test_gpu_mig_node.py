"""gpu_mig_node through ansible-playbook against the lab's real kube-apiserver: NVIDIA's MIG manager
labels, cordon, GPU pods evicted through the Eviction API (policy/v1 on 1.37, v1beta1 on 1.20), uncordon,
on kubelet-less nodes. The pods' terminationGracePeriodSeconds is 0, so an evicted pod goes at once
without a kubelet."""

from __future__ import annotations

import secrets
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labstack import LabStack, copy_kubeconfig, ensure_collection_link, run_tasks, wait_until

pytestmark = pytest.mark.cluster

sys.path.insert(0, str(ensure_collection_link()))
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_mig_node import (  # noqa: E402
    CORDONED_ANNOTATION,
    gpu_pods,
    node_patch,
)

CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"


@pytest.fixture
def cluster(stack: LabStack, tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A fresh namespace and kubelet-less node (deleted after), and a kubeconfig for the module."""
    cp = stack.control_plane
    core = cp.core_v1()
    suffix = secrets.token_hex(3)
    ns, node = f"t-mig-{suffix}", f"mig-{suffix}"
    core.create_namespace({"metadata": {"name": ns}})
    cp.fake_node(node, {"nvidia.com/gpu": 8}, {CONFIG: "all-disabled", STATE: "success"})

    def default_account() -> bool:
        return any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(ns).items)

    wait_until(f"the default ServiceAccount of {ns}", default_account, 60)
    yield {"core": core, "ns": ns, "node": node, "kubeconfig": str(copy_kubeconfig(cp, tmp_path))}
    core.delete_node(node)
    core.delete_namespace(ns)


def pod(core: Any, ns: str, node: str, name: str, resources: dict[str, int]) -> None:
    limits = {k: str(v) for k, v in resources.items()}
    spec = {
        "nodeName": node,
        "terminationGracePeriodSeconds": 0,
        "automountServiceAccountToken": False,
        "containers": [{"name": "c", "image": "busybox", "resources": {"limits": limits}}],
    }
    core.create_namespaced_pod(ns, {"metadata": {"name": name}, "spec": spec})


def mig_node(c: dict[str, Any], state: str, tmp: Path, *args: str, **extra: Any) -> dict[str, Any]:
    task = {
        "gpufleet.nvidia.gpu_mig_node": {
            "name": c["node"],
            "layout": "all-1g.10gb",
            "state": state,
            "kubeconfig": c["kubeconfig"],
            **extra,
        },
        "ignore_errors": True,
    }
    return run_tasks([task], tmp, args=args).task()


def node_view(c: dict[str, Any]) -> tuple[dict[str, str], bool, dict[str, str]]:
    node = c["core"].read_node(c["node"])
    labels = {k: v for k, v in (node.metadata.labels or {}).items() if k in (CONFIG, STATE)}
    return labels, bool(node.spec.unschedulable), dict(node.metadata.annotations or {})


def pods_left(c: dict[str, Any]) -> set[str]:
    return {p.metadata.name for p in c["core"].list_namespaced_pod(c["ns"]).items}


def test_pending_cordons_and_evicts_gpu_pods_success_uncordons(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    c = cluster
    pod(c["core"], c["ns"], c["node"], "whole-gpu", {"nvidia.com/gpu": 1})
    pod(c["core"], c["ns"], c["node"], "mig-slice", {"nvidia.com/mig-1g.10gb": 1})
    pod(c["core"], c["ns"], c["node"], "cpu-only", {"cpu": 1})

    check = mig_node(c, "pending", tmp_path, "--check", "--diff", drain=True)
    assert check["changed"] is True and sorted(check["evicted"]) == [
        f"{c['ns']}/mig-slice",
        f"{c['ns']}/whole-gpu",
    ]
    assert node_view(c)[:2] == ({CONFIG: "all-disabled", STATE: "success"}, False)
    assert pods_left(c) == {"whole-gpu", "mig-slice", "cpu-only"}

    pending = mig_node(c, "pending", tmp_path, drain=True)
    assert pending["changed"] is True, pending
    labels, unschedulable, annotations = node_view(c)
    assert labels == {CONFIG: "all-1g.10gb", STATE: "pending"} and unschedulable
    assert annotations[CORDONED_ANNOTATION] == "true"
    assert pods_left(c) == {"cpu-only"}
    assert mig_node(c, "pending", tmp_path, drain=True)["changed"] is False

    success = mig_node(c, "success", tmp_path, "--diff")
    assert success["changed"] is True
    applied = {CONFIG: "all-1g.10gb", STATE: "success"}
    assert success["diff"]["after"] == {"labels": applied, "unschedulable": False}
    labels, unschedulable, annotations = node_view(c)
    assert labels == {CONFIG: "all-1g.10gb", STATE: "success"} and not unschedulable
    assert CORDONED_ANNOTATION not in annotations
    assert mig_node(c, "success", tmp_path)["changed"] is False


def test_failed_stays_cordoned_and_an_operators_cordon_is_kept(
    cluster: dict[str, Any], tmp_path: Path
) -> None:
    c = cluster
    assert mig_node(c, "pending", tmp_path, drain=True)["changed"] is True
    assert mig_node(c, "failed", tmp_path)["changed"] is True
    labels, unschedulable, annotations = node_view(c)
    assert labels[STATE] == "failed" and unschedulable and CORDONED_ANNOTATION in annotations
    # A later successful run takes back gpufleet's cordon.
    assert mig_node(c, "success", tmp_path)["changed"] is True
    assert node_view(c)[1] is False
    # Cordoned by an operator before: still cordoned after success.
    c["core"].patch_node(c["node"], {"spec": {"unschedulable": True}})
    assert mig_node(c, "pending", tmp_path, drain=True)["changed"] is True  # the state label only
    mig_node(c, "success", tmp_path)
    labels, unschedulable, annotations = node_view(c)
    assert labels[STATE] == "success" and unschedulable and CORDONED_ANNOTATION not in annotations


def test_missing_node_is_a_clear_error(cluster: dict[str, Any], tmp_path: Path) -> None:
    c = {**cluster, "node": "no-such-node"}
    result = mig_node(c, "pending", tmp_path)
    assert result["failed"] is True and result["msg"] == "node no-such-node does not exist"


# -- pure logic -------------------------------------------------------------------------------------------


def test_daemonset_and_mirror_gpu_pods_are_left_running() -> None:
    def p(name: str, resources: dict[str, str], **meta: Any) -> dict[str, Any]:
        return {
            "metadata": {"name": name, "namespace": "ns", **meta},
            "spec": {"initContainers": [{"resources": {"requests": resources}}], "containers": [{}]},
            "status": {"phase": "Running"},
        }

    pods = [
        p("train", {"nvidia.com/gpu": "1"}),
        p("plugin", {"nvidia.com/gpu": "1"}, ownerReferences=[{"kind": "DaemonSet", "name": "x"}]),
        p("static", {"nvidia.com/mig-1g.10gb": "1"}, annotations={"kubernetes.io/config.mirror": "x"}),
        p("web", {"cpu": "1"}),
        {**p("done", {"nvidia.com/gpu": "1"}), "status": {"phase": "Succeeded"}},
    ]
    evict, kept = gpu_pods(pods, ["nvidia.com/gpu", "nvidia.com/mig-"])
    assert [e["metadata"]["name"] for e in evict] == ["train"]
    assert kept == ["ns/plugin", "ns/static"]


def test_node_patch_touches_only_what_differs() -> None:
    node = {"metadata": {"labels": {CONFIG: "a", STATE: "success"}}, "spec": {}}
    assert node_patch(node, "a", "success", cordon=True) == {}
    pending = {CONFIG: "b", STATE: "pending"}
    assert node_patch(node, "b", "pending", cordon=False) == {"metadata": {"labels": pending}}
    ours = {
        "metadata": {"labels": pending, "annotations": {CORDONED_ANNOTATION: "true"}},
        "spec": {"unschedulable": True},
    }
    assert node_patch(ours, "b", "failed", cordon=True) == {"metadata": {"labels": {STATE: "failed"}}}
    assert node_patch(ours, "b", "success", cordon=False) == {
        "metadata": {"labels": {STATE: "success"}, "annotations": {CORDONED_ANNOTATION: None}},
        "spec": {"unschedulable": None},
    }
