# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""The gpu_device_plugin module's logic: the objects of the DaemonSet deployment, and the capacity wait.

Objects (DaemonSet mode), in apply order: Namespace (optional), ServiceAccount, ClusterRole and
ClusterRoleBinding (only when the plugin needs the API), ConfigMap (the plugin's config file),
DaemonSet. RBAC follows what the plugin calls (src/gpufleet/deviceplugin/labels.py, gpumem/resolver.py):

- node labels/annotation (``labels.enabled``, the default): nodes get, patch;
- GPU-memory sharing (``sharing.mode: memory``) also: pods list, get, patch (the hand-off, docs/handoff.md);
- neither: no role at all and no service account token in the pod.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import reprlib
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_apply import ApplyResult, apply, delete
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import RESOURCES, Kube
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_module import WORKLOAD_ARGS
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_wait import (
    log_tail,
    pod_problem,
    resource_count,
    selector_string,
    wait_node_resources,
    wait_rollout,
    why_not_on_node,
)

CONFIG_KEY = "config.yaml"
CONFIG_DIR = "/etc/gpufleet"
SOCKET_DIR = "/var/lib/kubelet/device-plugins"
CONFIG_HASH_ANNOTATION = "gpufleet.io/config-sha256"
DEFAULT_TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "CriticalAddonsOnly", "operator": "Exists"},
]
DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}}
MAX_EXPECTED_GPUS = 4096  # GPUs on one node; any more is a typo (and multiplies into a device count)
_COUNT_TEXT = re.compile(r"\s*[0-9]{1,9}\s*")  # int() of a long digit string costs quadratic time
# The plugin's own spelling of booleans in its config file (src/gpufleet/deviceplugin/config.py).
_TRUE, _FALSE = {"true", "1", "yes", "on"}, {"false", "0", "no", "off"}

ARGUMENT_SPEC: dict[str, dict[str, Any]] = {
    "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
    "mode": {"type": "str", "default": "daemonset", "choices": ["daemonset", "systemd"]},
    "name": {"type": "str", "default": "gpufleet-device-plugin"},
    **WORKLOAD_ARGS,
    "image": {"type": "str", "default": "gpufleet/device-plugin:0.1.0"},
    "command": {"type": "list", "elements": "str"},
    "plugin_config": {"type": "dict", "default": {}},
    "node_selector": {"type": "dict", "default": {}},
    "tolerations": {"type": "list", "elements": "dict"},
    "priority_class_name": {"type": "str", "default": "system-node-critical"},
    "resources": {"type": "dict"},
    "host_root": {"type": "path", "default": "/"},
    "env": {"type": "dict", "default": {}},
    "extra_volumes": {
        "type": "list",
        "elements": "dict",
        "default": [],
        "options": {
            "name": {"type": "str", "required": True},
            "host_path": {"type": "path", "required": True},
            "mount_path": {"type": "path"},
            "read_only": {"type": "bool", "default": True},
        },
    },
    "expected_gpus": {"type": "dict", "default": {}},
    "wait": {"type": "bool", "default": True},
    "wait_timeout": {"type": "int", "default": 300},
}


class ParameterError(ValueError):
    """The parameters contradict each other or the plugin's configuration is invalid."""


@dataclass(frozen=True)
class PluginShape:
    """What the plugin's configuration implies for RBAC and the capacity wait."""

    resource: str
    per_gpu: int | None  # devices per GPU; None when it is not a fixed number (GPU memory: GiB per GPU)
    labels: bool
    memory: bool
    metrics_port: int


def plugin_config(params: Mapping[str, Any]) -> dict[str, Any]:
    """The plugin's config file: the module's ``plugin_config`` plus what the deployment pins."""
    cfg = copy.deepcopy(dict(params["plugin_config"] or {}))
    version = cfg.setdefault("version", "v1")
    if version != "v1":
        raise ParameterError(f"plugin_config.version: gpufleet's device plugin reads v1, got {version!r}")
    for pinned in ("socket_dir", "node_name"):
        if pinned in cfg:
            raise ParameterError(f"plugin_config.{pinned} is set by the deployment; remove it")
    if "configs" in cfg:
        # The plugin reads them (docs/deviceplugin.md, "Named configurations"); this module does not deploy
        # them yet: its capacity wait and RBAC assume one configuration for every node.
        raise ParameterError(
            "plugin_config.configs: named configurations are not deployed by this module yet (its capacity "
            "wait assumes one configuration on every node); deploy one configuration per node group"
        )
    if params["mode"] == "daemonset":
        cfg["host_root"] = params["host_root"]
    return cfg


