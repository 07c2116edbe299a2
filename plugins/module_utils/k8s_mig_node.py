# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""A Kubernetes node around a MIG layout change: the MIG manager's labels, cordon, GPU pods evicted, uncordon.

The labels are those NVIDIA's MIG manager (mig-parted's k8s-mig-manager) reads and writes:
``nvidia.com/mig.config`` names the wanted layout, ``nvidia.com/mig.config.state`` is ``pending`` while it
changes, then ``success`` or ``failed``. The MIG manager itself neither cordons nor evicts: it only stops
the GPU operator's own GPU clients. gpufleet cordons the node and evicts the pods that ask for GPU resources
(DaemonSet pods and mirror pods excepted), and remembers in an annotation that it cordoned the node, so a
node an operator had cordoned stays cordoned afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.handoff import (
    MIG_RESOURCE_PREFIX,
    WHOLE_GPU_RESOURCE,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import (
    RESOURCES,
    Kube,
    KubeError,
    NotFound,
)

CONFIG_LABEL = "nvidia.com/mig.config"
STATE_LABEL = "nvidia.com/mig.config.state"
CORDONED_ANNOTATION = "gpufleet.io/mig-cordoned"
STATES = ("pending", "success", "failed")
# Prefixes (the module's documented default): whole GPUs, MIG devices, gpufleet's own (gpufleet.io/gpu-mem).
DEFAULT_GPU_RESOURCES = (WHOLE_GPU_RESOURCE, MIG_RESOURCE_PREFIX, "gpufleet.io/gpu")
MERGE_PATCH = "application/merge-patch+json"


def uses_gpus(pod: Mapping[str, Any], prefixes: Sequence[str]) -> bool:
    """Whether a container (init containers included) requests or limits a resource named by `prefixes`."""
    spec = pod.get("spec") or {}
    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        resources = container.get("resources") or {}
        names = [*(resources.get("requests") or {}), *(resources.get("limits") or {})]
        if any(name.startswith(prefix) for name in names for prefix in prefixes):
            return True
    return False


def _daemonset_or_mirror(pod: Mapping[str, Any]) -> bool:
    meta = pod.get("metadata") or {}
    if "kubernetes.io/config.mirror" in (meta.get("annotations") or {}):
        return True
    return any(ref.get("kind") == "DaemonSet" for ref in meta.get("ownerReferences") or [])


def gpu_pods(pods: Sequence[Mapping[str, Any]], prefixes: Sequence[str]) -> tuple[list[dict], list[str]]:
    """(pods to evict, names of GPU pods left alone: DaemonSet and mirror pods) among a node's pods."""
    evict, kept = [], []
    for pod in pods:
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed") or not uses_gpus(pod, prefixes):
            continue
        meta = pod["metadata"]
        if _daemonset_or_mirror(pod):
            kept.append(f"{meta['namespace']}/{meta['name']}")
        else:
            evict.append(dict(pod))
    return evict, kept


def node_patch(node: Mapping[str, Any], layout: str, state: str, cordon: bool) -> dict[str, Any]:
    """The merge patch that gives the node the labels of `state` and, with `cordon`, cordons it (pending) or
    takes back gpufleet's cordon (success); {} when the node is as wanted."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    unschedulable = bool((node.get("spec") or {}).get("unschedulable"))
    patch: dict[str, Any] = {}
    want = {CONFIG_LABEL: layout, STATE_LABEL: state}
    changed_labels = {k: v for k, v in want.items() if labels.get(k) != v}
    if changed_labels:
        patch.setdefault("metadata", {})["labels"] = changed_labels
    if state == "pending" and cordon and not unschedulable:
        patch["spec"] = {"unschedulable": True}
        patch.setdefault("metadata", {})["annotations"] = {CORDONED_ANNOTATION: "true"}
    elif state == "success" and annotations.get(CORDONED_ANNOTATION) is not None:
        patch["spec"] = {"unschedulable": None} if unschedulable else {}
        patch.setdefault("metadata", {})["annotations"] = {CORDONED_ANNOTATION: None}
        if not patch["spec"]:
            del patch["spec"]
    return patch


def _eviction_version(kube: Kube) -> str:
    """policy/v1 from Kubernetes 1.22, policy/v1beta1 before (1.20, 1.21)."""
    version = kube.server_version().lstrip("v").split(".")
    try:
        minor = int("".join(ch for ch in version[1] if ch.isdigit()))
    except (IndexError, ValueError):
        return "policy/v1"
    return "policy/v1" if int(version[0]) > 1 or minor >= 22 else "policy/v1beta1"


def evict(kube: Kube, pods: Sequence[Mapping[str, Any]], timeout: float) -> None:
    """Evict `pods` through the Eviction API (a PodDisruptionBudget refusal is retried) and wait until they
    are gone; KubeError naming the pods still there after `timeout` seconds."""
    api_version = _eviction_version(kube) if pods else "policy/v1"
    deadline = time.monotonic() + timeout
    res = RESOURCES["Pod"]
    waiting = {(p["metadata"]["namespace"], p["metadata"]["name"]): p["metadata"].get("uid") for p in pods}
    to_evict = list(waiting)
    while to_evict:
        blocked = []
        for namespace, name in to_evict:
            body = {
                "apiVersion": api_version,
                "kind": "Eviction",
                "metadata": {"name": name, "namespace": namespace},
            }
            try:
                kube.request(
                    "POST",
                    res.path(namespace, name, "eviction"),
                    body=body,
                    what=("create", "pods/eviction", namespace, name),
                )
            except NotFound:
                continue
            except KubeError as exc:
                if exc.status != 429:  # 429: a PodDisruptionBudget allows no disruption now
                    raise
                blocked.append((namespace, name))
        to_evict = blocked
        if to_evict:
            if time.monotonic() > deadline:
                names = ", ".join(f"{ns}/{n}" for ns, n in to_evict)
                raise KubeError(f"eviction refused (PodDisruptionBudget) until the timeout: {names}")
            time.sleep(2)
    while waiting:
        for (namespace, name), uid in list(waiting.items()):
            live = kube.get(res, name, namespace)
            if live is None or live["metadata"].get("uid") != uid:
                del waiting[(namespace, name)]
        if not waiting:
            break
        if time.monotonic() > deadline:
            names = ", ".join(f"{ns}/{n}" for ns, n in waiting)
            raise KubeError(f"evicted pods still on the node after {timeout:.0f}s: {names}")
        time.sleep(1)


def reconcile(kube: Kube, params: Mapping[str, Any], check_mode: bool) -> dict[str, Any]:
    """Bring the node to `params` (name, layout, state, drain, gpu_resources, drain_timeout); the module's
    result."""
    name, state = params["name"], params["state"]
    res = RESOURCES["Node"]
    node = kube.get(res, name)
    if node is None:
        raise KubeError(f"node {name} does not exist")
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    result: dict[str, Any] = {
        "changed": False,
        "node": name,
        "evicted": [],
        "left_running": [],
        "before": {
            "labels": {k: labels[k] for k in (CONFIG_LABEL, STATE_LABEL) if k in labels},
            "unschedulable": bool((node.get("spec") or {}).get("unschedulable")),
        },
    }
    patch = node_patch(node, params["layout"], state, params["drain"])
    to_evict: list[dict] = []
    if state == "pending" and params["drain"]:
        pods = kube.list(RESOURCES["Pod"], None, field_selector=f"spec.nodeName={name}")
        to_evict, result["left_running"] = gpu_pods(pods, params["gpu_resources"])
        result["evicted"] = [f"{p['metadata']['namespace']}/{p['metadata']['name']}" for p in to_evict]
    result["changed"] = bool(patch or to_evict)
    if patch and not check_mode:
        node = kube.request(
            "PATCH",
            res.path(None, name),
            body=patch,
            content_type=MERGE_PATCH,
            what=("patch", res.display, None, name),
        )
    after_labels = {**result["before"]["labels"], **((patch.get("metadata") or {}).get("labels") or {})}
    unschedulable = result["before"]["unschedulable"]
    if "spec" in patch:
        unschedulable = bool(patch["spec"].get("unschedulable"))
    result["after"] = {"labels": after_labels, "unschedulable": unschedulable}
    if to_evict and not check_mode:
        try:
            evict(kube, to_evict, params["drain_timeout"])
        except KubeError as exc:
            exc.partial = result  # the node is labelled and cordoned already
            raise
    return result
