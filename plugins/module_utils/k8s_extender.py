# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""The gpu_scheduler_extender module's in-cluster part: objects, validation, rollout.

Objects, in apply order: Namespace (optional), ServiceAccount, ClusterRole, ClusterRoleBinding, ConfigMap
(the extender's settings file), Deployment, Service. RBAC is what ``src/gpufleet/extender/kube.py`` calls
(docs/handoff.md "RBAC"): nodes get/list/watch (cache) and patch (bind-lock); pods get/list/watch (cache)
and patch (assignment annotation); pods/binding create (it is the binder for GPU pods).
"""

from __future__ import annotations

import copy
import hashlib
import reprlib
from collections.abc import Mapping
from typing import Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_apply import ApplyResult, apply, delete
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import Kube
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_module import (
    WORKLOAD_ARGS,
    checked_config,
    node_names_affinity,
    required_image,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_wait import wait_rollout

SETTINGS_KEY = "extender.yaml"
SETTINGS_PATH = "/etc/gpufleet/extender.yaml"
TLS_DIR = "/etc/gpufleet/tls"
CONFIG_HASH_ANNOTATION = "gpufleet.io/config-sha256"
DEFAULT_PORT = 8800
DEFAULT_PREFIX = "/gpufleet"
DEFAULT_RESOURCES = {"requests": {"cpu": "200m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}}
RULES = [
    {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "patch"]},
    {"apiGroups": [""], "resources": ["pods/binding"], "verbs": ["create"]},
]

DEPLOY_ARGS: dict[str, dict[str, Any]] = {
    "name": {"type": "str", "default": "gpufleet-extender"},
    **WORKLOAD_ARGS,
    # no default: no registry holds a tag of gpufleet's; the role passes the digest reference role
    # gpufleet_images checked (docs/install.md). Required with state=present.
    "image": {"type": "str"},
    "command": {"type": "list", "elements": "str"},
    "replicas": {"type": "int", "default": 2},
    "settings": {"type": "dict", "default": {}},
    "tls_secret": {"type": "str", "no_log": False},  # the Secret's name, not its content
    "service_type": {"type": "str", "default": "NodePort", "choices": ["NodePort", "ClusterIP"]},
    "node_port": {"type": "int", "default": 32766},
    "env": {"type": "dict", "default": {}},
    "node_selector": {"type": "dict", "default": {}},
    "tolerations": {"type": "list", "elements": "dict", "default": []},
    "priority_class_name": {"type": "str", "default": "system-cluster-critical"},
    "resources": {"type": "dict"},
}


class ParameterError(ValueError):
    """Contradictory parameters or invalid extender settings."""


def settings_doc(params: Mapping[str, Any]) -> dict[str, Any]:
    """The extender's settings file: ``settings`` plus what the deployment decides (TLS paths, address)."""
    doc = copy.deepcopy(dict(params["settings"] or {}))
    version = doc.setdefault("version", "v1")
    if version != "v1":
        raise ParameterError(f"settings.version: gpufleet's extender reads v1, got {version!r}")
    for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "kubeconfig"):
        if key in doc:
            raise ParameterError(f"settings.{key} is set by the deployment (tls_secret / service account)")
    doc.setdefault("listen_address", "0.0.0.0")
    doc.setdefault("port", DEFAULT_PORT)
    doc.setdefault("url_prefix", DEFAULT_PREFIX)
    # The module reads these two itself (the scheduler's URL), so they are checked here too.
    port, prefix = doc["port"], doc["url_prefix"]
    if isinstance(port, str) and port.strip().isascii() and port.strip().isdigit() and len(port.strip()) <= 5:
        port = int(port)
    if isinstance(port, bool) or not isinstance(port, int) or not 0 < port <= 65535:
        raise ParameterError(
            f"settings.port: expected a port from 1 to 65535, got {reprlib.repr(doc['port'])}"
        )
    if not isinstance(prefix, str) or not prefix.startswith("/"):
        raise ParameterError(
            f"settings.url_prefix: expected a path starting with '/', got {reprlib.repr(prefix)}"
        )
    if params["tls_secret"]:
        doc["tls_cert_file"] = f"{TLS_DIR}/tls.crt"
        doc["tls_key_file"] = f"{TLS_DIR}/tls.key"
        doc["tls_client_ca_file"] = f"{TLS_DIR}/client-ca.crt"
    return doc


def validate_with_extender(doc: Mapping[str, Any]) -> None:
    """Check the settings with the extender's own loader (linked, see module_utils/extender), TLS files
    aside: they live in the Secret. Raises ParameterError."""
    from ansible_collections.gpufleet.nvidia.plugins.module_utils.extender.settings import (
        SettingsError,
        load_settings,
    )

    def load(text: str) -> object:
        return load_settings("settings", env={}, text=text)

    checked = {k: v for k, v in doc.items() if not k.startswith("tls_")}
    checked_config(checked, load, SettingsError, ParameterError, "settings are invalid")


