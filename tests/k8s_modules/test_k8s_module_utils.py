"""The modules' pure logic, without a cluster: comparison and merge patches, manifest surgery, object
shapes, waits' explanations, connection option handling."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from labstack import REPO, ensure_collection_link

from gpufleet_harness.cluster.k8s_build import NEWEST_K8S_VERSION
from gpufleet_harness.cluster.staticpod import write_kubeadm_manifest

ensure_collection_link()
sys.path.insert(0, str(REPO / ".cache" / "collections"))

from ansible_collections.gpufleet.nvidia.plugins.module_utils import (  # noqa: E402
    k8s_apply,
    k8s_client,
    k8s_deviceplugin,
    k8s_extender,
    k8s_module,
    k8s_nodelabels,
    k8s_schedconfig,
    k8s_wait,
)


# -- comparison ------------------------------------------------------------------------------------
def test_matches_ignores_what_the_server_adds_but_not_list_length() -> None:
    want = {"spec": {"ports": [{"port": 80}], "selector": {"a": "b"}}}
    live = {
        "spec": {"ports": [{"port": 80, "protocol": "TCP"}], "selector": {"a": "b"}, "clusterIP": "10.0.0.9"}
    }
    assert k8s_apply.matches(want, live)
    assert not k8s_apply.matches({"spec": {"ports": [{"port": 80}, {"port": 81}]}}, live)
    assert k8s_apply.matches({"spec": {"tolerations": []}}, {"spec": {}}), "empty equals absent (omitempty)"
    assert not k8s_apply.matches({"x": True}, {"x": "true"})


def test_merge_patch_changes_only_what_differs_and_drops_what_was_removed() -> None:
    want = {"metadata": {"labels": {"a": "1"}}, "spec": {"replicas": 2, "template": {"x": [1, 2]}}}
    live = {
        "metadata": {"labels": {"a": "1", "old": "y"}, "uid": "u"},
        "spec": {"replicas": 1, "template": {"x": [1, 2]}, "paused": True},
    }
    last = {"metadata": {"labels": {"a": "1", "old": "y"}}, "spec": {"replicas": 1}}
    assert k8s_apply.merge_patch(want, live, last) == {
        "metadata": {"labels": {"old": None}},
        "spec": {"replicas": 2},
    }
    assert (
        k8s_apply.merge_patch(
            want,
            k8s_apply.apply_patch(live, {"metadata": {"labels": {"old": None}}, "spec": {"replicas": 2}}),
            want,
        )
        == {}
    )


# -- kube-scheduler manifest -----------------------------------------------------------------------
def test_manifest_surgery_is_idempotent_and_reversible(tmp_path: Path) -> None:
    path = tmp_path / "kube-scheduler.yaml"
    original = yaml.safe_load(
        write_kubeadm_manifest(path, Path("/etc/kubernetes/scheduler.conf"), 10259, f"v{NEWEST_K8S_VERSION}")
    )
    once = k8s_schedconfig.with_config(original, "/etc/kubernetes/gs.yaml", "h1")
    assert k8s_schedconfig.with_config(once, "/etc/kubernetes/gs.yaml", "h1") == once
    assert once["spec"]["containers"][0]["command"][-1] == "--config=/etc/kubernetes/gs.yaml"
    moved = k8s_schedconfig.with_config(once, "/etc/kubernetes/other.yaml", "h2")
    assert [a for a in moved["spec"]["containers"][0]["command"] if a.startswith("--config")] == [
        "--config=/etc/kubernetes/other.yaml"
    ]
    assert len(moved["spec"]["volumes"]) == 2
    assert k8s_schedconfig.without_config(once, "/etc/kubernetes/gs.yaml") == original
    assert k8s_schedconfig.without_config(original, "/etc/kubernetes/gs.yaml") == original


def test_manifest_surgery_replaces_its_own_separate_config_argument_and_refuses_another() -> None:
    def doc(command: list[str], volumes: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "kind": "Pod",
            "spec": {"containers": [{"name": "kube-scheduler", "command": command}], "volumes": volumes},
        }

    ours = [{"name": "gpufleet-scheduler-config", "hostPath": {"path": "/old.yaml", "type": "File"}}]
    out = k8s_schedconfig.with_config(
        doc(["kube-scheduler", "--config", "/old.yaml", "--v=2"], ours), "/new.yaml", "h"
    )
    assert out["spec"]["containers"][0]["command"] == ["kube-scheduler", "--v=2", "--config=/new.yaml"]
    assert out["spec"]["volumes"] == [
        {"hostPath": {"path": "/new.yaml", "type": "File"}, "name": "gpufleet-scheduler-config"}
    ]
    # a --config gpufleet did not write is another tool's configuration: never replaced
    with pytest.raises(
        k8s_schedconfig.SchedulerError,
        match=r"already runs with --config=/theirs\.yaml, which gpufleet did not write",
    ):
        k8s_schedconfig.with_config(doc(["kube-scheduler", "--config=/theirs.yaml"], []), "/new.yaml", "h")


def test_scheduler_processes_are_found_with_start_times() -> None:
    procs = k8s_schedconfig.scheduler_processes()
    assert all(p.started > 0 and p.argv[0].endswith("kube-scheduler") for p in procs)


# -- object shapes ---------------------------------------------------------------------------------
# a digest reference as role gpufleet_images gives (the modules have no default image)
DP_IMAGE = "sha256:" + "1" * 64
EXT_IMAGE = "registry.test:5000/gpufleet/extender@sha256:" + "2" * 64


def _dp_params(**over: object) -> dict:
    params = {k: v.get("default") for k, v in k8s_deviceplugin.ARGUMENT_SPEC.items()} | {"image": DP_IMAGE}
    params.update(over)
    return params


def _dp_config(config: dict, **over: object) -> Any:
    """The plugin's Config for ``config``, as the module reads it (the plugin's loader, linked)."""
    params = _dp_params(plugin_config=config, **over)
    return k8s_deviceplugin.load_config(k8s_deviceplugin.plugin_config(params))


@pytest.mark.parametrize(
    ("config", "rules"),
    [
        ({}, [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]),
        (
            {"sharing": {"mode": "memory"}},
            [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "get", "patch"]},
            ],
        ),
        ({"labels": {"enabled": False}}, []),
    ],
)
def test_device_plugin_rbac_is_what_the_config_needs(config: dict, rules: list) -> None:
    assert k8s_deviceplugin.rbac_rules(_dp_config(config)) == rules


def test_device_plugin_expected_counts_follow_sharing() -> None:
    for config, want in (
        ({}, 8),
        ({"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 4}}}, 32),
        ({"sharing": {"mode": "memory"}}, None),
        ({"mig": {"strategy": "mixed"}}, None),  # how many whole GPUs and MIG devices: the layout says
        ({"mig": {"strategy": "single"}}, None),
        ({"mig": {"strategy": "none"}}, 8),
    ):
        params = _dp_params(plugin_config=config, expected_gpus={"n1": "8"})
        advertised = _dp_config(config).advertised()
        assert k8s_deviceplugin.expected_counts(params, advertised) == {"n1": want}
    with pytest.raises(
        k8s_deviceplugin.ParameterError, match=r"plugin_config\.node_name is set by the deployment"
    ):
        k8s_deviceplugin.plugin_config(_dp_params(plugin_config={"node_name": "x"}))


# -- named configurations --------------------------------------------------------------------------
NODES_GET_PATCH = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}
PODS = {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "get", "patch"]}
NAMED = {
    "configs": {
        "default": "training",
        "named": {
            "training": {},
            "sliced": {"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 4}}},
            "renamed": {
                "sharing.mode": "time-slicing",
                "sharing.time_slicing.rename": "nvidia.com/gpu.shared",
            },
        },
    }
}


def _named(config: dict) -> Any:
    named = _dp_config(config)
    assert named.named
    return named


@pytest.mark.parametrize(
    ("config", "cluster_rules"),
    [
        (NAMED, [{**NODES_GET_PATCH, "verbs": ["get", "patch", "list", "watch"]}]),
        (
            {**NAMED, "labels": {"enabled": False}},
            [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}],
        ),
        (  # a configuration a node may switch to shares GPU memory: the pod rules from the start
            {"configs": {"default": "a", "named": {"a": {}, "m": {"sharing": {"mode": "memory"}}}}},
            [{**NODES_GET_PATCH, "verbs": ["get", "patch", "list", "watch"]}, PODS],
        ),
    ],
)
def test_named_configurations_add_the_node_watch_and_event_rules(config: dict, cluster_rules: list) -> None:
    params = _dp_params(plugin_config=config)
    doc = k8s_deviceplugin.plugin_config(params)
    cfg = k8s_deviceplugin.load_config(doc)
    assert k8s_deviceplugin.rbac_rules(cfg) == cluster_rules
    wanted, unwanted = k8s_deviceplugin.build_objects(params, doc, cfg)
    roles = {(o["kind"], o["metadata"].get("namespace")): o for o in wanted}
    # events only where the plugin posts them, and only create
    assert roles[("Role", "default")]["rules"] == [
        {"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}
    ]
    assert roles[("RoleBinding", "default")]["roleRef"]["kind"] == "Role"
    assert unwanted == []


def test_runtime_class_object_and_the_plugin_pods_runtime_class_name() -> None:
    assert k8s_deviceplugin.runtime_class_objects(_dp_params()) == []
    wanted = {"name": "nvidia", "handler": "nvidia", "node_selector": {"runtime": "containerd"}}
    params = _dp_params(runtime_class=wanted, runtime_class_name="nvidia")
    (obj,) = k8s_deviceplugin.runtime_class_objects(params)
    assert obj["apiVersion"] == "node.k8s.io/v1" and obj["kind"] == "RuntimeClass"
    assert obj["handler"] == "nvidia" and obj["scheduling"] == {"nodeSelector": {"runtime": "containerd"}}
    assert k8s_client.resource_for(obj).path(None).endswith("/apis/node.k8s.io/v1/runtimeclasses")
    plain = k8s_deviceplugin.runtime_class_objects(_dp_params(runtime_class={**wanted, "node_selector": {}}))
    assert "scheduling" not in plain[0]
    cfg = k8s_deviceplugin.load_config(k8s_deviceplugin.plugin_config(params))
    assert k8s_deviceplugin.pod_spec(params, cfg)["runtimeClassName"] == "nvidia"
    assert "runtimeClassName" not in k8s_deviceplugin.pod_spec(_dp_params(), cfg)


class _OneObject:
    """A Kube that holds one live object and records any write."""

    def __init__(self, live: dict[str, Any]) -> None:
        self.live, self.writes = live, []

    def get(self, res: Any, name: str, namespace: str | None) -> dict[str, Any] | None:
        return self.live if name == self.live["metadata"]["name"] else None

    def request(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.writes.append(method)


def test_a_runtime_class_someone_else_made_is_neither_adopted_nor_deleted() -> None:
    foreign = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": "nvidia"},
               "handler": "nvidia"}  # fmt: skip
    kube = _OneObject(foreign)
    params = _dp_params(runtime_class={"name": "nvidia", "handler": "x", "node_selector": {}})
    wanted = k8s_deviceplugin.runtime_class_objects(params)
    (kept,) = k8s_apply.apply(kube, wanted, check_mode=False).changes  # type: ignore[arg-type]
    assert (kept.action, kept.note) == ("unchanged", "exists and is not gpufleet's: left as is")
    (skipped,) = k8s_apply.delete(kube, wanted, check_mode=False).changes  # type: ignore[arg-type]
    assert skipped.action == "skipped" and kube.writes == []


def test_without_named_configurations_the_event_role_is_removed() -> None:
    params = _dp_params(plugin_config={})
    doc = k8s_deviceplugin.plugin_config(params)
    wanted, unwanted = k8s_deviceplugin.build_objects(params, doc, k8s_deviceplugin.load_config(doc))
    assert [o["kind"] for o in unwanted] == ["Role", "RoleBinding"]
    assert {o["kind"] for o in wanted}.isdisjoint({"Role", "RoleBinding"})


def test_each_node_is_expected_to_serve_what_its_label_picks() -> None:
    named = _named(NAMED)
    assert named.config_label == "nvidia.com/device-plugin.config" and named.config_default == "training"
    assert {n: (c.advertised().resource, c.advertised().per_gpu) for n, c in named.named.items()} == {
        "training": ("nvidia.com/gpu", 1),
        "sliced": ("nvidia.com/gpu", 4),
        "renamed": ("nvidia.com/gpu.shared", 2),
    }
    pick = k8s_deviceplugin.pick

    def node(**labels: str) -> dict:
        return {"metadata": {"labels": labels}}

    label = "nvidia.com/device-plugin.config"
    assert pick(named, node()) == ("training", None)
    assert pick(named, node(**{label: "sliced"})) == ("sliced", None)
    # an unknown name: the plugin keeps what it runs (published when labels are on), else the default
    kept, warning = pick(named, node(**{label: "slicde", "gpufleet.io/device-plugin.config": "sliced"}))
    assert kept == "sliced"
    assert warning == (
        f"unknown device plugin configuration 'slicde' (label {label}); known: renamed, sliced, training; "
        "the plugin keeps 'sliced'"
    )
    assert pick(named, node(**{label: "slicde"}))[0] == "training"
    assert k8s_deviceplugin.devices(8, named.named["sliced"].advertised()) == 32
    assert named.advertised() == named.named["training"].advertised()  # what the module reports


def test_named_configurations_and_node_configs_are_checked_before_anything_is_written() -> None:
    with pytest.raises(
        k8s_deviceplugin.ParameterError, match=r"configs\.default: expected one of a, b, got 'c'"
    ):
        _named({"configs": {"default": "c", "named": {"a": {}, "b": {}}}})
    with pytest.raises(
        k8s_deviceplugin.ParameterError, match=r"configs\.named\.b\.sharing\.time_slicing\.replicas: "
    ):
        _named({"configs": {"default": "a", "named": {"a": {}, "b": {"sharing": {
            "mode": "time-slicing", "time_slicing": {"replicas": 0}}}}}})  # fmt: skip
    named = _named(NAMED)
    params = _dp_params(plugin_config=NAMED, node_configs={"n1": "sliced", "n2": None, "n3": ""})
    assert k8s_deviceplugin.node_config_names(params, named) == {"n1": "sliced", "n2": None, "n3": None}
    with pytest.raises(
        k8s_deviceplugin.ParameterError,
        match=r"node_configs\.n1: unknown device plugin configuration 'x'; known: renamed, sliced, training",
    ):
        k8s_deviceplugin.node_config_names(_dp_params(node_configs={"n1": "x"}), named)
    with pytest.raises(k8s_deviceplugin.ParameterError, match=r"plugin_config has no named configurations"):
        k8s_deviceplugin.node_config_names(_dp_params(node_configs={"n1": "x"}), _dp_config({}))


OWNER = "gpufleet.io/device-plugin.config-label"
LABEL = "nvidia.com/device-plugin.config"


def _node(labels: dict, owner: str | None = None) -> dict:
    return {"metadata": {"labels": labels, "annotations": {OWNER: owner} if owner else {}}}


def test_config_label_is_set_recorded_and_removed_only_when_the_module_set_it() -> None:
    patch = k8s_nodelabels.config_label_patch
    set_it = patch(_node({}), LABEL, "sliced")
    assert set_it == {"metadata": {"labels": {LABEL: "sliced"}, "annotations": {OWNER: f"{LABEL}=sliced"}}}
    assert patch(_node({LABEL: "sliced"}, f"{LABEL}=sliced"), LABEL, "sliced") == {}
    # the inventory wins over a hand-set value; a hand-set label of the same value is adopted
    assert patch(_node({LABEL: "training"}, f"{LABEL}=sliced"), LABEL, "sliced")["metadata"]["labels"] == {
        LABEL: "sliced"
    }
    assert patch(_node({LABEL: "sliced"}), LABEL, "sliced") == {
        "metadata": {"annotations": {OWNER: f"{LABEL}=sliced"}}
    }
    # unset: the module's own label goes; a hand-set one stays, and so does one changed by hand since
    assert patch(_node({LABEL: "sliced"}, f"{LABEL}=sliced"), LABEL, None) == {
        "metadata": {"labels": {LABEL: None}, "annotations": {OWNER: None}}
    }
    assert patch(_node({LABEL: "sliced"}), LABEL, None) == {}
    assert patch(_node({LABEL: "training"}, f"{LABEL}=sliced"), LABEL, None) == {
        "metadata": {"annotations": {OWNER: None}}
    }
    # the configuration label renamed: the old key the module set goes, the new one is set
    moved = patch(_node({LABEL: "sliced"}, f"{LABEL}=sliced"), "example.com/config", "sliced")
    assert moved["metadata"]["labels"] == {LABEL: None, "example.com/config": "sliced"}


# -- one check of a service's config file, by the service's own loader --------------------------------------
def test_both_modules_check_the_file_they_deploy_with_its_loader_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ansible_collections.gpufleet.nvidia.plugins.module_utils.deviceplugin import config as dpconfig
    from ansible_collections.gpufleet.nvidia.plugins.module_utils.extender import settings

    def no_file(*args: object, **kwargs: object) -> None:
        raise AssertionError("a temporary file was made")

    monkeypatch.setattr(tempfile, "NamedTemporaryFile", no_file)
    monkeypatch.setattr(tempfile, "mkstemp", no_file)
    ext_params = {k: v.get("default") for k, v in k8s_extender.DEPLOY_ARGS.items()}
    doc = k8s_extender.settings_doc({**ext_params, "settings": {"node_policy": "spread", "lock_wait": 0}})
    k8s_extender.validate_with_extender(doc)
    with pytest.raises(k8s_extender.ParameterError) as refused:
        k8s_extender.validate_with_extender({**doc, "node_policy": "sideways"})
    assert str(refused.value) == (
        "settings are invalid: node_policy from config file settings: expected one of binpack, spread, "
        "got 'sideways'"
    )
    dp_doc = k8s_deviceplugin.plugin_config(_dp_params(plugin_config={"sharing": {"mode": "memory"}}))
    cfg = k8s_deviceplugin.load_config(dp_doc)
    with pytest.raises(k8s_deviceplugin.ParameterError) as refused:
        k8s_deviceplugin.load_config({**dp_doc, "health": {"bogus": 1}})
    assert str(refused.value) == "plugin_config is invalid: plugin_config: health.bogus: unknown setting"
    monkeypatch.undo()
    # What each loader makes of the text is what it makes of a file holding it (the one the pods read).
    ext_file, dp_file = tmp_path / "extender.yaml", tmp_path / "config.yaml"
    ext_file.write_text(k8s_module.config_text(doc))
    dp_file.write_text(k8s_module.config_text(dp_doc))
    assert settings.load_settings(str(ext_file), env={}).node_policy.value == "spread"
    assert settings.load_settings(str(ext_file), env={}) == settings.load_settings(
        "settings", env={}, text=ext_file.read_text()
    )
    from_file = dpconfig.build(None, {"GPUFLEET_DP_CONFIG": str(dp_file), "NODE_NAME": "validation"})
    assert from_file == cfg and cfg.sharing_mode == "memory"


def _ext_params(**over: object) -> dict:
    return {k: v.get("default") for k, v in k8s_extender.DEPLOY_ARGS.items()} | {"image": EXT_IMAGE} | over


def test_node_names_pin_both_workloads_to_those_nodes_and_nothing_else_by_default() -> None:
    """Without a registry the images are only on the nodes role gpufleet_images imported them on; the role
    names those nodes (node_names) so that no pod lands where its image would have to be pulled."""
    cfg = _dp_config({})
    assert "affinity" not in k8s_deviceplugin.pod_spec(_dp_params(), cfg)  # [] limits nothing
    spec = k8s_deviceplugin.pod_spec(_dp_params(node_names=["gpu-b", "gpu-a", "gpu-a"]), cfg)
    # one value per matchFields requirement (the API server refuses more), one term per node
    terms = [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [n]}]}
        for n in ["gpu-a", "gpu-b"]
    ]
    required = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}
    assert spec["affinity"] == {"nodeAffinity": required}
    assert spec["containers"][0]["image"] == DP_IMAGE

    params = _ext_params(node_names=["gpu-a"], node_selector={"zone": "z1"})
    objects = k8s_extender.build_objects(params, k8s_extender.settings_doc(params))
    pod = next(o for o in objects if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ][0]["matchFields"][0]["values"] == ["gpu-a"]
    assert pod["nodeSelector"] == {"zone": "z1"} and pod["containers"][0]["image"] == EXT_IMAGE
    plain = k8s_extender.build_objects(_ext_params(), k8s_extender.settings_doc(_ext_params()))
    assert "affinity" not in next(o for o in plain if o["kind"] == "Deployment")["spec"]["template"]["spec"]


def test_no_image_is_refused_naming_where_one_comes_from_but_removal_needs_none() -> None:
    """No registry holds a tag of gpufleet's, so neither module has a default image to fall back on."""
    assert "default" not in k8s_deviceplugin.ARGUMENT_SPEC["image"]
    assert "default" not in k8s_extender.DEPLOY_ARGS["image"]
    with pytest.raises(k8s_deviceplugin.ParameterError, match="image is required to deploy the device"):
        k8s_deviceplugin.pod_spec(_dp_params(image=None), _dp_config({}))
    params = _ext_params(image="")
    with pytest.raises(k8s_extender.ParameterError, match="gpufleet_images_dir"):
        k8s_extender.build_objects(params, k8s_extender.settings_doc(params))
    absent = _dp_params(image=None, state="absent")
    assert k8s_deviceplugin.pod_spec(absent, _dp_config({}))["containers"][0]["image"] == ""