def _section(doc: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    """``doc[name]`` when it is a mapping (absent or null: empty); ParameterError naming it otherwise."""
    value = doc.get(name.rsplit(".", 1)[-1]) or {}
    if not isinstance(value, Mapping):
        raise ParameterError(f"plugin_config.{name} must be a mapping, got {type(value).__name__}")
    return value


def _count(value: Any, what: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi] given as a number or its digits; ParameterError naming ``what`` otherwise."""
    if (isinstance(value, str) and _COUNT_TEXT.fullmatch(value)) or (
        isinstance(value, float) and value.is_integer()
    ):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ParameterError(f"{what}: expected an integer from {lo} to {hi}, got {reprlib.repr(value)}")
    return value


def _flag(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
        return value.lower() in _TRUE
    raise ParameterError(f"{what}: expected true or false, got {type(value).__name__}")


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value:
        raise ParameterError(f"{what}: expected a resource name, got {type(value).__name__}")
    return value


def shape_of(cfg: Mapping[str, Any]) -> PluginShape:
    """Resource name, devices per GPU and API needs, from the plugin config (defaults as the plugin's);
    ParameterError when a value the module reads here has the wrong type or range."""
    sharing = _section(cfg, "sharing")
    mode = sharing.get("mode", "none")
    labels = _flag(_section(cfg, "labels").get("enabled", True), "plugin_config.labels.enabled")
    port = _count(_section(cfg, "http").get("port", 0) or 0, "plugin_config.http.port", 0, 65535)
    if mode == "memory":
        memory = _section(sharing, "sharing.memory")
        name = _name(
            memory.get("resource_name", "gpufleet.io/gpu-mem"), "plugin_config.sharing.memory.resource_name"
        )
        return PluginShape(name, None, labels, True, port)
    base = _name(cfg.get("resource_name", "nvidia.com/gpu"), "plugin_config.resource_name")
    if mode == "time-slicing":
        ts = _section(sharing, "sharing.time_slicing")
        replicas = _count(ts.get("replicas", 2), "plugin_config.sharing.time_slicing.replicas", 1, 1024)
        rename = ts.get("rename") or base
        return PluginShape(
            _name(rename, "plugin_config.sharing.time_slicing.rename"), replicas, labels, False, port
        )
    if mode != "none":
        raise ParameterError(
            f"plugin_config.sharing.mode: none, time-slicing or memory, got {reprlib.repr(mode)}"
        )
    return PluginShape(base, 1, labels, False, port)


def validate_with_plugin(cfg: Mapping[str, Any]) -> str | None:
    """Check the config with the plugin's own loader when gpufleet is installed here; the reason it could
    not be checked otherwise (None when it was). Raises ParameterError on an invalid config."""
    try:
        from gpufleet.deviceplugin import config as dpconfig
    except ImportError:
        return "the gpufleet package is not installed on the controller; the plugin validates it at start"
    import yaml

    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as fh:
        yaml.safe_dump(dict(cfg), fh)
    try:
        dpconfig.build(None, {"GPUFLEET_DP_CONFIG": fh.name, "NODE_NAME": "validation"})
    except dpconfig.ConfigError as exc:
        raise ParameterError(
            "plugin_config is invalid: " + str(exc).replace(fh.name, "plugin_config")
        ) from None
    finally:
        os.unlink(fh.name)
    return None


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "device-plugin"}


def rbac_rules(shape: PluginShape) -> list[dict[str, Any]]:
    """The least the plugin needs (empty: it never calls the API)."""
    rules: list[dict[str, Any]] = []
    if shape.labels or shape.memory:
        rules.append({"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]})
    if shape.memory:
        rules.append({"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "get", "patch"]})
    return rules


def build_objects(
    params: Mapping[str, Any], cfg: Mapping[str, Any]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(objects to apply, objects that must not exist) for DaemonSet mode."""
    import yaml

    name, ns = params["name"], params["namespace"]
    shape = shape_of(cfg)
    labels = _labels(name)
    config_text = yaml.safe_dump(dict(cfg), sort_keys=True)
    rules = rbac_rules(shape)
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name}
    namespace_obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    account: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "automountServiceAccountToken": bool(rules),
    }
    role: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": {"name": name, "labels": labels},
        "rules": rules,
    }
    binding: dict[str, Any] = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": {"name": name, "labels": labels},
        "roleRef": role_ref,
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": ns}],
    }
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "data": {CONFIG_KEY: config_text},
    }
    daemonset = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "selector": {"matchLabels": {"app.kubernetes.io/name": name}},
            "updateStrategy": {"type": "RollingUpdate"},
            "template": {
                "metadata": {
                    "labels": labels,
                    "annotations": {CONFIG_HASH_ANNOTATION: hashlib.sha256(config_text.encode()).hexdigest()},
                },
                "spec": pod_spec(params, shape),
            },
        },
    }
    wanted = ([namespace_obj] if params["create_namespace"] else []) + [account]
    unwanted: list[dict[str, Any]] = []
    (wanted if rules else unwanted).extend([role, binding])
    wanted += [configmap, daemonset]
    return wanted, unwanted


