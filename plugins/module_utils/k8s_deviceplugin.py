# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""The gpu_device_plugin module's logic: the objects of the DaemonSet deployment, and the capacity wait.

Objects (DaemonSet mode), in apply order: Namespace (optional), ServiceAccount, ClusterRole and
ClusterRoleBinding (only when the plugin needs the API), Role and RoleBinding in ``default`` (only with
named configurations), ConfigMap (the plugin's config file), DaemonSet. RBAC follows what the plugin calls
(src/gpufleet/deviceplugin/labels.py, gpumem/resolver.py, nodeconfig.py):

The plugin's configuration is read by the plugin's own loader (``module_utils/deviceplugin/config.py``, a
link to the package's file): the module checks with it the exact file it deploys, and asks the Config what
each configuration advertises and calls.

- node labels/annotation (``labels.enabled``, the default): nodes get, patch;
- GPU-memory sharing (``sharing.mode: memory``, in the file or in any named configuration) also: pods list,
  watch (the hand-off's watch of the node's pods, docs/handoff.md), get (the telemetry's pod assignments),
  patch (``allocated``);
- named configurations (``configs``): nodes list, watch (the plugin watches its own Node for the label) and
  events create in ``default`` (its refusal and switch events, where the kubelet records a node's events);
- none of these: no role at all and no service account token in the pod.

With named configurations the node label picks each node's configuration: ``node_configs`` sets it
(k8s_nodelabels), and the capacity wait expects on each node what the configuration its label picks serves.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import posixpath
import re
import reprlib
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.deviceplugin.api.constants import (
    DEFAULT_SOCKET_DIR as SOCKET_DIR,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_apply import (
    ApplyResult,
    apply,
    delete,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import RESOURCES, Kube, KubeError
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_module import (
    WORKLOAD_ARGS,
    checked_config,
    config_text,
    node_names_affinity,
    required_image,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_nodelabels import label_nodes
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_wait import (
    POLL_SECONDS,
    WaitTimeout,
    log_tail,
    pod_problem,
    reports_resource,
    resource_count,
    selector_string,
    wait_node_resources,
    wait_rollout,
    why_not_on_node,
)

if TYPE_CHECKING:  # the loader is imported when used: it needs PyYAML, which the module checks for first
    from ansible_collections.gpufleet.nvidia.plugins.module_utils.deviceplugin.config import (
        Advertised,
        Config,
    )

CONFIG_KEY = "config.yaml"
CONFIG_DIR = "/etc/gpufleet"
CONFIG_HASH_ANNOTATION = "gpufleet.io/config-sha256"
DEFAULT_TOLERATIONS = [
    {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    {"key": "CriticalAddonsOnly", "operator": "Exists"},
]
DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}}
MAX_EXPECTED_GPUS = 4096  # GPUs on one node; any more is a typo (and multiplies into a device count)
_COUNT_TEXT = re.compile(r"\s*[0-9]{1,9}\s*")  # int() of a long digit string costs quadratic time
# Where the plugin posts its events about named configurations (src/gpufleet/deviceplugin/nodeconfig.py,
# which imports kubernetes and so is not linked here), as the kubelet does a node's.
EVENT_NAMESPACE = "default"
# NODE_NAME while the loader checks the file: the DaemonSet gives each plugin its node's name (downward API).
CHECK_NODE_NAME = "validation"

ARGUMENT_SPEC: dict[str, dict[str, Any]] = {
    "state": {"type": "str", "default": "present", "choices": ["present", "absent"]},
    "mode": {"type": "str", "default": "daemonset", "choices": ["daemonset", "systemd"]},
    "name": {"type": "str", "default": "gpufleet-device-plugin"},
    **WORKLOAD_ARGS,
    # no default: no registry holds a tag of gpufleet's; the role passes the digest reference role
    # gpufleet_images checked (docs/install.md). Required for a DaemonSet (checked where the module runs).
    "image": {"type": "str"},
    "command": {"type": "list", "elements": "str"},
    "plugin_config": {"type": "dict", "default": {}},
    "node_selector": {"type": "dict", "default": {}},
    "tolerations": {"type": "list", "elements": "dict"},
    "priority_class_name": {"type": "str", "default": "system-node-critical"},
    "runtime_class_name": {"type": "str", "default": ""},
    "runtime_class": {
        "type": "dict",
        "options": {
            "name": {"type": "str", "default": "nvidia"},
            "handler": {"type": "str", "default": "nvidia"},
            "node_selector": {"type": "dict", "default": {}},
        },
    },
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
    "node_configs": {"type": "dict", "default": {}},
    "wait": {"type": "bool", "default": True},
    "wait_timeout": {"type": "int", "default": 300},
}


class ParameterError(ValueError):
    """The parameters contradict each other or the plugin's configuration is invalid."""


def plugin_config(params: Mapping[str, Any]) -> dict[str, Any]:
    """The plugin's config file: the module's ``plugin_config`` plus what the deployment pins."""
    cfg = copy.deepcopy(dict(params["plugin_config"] or {}))
    version = cfg.setdefault("version", "v1")
    if version != "v1":
        raise ParameterError(f"plugin_config.version: gpufleet's device plugin reads v1, got {version!r}")
    for pinned in ("socket_dir", "node_name"):
        if pinned in cfg:
            raise ParameterError(f"plugin_config.{pinned} is set by the deployment; remove it")
    if params["mode"] == "daemonset":
        cfg["host_root"] = params["host_root"]
    return cfg


def load_config(doc: Mapping[str, Any]) -> Config:
    """The Config the plugin starts with from the file the module deploys for ``doc`` (plugin_config()), as
    the plugin's own loader reads it: every named configuration merged and checked. ParameterError naming
    each problem, before anything is written."""
    from ansible_collections.gpufleet.nvidia.plugins.module_utils.deviceplugin import config as dpconfig

    def load(text: str) -> Config:
        return dpconfig.from_text(text, "plugin_config", {"NODE_NAME": CHECK_NODE_NAME})

    return checked_config(doc, load, dpconfig.ConfigError, ParameterError, "plugin_config is invalid")


def _count(value: Any, what: str, lo: int, hi: int) -> int:
    """An integer in [lo, hi] given as a number or its digits; ParameterError naming ``what`` otherwise."""
    if (isinstance(value, str) and _COUNT_TEXT.fullmatch(value)) or (
        isinstance(value, float) and value.is_integer()
    ):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ParameterError(f"{what}: expected an integer from {lo} to {hi}, got {reprlib.repr(value)}")
    return value


def served(cfg: Config) -> list[Config]:
    """The configurations a node may serve: each named one, else the file's."""
    return list(cfg.named.values()) or [cfg]


def pick(cfg: Config, node: Mapping[str, Any] | None) -> tuple[str, str | None]:
    """The named configuration the plugin serves on ``node``, picked by its label as the plugin picks it
    (Config.select), and a warning when the label names an unknown one: the plugin then keeps the one it
    runs (published under Config.running_label with labels enabled), the default at start."""
    from ansible_collections.gpufleet.nvidia.plugins.module_utils.deviceplugin.config import ConfigError

    labels = ((node or {}).get("metadata") or {}).get("labels") or {}
    try:
        return cfg.select(labels.get(cfg.config_label)).config_name, None
    except ConfigError as exc:
        running = labels.get(cfg.running_label) if cfg.labels_enabled else None
        kept = str(running) if running in cfg.named else cfg.config_default
        return kept, f"{exc}; the plugin keeps {kept!r}"


def _labels(name: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": name, "app.kubernetes.io/component": "device-plugin"}


def rbac_rules(cfg: Config) -> list[dict[str, Any]]:
    """The least the plugin needs at cluster scope (empty: it never calls the API). With named
    configurations, any of which a node may switch to, their union, and the watch on its own Node."""
    memory = any(c.sharing_mode == "memory" for c in served(cfg))
    verbs = ["get", "patch"] if cfg.labels_enabled or memory else []
    if cfg.named:
        verbs += ["list", "watch"]
    rules: list[dict[str, Any]] = []
    if verbs:
        rules.append({"apiGroups": [""], "resources": ["nodes"], "verbs": verbs})
    if memory:
        rules.append({"apiGroups": [""], "resources": ["pods"], "verbs": ["list", "watch", "get", "patch"]})
    return rules


def event_rules(cfg: Config) -> list[dict[str, Any]]:
    """What the plugin needs in ``default``: creating its node events, with named configurations only."""
    return [{"apiGroups": [""], "resources": ["events"], "verbs": ["create"]}] if cfg.named else []


def build_objects(
    params: Mapping[str, Any], doc: Mapping[str, Any], cfg: Config
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(objects to apply, objects that must not exist) for DaemonSet mode: ``doc`` is the config file
    (plugin_config()), ``cfg`` what the plugin makes of it (load_config())."""
    name, ns = params["name"], params["namespace"]
    labels = _labels(name)
    text = config_text(doc)
    rules = rbac_rules(cfg)
    subjects = [{"kind": "ServiceAccount", "name": name, "namespace": ns}]
    namespace_obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}
    account: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "automountServiceAccountToken": bool(rules),
    }
    role, binding = _role_and_binding("ClusterRole", {"name": name, "labels": labels}, rules, subjects)
    event_meta = {"name": name, "namespace": EVENT_NAMESPACE, "labels": labels}
    event_role, event_binding = _role_and_binding("Role", event_meta, event_rules(cfg), subjects)
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "data": {CONFIG_KEY: text},
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
                    "annotations": {
                        CONFIG_HASH_ANNOTATION: hashlib.sha256(text.encode()).hexdigest(),
                        **scrape_annotations(cfg),
                    },
                },
                "spec": pod_spec(params, cfg),
            },
        },
    }
    wanted = ([namespace_obj] if params["create_namespace"] else []) + [account]
    unwanted: list[dict[str, Any]] = []
    (wanted if rules else unwanted).extend([role, binding])
    (wanted if cfg.named else unwanted).extend([event_role, event_binding])
    wanted += [configmap, daemonset]
    return wanted, unwanted


def scrape_annotations(cfg: Config) -> dict[str, str]:
    """The annotations a Prometheus scrape config keys on (deploy/prometheus/scrape-config.yaml), where the
    plugin serves /metrics."""
    if not cfg.http_port:
        return {}
    return {"prometheus.io/scrape": "true", "prometheus.io/port": str(cfg.http_port),
            "prometheus.io/path": "/metrics"}  # fmt: skip


def runtime_class_objects(params: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The RuntimeClass of ``runtime_class`` (none when it is not given): GPU pods that name it run with the
    containerd/CRI-O runtime handler of that name, the GPU Operator's way when nvidia is not the default."""
    wanted = params.get("runtime_class")
    if not wanted:
        return []
    obj: dict[str, Any] = {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": wanted["name"], "labels": {"app.kubernetes.io/part-of": "gpufleet"}},
        "handler": wanted["handler"],
    }
    if wanted.get("node_selector"):
        obj["scheduling"] = {"nodeSelector": {str(k): str(v) for k, v in wanted["node_selector"].items()}}
    return [obj]


def _role_and_binding(
    kind: str, meta: Mapping[str, Any], rules: list[dict[str, Any]], subjects: list[dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A ClusterRole or Role with ``rules`` and its binding to ``subjects``, both with ``meta``."""
    api = "rbac.authorization.k8s.io"
    role = {"apiVersion": f"{api}/v1", "kind": kind, "metadata": dict(meta), "rules": rules}
    binding = {
        "apiVersion": f"{api}/v1",
        "kind": f"{kind}Binding",
        "metadata": dict(meta),
        "roleRef": {"apiGroup": api, "kind": kind, "name": meta["name"]},
        "subjects": subjects,
    }
    return role, binding


def pod_spec(params: Mapping[str, Any], cfg: Config) -> dict[str, Any]:
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
    pod_resources_dir = posixpath.dirname(cfg.pod_resources_in_use) if cfg.pod_resources_in_use else ""
    if pod_resources_dir:
        # Read-only, as dcgm-exporter's chart mounts it: connect() on a unix socket works through a read-only
        # bind mount (checked on this machine's kernel). The kubelet creates the directory.
        mounts.append({"name": "pod-resources", "mountPath": pod_resources_dir, "readOnly": True})
        volumes.append({"name": "pod-resources", "hostPath": {"path": pod_resources_dir}})
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
        "image": required_image(params, "device plugin DaemonSet", ParameterError),
        "imagePullPolicy": params["image_pull_policy"],
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_KEY}"],
        "env": env,
        "resources": params["resources"] or DEFAULT_RESOURCES,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": mounts,
    }
    if params["command"]:
        container["command"] = list(params["command"])
    if cfg.http_port:
        container["ports"] = [{"name": "metrics", "containerPort": cfg.http_port}]
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
    if params.get("runtime_class_name"):
        spec["runtimeClassName"] = params["runtime_class_name"]
    if params["node_selector"]:
        spec["nodeSelector"] = {str(k): str(v) for k, v in params["node_selector"].items()}
    if params.get("node_names"):
        spec["affinity"] = node_names_affinity(params["node_names"])
    if params["host_network"]:
        spec["hostNetwork"] = True
        spec["dnsPolicy"] = "ClusterFirstWithHostNet"
    return spec


def gpu_counts(params: Mapping[str, Any]) -> dict[str, int]:
    """{node: GPUs} from ``expected_gpus``, checked."""
    return {
        str(node): _count(gpus, f"expected_gpus.{node}", 0, MAX_EXPECTED_GPUS)
        for node, gpus in (params["expected_gpus"] or {}).items()
    }


def devices(gpus: int | None, advertised: Advertised) -> int | None:
    """The count a node with ``gpus`` GPUs advertises (Config.advertised(); None: any positive count)."""
    return None if gpus is None or advertised.per_gpu is None else gpus * advertised.per_gpu


def expected_counts(params: Mapping[str, Any], advertised: Advertised) -> dict[str, int | None]:
    """{node: expected count of the advertised resource} from ``expected_gpus`` (None: any positive)."""
    return {node: devices(gpus, advertised) for node, gpus in gpu_counts(params).items()}


# -- the node label that picks a named configuration ------------------------------------------------
def node_config_names(params: Mapping[str, Any], cfg: Config) -> dict[str, str | None]:
    """``node_configs`` checked against the named configurations: {node: name, or None for no label}."""
    out: dict[str, str | None] = {}
    for node, name in (params["node_configs"] or {}).items():
        if name is None or name == "":
            out[str(node)] = None
        elif not cfg.named:
            raise ParameterError(
                f"node_configs.{node}: {reprlib.repr(name)} names a configuration, "
                "but plugin_config has no named configurations (configs)"
            )
        elif str(name) not in cfg.named:
            raise ParameterError(
                f"node_configs.{node}: unknown device plugin configuration {reprlib.repr(name)}; "
                f"known: {', '.join(sorted(cfg.named))}"
            )
        else:
            out[str(node)] = str(name)
    return out


class CapacityExplainer:
    """Turns a node that lacks the plugin's resource into a reason: no pod, pod failing, not registered,
    fewer devices than expected, unhealthy devices (with the plugin's last log lines). ``target`` says what
    a node should report: (resource, count or None for any positive count)."""

    def __init__(
        self,
        kube: Kube,
        params: Mapping[str, Any],
        daemonset: dict[str, Any] | None,
        target: Callable[[str, dict[str, Any] | None], tuple[str, int | None]],
    ):
        self.kube, self.params, self.daemonset, self.target = kube, params, daemonset, target

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
        res, want = self.target(node_name, node)
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
        if capacity is None:
            return f"plugin not registered with the kubelet: the node reports no {res}" + self._log(pod)
        if capacity == 0:
            return f"plugin registered but advertises no {res} (NVML found no GPU?)" + self._log(pod)
        if want is not None and capacity != want:
            return f"advertises {capacity} {res}, expected {want}" + self._log(pod)
        if allocatable == 0:
            # The kubelet keeps a stopped plugin's capacity with allocatable 0 for its grace period.
            return (
                f"no {res} allocatable (capacity {capacity}): the plugin is not running or not registered, "
                "or every device is unhealthy" + self._log(pod)
            )
        if allocatable is not None and allocatable < capacity:
            return f"{capacity - allocatable} of {capacity} {res} devices unhealthy" + self._log(pod)
        return f"capacity {capacity}, allocatable {allocatable} (still settling)"


def reconcile(kube: Kube, params: Mapping[str, Any], check_mode: bool) -> ApplyResult:
    """State present: label the nodes of ``node_configs``, then apply the DaemonSet-mode objects, all of it
    checked before the first write. State absent: delete the objects, then the labels this module set on
    those nodes.

    In systemd mode only the node labels are the module's: the node-side install is the role's job.
    """
    doc = plugin_config(params)
    cfg = load_config(doc)
    label = cfg.config_label if cfg.named else None
    daemonset = params["mode"] == "daemonset"
    wanted, unwanted = build_objects(params, doc, cfg) if daemonset else ([], [])
    wanted = runtime_class_objects(params) + wanted  # before the pods that may name it
    if params["state"] == "absent":
        timeout = params["wait_timeout"] if params["wait"] else 0
        removed = delete(kube, wanted + unwanted, check_mode=check_mode, wait_timeout=timeout)
        ours = dict.fromkeys(map(str, params["node_configs"] or {}))  # every label this module set goes
        removed.changes += label_nodes(kube, ours, label, check_mode).changes
        return removed
    picks = node_config_names(params, cfg)
    # Labels first: a new plugin pod finds its node's label at start, not at some later moment.
    result = label_nodes(kube, picks, label, check_mode)
    try:
        applied = apply(kube, wanted, check_mode=check_mode)
    except KubeError as exc:
        if exc.partial is not None:
            exc.partial.changes[:0] = result.changes
        raise
    pruned = delete(kube, unwanted, check_mode=check_mode)
    result.changes += applied.changes + [c for c in pruned.changes if c.action != "absent"]
    return result


def wait_ready(kube: Kube, params: Mapping[str, Any]) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Rollout done (DaemonSet mode) and every target node reports the expected capacity and allocatable;
    (per node what it reports, warnings). With named configurations each node is expected to serve what
    the configuration its label picks serves."""
    cfg = load_config(plugin_config(params))
    daemonset = None
    if params["mode"] == "daemonset":
        daemonset = wait_rollout(
            kube, "DaemonSet", params["name"], params["namespace"], params["wait_timeout"]
        )
    gpus: dict[str, int | None] = dict(gpu_counts(params))
    if not gpus:
        gpus = dict.fromkeys(_nodes_running_the_plugin(kube, params, daemonset))
    if not cfg.named:
        advertised = cfg.advertised()
        expected = {node: devices(count, advertised) for node, count in gpus.items()}
        explain = CapacityExplainer(kube, params, daemonset, lambda n, _: (advertised.resource, expected[n]))
        return wait_node_resources(kube, advertised.resource, expected, params["wait_timeout"], explain), []

    def target(node_name: str, node: dict[str, Any] | None) -> tuple[str, int | None]:
        picked = cfg.named[pick(cfg, node)[0]].advertised()
        return picked.resource, devices(gpus[node_name], picked)

    explain = CapacityExplainer(kube, params, daemonset, target)
    return wait_named_resources(kube, cfg, gpus, params["wait_timeout"], explain)


def wait_named_resources(
    kube: Kube,
    cfg: Config,
    gpus: Mapping[str, int | None],
    timeout: float,
    explain: CapacityExplainer,
) -> tuple[dict[str, dict[str, Any]], list[str]]:
    """Wait until each node of ``gpus`` reports, in capacity and allocatable, what the configuration its
    label picks serves (read again at every poll, as the plugin follows the label); WaitTimeout naming each
    node that falls short, its configuration and why. Unknown names in labels come back as warnings."""
    deadline = time.monotonic() + timeout
    while True:
        seen = {n: kube.get(RESOURCES["Node"], n) for n in gpus}
        picked = {n: pick(cfg, node) for n, node in seen.items()}
        wanted = {n: cfg.named[picked[n][0]].advertised() for n in gpus}
        short = [
            n for n in gpus if not reports_resource(seen[n], wanted[n].resource, devices(gpus[n], wanted[n]))
        ]
        left = deadline - time.monotonic()
        if not short or left <= 0:
            break
        time.sleep(min(2 * POLL_SECONDS, left))
    warnings = [f"node {n}: {picked[n][1]}" for n in sorted(picked) if picked[n][1]]
    if short:
        reasons = [f"{n} (configuration {picked[n][0]}): {explain(n, seen[n])}" for n in sorted(short)]
        raise WaitTimeout(
            f"{len(short)} of {len(gpus)} node(s) do not report what their device plugin configuration "
            f"serves after {timeout:.0f}s: " + "; ".join(reasons + warnings)
        )
    return {
        n: {
            "config": picked[n][0],
            "resource": wanted[n].resource,
            "capacity": resource_count(node or {}, "capacity", wanted[n].resource),
            "allocatable": resource_count(node or {}, "allocatable", wanted[n].resource),
        }
        for n, node in seen.items()
    }, warnings


def _nodes_running_the_plugin(
    kube: Kube, params: Mapping[str, Any], daemonset: dict[str, Any] | None
) -> list[str]:
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
    return nodes
