"""The device plugin's MIG strategies against the real kubelet, 1.37 (issue 17, "tested against the real
kubelet").

The MIG layout is made through the unmodified pynvml on a fresh simulated dgx-a100 before the plugin starts;
the plugin then runs inside the lab node as in test_deviceplugin_kubelet.py. What is read: the Node's
capacity and allocatable per resource (the kubelet's view of each registration), and what a pod's container
sees: ``NVIDIA_VISIBLE_DEVICES`` and its ``/dev/nvidia*`` and ``/dev/nvidia-caps/*`` character devices, as
containerd (CRI) made them from the plugin's device specs.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from test_deviceplugin_kubelet import (  # noqa: F401 - gpu_pods is a fixture
    PluginRun,
    gpu_pods,
    wait_node_resource,
    wait_running_report,
)

from gpufleet_harness.cluster.node import KubeletNode
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import miglayout

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"
MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
Layout = dict[int, list[dict[str, Any]]]  # GPU index -> its MIG devices (miglayout.make_layout)


@pytest.fixture
def mig_plugin(
    kubelet_node: KubeletNode, sim_lib: Path, tmp_path: Path
) -> Iterator[Callable[..., tuple[PluginRun, Layout]]]:
    """``mig_plugin(layout, strategy)``: a fresh dgx-a100 with that MIG layout and the plugin on it, inside
    the node; every plugin started here is stopped when the test ends."""
    runs: list[PluginRun] = []

    def start(layout: dict[int, list[str]], strategy: str) -> tuple[PluginRun, Layout]:
        root = simmachine.materialize("dgx-a100", tmp_path / f"sim-{len(runs)}", library=sim_lib)
        migs = miglayout.make_layout(root, layout)
        gpus = sorted(json.loads((root / "machine.json").read_text())["gpus"], key=lambda g: g["index"])
        argv = [
            sys.executable, "-m", "gpufleet.deviceplugin", "--log-format", "json",
            "--labels-enabled", "false", "--mig-strategy", strategy,
        ]  # fmt: skip
        env = {**os.environ, **simmachine.sim_env(root), "PYTHONUNBUFFERED": "1"}
        daemon = kubelet_node.spawn(f"dp-mig-{strategy}-{secrets.token_hex(3)}", argv, env=env)
        run = PluginRun(
            kubelet_node, "dgx-a100", root, daemon, [g["uuid"] for g in gpus],
            {g["uuid"]: int(g["minor"]) for g in gpus},
        )  # fmt: skip
        runs.append(run)
        return run, migs

    yield start
    for run in reversed(runs):
        run.stop()


def capability_nodes(root: Path, gpu_minor: int, mig: dict[str, Any]) -> set[str]:
    """The /dev/nvidia-caps nodes of one MIG device, from the driver's mig-minors table."""
    lines = (root / "host/proc/driver/nvidia-caps/mig-minors").read_text().splitlines()
    table = dict(line.split() for line in lines)
    names = (f"gpu{gpu_minor}/gi{mig['gi']}/access", f"gpu{gpu_minor}/gi{mig['gi']}/ci{mig['ci']}/access")
    return {f"/dev/nvidia-caps/nvidia-cap{table[n]}" for n in names}


def registered(plugin: PluginRun, resource: str) -> None:
    plugin.wait_event(f"{resource} registered", "registered", lambda e: e.get("resource") == resource)


def test_mixed_strategy_pod_gets_one_mig_device_its_parent_and_capabilities(
    core: k8s.CoreV1Api,
    mig_plugin: Callable[..., tuple[PluginRun, Layout]],
    namespace: str,
    gpu_pods: Callable[..., k8s.V1Pod],  # noqa: F811 - the fixture imported above
) -> None:
    """mixed: whole GPUs stay nvidia.com/gpu, each profile is its own resource, and a pod asking for one
    1g.10gb device sees that MIG device only: its UUID, its parent's device node and its two capability
    nodes (GPU instance, compute instance), no other GPU."""
    plugin, migs = mig_plugin({0: ["1g.10gb"] * 7, 1: ["3g.40gb"] * 2}, "mixed")
    for resource in (GPU, MIG_1G, MIG_3G):
        registered(plugin, resource)
    node = plugin.node.name
    wait_node_resource(core, node, GPU, "6", "6", plugin.check)  # GPUs 0 and 1 are MIG: not whole
    wait_node_resource(core, node, MIG_1G, "7", "7", plugin.check)
    wait_node_resource(core, node, MIG_3G, "2", "2", plugin.check)

    gpu_pods("mig-1g", {MIG_1G: "1"}, node_name=plugin.node.name)
    view = wait_running_report(core, namespace, "mig-1g")
    by_uuid = {m["uuid"]: m for m in migs[0]}
    assert len(view.visible) == 1 and view.visible[0] in by_uuid, view
    parent = plugin.minors[plugin.uuids[0]]
    gpu_nodes = sorted(p for p in view.char_devices if re.fullmatch(r"/dev/nvidia\d+", p))
    assert gpu_nodes == [f"/dev/nvidia{parent}"], view
    caps = {p for p in view.char_devices if p.startswith("/dev/nvidia-caps/")}
    assert caps == capability_nodes(plugin.root, parent, by_uuid[view.visible[0]]), view
    assert all(view.char_devices[p][0] == simmachine.NVIDIA_CAPS_MAJOR for p in caps), view

    gpu_pods("whole", {GPU: "1"}, node_name=plugin.node.name)
    whole = wait_running_report(core, namespace, "whole")
    assert len(whole.visible) == 1 and plugin.indexes(whole.visible) not in ([0], [1]), whole
    assert not any(p.startswith("/dev/nvidia-caps/") for p in whole.char_devices), whole


def test_single_and_none_strategies_as_the_kubelet_counts_them(
    core: k8s.CoreV1Api,
    mig_plugin: Callable[..., tuple[PluginRun, Layout]],
    namespace: str,
    gpu_pods: Callable[..., k8s.V1Pod],  # noqa: F811 - the fixture imported above
) -> None:
    """single: every GPU's 1g.10gb devices are nvidia.com/gpu (56 on 8 GPUs) and a pod asking for two gets
    two MIG UUIDs; none: the same MIG-enabled GPUs are advertised whole (8), as NVIDIA's plugin does."""
    layout = {gpu: ["1g.10gb"] * 7 for gpu in range(8)}
    plugin, migs = mig_plugin(layout, "single")
    registered(plugin, GPU)
    wait_node_resource(core, plugin.node.name, GPU, "56", "56", plugin.check)
    gpu_pods("single-two", {GPU: "2"}, node_name=plugin.node.name)
    view = wait_running_report(core, namespace, "single-two")
    all_migs = {m["uuid"] for devices in migs.values() for m in devices}
    assert len(view.visible) == 2 and set(view.visible) <= all_migs, view
    plugin.stop()

    none, _ = mig_plugin({0: ["1g.10gb"]}, "none")
    registered(none, GPU)
    wait_node_resource(core, none.node.name, GPU, "8", "8", none.check)
