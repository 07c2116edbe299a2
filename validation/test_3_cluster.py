"""Cluster suite: each GPU host's Kubernetes node advertises its GPUs.

Per host with a ``node_name`` (default: the host's name): the node exists and is Ready; capacity and
allocatable of the GPU resource equal the GPU count (``nvidia.com/gpu``, or the host's ``resource``; with
``sharing: time-slicing``, times its ``replicas``; with ``sharing: memory`` the node advertises
``gpufleet.io/gpu-mem`` instead, checked for being present and whole; with ``mig_strategy: mixed`` the GPUs
in MIG mode, ``mig_gpus``, are not counted: they are MIG resources; with ``single`` every device is a MIG
device, whose number the GPU count does not give, so only a non-zero count is checked); the device plugin's
GPU labels and the ``gpufleet.io/gpus`` annotation are there and agree with the count and model.

With a Prometheus in the expectations (``cluster.prometheus.url``): every GPU of the node's
``gpufleet.io/gpus`` annotation has its GPU series there (``DCGM_FI_DEV_FB_USED``, with
``gpufleet_gpu_up`` 1), and a GPU pod held running on the node finds its pod and namespace on the series of
the GPU it holds (docs/metrics.md).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hostcheck import Target
from metricscheck import GPU_SERIES, UP_SERIES, PrometheusApi, uuid_regex
from podcheck import Cluster

SUITE = "cluster"


def _node(target: Target, cluster: Cluster) -> dict[str, Any]:
    name = str(target.want("node_name") or target.name)
    node = cluster.node(name)
    assert node is not None, f"{target.name}: Kubernetes has no node {name}"
    return node


def _resource(target: Target, cluster: Cluster) -> str:
    """What the node advertises its GPUs as: GPU memory, or the host's (renamed) GPU resource."""
    if target.want("sharing") == "memory":
        return cluster.memory_resource
    return str(target.want("resource") or cluster.resource)


def _devices(target: Target) -> int | None:
    """Devices the node should advertise: whole GPUs x time-slicing replicas (1 when not time-sliced); whole
    GPUs are all of them but, under MIG strategy mixed, those in MIG mode; unknown under strategy single."""
    want, strategy = target.want("gpu_count"), target.want("mig_strategy") or "none"
    if want is None or strategy == "single":
        return None
    whole = int(want) - (int(target.want("mig_gpus") or 0) if strategy == "mixed" else 0)
    return whole * int(target.want("replicas") or 1)


def _count(node: dict[str, Any], section: str, resource: str) -> int | None:
    value = (node.get("status", {}).get(section) or {}).get(resource)
    return None if value is None else int(value)


def test_node_ready(target: Target, cluster: Cluster) -> None:
    node = _node(target, cluster)
    ready = [c for c in node["status"].get("conditions", []) if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True", (
        f"{target.name}: node {node['metadata']['name']} is not Ready: "
        f"{ready[0].get('reason', '') + ' ' + ready[0].get('message', '') if ready else 'no Ready condition'}"
    )


def test_gpu_capacity(target: Target, cluster: Cluster) -> None:
    node, resource = _node(target, cluster), _resource(target, cluster)
    name, capacity = node["metadata"]["name"], _count(node, "capacity", resource)
    assert capacity is not None, (
        f"{target.name}: node {name} has no {resource} in its capacity: "
        "the device plugin never registered there"
    )
    want = _devices(target)
    if target.want("sharing") != "memory" and want is not None:
        assert capacity == want, (
            f"{target.name}: node {name} has capacity {resource}={capacity}, expected {want}"
        )
    else:
        assert capacity > 0, f"{target.name}: node {name} has capacity {resource}=0"


def test_gpu_allocatable(target: Target, cluster: Cluster) -> None:
    node, resource = _node(target, cluster), _resource(target, cluster)
    name = node["metadata"]["name"]
    capacity, allocatable = _count(node, "capacity", resource), _count(node, "allocatable", resource)
    want = _devices(target) if target.want("sharing") != "memory" else capacity
    assert allocatable is not None and capacity, f"{target.name}: node {name} advertises no {resource}"
    assert allocatable == int(want if want is not None else capacity), (
        f"{target.name}: node {name} has allocatable {resource}={allocatable}, expected {want} "
        f"(capacity {capacity}): "
        + (
            "the device plugin is not running or not registered on it"
            if allocatable == 0
            else f"{int(want or capacity) - allocatable} device(s) unhealthy"
        )
    )


