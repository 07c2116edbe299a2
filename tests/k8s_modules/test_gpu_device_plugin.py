"""gpu_device_plugin through ansible-playbook against the lab: objects, idempotence, check mode, diff,
absent, least-privilege RBAC, and the capacity wait with the plugin running as a DaemonSet of the gpufleet
image on real kubelets with simulated GPUs (and as a process, for systemd mode)."""

from __future__ import annotations

import contextlib
import os
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from labstack import SIM_DIR, LabStack, run_tasks, timed, wait_until
from modargs import COMMON_KINDS, admin_args, lab_plugin_args, object_actions
from modargs import DEVICE_PLUGIN as MODULE
from modargs import plain as _plain

from gpufleet_harness.sim import control as simcontrol

pytestmark = pytest.mark.cluster

CONFIG_LABEL = "nvidia.com/device-plugin.config"
OWNER_ANNOTATION = "gpufleet.io/device-plugin.config-label"
EVENT_NAMESPACE = "default"
# Whole GPUs by default, time-sliced by three where a node's label says so.
NAMED_CONFIG = {
    "configs": {
        "default": "whole",
        "named": {
            "whole": {},
            "sliced": {"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 3}}},
        },
    }
}


def _lab_daemonset(stack: LabStack, name: str, **extra: Any) -> dict[str, Any]:
    """Module arguments that run the plugin on the lab's GPU nodes, its HTTP server off and quick health."""
    config = {"http": {"port": 0}, "health": {"probe_interval": 1}}
    return admin_args(stack, name, **lab_plugin_args(stack), plugin_config=config) | extra


def test_objects_idempotence_check_mode_diff_and_absent(stack: LabStack, tmp_path: Path) -> None:
    name = f"dp-{secrets.token_hex(3)}"
    args = admin_args(stack, name, wait=False, node_selector={"gpufleet.io/none": "x"})
    check = run_tasks([{MODULE: args}], tmp_path, args=["--check"]).task()
    assert check["changed"] and {o["action"] for o in check["objects"]} == {"created"}
    core = stack.control_plane.core_v1()
    assert name not in {n.metadata.name for n in core.list_namespace().items}, "check mode created something"

    first = run_tasks([{MODULE: args}], tmp_path).task()
    assert first["changed"], first
    assert object_actions(first) == [(kind, "created") for kind in (*COMMON_KINDS, "DaemonSet")]
    rbac = k8s.RbacAuthorizationV1Api(stack.control_plane.api_client())
    rules = _plain(rbac.read_cluster_role(name))["rules"]
    assert rules == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert not _event_role(rbac, name), "no event rights without named configurations"
    apps = k8s.AppsV1Api(stack.control_plane.api_client())
    ds = _plain(apps.read_namespaced_daemon_set(name, name))
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"gpufleet.io/none": "x"}
    assert {v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v} == {
        "/var/lib/kubelet/device-plugins",
        "/dev",
    }
    assert ds["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gpufleet"

    with timed(stack.timings, "device plugin module: unchanged run"):
        second = run_tasks([{MODULE: args}], tmp_path).task()
    assert not second["changed"], second
    assert {o["action"] for o in second["objects"]} == {"unchanged"}

    # a change: check mode shows it in the diff and writes nothing; the real run patches only that
    changed = {**args, "plugin_config": {"sharing": {"mode": "memory"}}, "tolerations": []}
    preview = run_tasks([{MODULE: changed}], tmp_path, args=["--check", "--diff"]).task()
    assert preview["changed"]
    touched = {(o["kind"], o["action"]) for o in preview["objects"] if o["action"] != "unchanged"}
    assert touched == {("ClusterRole", "updated"), ("ConfigMap", "updated"), ("DaemonSet", "updated")}
    diff = {d["before_header"]: d for d in preview["diff"]}
    assert "mode: memory" in diff[f"ConfigMap {name}/{name}"]["after"]
    assert "mode: memory" not in diff[f"ConfigMap {name}/{name}"]["before"]
    assert (
        "pods" in diff[f"ClusterRole {name}"]["after"] and "pods" not in diff[f"ClusterRole {name}"]["before"]
    )
    assert "tolerations: []" in diff[f"DaemonSet {name}/{name}"]["after"]
    assert "memory" not in _plain(core.read_namespaced_config_map(name, name))["data"]["config.yaml"]

    applied = run_tasks([{MODULE: changed}], tmp_path).task()
    assert applied["changed"]
    rules = _plain(rbac.read_cluster_role(name))["rules"]
    assert {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "get", "patch"]} in rules
    assert not _plain(apps.read_namespaced_daemon_set(name, name))["spec"]["template"]["spec"].get(
        "tolerations"
    )
    assert not run_tasks([{MODULE: changed}], tmp_path).task()["changed"]

    # labels off and no memory sharing: the plugin needs no API, so the role goes and no token is mounted
    silent = {**args, "plugin_config": {"labels": {"enabled": False}}}
    quiet = run_tasks([{MODULE: silent}], tmp_path).task()
    assert ("ClusterRole", "deleted") in {(o["kind"], o["action"]) for o in quiet["objects"]}
    account = _plain(core.read_namespaced_service_account(name, name))
    assert account["automountServiceAccountToken"] is False

    gone = run_tasks(
        [{MODULE: {**args, "state": "absent", "wait": True, "wait_timeout": 60}}], tmp_path
    ).task()
    assert gone["changed"], gone
    assert {o["action"] for o in gone["objects"]} <= {"deleted", "absent"}
    assert name not in {n.metadata.name for n in core.list_namespace().items}
    again = run_tasks([{MODULE: {**args, "state": "absent"}}], tmp_path).task()
    assert not again["changed"] and {o["action"] for o in again["objects"]} == {"absent"}


