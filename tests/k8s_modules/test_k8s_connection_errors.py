"""Connection and permission failures of gpufleet's Kubernetes modules, through ansible-playbook against
the lab's real kube-apiserver: each says what failed, none shows a credential."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import pytest
from labstack import LabStack, run_tasks
from modargs import DEVICE_PLUGIN, EXTENDER, OBJECTS_IMAGE, token_args

from gpufleet_harness.cluster.process import free_ports

pytestmark = pytest.mark.cluster


def _sa_token(stack: LabStack, namespace: str, name: str) -> str:
    """Create a ServiceAccount and return a token for it (TokenRequest API)."""
    core = stack.control_plane.core_v1()
    core.create_namespace({"metadata": {"name": namespace}})
    core.create_namespaced_service_account(namespace, {"metadata": {"name": name}})
    return stack.control_plane.service_account_token(namespace, name)


def test_least_privilege_token_gets_forbidden_naming_verb_and_resource(
    stack: LabStack, tmp_path: Path
) -> None:
    """A token that may read but not create RBAC objects: the module names the verb, resource and scope."""
    ns = f"t-{secrets.token_hex(3)}"
    token = _sa_token(stack, ns, "deployer")
    rbac = stack.control_plane.api_client()
    from kubernetes import client as k8s

    rbac_api = k8s.RbacAuthorizationV1Api(rbac)
    role = {
        "metadata": {"name": ns},
        "rules": [
            {
                "apiGroups": ["", "apps", "rbac.authorization.k8s.io"],
                "verbs": ["get", "list"],
                "resources": [
                    "namespaces",
                    "serviceaccounts",
                    "configmaps",
                    "daemonsets",
                    "clusterroles",
                    "clusterrolebindings",
                ],
            },
            {"apiGroups": [""], "verbs": ["create"], "resources": ["namespaces", "serviceaccounts"]},
        ],
    }
    rbac_api.create_cluster_role(role)  # type: ignore[arg-type]
    binding: dict[str, Any] = {
        "metadata": {"name": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": ns},
        "subjects": [{"kind": "ServiceAccount", "name": "deployer", "namespace": ns}],
    }
    rbac_api.create_cluster_role_binding(binding)  # type: ignore[arg-type]
    try:
        task = {
            DEVICE_PLUGIN: token_args(stack.control_plane, token, namespace=ns, name="dp-" + ns, wait=False)
        }
        run = run_tasks([task], tmp_path, args=["-vvv"], json_output=False)
        assert run.rc == 2, run.output
        assert "forbidden: create clusterroles.rbac.authorization.k8s.io at cluster scope" in run.output
        assert "cannot create resource" in run.output
        assert token not in run.output
        structured = run_tasks([task], tmp_path)
        result = structured.task()
        assert result["failed"] and result["msg"].startswith(
            "forbidden: create clusterroles.rbac.authorization.k8s.io"
        )
        # what was done before the failure is reported: the first run created the account, the namespace
        # was there
        assert [(o["kind"], o["action"]) for o in result["objects"]] == [
            ("Namespace", "unchanged"),
            ("ServiceAccount", "unchanged"),
        ]
        assert token not in structured.output
    finally:  # the lab is shared with other tests: leave no RBAC objects or namespace behind
        rbac_api.delete_cluster_role_binding(ns)
        rbac_api.delete_cluster_role(ns)
        stack.control_plane.core_v1().delete_namespace(ns)


def test_unreachable_api_server_is_named(stack: LabStack, tmp_path: Path) -> None:
    (port,) = free_ports(1)
    token = secrets.token_hex(16)
    task = {
        EXTENDER: {
            "host": f"https://127.0.0.1:{port}",
            "api_key": token,
            "validate_certs": False,
            "wait": False,
            "request_timeout": 5,
            "image": OBJECTS_IMAGE,
        }
    }
    run = run_tasks([task], tmp_path)
    result = run.task()
    assert result["failed"]
    assert result["msg"].startswith(f"cannot reach the API server at https://127.0.0.1:{port}:"), result[
        "msg"
    ]
    assert "refused" in result["msg"].lower()
    assert token not in run.output


def test_missing_kubeconfig_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "nope.kubeconfig"
    run = run_tasks([{DEVICE_PLUGIN: {"kubeconfig": str(missing), "wait": False}}], tmp_path)
    result = run.task()
    assert result["failed"] and result["msg"] == f"no kubeconfig: {missing} does not exist"


def test_default_kubeconfig_missing_says_where_it_looked(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    run = run_tasks([{EXTENDER: {"wait": False, "image": OBJECTS_IMAGE}}], tmp_path, env={"HOME": str(home)})
    result = run.task()
    assert result["failed"]
    assert result["msg"].startswith("no kubeconfig: ~/.kube/config does not exist; set the kubeconfig option")


def test_wrong_token_is_unauthorized(stack: LabStack, tmp_path: Path) -> None:
    cp = stack.control_plane
    token = secrets.token_hex(16)
    task = {DEVICE_PLUGIN: token_args(cp, token, wait=False)}
    run = run_tasks([task], tmp_path)
    result = run.task()
    assert result["failed"] and result["msg"].startswith(f"unauthorized: the API server at {cp.url} rejected")
    assert token not in run.output