def test_extender_settings_pin_tls_paths_from_the_secret() -> None:
    params = _ext_params(tls_secret="s")
    doc = k8s_extender.settings_doc(params)
    assert doc["tls_cert_file"] == "/etc/gpufleet/tls/tls.crt"
    objects = k8s_extender.build_objects(params, doc)
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    probe = deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]
    assert probe["httpGet"]["scheme"] == "HTTPS"
    assert k8s_extender.default_url(params, doc) == "https://127.0.0.1:32766/gpufleet"


# -- waits' explanations ---------------------------------------------------------------------------
def test_why_not_on_node_names_selector_taint_and_readiness() -> None:
    node = {
        "metadata": {"labels": {"a": "1"}},
        "spec": {"taints": [{"key": "gpu", "effect": "NoSchedule"}]},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }
    assert k8s_wait.why_not_on_node(node, {"nodeSelector": {"a": "2"}}) == (
        "its labels do not match the nodeSelector a=2"
    )
    assert "taint gpu:NoSchedule" in str(k8s_wait.why_not_on_node(node, {}))
    assert k8s_wait.why_not_on_node(node, {"tolerations": [{"key": "gpu", "operator": "Exists"}]}) is None


def test_rollout_status_of_daemonset_and_deployment() -> None:
    ds: dict[str, Any] = {
        "kind": "DaemonSet",
        "metadata": {"generation": 2},
        "status": {
            "observedGeneration": 2,
            "desiredNumberScheduled": 2,
            "updatedNumberScheduled": 2,
            "numberAvailable": 1,
            "numberUnavailable": 1,
        },
    }
    assert not k8s_wait.rollout_status(ds).done
    ds["status"] = {**ds["status"], "numberAvailable": 2, "numberUnavailable": 0}
    assert k8s_wait.rollout_status(ds).done
    dep = {
        "kind": "Deployment",
        "metadata": {"generation": 1},
        "spec": {"replicas": 1},
        "status": {
            "observedGeneration": 1,
            "conditions": [
                {"type": "Progressing", "reason": "ProgressDeadlineExceeded", "message": "too slow"}
            ],
        },
    }
    assert k8s_wait.rollout_status(dep).failed == "progress deadline exceeded: too slow"


