"""The modules' pure logic, without a cluster: comparison and merge patches, manifest surgery, object
shapes, waits' explanations, connection option handling."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from labstack import REPO, ensure_collection_link

from gpufleet_harness.cluster.staticpod import write_kubeadm_manifest

ensure_collection_link()
sys.path.insert(0, str(REPO / ".cache" / "collections"))

from ansible_collections.gpufleet.nvidia.plugins.module_utils import (  # noqa: E402
    k8s_apply,
    k8s_client,
    k8s_deviceplugin,
    k8s_extender,
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
    original = yaml.safe_load(write_kubeadm_manifest(path, Path("/etc/kubernetes/scheduler.conf"), 10259))
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


def test_manifest_surgery_replaces_a_separate_config_argument() -> None:
    doc = {
        "kind": "Pod",
        "spec": {
            "containers": [
                {"name": "kube-scheduler", "command": ["kube-scheduler", "--config", "/old.yaml", "--v=2"]}
            ]
        },
    }
    out = k8s_schedconfig.with_config(doc, "/new.yaml", "h")
    assert out["spec"]["containers"][0]["command"] == ["kube-scheduler", "--config=/new.yaml", "--v=2"]


def test_scheduler_processes_are_found_with_start_times() -> None:
    procs = k8s_schedconfig.scheduler_processes()
    assert all(p.started > 0 and p.argv[0].endswith("kube-scheduler") for p in procs)


# -- object shapes ---------------------------------------------------------------------------------
def _dp_params(**over: object) -> dict:
    params = {k: v.get("default") for k, v in k8s_deviceplugin.ARGUMENT_SPEC.items()}
    params.update(over)
    return params


@pytest.mark.parametrize(
    ("config", "rules"),
    [
        ({}, [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]),
        (
            {"sharing": {"mode": "memory"}},
            [
                {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]},
                {"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "get", "patch"]},
            ],
        ),
        ({"labels": {"enabled": False}}, []),
    ],
)
def test_device_plugin_rbac_is_what_the_config_needs(config: dict, rules: list) -> None:
    cfg = k8s_deviceplugin.plugin_config(_dp_params(plugin_config=config))
    assert k8s_deviceplugin.rbac_rules(k8s_deviceplugin.shape_of(cfg)) == rules


def test_device_plugin_expected_counts_follow_sharing() -> None:
    for config, want in (
        ({}, 8),
        ({"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 4}}}, 32),
        ({"sharing": {"mode": "memory"}}, None),
    ):
        params = _dp_params(plugin_config=config, expected_gpus={"n1": "8"})
        shape = k8s_deviceplugin.shape_of(k8s_deviceplugin.plugin_config(params))
        assert k8s_deviceplugin.expected_counts(params, shape) == {"n1": want}
    with pytest.raises(
        k8s_deviceplugin.ParameterError, match=r"plugin_config\.node_name is set by the deployment"
    ):
        k8s_deviceplugin.plugin_config(_dp_params(plugin_config={"node_name": "x"}))
    # the plugin reads named configurations; the module says plainly that it cannot deploy them yet
    named = {"configs": {"default": "a", "named": {"a": {}}}}
    with pytest.raises(k8s_deviceplugin.ParameterError, match=r"plugin_config\.configs: named configurations "
                       r"are not deployed by this module yet"):  # fmt: skip
        k8s_deviceplugin.plugin_config(_dp_params(plugin_config=named))


def test_extender_settings_pin_tls_paths_from_the_secret() -> None:
    params = {k: v.get("default") for k, v in k8s_extender.DEPLOY_ARGS.items()} | {"tls_secret": "s"}
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