def build_objects(params: Mapping[str, Any], doc: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Every object of the extender's deployment."""
    import yaml

    name, ns = params["name"], params["namespace"]
    labels = {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "scheduler-extender"}
    text = yaml.safe_dump(dict(doc), sort_keys=True)
    https = bool(params["tls_secret"])
    port = int(doc["port"])
    mounts = [{"name": "config", "mountPath": SETTINGS_PATH, "subPath": SETTINGS_KEY, "readOnly": True}]
    volumes: list[dict[str, Any]] = [{"name": "config", "configMap": {"name": name}}]
    if https:
        mounts.append({"name": "tls", "mountPath": TLS_DIR, "readOnly": True})
        volumes.append({"name": "tls", "secret": {"secretName": params["tls_secret"]}})
    scheme = "HTTPS" if https else "HTTP"
    container: dict[str, Any] = {
        "name": "extender",
        "image": required_image(params, "scheduler extender", ParameterError),
        "imagePullPolicy": params["image_pull_policy"],
        "command": list(params["command"] or ["gpufleet-extender", "serve", "--config", SETTINGS_PATH]),
        "ports": [{"name": "http", "containerPort": port}],
        "livenessProbe": {
            "httpGet": {"path": "/healthz", "port": port, "scheme": scheme},
            "periodSeconds": 10,
        },
        # Ready once the node and pod lists are in; until then filter/bind answer "not synced".
        "readinessProbe": {
            "httpGet": {"path": "/readyz", "port": port, "scheme": scheme},
            "periodSeconds": 2,
        },
        "resources": params["resources"] or DEFAULT_RESOURCES,
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": mounts,
    }
    if params["env"]:
        container["env"] = [{"name": str(k), "value": str(v)} for k, v in sorted(params["env"].items())]
    pod: dict[str, Any] = {
        "serviceAccountName": name,
        # The kubelet would export the Service "gpufleet-extender" as GPUFLEET_EXTENDER_SERVICE_HOST etc.,
        # which the extender reads as (unknown) settings and refuses to start.
        "enableServiceLinks": False,
        # what Pod Security's "restricted" level asks (deploy/extender/deployment.yaml sets the same)
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if params["priority_class_name"]:
        pod["priorityClassName"] = params["priority_class_name"]
    if params["node_selector"]:
        pod["nodeSelector"] = {str(k): str(v) for k, v in params["node_selector"].items()}
    if params.get("node_names"):
        pod["affinity"] = node_names_affinity(params["node_names"])
    if params["tolerations"]:
        pod["tolerations"] = params["tolerations"]
    if params["host_network"]:
        pod["hostNetwork"] = True
        pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    service_port: dict[str, Any] = {"name": "http", "port": port, "targetPort": port}
    if params["service_type"] == "NodePort":
        service_port["nodePort"] = params["node_port"]
    objects: list[dict[str, Any]] = []
    if params["create_namespace"]:
        objects.append({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    objects += [
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": name, "labels": labels},
            "rules": RULES,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": name, "labels": labels},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "data": {SETTINGS_KEY: text},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {
                "replicas": params["replicas"],
                "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
                "template": {
                    "metadata": {
                        "labels": labels,
                        "annotations": {CONFIG_HASH_ANNOTATION: hashlib.sha256(text.encode()).hexdigest()},
                    },
                    "spec": pod,
                },
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": name, "namespace": ns, "labels": labels},
            "spec": {
                "type": params["service_type"],
                "selector": {"app.kubernetes.io/name": name},
                "ports": [service_port],
            },
        },
    ]
    return objects


def reconcile(kube: Kube, params: Mapping[str, Any], check_mode: bool) -> ApplyResult:
    """Apply (present) or delete (absent; waiting until gone with ``wait``) the in-cluster objects."""
    doc = settings_doc(params)
    objects = build_objects(params, doc)
    if params["state"] == "absent":
        timeout = params["wait_timeout"] if params["wait"] else 0
        return delete(kube, objects, check_mode=check_mode, wait_timeout=timeout)
    validate_with_extender(doc)
    return apply(kube, objects, check_mode=check_mode)


def wait_ready(kube: Kube, params: Mapping[str, Any]) -> None:
    """Every replica updated and ready (ready = synced with the API server, /readyz)."""
    wait_rollout(kube, "Deployment", params["name"], params["namespace"], params["wait_timeout"])


def default_url(params: Mapping[str, Any], doc: Mapping[str, Any]) -> str:
    """What a host-network kube-scheduler on a control-plane node dials: the NodePort on loopback, or the
    Service's cluster DNS name for ClusterIP."""
    scheme = "https" if params["tls_secret"] else "http"
    prefix = str(doc.get("url_prefix", DEFAULT_PREFIX))
    if params["service_type"] == "NodePort":
        return f"{scheme}://127.0.0.1:{params['node_port']}{prefix}"
    return f"{scheme}://{params['name']}.{params['namespace']}.svc:{doc.get('port', DEFAULT_PORT)}{prefix}"