# -- connection options ----------------------------------------------------------------------------
def test_connection_options_never_show_the_token() -> None:
    opts = k8s_client.ConnectionOptions(host="https://h", api_key="s3cret-token")
    assert "s3cret-token" not in repr(opts)
    with pytest.raises(k8s_client.KubeError, match="host and api_key go together"):
        k8s_client.build_configuration(k8s_client.ConnectionOptions(host="https://h"))


def test_forbidden_message_names_verb_resource_and_namespace() -> None:
    kube = k8s_client.Kube.__new__(k8s_client.Kube)
    kube.host = "https://h"
    err = kube._translate_status(
        403, "Forbidden", b'{"message": "nope"}', ("patch", "daemonsets.apps", "ns", "x")
    )
    assert str(err) == "forbidden: patch daemonsets.apps in ns: nope"


class _Nodes:
    """A Kube stand-in that knows only Node objects."""

    def __init__(self, *nodes: dict) -> None:
        self.nodes = {n["metadata"]["name"]: n for n in nodes}

    def get(self, res: k8s_client.Resource, name: str, namespace: str | None = None) -> dict | None:
        assert res.kind == "Node"
        return self.nodes.get(name)


def test_named_wait_names_each_short_node_with_its_configuration() -> None:
    def node(name: str, count: int, **labels: str) -> dict:
        counts = {"nvidia.com/gpu": str(count)}
        return {
            "metadata": {"name": name, "labels": labels},
            "status": {"capacity": counts, "allocatable": counts},
        }

    kube = _Nodes(node("a", 8), node("b", 2, **{LABEL: "sliced"}))
    params = _dp_params(mode="systemd", plugin_config=NAMED)
    named = _named(NAMED)
    gpus = {"a": 8, "b": 2}

    def target(name: str, live: dict | None) -> tuple[str, int | None]:
        advertised = named.named[k8s_deviceplugin.pick(named, live)[0]].advertised()
        return advertised.resource, k8s_deviceplugin.devices(gpus[name], advertised)

    explain = k8s_deviceplugin.CapacityExplainer(kube, params, None, target)  # type: ignore[arg-type]
    with pytest.raises(k8s_wait.WaitTimeout) as failed:
        k8s_deviceplugin.wait_named_resources(kube, named, gpus, 0, explain)  # type: ignore[arg-type]
    assert str(failed.value).startswith(
        "1 of 2 node(s) do not report what their device plugin configuration serves after 0s: "
        "b (configuration sliced): advertises 2 nvidia.com/gpu, expected 8"
    ), failed.value
    kube.nodes["b"] = node("b", 8, **{LABEL: "sliced"})
    nodes, warnings = k8s_deviceplugin.wait_named_resources(kube, named, gpus, 0, explain)  # type: ignore[arg-type]
    assert nodes["b"] == {"config": "sliced", "resource": "nvidia.com/gpu", "capacity": 8, "allocatable": 8}
    assert warnings == []