def test_gpu_labels(target: Target, cluster: Cluster) -> None:
    node = _node(target, cluster)
    name, prefix = node["metadata"]["name"], cluster.label_prefix
    labels = node["metadata"].get("labels") or {}
    annotations = node["metadata"].get("annotations") or {}
    missing = [
        k
        for k in (f"{prefix}/gpu.present", f"{prefix}/gpu.count", f"{prefix}/gpu.product")
        if k not in labels
    ]
    assert not missing, f"{target.name}: node {name} lacks the GPU labels {', '.join(missing)}"
    want = target.want("gpu_count")
    try:
        gpus = json.loads(annotations.get(f"{prefix}/gpus", ""))
    except ValueError:
        pytest.fail(f"{target.name}: node {name} has no parseable {prefix}/gpus annotation")
    # gpu.count has GPU Feature Discovery's meaning (docs/deviceplugin.md): the GPUs of one model, MIG
    # devices under strategy single. It is the node's GPU count only with one model and MIG off.
    one_model = len({g.get("model") for g in gpus if isinstance(g, dict)}) <= 1
    if want is not None and one_model and (target.want("mig_strategy") or "none") == "none":
        assert labels[f"{prefix}/gpu.count"] == str(want), (
            f"{target.name}: node {name} is labelled {prefix}/gpu.count={labels[f'{prefix}/gpu.count']}, "
            f"expected {want}"
        )
    assert want is None or len(gpus) == int(want), (
        f"{target.name}: node {name}'s {prefix}/gpus annotation lists {len(gpus)} GPUs, expected {want}"
    )
    model = target.want("gpu_model")
    wrong = [g.get("model") for g in gpus if model and str(model) not in str(g.get("model"))]
    assert not wrong, f"{target.name}: node {name}'s GPUs are {sorted(set(wrong))}, expected {model}"


def _gpus(target: Target, cluster: Cluster, node: dict[str, Any]) -> list[tuple[int, str]]:
    """(index, UUID) of each GPU the node's device plugin published in ``gpufleet.io/gpus``."""
    name, prefix = node["metadata"]["name"], cluster.label_prefix
    raw = (node["metadata"].get("annotations") or {}).get(f"{prefix}/gpus", "")
    try:
        gpus = [(int(g["index"]), str(g["uuid"])) for g in json.loads(raw)]
    except (ValueError, TypeError, KeyError):
        pytest.fail(f"{target.name}: node {name} has no parseable {prefix}/gpus annotation to find GPUs by")
    assert gpus, f"{target.name}: node {name}'s {prefix}/gpus annotation lists no GPU"
    return gpus


def _named(gpus: list[tuple[int, str]]) -> str:
    return ", ".join(f"GPU {index} ({uuid})" for index, uuid in gpus)


def test_gpu_series_in_prometheus(target: Target, cluster: Cluster, prometheus: PrometheusApi) -> None:
    node = _node(target, cluster)
    name, gpus = node["metadata"]["name"], _gpus(target, cluster, node)
    wanted = uuid_regex([uuid for _, uuid in gpus])
    uuids = {uuid for _, uuid in gpus}

    def every_gpu(found: list[dict[str, Any]]) -> bool:
        return {s["metric"].get("UUID") for s in found} >= uuids

    # the GPU's own series, not a MIG device's (those carry GPU_I_ID)
    found, waited = prometheus.wait(f'{GPU_SERIES}{{UUID=~"{wanted}",GPU_I_ID=""}}', every_gpu)
    seen = {s["metric"].get("UUID") for s in found}
    missing = [(index, uuid) for index, uuid in gpus if uuid not in seen]
    if missing:
        targets = prometheus.targets_of(name)
        where = "; ".join(targets) if targets else f"no scrape target in it is labelled node={name}"
        pytest.fail(
            f"{target.name}: node {name}: {_named(missing)} "
            f"{'has' if len(missing) == 1 else 'have'} no {GPU_SERIES} series in Prometheus {prometheus.url} "
            f"after {waited:.0f} s (is the node's device plugin serving /metrics? {where})"
        )
    answered = prometheus.query(f'{UP_SERIES}{{UUID=~"{wanted}"}}')
    up = {s["metric"].get("UUID"): s["value"][1] for s in answered}
    down = [(index, uuid) for index, uuid in gpus if up.get(uuid) != "1"]
    assert not down, (
        f"{target.name}: node {name}: {UP_SERIES} is not 1 for {_named(down)}: its device plugin cannot read "
        "the GPU through NVML (lost, hung or driver gone; the plugin's log names it: telemetry_gpu_down)"
    )


def test_gpu_pod_series_carry_its_pod_and_namespace(
    target: Target, cluster: Cluster, prometheus: PrometheusApi
) -> None:
    node = _node(target, cluster)
    name, gpus = node["metadata"]["name"], _gpus(target, cluster, node)
    if target.want("sharing") == "memory":
        limits = {cluster.memory_resource: str(cluster.workload.get("gpu_mem_gib", 1))}
    else:
        limits = {_resource(target, cluster): "1"}
    runtime_class = str(target.want("runtime_class") or "") or None
    with cluster.held_gpu_pod("metrics", limits, node=name, runtime_class=runtime_class) as run:
        assert run.phase == "Running", (
            f"{target.name}: a pod with {limits} on node {name} did not run, so its series could not be "
            f"checked: {run.problem}"
        )
        expr = f'{GPU_SERIES}{{pod="{run.name}",namespace="{cluster.namespace}"}}'
        found, waited = prometheus.wait(expr)
    assert found, (
        f"{target.name}: pod {cluster.namespace}/{run.name} held a GPU of node {name} for {waited:.0f} s, "
        f"but no {GPU_SERIES} series in Prometheus {prometheus.url} carries its pod and namespace (does the "
        "device plugin reach the kubelet's PodResources socket? its log says pod_resources_unavailable)"
    )
    theirs = {uuid for _, uuid in gpus}
    foreign = sorted({s["metric"].get("UUID") for s in found} - theirs)
    assert not foreign, f"{target.name}: pod {run.name} is named on GPUs {foreign}, not ones of node {name}"
