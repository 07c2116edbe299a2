"""The device plugin's MIG strategies against the real kubelet 1.20 (issue 17, "tested against the real
kubelet").

The MIG layout is made through the unmodified pynvml on a fresh simulated dgx-a100 before the plugin starts;
the plugin then runs inside the lab node as in test_deviceplugin_kubelet.py. What is read: the Node's
capacity and allocatable per resource (the kubelet's view of each registration), and what a pod's container
sees: ``NVIDIA_VISIBLE_DEVICES`` and its ``/dev/nvidia*`` and ``/dev/nvidia-caps/*`` character devices, as
dockershim made them from the plugin's device specs.
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
from test_deviceplugin_kubelet import (
    DEADLINE,
    REPORT_DONE,
    PluginRun,
    _plain,
    wait_node_resource,
)

from gpufleet_harness.cluster.node import BUSYBOX_IMAGE, KubeletNode
from gpufleet_harness.cluster.process import wait_for
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import miglayout

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"
MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"
Layout = dict[int, list[dict[str, Any]]]  # GPU index -> its MIG devices (miglayout.make_layout)
_LS_CHARDEV = re.compile(r"^c\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s.*\s(/dev/\S+)$")
_REPORT = (
    'echo "visible=$NVIDIA_VISIBLE_DEVICES"; ls -l /dev/nvidia* /dev/nvidia-caps/* 2>&1; '
    f"echo {REPORT_DONE}; exec sleep 3600"
)


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


@pytest.fixture
def pods(core: k8s.CoreV1Api, namespace: str) -> Iterator[Callable[[str, dict[str, str]], dict[str, Any]]]:
    """``pods(name, limits)``: a busybox pod on the lab node that reports what it sees; returns the report
    (``visible``: the MIG/GPU UUIDs, ``devices``: path -> (major, minor)). Pods are deleted at the end."""
    created: list[str] = []

    def run(name: str, limits: dict[str, str]) -> dict[str, Any]:
        container = k8s.V1Container(
            name="c", image=BUSYBOX_IMAGE, image_pull_policy="Never", command=["/bin/sh", "-c", _REPORT],
            resources=k8s.V1ResourceRequirements(limits=limits),
        )  # fmt: skip
        spec = k8s.V1PodSpec(
            containers=[container], node_name="lab-node", termination_grace_period_seconds=0,
            restart_policy="Never",
        )  # fmt: skip
        core.create_namespaced_pod(namespace, k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name), spec=spec))
        created.append(name)

        def report() -> str | None:
            status = _plain(core.read_namespaced_pod(name, namespace)).get("status", {})
            if status.get("phase") in ("Failed", "Succeeded"):
                raise AssertionError(f"pod {name} {status.get('phase')}: {status.get('message')}")
            if status.get("phase") != "Running":
                return None
            log: str = core.read_namespaced_pod_log(name, namespace)
            return log if REPORT_DONE in log else None

        log = wait_for(f"pod {name}'s report", report, DEADLINE, interval=0.25)
        visible: list[str] = []
        devices: dict[str, tuple[int, int]] = {}
        for line in log.splitlines():
            if line.startswith("visible="):
                visible = [u for u in line.removeprefix("visible=").split(",") if u]
            elif match := _LS_CHARDEV.match(line.strip()):
                devices[match.group(3)] = (int(match.group(1)), int(match.group(2)))
        return {"visible": visible, "devices": devices}

    yield run
    for name in created:
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)

    def gone() -> bool:
        names = {p["metadata"]["name"] for p in _plain(core.list_namespaced_pod(namespace))["items"]}
        return not names & set(created)

    wait_for(f"pods {created} deleted", gone, DEADLINE, interval=0.25)


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
    pods: Callable[[str, dict[str, str]], dict[str, Any]],
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

    view = pods("mig-1g", {MIG_1G: "1"})
    by_uuid = {m["uuid"]: m for m in migs[0]}
    assert len(view["visible"]) == 1 and view["visible"][0] in by_uuid, view
    parent = plugin.minors[plugin.uuids[0]]
    gpu_nodes = sorted(p for p in view["devices"] if re.fullmatch(r"/dev/nvidia\d+", p))
    assert gpu_nodes == [f"/dev/nvidia{parent}"], view
    caps = {p for p in view["devices"] if p.startswith("/dev/nvidia-caps/")}
    assert caps == capability_nodes(plugin.root, parent, by_uuid[view["visible"][0]]), view
    assert all(view["devices"][p][0] == simmachine.NVIDIA_CAPS_MAJOR for p in caps), view

    whole = pods("whole", {GPU: "1"})
    assert len(whole["visible"]) == 1 and plugin.indexes(whole["visible"]) not in ([0], [1]), whole
    assert not any(p.startswith("/dev/nvidia-caps/") for p in whole["devices"]), whole


def test_single_and_none_strategies_as_the_kubelet_counts_them(
    core: k8s.CoreV1Api,
    mig_plugin: Callable[..., tuple[PluginRun, Layout]],
    pods: Callable[[str, dict[str, str]], dict[str, Any]],
) -> None:
    """single: every GPU's 1g.10gb devices are nvidia.com/gpu (56 on 8 GPUs) and a pod asking for two gets
    two MIG UUIDs; none: the same MIG-enabled GPUs are advertised whole (8), as NVIDIA's plugin does."""
    layout = {gpu: ["1g.10gb"] * 7 for gpu in range(8)}
    plugin, migs = mig_plugin(layout, "single")
    registered(plugin, GPU)
    wait_node_resource(core, plugin.node.name, GPU, "56", "56", plugin.check)
    view = pods("single-two", {GPU: "2"})
    all_migs = {m["uuid"] for devices in migs.values() for m in devices}
    assert len(view["visible"]) == 2 and set(view["visible"]) <= all_migs, view
    plugin.stop()

    none, _ = mig_plugin({0: ["1g.10gb"]}, "none")
    registered(none, GPU)
    wait_node_resource(core, none.node.name, GPU, "8", "8", none.check)