ROLE = REPO / "roles" / "gpufleet_kubernetes"
# What the role hands the module as the plugin's configuration, for each inventory (task-level vars play the
# inventory's part: they override the role's defaults and vars as an inventory does).
ROLE_CONFIGS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    ({}, {"http": {"port": 9402}}),  # a plain site.yml: /metrics on
    ({"gpufleet_kubernetes_device_plugin_config": {"configs": {"default": "a", "named": {"a": {}}}}},
     {"http": {"port": 9402}, "configs": {"default": "a", "named": {"a": {}}}}),
    ({"gpufleet_kubernetes_device_plugin_config": {"http": {"port": 0}}}, {"http": {"port": 0}}),
    ({"gpufleet_kubernetes_device_plugin_config": {"http": {"address": "10.0.0.1"}}},
     {"http": {"port": 9402, "address": "10.0.0.1"}}),
    ({"gpufleet_kubernetes_device_plugin_metrics_port": 9500}, {"http": {"port": 9500}}),
    ({"gpufleet_kubernetes_device_plugin_metrics_port": 0}, {}),
]  # fmt: skip


def test_the_role_deploys_the_plugin_with_metrics_on_9402_unless_the_inventory_says_otherwise(
    tmp_path: Path,
) -> None:
    """roles/gpufleet_kubernetes's defaults and vars rendered by ansible-playbook itself, then the DaemonSet
    the module builds from a plain inventory's: the plugin serves /metrics on 9402 and Prometheus finds it."""
    var = "gpufleet_kubernetes_device_plugin_effective_config"
    tasks = [{"name": f"config {i}", "ansible.builtin.debug": {"var": var}, "vars": inventory}
             for i, (inventory, _) in enumerate(ROLE_CONFIGS)]  # fmt: skip
    play = [{"hosts": "localhost", "gather_facts": False,
             "vars_files": [str(ROLE / "defaults" / "main.yml"), str(ROLE / "vars" / "main.yml")],
             "tasks": tasks}]  # fmt: skip
    (tmp_path / "play.yml").write_text(yaml.safe_dump(play))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET_", "ANSIBLE_"))}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", "localhost,", "play.yml"],
        cwd=tmp_path,
        env=env | {"ANSIBLE_STDOUT_CALLBACK": "json", "ANSIBLE_LOCALHOST_WARNING": "false"},
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])
    got = [t["hosts"]["localhost"][var] for t in report["plays"][0]["tasks"]]
    assert got == [wanted for _, wanted in ROLE_CONFIGS]
    doc = k8s_deviceplugin.plugin_config(_dp_params(plugin_config=got[0]))
    cfg = k8s_deviceplugin.load_config(doc)
    objects, _ = k8s_deviceplugin.build_objects(_dp_params(plugin_config=got[0]), doc, cfg)
    [daemonset] = [o for o in objects if o["kind"] == "DaemonSet"]
    template = daemonset["spec"]["template"]
    assert template["metadata"]["annotations"]["prometheus.io/port"] == "9402"
    assert template["spec"]["containers"][0]["ports"] == [{"name": "metrics", "containerPort": 9402}]