def pod_spec(params: Mapping[str, Any], shape: PluginShape) -> dict[str, Any]:
    """The DaemonSet's pod: plugin container, kubelet socket dir, the host's /dev, the config file."""
    host_root = params["host_root"]
    mounts = [
        {"name": "device-plugins", "mountPath": SOCKET_DIR},
        {"name": "host-dev", "mountPath": os.path.join(host_root, "dev"), "readOnly": True},
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
    ]
    volumes = [
        {"name": "device-plugins", "hostPath": {"path": SOCKET_DIR, "type": "Directory"}},
        {"name": "host-dev", "hostPath": {"path": os.path.join(host_root, "dev")}},
        {"name": "config", "configMap": {"name": params["name"]}},
    ]
    for extra in params["extra_volumes"]:
        mounts.append(
            {
                "name": extra["name"],
                "mountPath": extra["mount_path"] or extra["host_path"],
                "readOnly": extra["read_only"],
            }
        )
        volumes.append({"name": extra["name"], "hostPath": {"path": extra["host_path"]}})
    env = [{"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]
    env += [{"name": str(k), "value": str(v)} for k, v in sorted((params["env"] or {}).items())]
    container: dict[str, Any] = {
        "name": "plugin",
        "image": params["image"],
        "imagePullPolicy": params["image_pull_policy"],
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": env,
        "resources": params["resources"] or DEFAULT_RESOURCES,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts,
    }
    if params["command"]:
        container["command"] = list(params["command"])
    if shape.metrics_port:
        container["ports"] = [{"name": "metrics", "containerPort": shape.metrics_port}]
        container["livenessProbe"] = {
            "httpGet": {"path": "/healthz", "port": "metrics"},
            "initialDelaySeconds": 30,
            "periodSeconds": 30,
        }
    spec: dict[str, Any] = {
        "serviceAccountName": params["name"],
        "tolerations": params["tolerations"] if params["tolerations"] is not None else DEFAULT_TOLERATIONS,
        "containers": [container],
        "volumes": volumes,
    }
    if params["priority_class_name"]:
        spec["priorityClassName"] = params["priority_class_name"]
    if params["node_selector"]:
        spec["nodeSelector"] = {str(k): str(v) for k, v in params["node_selector"].items()}
    if params["host_network"]:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return spec


def expected_counts(params: Mapping[str, Any], shape: PluginShape) -> dict[str, int | None]:
    """{node: expected count of the advertised resource} from ``expected_gpus`` (None: any positive)."""
    out: dict[str, int | None] = {}
    for node, gpus in (params["expected_gpus"] or {}).items():
        count = _count(gpus, f"expected_gpus.{node}", 0, MAX_EXPECTED_GPUS)
        out[str(node)] = None if shape.per_gpu is None else count * shape.per_gpu
    return out


class CapacityExplainer:
    """Turns a node that lacks the plugin's resource into a reason: no pod, pod failing, not registered,
    fewer devices than expected, unhealthy devices (with the plugin's last log lines)."""

    def __init__(
        self, kube: Kube, params: Mapping[str, Any], shape: PluginShape, daemonset: dict[str, Any] | None
    ):
        self.kube, self.params, self.shape = kube, params, shape
        self.daemonset = daemonset
        self.expected = expected_counts(params, shape)

    def _pod(self, node_name: str) -> dict[str, Any] | None:
        if self.daemonset is None:
            return None
        selector = selector_string(self.daemonset["spec"]["selector"]["matchLabels"])
        pods = self.kube.list(
            RESOURCES["Pod"],
            self.params["namespace"],
            label_selector=selector,
            field_selector=f"spec.nodeName={node_name}",
        )
        return pods[0] if pods else None

    def _log(self, pod: dict[str, Any] | None) -> str:
        if pod is None:
            return f" (systemd mode: see `journalctl -u {self.params['name']}` on the node)"
        tail = log_tail(self.kube, pod["metadata"]["name"], self.params["namespace"], "plugin")
        return f"; plugin log: {tail}" if tail else ""

    def __call__(self, node_name: str, node: dict[str, Any] | None) -> str:
        if node is None:
            return "no such node in the cluster"
        res = self.shape.resource
        pod = self._pod(node_name)
        if self.daemonset is not None:
            if pod is None:
                why = why_not_on_node(node, self.daemonset["spec"]["template"]["spec"])
                return "no plugin pod on it: " + (why or "the DaemonSet controller has not placed one yet")
            problem = pod_problem(self.kube, pod)
            if problem:
                return problem
        capacity = resource_count(node, "capacity", res)
        allocatable = resource_count(node, "allocatable", res)
        want = self.expected.get(node_name)
        if capacity is None:
            return f"plugin not registered with the kubelet: the node reports no {res}" + self._log(pod)
        if capacity == 0:
            return f"plugin registered but advertises no {res} (NVML found no GPU?)" + self._log(pod)
        if want is not None and capacity != want:
            return f"advertises {capacity} {res}, expected {want}" + self._log(pod)
        if allocatable is not None and allocatable < capacity:
            return f"{capacity - allocatable} of {capacity} {res} devices unhealthy" + self._log(pod)
        return f"capacity {capacity}, allocatable {allocatable} (still settling)"


def reconcile(kube: Kube, params: Mapping[str, Any], check_mode: bool) -> tuple[ApplyResult, list[str]]:
    """Apply (state present) or delete (absent) the DaemonSet-mode objects; (changes, warnings).

    In systemd mode nothing in the cluster is the module's: the node-side install is the role's job.
    """
    if params["mode"] != "daemonset":
        return ApplyResult(), []
    cfg = plugin_config(params)
    wanted, unwanted = build_objects(params, cfg)
    if params["state"] == "absent":
        timeout = params["wait_timeout"] if params["wait"] else 0
        return delete(kube, wanted + unwanted, check_mode=check_mode, wait_timeout=timeout), []
    warnings = []
    note = validate_with_plugin(cfg)
    if note:
        warnings.append(f"plugin_config not validated: {note}")
    applied = apply(kube, wanted, check_mode=check_mode)
    pruned = delete(kube, unwanted, check_mode=check_mode)
    applied.changes += [c for c in pruned.changes if c.action != "absent"]
    return applied, warnings


def wait_ready(kube: Kube, params: Mapping[str, Any]) -> dict[str, dict[str, int | None]]:
    """Rollout done (DaemonSet mode) and every target node reports the expected capacity and allocatable."""
    shape = shape_of(plugin_config(params))
    daemonset = None
    if params["mode"] == "daemonset":
        daemonset = wait_rollout(
            kube, "DaemonSet", params["name"], params["namespace"], params["wait_timeout"]
        )
    expected = expected_counts(params, shape)
    if not expected:
        expected = _nodes_running_the_plugin(kube, params, daemonset)
    explain = CapacityExplainer(kube, params, shape, daemonset)
    return wait_node_resources(kube, shape.resource, expected, params["wait_timeout"], explain)


def _nodes_running_the_plugin(
    kube: Kube, params: Mapping[str, Any], daemonset: dict[str, Any] | None
) -> dict[str, int | None]:
    """Without ``expected_gpus``: every node the DaemonSet runs on must report some of the resource."""
    if daemonset is None:
        raise ParameterError("mode systemd with wait needs expected_gpus (which nodes to wait for)")
    selector = selector_string(daemonset["spec"]["selector"]["matchLabels"])
    pods = kube.list(RESOURCES["Pod"], params["namespace"], label_selector=selector)
    nodes = sorted({str(n) for p in pods if (n := (p.get("spec") or {}).get("nodeName"))})
    if not nodes:
        spec = daemonset["spec"]["template"]["spec"]
        raise ParameterError(
            f"DaemonSet {params['namespace']}/{params['name']} runs on no node "
            f"(nodeSelector {json.dumps(spec.get('nodeSelector') or {})}); set node_selector or expected_gpus"
        )
    return dict.fromkeys(nodes)
