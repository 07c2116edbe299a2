# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""The gpu_scheduler_extender module's scheduler part: the KubeSchedulerConfiguration file and the
kube-scheduler static pod manifest of a kubeadm control-plane node.

The configuration comes from the extender's own generator (``gpufleet.extender.schedconfig``, linked into
this collection's module_utils), on Python 3.11 or later; or it is handed over as text
(``scheduler_config_content``, e.g. the ``scheduler_config`` an earlier run on the controller returned).

The manifest is merged as YAML, never rewritten from a template: in the ``kube-scheduler`` container
``--config=<file>`` is set, a volumeMount and hostPath volume (``gpufleet-scheduler-config``) carry the
file, one more pair (``gpufleet-scheduler-<role>``) carries each file the configuration names that the pod
does not mount yet (extender TLS files), flags the configuration supersedes are taken out (and remembered
in an annotation), and the annotation ``gpufleet.io/scheduler-config-sha256`` records the file's hash, so
that new file content also restarts the static pod (the kubelet recreates a static pod only when its
manifest changes). Everything else stays as it was, also what another tool changed. ``state: absent``
removes exactly those things and puts the flags back. Backups go to a directory outside the manifests
directory: the kubelet would run any file it finds there as another static pod.

Before anything is written the configuration can be checked by the kube-scheduler of the static pod's own
image (:func:`validate_with_image`); after the change the restarted scheduler is waited for, and a
scheduler that exits on the configuration is recognised from its container log (:func:`crashed_scheduler`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ansible.module_utils.urls import open_url

# Every volume (and mount) gpufleet adds to the static pod is named with this prefix: the configuration's,
# and one per file the configuration names that the pod does not mount yet (TLS files, kubeconfig).
FILE_VOLUME_PREFIX = "gpufleet-scheduler-"
VOLUME_NAME = "gpufleet-scheduler-config"
HASH_ANNOTATION = "gpufleet.io/scheduler-config-sha256"
# The flags gpufleet took out because the configuration supersedes them, as JSON [[index, token], ...]
# (index in the manifest's argv without gpufleet's changes): state absent puts them back there.
REMOVED_FLAGS_ANNOTATION = "gpufleet.io/scheduler-removed-flags"
# kube-scheduler's leader election flags (k8s.io/component-base/config/options, BindLeaderElectionFlags)
# and the KubeSchedulerConfiguration field each overrides when --config is set.
LEADER_ELECTION_FLAGS = {
    "--leader-elect": "leaderElect",
    "--leader-elect-lease-duration": "leaseDuration",
    "--leader-elect-renew-deadline": "renewDeadline",
    "--leader-elect-retry-period": "retryPeriod",
    "--leader-elect-resource-lock": "resourceLock",
    "--leader-elect-resource-name": "resourceName",
    "--leader-elect-resource-namespace": "resourceNamespace",
}
# Flags that take a value and may be written as two tokens (``--kubeconfig /etc/...``).
SPLIT_VALUE_FLAGS = {"--config", "--kubeconfig"} | (set(LEADER_ELECTION_FLAGS) - {"--leader-elect"})
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
def config_document(text: str) -> dict[str, Any]:
    """The parsed KubeSchedulerConfiguration; SchedulerError when ``text`` is not one."""
    import yaml

    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SchedulerError(f"the scheduler configuration is not YAML: {exc}") from None
    if not isinstance(doc, dict) or doc.get("kind") != "KubeSchedulerConfiguration":
        found = doc.get("kind") if isinstance(doc, dict) else type(doc).__name__
        raise SchedulerError(
            f"the scheduler configuration is not a KubeSchedulerConfiguration (kind {found!r})"
        )
    return doc


def config_files(config: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(volume name, path) of every file the configuration makes kube-scheduler read besides itself:
    ``clientConnection.kubeconfig`` and each extender's ``tlsConfig`` caFile, certFile and keyFile. A path
    named twice is listed once."""
    found: list[tuple[str, str]] = []
    seen: set[str] = set()

    def add(role: str, path: Any) -> None:
        if isinstance(path, str) and path and path not in seen:
            seen.add(path)
            found.append((f"{FILE_VOLUME_PREFIX}{role}", path))

    add("kubeconfig", (config.get("clientConnection") or {}).get("kubeconfig"))
    for index, extender in enumerate(config.get("extenders") or []):
        tls = (extender or {}).get("tlsConfig") or {}
        suffix = f"-{index}" if index else ""
        for key, role in (("caFile", "ca"), ("certFile", "cert"), ("keyFile", "key")):
            add(f"{role}{suffix}", tls.get(key))
    for _name, path in found:
        if not path.startswith("/"):
            raise SchedulerError(f"the scheduler configuration names {path!r}: expected an absolute path")
    return found


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


def _flags(argv: list[str]) -> list[tuple[int, int, str, str | None]]:
    """Each flag of ``argv`` as (first index, token count, name, value): ``--name=value``, ``--name value``
    for the string flags kube-scheduler's --config supersedes, or a bare ``--name`` (value None)."""
    found: list[tuple[int, int, str, str | None]] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--"):
            i += 1
            continue
        name, sep, value = arg.partition("=")
        if sep:
            found.append((i, 1, name, value))
        elif name in SPLIT_VALUE_FLAGS and i + 1 < len(argv) and not argv[i + 1].startswith("-"):
            found.append((i, 2, name, argv[i + 1]))
            i += 1
        else:
            found.append((i, 1, name, None))
        i += 1
    return found


def _same(flag_value: str | None, config_value: Any) -> bool:
    if isinstance(config_value, bool):
        return (flag_value is None or flag_value.lower() == "true") == config_value
    return flag_value == str(config_value)


def superseded_flags(argv: list[str], config: Mapping[str, Any]) -> list[tuple[int, int, str]]:
    """The flags of ``argv`` that contradict ``config`` once ``--config`` is set, as (index, token count,
    why). kube-scheduler 1.37 then ignores ``--kubeconfig`` (it reads ``clientConnection.kubeconfig``) and
    lets the leader election flags override ``leaderElection`` (cmd/kube-scheduler/app/options, ApplyTo):
    a ``--kubeconfig`` naming another file than the configuration, and a leader election flag whose value
    differs from what the configuration sets, would make the manifest say one thing and the scheduler do
    another. Raises SchedulerError when the manifest's ``--kubeconfig`` would silently stop applying."""
    client = (config.get("clientConnection") or {}).get("kubeconfig") or ""
    election = config.get("leaderElection") or {}
    conflicts = []
    for index, count, name, value in _flags(argv):
        if name == "--kubeconfig":
            if not client:
                raise SchedulerError(
                    f"the scheduler configuration has no clientConnection.kubeconfig, and with --config "
                    f"kube-scheduler ignores the manifest's --kubeconfig={value}: set "
                    f"scheduler_config.kubeconfig to {value}"
                )
            if value != client:
                conflicts.append((index, count, f"--kubeconfig={value}: the configuration reads {client}"))
        elif name in LEADER_ELECTION_FLAGS:
            field = LEADER_ELECTION_FLAGS[name]
            if field in election and not _same(value, election[field]):
                conflicts.append(
                    (index, count, f"{name}={value}: overrides leaderElection.{field}: {election[field]}")
                )
    return conflicts


def _config_flag_index(argv: list[str]) -> tuple[int, int, str] | None:
    """(index, token count, path) of the ``--config`` flag, if any."""
    for index, count, name, value in _flags(argv):
        if name == CONFIG_FLAG:
            path = value if value is not None else (argv[index + 1] if index + 1 < len(argv) else "")
            return index, 2 if value is None and index + 1 < len(argv) else count, path
    return None


def _ours(name: str) -> bool:
    return str(name).startswith(FILE_VOLUME_PREFIX)


def _host_path(spec: Mapping[str, Any], name: str) -> str | None:
    for volume in spec.get("volumes") or []:
        if volume.get("name") == name:
            return (volume.get("hostPath") or {}).get("path")
    return None


def _restore(argv: list[str], removed: list[list[Any]]) -> list[str]:
    """``argv`` with the flags gpufleet took out (``[index in the full argv, token]``) back in place."""
    out = list(argv)
    for position, token in sorted((int(p), str(t)) for p, t in removed):
        out.insert(min(position, len(out)), token)
    return out


def with_config(
    manifest: Mapping[str, Any],
    path: str,
    config_hash: str,
    *,
    config: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest with the scheduler pointed at ``path`` (idempotent): ``--config=<path>``, a hostPath
    volume and mount for the file and, given the parsed ``config``, for each file it names that no mount of
    the pod already provides (:func:`config_files`), the flags it supersedes taken out and remembered in an
    annotation (:func:`superseded_flags`), and the content's hash as an annotation. Everything else stays:
    another tool's flags, volumes and annotations are kept."""
    out = copy.deepcopy(dict(manifest))
    container = _container(out)
    key, argv = _argv(container)
    spec = out.setdefault("spec", {})
    metadata = out.setdefault("metadata", {})
    annotations = dict(metadata.get("annotations") or {})
    found = _config_flag_index(argv)
    if found is not None:
        index, count, current = found
        if current != path and _host_path(spec, VOLUME_NAME) != current:
            raise SchedulerError(
                f"kube-scheduler already runs with --config={current}, which gpufleet did not write: merge "
                f"the extender into that configuration and pass it as scheduler_config_content with "
                f"scheduler_config_file {current}, or remove the flag first"
            )
        del argv[index : index + count]
    removed: list[list[Any]] = json.loads(annotations.get(REMOVED_FLAGS_ANNOTATION) or "[]")
    if config is not None:
        # decide on the manifest as it was before gpufleet (plus whatever others changed since)
        argv = _restore(argv, removed)
        drop = {i + k for i, count, _why in superseded_flags(argv, config) for k in range(count)}
        removed = [[i, argv[i]] for i in sorted(drop)]
        argv = [arg for i, arg in enumerate(argv) if i not in drop]
    argv.append(f"{CONFIG_FLAG}={path}")
    container[key] = argv
    files = [(VOLUME_NAME, path)] + (config_files(config) if config is not None else [])
    mounts = [m for m in container.get("volumeMounts") or [] if not _ours(m.get("name", ""))]
    volumes = [v for v in spec.get("volumes") or [] if not _ours(v.get("name", ""))]
    for name, file in files:
        if name != VOLUME_NAME and _provided(file, mounts, volumes):
            continue
        mounts.append({"mountPath": file, "name": name, "readOnly": True})
        volumes.append({"hostPath": {"path": file, "type": "File"}, "name": name})
    container["volumeMounts"] = mounts
    spec["volumes"] = volumes
    annotations[HASH_ANNOTATION] = config_hash
    annotations.pop(REMOVED_FLAGS_ANNOTATION, None)
    if removed:
        annotations[REMOVED_FLAGS_ANNOTATION] = json.dumps(removed, separators=(",", ":"))
    metadata["annotations"] = annotations
    return out


def _provided(path: str, mounts: list[dict[str, Any]], volumes: list[dict[str, Any]]) -> bool:
    """Whether a mount of the pod already shows the host's ``path`` at ``path``; SchedulerError when one
    shows something else there."""
    by_name = {v.get("name"): v for v in volumes}
    for mount in mounts:
        target = str(mount.get("mountPath", "")).rstrip("/")
        if path != target and not path.startswith(target + "/"):
            continue
        source = (by_name.get(mount.get("name")) or {}).get("hostPath", {}).get("path")
        if source is not None and source.rstrip("/") == target:
            return True
        raise SchedulerError(
            f"{path} is inside the kube-scheduler pod's mount {mount.get('name')} at {target}, which shows "
            f"{source or 'no host path'} there: the scheduler would not read this host's {path}"
        )
    return False


def without_config(manifest: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The manifest with gpufleet's flag, volumes, mounts and annotations removed and the flags it took out
    put back where they were (idempotent)."""
    out = copy.deepcopy(dict(manifest))
    container = _container(out)
    key, argv = _argv(container)
    found = _config_flag_index(argv)
    if found is not None and found[2] == path:
        del argv[found[0] : found[0] + found[1]]
    metadata = out.get("metadata") or {}
    annotations = metadata.get("annotations")
    if isinstance(annotations, dict):
        argv = _restore(argv, json.loads(annotations.get(REMOVED_FLAGS_ANNOTATION) or "[]"))
    container[key] = argv
    mounts = [m for m in container.get("volumeMounts") or [] if not _ours(m.get("name", ""))]
    if mounts or "volumeMounts" in container:
        container["volumeMounts"] = mounts
    spec = out.get("spec") or {}
    if "volumes" in spec:
        spec["volumes"] = [v for v in spec["volumes"] if not _ours(v.get("name", ""))]
    if isinstance(annotations, dict):
        annotations.pop(HASH_ANNOTATION, None)
        annotations.pop(REMOVED_FLAGS_ANNOTATION, None)
        if not annotations:
            out["metadata"].pop("annotations")
    return out


def configured_path(manifest: Mapping[str, Any]) -> str | None:
    """The configuration file gpufleet pointed the manifest at (its volume's host path), or None."""
    return _host_path(manifest.get("spec") or {}, VOLUME_NAME)


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


def original_text(doc: Mapping[str, Any], backup_dir: str, basename: str, limit: int = 50) -> str | None:
    """The text of the newest backup of ``basename`` in ``backup_dir`` that parses to ``doc``: what to write
    back byte for byte when state absent leaves the manifest as it was before gpufleet (its YAML would
    otherwise be re-dumped). None when no backup matches (the manifest changed since)."""
    import yaml

    try:
        names = sorted((n for n in os.listdir(backup_dir) if n.startswith(basename + ".")), reverse=True)
    except OSError:
        return None
    for name in names[:limit]:
        try:
            with open(os.path.join(backup_dir, name), encoding="utf-8") as fh:
                text = fh.read()
            if yaml.safe_load(text) == doc:
                return text
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue
    return None


# -- checking the configuration with the static pod's own kube-scheduler ---------------------------
# Where the kube-scheduler image keeps its binary: the distroless images' PATH (registry.k8s.io images put
# it in /usr/local/bin), searched in the mounted root filesystem.
IMAGE_PATH = ("/usr/local/bin", "/usr/local/sbin", "/usr/bin", "/usr/sbin", "/bin", "/sbin")
# containerd's namespace for CRI's images.
CRI_NAMESPACE = "k8s.io"


@dataclass
class Validation:
    """What :func:`validate_with_image` did: ``ran`` false with ``reason`` when it could not check."""

    ran: bool
    reason: str = ""
    image: str = ""


def _klog_errors(text: str, lines: int = 6) -> str:
    """The error lines of kube-scheduler's output (klog ``E``/``F`` lines, cobra's ``Error:``), else its
    last lines."""
    said = [line.strip() for line in text.splitlines() if line.strip()]
    errors = [line for line in said if re.match(r"^[EF]\d{4} ", line) or line.startswith("Error:")]
    return "\n".join((errors or said)[-lines:])


def validate_with_image(
    run: Any, manifest: Mapping[str, Any], config_text: str, *, ctr: str = "ctr", timeout: int = 60
) -> Validation:
    """Run the kube-scheduler of the static pod's image, with the manifest's flags and ``config_text`` as
    ``--config``, until it has built the scheduler (configuration decoded strictly, validated, extenders
    built: their TLS files read) and written the result to ``--write-config-to``, where it exits without
    serving or contacting the API server (``--secure-port=0``: the running scheduler keeps its port).

    The image is mounted read-only from containerd's CRI namespace (``ctr images mount``, removed after)
    and its binary runs on this host, where the manifest's hostPath files are at the same paths. ``run``
    is AnsibleModule.run_command. Raises SchedulerError with the scheduler's own error when it refuses the
    configuration; returns ``Validation(ran=False, reason)`` when the check cannot run here (no ctr, the
    image not in containerd)."""
    import shutil
    import tempfile

    container = _container(manifest)
    image = str(container.get("image") or "")
    _key, argv = _argv(container)
    if not image or not argv:
        return Validation(False, "the kube-scheduler container names no image or command", image)
    if shutil.which(ctr) is None:
        return Validation(False, f"{ctr} is not installed (containerd's client)", image)
    work = tempfile.mkdtemp(prefix="gpufleet-scheduler-check-")
    root = os.path.join(work, "rootfs")
    os.mkdir(root)
    mounted = False
    try:
        rc, _out, err = run([ctr, "--namespace", CRI_NAMESPACE, "images", "mount", image, root])
        if rc != 0:
            return Validation(False, f"ctr cannot mount {image}: {(err or _out).strip()[-300:]}", image)
        mounted = True
        program = argv[0]
        candidates = [program] if program.startswith("/") else [os.path.join(d, program) for d in IMAGE_PATH]
        binary = next((root + c for c in candidates if os.access(root + c, os.X_OK)), None)
        if binary is None:
            return Validation(False, f"{image} has no {program} in {', '.join(IMAGE_PATH)}", image)
        config = os.path.join(work, "config.yaml")
        with open(config, "w", encoding="utf-8") as fh:
            fh.write(config_text)
        flags = [a for a in argv[1:] if not (a == CONFIG_FLAG or a.startswith(CONFIG_FLAG + "="))]
        written = os.path.join(work, "effective.yaml")
        command = [
            "timeout", str(timeout), binary, *flags, f"{CONFIG_FLAG}={config}", "--secure-port=0",
            f"--write-config-to={written}",
        ]  # fmt: skip
        rc, out, err = run(command)
        if rc == 124:
            return Validation(False, f"{image}'s kube-scheduler did not finish within {timeout}s", image)
        if rc != 0 or not os.path.exists(written):
            said = _klog_errors((err or "") + "\n" + (out or "")).replace(config, "<the configuration>")
            raise SchedulerError(
                f"kube-scheduler ({image}) refuses the configuration (exit {rc}); nothing was changed:\n"
                f"{said}"
            )
        return Validation(True, "", image)
    finally:
        if mounted:
            run([ctr, "--namespace", CRI_NAMESPACE, "images", "unmount", "--rm", root])
        shutil.rmtree(work, ignore_errors=True)


# -- a scheduler that exits on its configuration ----------------------------------------------------
POD_LOGS = "/var/log/pods"


class SchedulerRejected(SchedulerError):
    """The restarted kube-scheduler exited (and was restarted by the kubelet); ``log`` is what it said."""

    def __init__(self, message: str, log: str) -> None:
        super().__init__(message)
        self.log = log


def _cri_log(path: str) -> tuple[float | None, str]:
    """(time of the first line, text) of a container log in the CRI format the kubelet keeps
    (``<RFC 3339 time> <stream> <P|F> <text>`` per line)."""
    import datetime

    first: float | None = None
    text: list[str] = []
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            for line in fh:
                parts = line.rstrip("\n").split(" ", 3)
                if len(parts) < 4:
                    continue
                if first is None:
                    stamp = re.sub(r"\.(\d{6})\d*", r".\1", parts[0]).replace("Z", "+00:00")
                    with contextlib.suppress(ValueError):
                        first = datetime.datetime.fromisoformat(stamp).timestamp()
                text.append(parts[3])
    except OSError:
        return None, ""
    return first, "\n".join(text)


def crashed_scheduler(since: float, log_root: str = POD_LOGS) -> str | None:
    """What a kube-scheduler started after ``since`` said before it exited, once the kubelet has restarted
    it (a second run's log exists), or None. The kubelet keeps each run of a container as
    ``<log_root>/<namespace>_<pod>_<uid>/<container>/<restart count>.log``; a new manifest is a new static
    pod (a new uid), so its first run is the one whose log starts after ``since``."""
    import glob

    for directory in glob.glob(os.path.join(log_root, f"kube-system_{CONTAINER}-*", CONTAINER)):
        runs = sorted(
            (int(name[:-4]), name)
            for name in os.listdir(directory)
            if name.endswith(".log") and name[:-4].isdigit()
        )
        if len(runs) < 2:
            continue
        started, text = _cri_log(os.path.join(directory, runs[0][1]))
        if started is not None and started >= since - 1:
            return _klog_errors(text)
    return None


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
    config_path: str,
    *,
    present: bool,
    since: float,
    healthz_url: str,
    timeout: float,
    proc: str = "/proc",
    log_root: str | None = POD_LOGS,
) -> SchedulerProcess:
    """Wait until the kubelet has restarted kube-scheduler after ``since``: a process started after it whose
    argv has (``present``) or lacks ``--config=<config_path>``, and ``healthz_url`` answers 200.

    Raises SchedulerRejected as soon as a kube-scheduler started after ``since`` has exited and been
    restarted (:func:`crashed_scheduler` on ``log_root``), SchedulerError at the timeout."""
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
        said = crashed_scheduler(since, log_root) if log_root else None
        if said is not None:
            message = (
                "kube-scheduler exited after the manifest change and the kubelet restarted it; it said:\n"
            )
            raise SchedulerRejected(message + said, said)
        if time.monotonic() > deadline:
            break
        time.sleep(1)
    what = f"with --config={config_path}" if present else "without gpufleet's --config"
    running = ", ".join(f"pid {p.pid} started {time.ctime(p.started)}" for p in seen) or "none running"
    raise SchedulerError(
        f"kube-scheduler did not come back {what} and healthy ({healthz_url}) within {timeout:.0f}s of the "
        f"manifest change ({running}); check the kubelet's log and the static pod's container log"
    )
