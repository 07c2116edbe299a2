"""GPU telemetry's pod attribution against the real kubelet 1.37 of the lab (issue 35): its PodResources API
v1 ``List`` on the default socket, ``/var/lib/kubelet/pod-resources/kubelet.sock``, seen from inside the
node, names the pods that hold the plugin's devices.

The plugin runs inside the lab node as in test_deviceplugin_kubelet.py, with its HTTP side on a free
loopback port (the node shares this machine's network); /metrics is read with prometheus_client's parser.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from kubernetes import client as k8s
from prometheus_client.parser import text_string_to_metric_families
from test_deviceplugin_kubelet import (  # noqa: F401 - gpu_pods, memory_node and start_plugin are fixtures
    DEADLINE,
    GPU,
    GPU_MEM,
    PluginRun,
    bind_as_the_extender,
    gpu_pods,
    memory_node,
    registered,
    start_plugin,
    wait_node_resource,
    wait_running_report,
)

from gpufleet_harness.cluster.cluster import ControlPlane
from gpufleet_harness.cluster.node import KubeletNode
from gpufleet_harness.cluster.process import free_ports, wait_for

pytestmark = pytest.mark.cluster

GIB = 1 << 30


def telemetry_flags() -> list[str]:
    (port,) = free_ports(1)
    return ["--http-port", str(port), "--http-address", "127.0.0.1", "--telemetry-interval", "0.5"]


def port_of(plugin: PluginRun) -> int:
    argv = plugin.daemon.argv
    return int(argv[argv.index("--http-port") + 1])


def series(plugin: PluginRun, name: str, **labels: str) -> list[Any]:
    """Samples of `name` on the plugin's /metrics whose labels include `labels`."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port_of(plugin)}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]
    return []


def wait_series(plugin: PluginRun, what: str, name: str, **labels: str) -> list[Any]:
    return wait_for(what, lambda: series(plugin, name, **labels), DEADLINE, interval=0.25, alive=plugin.check)


def test_a_running_pods_gpus_carry_its_pod_namespace_and_container(
    core: k8s.CoreV1Api,
    kubelet_node: KubeletNode,
    namespace: str,
    start_plugin: Callable[..., PluginRun],  # noqa: F811
    gpu_pods: Callable[..., k8s.V1Pod],  # noqa: F811
) -> None:
    plugin = start_plugin("dgx-a100", *telemetry_flags())
    registered(plugin, core, 8)
    gpu_pods("tel-two", {GPU: "2"}, node_name=kubelet_node.name)
    view = wait_running_report(core, namespace, "tel-two")
    held = wait_series(plugin, "the pod's GPU series", "DCGM_FI_DEV_GPU_UTIL", pod="tel-two")
    assert sorted(s.labels["UUID"] for s in held) == sorted(view.visible)
    assert {(s.labels["namespace"], s.labels["container"]) for s in held} == {(namespace, "c")}
    # every GPU keeps exactly one series; the kubelet's socket answered
    assert len(series(plugin, "DCGM_FI_DEV_GPU_UTIL")) == 8
    assert series(plugin, "gpufleet_telemetry_pod_resources_up")[0].value == 1
    assert not plugin.events("pod_resources_unavailable")


def test_a_time_sliced_replica_labels_its_gpu_with_the_pod_and_the_replica(
    core: k8s.CoreV1Api,
    kubelet_node: KubeletNode,
    namespace: str,
    start_plugin: Callable[..., PluginRun],  # noqa: F811
    gpu_pods: Callable[..., k8s.V1Pod],  # noqa: F811
) -> None:
    flags = ["--sharing-mode", "time-slicing", "--sharing-time-slicing-replicas", "2"]
    plugin = start_plugin("pcie-2x-t4", *flags, *telemetry_flags())
    plugin.wait_event("registered", "registered", lambda e: e.get("resource") == GPU)
    wait_node_resource(core, kubelet_node.name, GPU, "4", "4", plugin.check)
    gpu_pods("tel-slice", {GPU: "1"}, node_name=kubelet_node.name)
    view = wait_running_report(core, namespace, "tel-slice")
    [held] = wait_series(plugin, "the replica's series", "DCGM_FI_DEV_GPU_UTIL", pod="tel-slice")
    assert [held.labels["UUID"]] == view.visible
    assert held.labels["vgpu"] in ("0", "1") and held.labels["namespace"] == namespace


def test_a_gpu_memory_pods_share_is_placed_by_its_assignment(
    core: k8s.CoreV1Api,
    control_plane: ControlPlane,
    memory_node: KubeletNode,  # noqa: F811
    namespace: str,
    start_plugin: Callable[..., PluginRun],  # noqa: F811
    gpu_pods: Callable[..., k8s.V1Pod],  # noqa: F811
) -> None:
    node = memory_node.name
    plugin = start_plugin(
        "dgx-a100", "--sharing-mode", "memory", "--node-name", node,
        "--kubernetes-kubeconfig", str(control_plane.kubeconfig()), *telemetry_flags(),
    )  # fmt: skip
    plugin.wait_event("registered gpu-mem", "registered", lambda e: e.get("resource") == GPU_MEM)
    wait_node_resource(core, node, GPU_MEM, "640", "640", plugin.check)
    target = plugin.uuids[5]
    bind_as_the_extender(core, gpu_pods, namespace, node, "tel-mem", 6, target)
    assert wait_running_report(core, namespace, "tel-mem").visible == [target]
    [share] = wait_series(plugin, "the memory share", "gpufleet_pod_gpu_memory_bytes", pod="tel-mem")
    assert share.labels["UUID"] == target and share.labels["namespace"] == namespace
    assert share.value == 6 * GIB
    [held] = series(plugin, "DCGM_FI_DEV_FB_USED", pod="tel-mem")
    assert held.labels["UUID"] == target