def test_telemetry_gets_the_pod_resources_mount_and_scrape_annotations_where_metrics_are_served() -> None:
    doc = k8s_deviceplugin.plugin_config(_dp_params(plugin_config={"http": {"port": 9402}}))
    cfg = k8s_deviceplugin.load_config(doc)
    spec = k8s_deviceplugin.pod_spec(_dp_params(), cfg)
    [volume] = [v for v in spec["volumes"] if v["name"] == "pod-resources"]
    assert volume["hostPath"] == {"path": "/var/lib/kubelet/pod-resources"}
    [mount] = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "pod-resources"]
    assert mount == {"name": "pod-resources", "mountPath": "/var/lib/kubelet/pod-resources", "readOnly": True}
    wanted, _ = k8s_deviceplugin.build_objects(_dp_params(plugin_config={"http": {"port": 9402}}), doc, cfg)
    [daemonset] = [o for o in wanted if o["kind"] == "DaemonSet"]
    annotations = daemonset["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9402"
    # no /metrics, telemetry off, or no socket: no mount, no annotations
    for config in ({}, {"http": {"port": 9402}, "telemetry": {"enabled": False}},
                   {"http": {"port": 9402}, "telemetry": {"pod_resources_socket": ""}}):  # fmt: skip
        volumes = k8s_deviceplugin.pod_spec(_dp_params(), _dp_config(config))["volumes"]
        assert all(v["name"] != "pod-resources" for v in volumes)
    assert k8s_deviceplugin.scrape_annotations(_dp_config({})) == {}
    with pytest.raises(k8s_deviceplugin.ParameterError, match="pod_resources_socket: expected an absolute"):
        _dp_config({"http": {"port": 1}, "telemetry": {"pod_resources_socket": "k.sock"}})
