# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""The gpu_scheduler_extender module's scheduler part: the KubeSchedulerConfiguration file and the
kube-scheduler static pod manifest of a kubeadm control-plane node.

The configuration comes from the extender's own generator (``gpufleet.extender.schedconfig``, linked into
this collection's module_utils), on Python 3.11 or later; or it is handed over as text
(``scheduler_config_content``, e.g. the ``scheduler_config`` an earlier run on the controller returned).

The manifest is changed surgically: in the ``kube-scheduler`` container only ``--config=<file>`` is set,
one volumeMount and one hostPath volume (both named ``gpufleet-scheduler-config``) are added, and the
annotation ``gpufleet.io/scheduler-config-sha256`` records the file's hash, so that new file content also
restarts the static pod (the kubelet recreates a static pod only when its manifest changes). Everything
else stays as it was. ``state: absent`` removes exactly those four things. Backups go to a directory
outside the manifests directory: the kubelet would run any file it finds there as another static pod.
"""

from __future__ import annotations

import copy
import hashlib
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ansible.module_utils.urls import open_url

VOLUME_NAME = "gpufleet-scheduler-config"
HASH_ANNOTATION = "gpufleet.io/scheduler-config-sha256"
CONTAINER = "kube-scheduler"
CONFIG_FLAG = "--config"

SCHEDULER_ARGS: dict[str, dict[str, Any]] = {
    "url": {"type": "str"},
    "kubeconfig": {"type": "str", "default": "/etc/kubernetes/scheduler.conf"},
    "leader_elect": {"type": "bool", "default": True},
    "weight": {"type": "int", "default": 5},
    "http_timeout": {"type": "str", "default": "10s"},
    "ignorable": {"type": "bool", "default": False},
    "node_cache_capable": {"type": "bool", "default": True},
    "manage_whole_gpus": {"type": "bool", "default": True},
    "ca_file": {"type": "str", "default": ""},
    "cert_file": {"type": "str", "default": ""},
    "key_file": {"type": "str", "default": ""},
    "server_name": {"type": "str", "default": ""},
    "insecure": {"type": "bool", "default": False},
    "healthz_bind_address": {"type": "str", "default": ""},
    "metrics_bind_address": {"type": "str", "default": ""},
}


class SchedulerError(Exception):
    """The scheduler configuration or manifest cannot be produced or changed; the message says why."""


def render_config(api_version: str, url: str, options: Mapping[str, Any]) -> str:
    """The KubeSchedulerConfiguration as YAML, from the extender's own generator (linked, see
    module_utils/extender)."""
    if sys.version_info < (3, 11):  # noqa: UP036 - a target host's Python, not the controller's
        raise SchedulerError(
            "generating the scheduler configuration needs Python 3.11 or later on this host (it has "
            f"{sys.version.split()[0]}): run the module on the controller first and pass its "
            "scheduler_config return value as scheduler_config_content"
        )
    from ansible_collections.gpufleet.nvidia.plugins.module_utils.extender.schedconfig import (
        SchedulerConfigError,
        SchedulerConfigOptions,
        render,
    )

    fields = {k: v for k, v in options.items() if k in SCHEDULER_ARGS and k != "url"}
    try:
        return str(render(SchedulerConfigOptions(url=url, api_version=api_version, **fields)))
    except SchedulerConfigError as exc:
        raise SchedulerError(f"scheduler configuration: {exc}") from None


def content_hash(text: str) -> str:
    """sha256 of the configuration text (what the manifest annotation records)."""
    return hashlib.sha256(text.encode()).hexdigest()


# -- the static pod manifest -----------------------------------------------------------------------
def _container(manifest: Mapping[str, Any]) -> dict[str, Any]:
    containers = ((manifest.get("spec") or {}).get("containers")) or []
    for container in containers:
        if container.get("name") == CONTAINER:
            return container  # type: ignore[no-any-return]
    if len(containers) == 1:
        return containers[0]  # type: ignore[no-any-return]
    raise SchedulerError(f"the manifest has no container named {CONTAINER}")


def _argv(container: Mapping[str, Any]) -> tuple[str, list[str]]:
    """Which list holds the flags (kubeadm: ``command``) and the list."""
    for key in ("command", "args"):
        values = container.get(key)
        if values and any(str(v).startswith("--") for v in values):
            return key, [str(v) for v in values]
    if container.get("command"):
        return "command", [str(v) for v in container["command"]]
    raise SchedulerError("the kube-scheduler container has neither command nor args with flags")


def with_config(manifest: Mapping[str, Any], path: str, config_hash: str) -> dict[str, Any]:
    """The manifest with the scheduler pointed at ``path`` (idempotent)."""
    out = copy.deepcopy(dict(manifest))
    container = _container(out)
    key, argv = _argv(container)
    flag = f"{CONFIG_FLAG}={path}"
    replaced = False
    for i, arg in enumerate(argv):
        if arg == CONFIG_FLAG or arg.startswith(CONFIG_FLAG + "="):
            if arg == CONFIG_FLAG and i + 1 < len(argv):  # "--config PATH" form
                del argv[i + 1]
            argv[i] = flag
            replaced = True
            break
    if not replaced:
        argv.append(flag)
    container[key] = argv
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != VOLUME_NAME]
    mounts.append({"mountPath": path, "name": VOLUME_NAME, "readOnly": True})
    container["volumeMounts"] = mounts
    spec = out.setdefault("spec", {})
    volumes = [v for v in spec.get("volumes") or [] if v.get("name") != VOLUME_NAME]
    volumes.append({"hostPath": {"path": path, "type": "File"}, "name": VOLUME_NAME})
    spec["volumes"] = volumes
    out.setdefault("metadata", {}).setdefault("annotations", {})[HASH_ANNOTATION] = config_hash
    return out


def without_config(manifest: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The manifest with gpufleet's flag, mount, volume and annotation removed (idempotent)."""
    out = copy.deepcopy(dict(manifest))
    container = _container(out)
    key, argv = _argv(container)
    kept: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == f"{CONFIG_FLAG}={path}":
            continue
        if arg == CONFIG_FLAG:
            skip = True
            continue
        kept.append(arg)
    container[key] = kept
    mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != VOLUME_NAME]
    if mounts or "volumeMounts" in container:
        container["volumeMounts"] = mounts
    spec = out.get("spec") or {}
    if "volumes" in spec:
        spec["volumes"] = [v for v in spec["volumes"] if v.get("name") != VOLUME_NAME]
    annotations = (out.get("metadata") or {}).get("annotations")
    if isinstance(annotations, dict):
        annotations.pop(HASH_ANNOTATION, None)
        if not annotations:
            out["metadata"].pop("annotations")
    return out