def test_runtime_class_is_created_named_by_the_pods_left_alone_when_foreign_and_removed(
    stack: LabStack, tmp_path: Path
) -> None:
    """The RuntimeClass of ``runtime_class`` (node.k8s.io/v1: 1.37 and 1.20 serve it) with its handler
    and scheduling; the plugin pods name ``runtime_class_name``; a second run changes nothing; one that
    gpufleet did not create is neither adopted nor deleted; absent removes gpufleet's. Three playbook runs
    (several module tasks each)."""
    name = f"dp-{secrets.token_hex(3)}"
    ours, foreign = f"nvidia-{name}", f"other-{name}"
    node_api = k8s.NodeV1Api(stack.control_plane.api_client())
    wanted = {"name": ours, "handler": "nvidia", "node_selector": {"gpufleet.io/runtime-class": "nvidia"}}
    args = admin_args(stack, name, wait=False, node_selector={"gpufleet.io/none": "x"})
    args |= {"runtime_class": wanted, "runtime_class_name": ours}
    node_api.create_runtime_class({"metadata": {"name": foreign}, "handler": "crun"})
    removed = False
    try:
        check = run_tasks([{MODULE: args}], tmp_path, args=["--check"]).task()
        assert ("RuntimeClass", "created") in object_actions(check)
        names = {rc.metadata.name for rc in node_api.list_runtime_class().items}
        assert ours not in names, "check mode wrote"

        both = run_tasks([{MODULE: args}, {MODULE: args}], tmp_path)
        first, second = both.task(0), both.task(1)
        assert object_actions(first)[0] == ("RuntimeClass", "created"), "before the pods that name it"
        live = _plain(node_api.read_runtime_class(ours))
        assert live["handler"] == "nvidia"
        assert live["scheduling"]["nodeSelector"] == {"gpufleet.io/runtime-class": "nvidia"}
        assert live["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "gpufleet"
        apps = k8s.AppsV1Api(stack.control_plane.api_client())
        pod = _plain(apps.read_namespaced_daemon_set(name, name))["spec"]["template"]["spec"]
        assert pod["runtimeClassName"] == ours
        assert not second["changed"], second

        other = {**args, "runtime_class": {"name": foreign}, "runtime_class_name": ""}
        done = run_tasks(
            [
                {MODULE: other},
                {MODULE: {**other, "state": "absent", "wait": True, "wait_timeout": 60}},
                {MODULE: {**args, "state": "absent"}},
            ],
            tmp_path,
        )
        kept = [o for o in done.task(0)["objects"] if o["kind"] == "RuntimeClass"]
        assert kept == [
            {
                "kind": "RuntimeClass",
                "name": foreign,
                "namespace": None,
                "action": "unchanged",
                "note": "exists and is not gpufleet's: left as is",
            }
        ], done.task(0)
        assert ("RuntimeClass", "skipped") in object_actions(done.task(1))
        foreign_live = _plain(node_api.read_runtime_class(foreign))
        assert foreign_live["handler"] == "crun" and "labels" not in foreign_live["metadata"]
        removed = ("RuntimeClass", "deleted") in object_actions(done.task(2))
        assert removed, done.task(2)
        assert ours not in {rc.metadata.name for rc in node_api.list_runtime_class().items}
    finally:
        if not removed:
            run_tasks([{MODULE: {**args, "state": "absent"}}], tmp_path)
        for leftover in (ours, foreign):
            with contextlib.suppress(ApiException):
                node_api.delete_runtime_class(leftover)


def _event_role(rbac: k8s.RbacAuthorizationV1Api, name: str) -> dict[str, Any] | None:
    """The plugin's Role in ``default`` (where it posts its node events), None when there is none."""
    try:
        return dict(_plain(rbac.read_namespaced_role(name, EVENT_NAMESPACE)))
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def _node_labels(core: k8s.CoreV1Api, node: str) -> dict[str, str]:
    return dict(_plain(core.read_node(node))["metadata"].get("labels") or {})


def test_named_configurations_get_watch_and_event_rbac_and_the_nodes_their_labels(
    stack: LabStack, tmp_path: Path
) -> None:
    """Named configurations without pods (two API-only Node objects): the RBAC they need, the labels of
    ``node_configs`` set before anything else, check mode and diff, idempotence, a hand-set label left alone,
    an unknown name refused before anything is written, absent removing only the module's own label."""
    name = f"dp-{secrets.token_hex(3)}"
    core = stack.control_plane.core_v1()
    rbac = k8s.RbacAuthorizationV1Api(stack.control_plane.api_client())
    ours, hand_set = f"{name}-ours", f"{name}-hand"
    core.create_node({"metadata": {"name": ours}})
    core.create_node({"metadata": {"name": hand_set, "labels": {CONFIG_LABEL: "sliced"}}})
    args = admin_args(
        stack,
        name,
        wait=False,
        node_selector={"gpufleet.io/none": "x"},
        plugin_config=NAMED_CONFIG,
        node_configs={ours: "sliced", hand_set: None},
    )
    try:
        check = run_tasks([{MODULE: args}], tmp_path, args=["--check"]).task()
        assert check["changed"] and ("Node", "updated") in object_actions(check), check
        assert CONFIG_LABEL not in _node_labels(core, ours), "check mode labelled a node"

        first = run_tasks([{MODULE: args}], tmp_path).task()
        assert (
            object_actions(first)
            == [
                ("Node", "updated"),  # first: a plugin pod finds its label at start
                *((kind, "created") for kind in COMMON_KINDS[:-1]),
                ("Role", "created"),
                ("RoleBinding", "created"),
                ("ConfigMap", "created"),
                ("DaemonSet", "created"),
            ]
        ), first
        assert first["resource"] == "nvidia.com/gpu"
        rules = _plain(rbac.read_cluster_role(name))["rules"]
        assert rules == [
            {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch", "list", "watch"]}
        ]
        role = _event_role(rbac, name)
        assert role and role["rules"] == [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}]
        binding = _plain(rbac.read_namespaced_role_binding(name, EVENT_NAMESPACE))
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": name, "namespace": name}]
        labelled = _plain(core.read_node(ours))["metadata"]
        assert labelled["labels"][CONFIG_LABEL] == "sliced"
        assert labelled["annotations"][OWNER_ANNOTATION] == f"{CONFIG_LABEL}=sliced"

        second = run_tasks([{MODULE: args}], tmp_path).task()
        assert not second["changed"], second
        assert {o["action"] for o in second["objects"]} == {"unchanged"}

        # taking the name away: check mode shows the label going and leaves it
        unset = {**args, "node_configs": {ours: None, hand_set: None}}
        preview = run_tasks([{MODULE: unset}], tmp_path, args=["--check", "--diff"]).task()
        assert [(o["kind"], o["name"]) for o in preview["objects"] if o["action"] == "updated"] == [
            ("Node", ours)
        ]
        diff = {d["before_header"]: d for d in preview["diff"]}[f"Node {ours}"]
        assert f"{CONFIG_LABEL}: sliced" in diff["before"] and CONFIG_LABEL not in diff["after"]
        assert _node_labels(core, ours)[CONFIG_LABEL] == "sliced"

        unknown = run_tasks([{MODULE: {**args, "node_configs": {ours: "inferense"}}}], tmp_path).task()
        assert unknown["failed"] and unknown["objects"] == []
        assert (
            f"node_configs.{ours}: unknown device plugin configuration 'inferense'; known: sliced, whole"
            in unknown["msg"]
        )

        gone = run_tasks([{MODULE: {**unset, "state": "absent", "wait": True, "wait_timeout": 60}}], tmp_path)
        assert ("Node", "updated") in object_actions(gone.task()) and ("Role", "deleted") in object_actions(
            gone.task()
        )
        assert CONFIG_LABEL not in _node_labels(core, ours)
        assert OWNER_ANNOTATION not in (_plain(core.read_node(ours))["metadata"].get("annotations") or {})
        assert _node_labels(core, hand_set)[CONFIG_LABEL] == "sliced", "a label the module did not set stays"
        assert not _event_role(rbac, name)
    finally:
        run_tasks([{MODULE: {**args, "state": "absent", "wait": False, "node_configs": {}}}], tmp_path)
        for node in (ours, hand_set):
            core.delete_node(node)


def test_invalid_plugin_config_is_refused_before_anything_is_written(stack: LabStack, tmp_path: Path) -> None:
    name = f"dp-{secrets.token_hex(3)}"
    bad = admin_args(
        stack, name, wait=False, plugin_config={"health": {"bogus": 1}, "log": {"level": "loud"}}
    )
    result = run_tasks([{MODULE: bad}], tmp_path).task()
    assert result["failed"]
    assert "plugin_config is invalid" in result["msg"]
    assert "health.bogus: unknown setting" in result["msg"]
    core = stack.control_plane.core_v1()
    assert name not in {n.metadata.name for n in core.list_namespace().items}


def test_daemonset_waits_for_rollout_and_every_node_capacity(stack: LabStack, tmp_path: Path) -> None:
    nodes = stack.nodes()
    name = f"dp-{secrets.token_hex(3)}"
    args = _lab_daemonset(
        stack,
        name,
        node_selector={"gpufleet.io/lab-gpus": "whole"},
        expected_gpus={"gpu-a": 8},
        wait_timeout=180,
    )
    try:
        with timed(stack.timings, "device plugin module: deploy + rollout + capacity"):
            result = run_tasks([{MODULE: args}], tmp_path).task()
        assert not result.get("failed"), result.get("msg")
        assert result["nodes"] == {"gpu-a": {"capacity": 8, "allocatable": 8}}
        core = stack.control_plane.core_v1()
        node = _plain(core.read_node("gpu-a"))
        # the plugin reached the API through the lab relay and published its labels
        labels = wait_until(
            "GPU labels on gpu-a",
            lambda: _plain(core.read_node("gpu-a"))["metadata"]["labels"].get("gpufleet.io/gpu.count"),
            30,
        )
        assert labels == "8"
        assert node["status"]["capacity"]["nvidia.com/gpu"] == "8"
        with timed(stack.timings, "device plugin module: unchanged run incl. waits"):
            again = run_tasks([{MODULE: args}], tmp_path).task()
        assert not again["changed"] and again["nodes"]["gpu-a"]["allocatable"] == 8

        # a node expected to have more GPUs than the plugin finds: named, with the count
        short = run_tasks(
            [{MODULE: {**args, "expected_gpus": {"gpu-a": 9}, "wait_timeout": 8}}], tmp_path
        ).task()
        assert short["failed"]
        assert "1 of 1 node(s) do not report the expected nvidia.com/gpu" in short["msg"]
        assert "gpu-a: advertises 8 nvidia.com/gpu, expected 9" in short["msg"]

        # a node the DaemonSet does not select: "no plugin pod on it" and why
        off = run_tasks(
            [{MODULE: {**args, "expected_gpus": {"gpu-a": 8, "gpu-b": 2}, "wait_timeout": 5}}], tmp_path
        ).task()
        assert off["failed"]
        assert (
            "gpu-b: no plugin pod on it: its labels do not match the nodeSelector gpufleet.io/lab-gpus=whole"
            in off["msg"]
        ), off["msg"]
        assert "gpu-a:" not in off["msg"]

        # an unhealthy GPU lowers allocatable: named as unhealthy devices, with the plugin's log line
        simcontrol.inject(nodes["gpu-a"].sim_root, ["xid", "3", "48"])
        wait_until(
            "allocatable 7 on gpu-a",
            lambda: _plain(core.read_node("gpu-a"))["status"]["allocatable"]["nvidia.com/gpu"] == "7",
            30,
        )
        sick = run_tasks([{MODULE: {**args, "wait_timeout": 5}}], tmp_path).task()
        assert sick["failed"]
        assert "gpu-a: 1 of 8 nvidia.com/gpu devices unhealthy; plugin log:" in sick["msg"], sick["msg"]
        assert "XID 48" in sick["msg"]
    finally:
        simcontrol.inject(nodes["gpu-a"].sim_root, ["gpu", "3", "lost"])
        time.sleep(2)
        simcontrol.inject(nodes["gpu-a"].sim_root, ["gpu", "3", "ok"])
        run_tasks([{MODULE: {**args, "state": "absent", "wait": True, "wait_timeout": 60}}], tmp_path)


def test_one_daemonset_serves_each_node_the_configuration_its_label_picks(
    stack: LabStack, tmp_path: Path
) -> None:
    """Named configurations on both lab nodes, through the plugin's own service account: gpu-b labelled
    ``sliced`` by the module (2 GPUs x 3), gpu-a on the default (8 whole GPUs); a hand-set unknown name is
    refused by the plugin with its event and the wait expects the configuration it keeps; the name taken
    away switches gpu-b back live, and the wait follows."""
    stack.nodes()
    core = stack.control_plane.core_v1()
    name = f"dp-{secrets.token_hex(3)}"
    selector = {"gpufleet.io/dp-test": name}
    # labels off: the plugin must not publish gpufleet.io/gpu-sharing over gpu-b's lab label; its RBAC is
    # then exactly the watch on its Node and its events
    config = {
        **NAMED_CONFIG,
        "http": {"port": 0},
        "health": {"probe_interval": 1},
        "labels": {"enabled": False},
    }
    args = admin_args(stack, name, **lab_plugin_args(stack), plugin_config=config) | {
        "node_selector": selector,
        "expected_gpus": {"gpu-a": 8, "gpu-b": 2},
        "node_configs": {"gpu-b": "sliced"},
        "wait_timeout": 180,
    }
    for node in ("gpu-a", "gpu-b"):
        core.patch_node(node, {"metadata": {"labels": selector}})
    try:
        with timed(stack.timings, "device plugin module: named configurations on two nodes"):
            first = run_tasks([{MODULE: args}], tmp_path).task()
        assert not first.get("failed"), first.get("msg")
        assert first["nodes"] == {
            "gpu-a": {"config": "whole", "resource": "nvidia.com/gpu", "capacity": 8, "allocatable": 8},
            "gpu-b": {"config": "sliced", "resource": "nvidia.com/gpu", "capacity": 6, "allocatable": 6},
        }
        again = run_tasks([{MODULE: args}], tmp_path).task()
        assert not again["changed"] and again["nodes"] == first["nodes"], again

        # an unknown name set by hand: the plugin refuses it (its event, through its Role) and keeps "whole"
        core.patch_node("gpu-a", {"metadata": {"labels": {CONFIG_LABEL: "inferense"}}})
        wait_until(
            "the plugin's refusal on gpu-a",
            lambda: _config_event(core, "gpu-a", "DevicePluginConfigUnknown", "'inferense'"),
            60,
        )
        kept = run_tasks([{MODULE: args}], tmp_path).task()
        assert not kept.get("failed") and kept["nodes"]["gpu-a"]["config"] == "whole", kept
        assert (  # the plugin's own words for the refusal (Config.select), as in its event
            f"node gpu-a: unknown device plugin configuration 'inferense' (label {CONFIG_LABEL}); "
            "known: sliced, whole; the plugin keeps 'whole'" in kept["warnings"]
        )

        # the module's label taken away: gpu-b switches back to whole GPUs, live
        back = run_tasks([{MODULE: {**args, "node_configs": {"gpu-b": None}}}], tmp_path).task()
        assert not back.get("failed"), back.get("msg")
        assert back["nodes"]["gpu-b"] == {
            "config": "whole",
            "resource": "nvidia.com/gpu",
            "capacity": 2,
            "allocatable": 2,
        }
        assert CONFIG_LABEL not in _node_labels(core, "gpu-b")
        wait_until(
            "the switch back's event on gpu-b",
            lambda: _config_event(core, "gpu-b", "DevicePluginConfigApplied", "'whole' (was 'sliced')"),
            30,
        )
    finally:
        run_tasks(
            [
                {
                    MODULE: {
                        **args,
                        "state": "absent",
                        "wait": True,
                        "wait_timeout": 60,
                        "node_configs": {"gpu-b": None},
                    }
                }
            ],
            tmp_path,
        )
        for node in ("gpu-a", "gpu-b"):
            core.patch_node(node, {"metadata": {"labels": {"gpufleet.io/dp-test": None, CONFIG_LABEL: None}}})


def _config_event(core: k8s.CoreV1Api, node: str, reason: str, text: str) -> dict[str, Any] | None:
    """An event the device plugin posted on ``node`` with this reason and ``text`` in its message."""
    selector = f"involvedObject.kind=Node,involvedObject.name={node},reason={reason}"
    items = _plain(core.list_namespaced_event(EVENT_NAMESPACE, field_selector=selector))["items"]
    return next(
        (
            e
            for e in items
            if (e.get("source") or {}).get("component") == "gpufleet-device-plugin" and text in e["message"]
        ),
        None,
    )


def test_pod_that_cannot_start_is_named_with_its_reason(stack: LabStack, tmp_path: Path) -> None:
    stack.nodes()
    name = f"dp-{secrets.token_hex(3)}"
    args = _lab_daemonset(
        stack,
        name,
        node_selector={"gpufleet.io/lab-gpus": "whole"},
        image="gpufleet-lab/not-there:1",
        wait_timeout=15,
    )
    try:
        result = run_tasks([{MODULE: args}], tmp_path).task()
        assert result["failed"]
        assert f"DaemonSet {name}/{name} not rolled out after 15s" in result["msg"]
        assert "on node gpu-a" in result["msg"] and "ErrImageNeverPull" in result["msg"], result["msg"]
    finally:
        run_tasks([{MODULE: {**args, "state": "absent", "wait": False}}], tmp_path)


def test_systemd_mode_waits_for_a_plugin_process_and_names_a_node_without_one(
    stack: LabStack, tmp_path: Path
) -> None:
    """The plugin as a node process (what the role's systemd unit runs): the module only waits."""
    nodes = stack.nodes()
    gpu_b = nodes["gpu-b"]
    base = admin_args(stack, mode="systemd", wait_timeout=6)
    missing = run_tasks([{MODULE: {**base, "expected_gpus": {"gpu-b": 2}}}], tmp_path).task()
    assert missing["failed"]
    # Never registered there: no capacity at all. Registered earlier in this session (the lab is shared)
    # and stopped: the kubelet keeps the capacity with allocatable 0.
    assert (
        "gpu-b: plugin not registered with the kubelet: the node reports no nvidia.com/gpu" in missing["msg"]
        or "gpu-b: no nvidia.com/gpu allocatable (capacity 2): the plugin is not running or not registered"
        in missing["msg"]
    ), missing["msg"]
    assert "journalctl -u gpufleet-device-plugin" in missing["msg"]
    assert missing["objects"] == [] and not missing["changed"]

    env = {
        **os.environ,
        "GPUFLEET_SIM_ROOT": SIM_DIR,
        "LD_LIBRARY_PATH": f"{SIM_DIR}/lib",
        "NODE_NAME": "gpu-b",
    }
    plugin = gpu_b.node.spawn(
        "device-plugin",
        [
            sys.executable,
            "-m",
            "gpufleet.deviceplugin",
            "--host-root",
            f"{SIM_DIR}/host",
            "--labels-enabled",
            "false",
        ],
        env=env,
    )
    try:
        with timed(stack.timings, "device plugin module: systemd-mode wait"):
            ok = run_tasks(
                [{MODULE: {**base, "expected_gpus": {"gpu-b": 2}, "wait_timeout": 60}}], tmp_path
            ).task()
        assert not ok.get("failed"), ok.get("msg")
        assert ok["nodes"] == {"gpu-b": {"capacity": 2, "allocatable": 2}} and not ok["changed"]
    finally:
        plugin.stop()