def load_manifest(path: str) -> tuple[str, dict[str, Any]]:
    """(text, parsed) of a static pod manifest."""
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise SchedulerError(f"cannot read the kube-scheduler manifest {path}: {exc.strerror}") from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SchedulerError(f"{path} is not YAML: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "Pod":
        raise SchedulerError(f"{path} is not a Pod manifest")
    return text, doc


def dump_manifest(doc: Mapping[str, Any]) -> str:
    """YAML in kubeadm's layout (keys in their order, block style)."""
    import yaml

    return str(yaml.safe_dump(dict(doc), sort_keys=False, default_flow_style=False))


# -- waiting for the restarted scheduler -----------------------------------------------------------
@dataclass(frozen=True)
class SchedulerProcess:
    """A running kube-scheduler found in /proc."""

    pid: int
    argv: tuple[str, ...]
    started: float  # unix time


def _boot_time(proc: str) -> float:
    with open(os.path.join(proc, "stat")) as fh:
        for line in fh:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise SchedulerError("no btime in /proc/stat")


def scheduler_processes(proc: str = "/proc") -> list[SchedulerProcess]:
    """Every process whose program is kube-scheduler, with its start time."""
    ticks = os.sysconf("SC_CLK_TCK")
    boot = _boot_time(proc)
    found = []
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(os.path.join(proc, entry, "cmdline"), "rb") as fh:
                argv = tuple(a.decode(errors="replace") for a in fh.read().split(b"\0") if a)
            with open(os.path.join(proc, entry, "stat")) as fh:
                stat = fh.read()
        except OSError:
            continue
        if not argv or os.path.basename(argv[0]) != "kube-scheduler":
            continue
        start_ticks = int(stat.rsplit(")", 1)[1].split()[19])
        found.append(SchedulerProcess(int(entry), argv, boot + start_ticks / ticks))
    return found


def _healthy(url: str) -> bool:
    """GET ``url`` answers 200 (the scheduler's serving certificate is self-signed: not verified)."""
    try:
        reply = open_url(url, validate_certs=False, timeout=3)
        return bool(reply.getcode() == 200)
    except (OSError, ValueError):  # HTTPError and URLError are OSErrors
        return False


def wait_restarted(
    config_path: str, *, present: bool, since: float, healthz_url: str, timeout: float, proc: str = "/proc"
) -> SchedulerProcess:
    """Wait until the kubelet has restarted kube-scheduler after ``since``: a process started after it whose
    argv has (``present``) or lacks ``--config=<config_path>``, and /healthz answers 200."""
    flag = re.compile(rf"^{re.escape(CONFIG_FLAG)}(=|$)")
    deadline = time.monotonic() + timeout
    seen: list[SchedulerProcess] = []
    while True:
        seen = scheduler_processes(proc)
        for candidate in seen:
            has_config = f"{CONFIG_FLAG}={config_path}" in candidate.argv
            other_config = any(flag.match(a) for a in candidate.argv) and not has_config
            fresh = candidate.started >= since - 1 and has_config == present and not other_config
            if fresh and _healthy(healthz_url):
                return candidate
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    what = f"with --config={config_path}" if present else "without gpufleet's --config"
    running = ", ".join(f"pid {p.pid} started {time.ctime(p.started)}" for p in seen) or "none running"
    raise SchedulerError(
        f"kube-scheduler did not come back {what} and healthy ({healthz_url}) within {timeout:.0f}s of the "
        f"manifest change ({running}); check the kubelet's log and the static pod's container log"
    )
