"""Configuration: a versioned YAML file, environment variables and flags, validated at start.

Precedence, highest first: flags > environment > the node's named configuration > file > defaults. Every
setting has one dotted name (`health.probe_interval`); its flag is that name with dots and underscores as
dashes (`--health-probe-interval`) and its variable is `GPUFLEET_DP_` + the name in capitals with dots as
underscores (`GPUFLEET_DP_HEALTH_PROBE_INTERVAL`). Errors name the source and the setting, and all of
them are reported at once.

Named configurations (the file's `configs` section) let one DaemonSet serve a mixed fleet: each name holds
per-node settings (`resource_name`, `sharing.*`, `allocate.*`, `mig.*`) over the file's base, a node
label (`configs.label`, NVIDIA's `nvidia.com/device-plugin.config` by default) picks one per node, and
`configs.default` serves nodes without the label. Every named configuration is validated at start.
"""

from __future__ import annotations

import argparse
import os
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..handoff import GPU_MEM_RESOURCE, LABEL_PREFIX, WHOLE_GPU_RESOURCE
from ..layered import Layer, as_bool, as_str, choice, int_in, merge, seconds
from ..logs import log_event
from ..yamlfile import YamlFileError, parse_yaml, read_yaml
from .api.constants import DEFAULT_SOCKET_DIR, POD_RESOURCES_SOCKET
from .gfd_names import DOMAIN as GFD_DOMAIN
from .gfd_names import MODES as GFD_MODES
from .gfd_names import gfd_profile
from .rm.devices import ResourceKind, ResourceSpec
from .rm.health import DEFAULT_IGNORED_XIDS
from .rm.model import NodeInventory

CONFIG_VERSION = "v1"
ENV_PREFIX = "GPUFLEET_DP_"
CONFIG_ENV = ENV_PREFIX + "CONFIG"

MAX_CONFIG_BYTES = 16 * 1024  # every setting with comments fits in 4 KiB; more is not a config file
MAX_INTERVAL_S = 86_400.0  # a day: longer is a typo, and thread waits overflow on huge timeouts
MAX_LABEL_PREFIX = 253  # a label key's prefix is a DNS subdomain, at most 253 characters
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


# The label that picks a node's named configuration: NVIDIA's, so nodes labelled for NVIDIA's plugin keep it.
DEFAULT_CONFIG_LABEL = "nvidia.com/device-plugin.config"
# Under labels.prefix: the node label where the plugin publishes the named configuration it runs.
CONFIG_LABEL_NAME = "device-plugin.config"
# Settings a named configuration may set: what a node's kind changes. Process-wide settings (sockets, the
# node's name, NVML, health checking, HTTP, logs, API access) stay in the base file, flags and environment:
# a switch keeps the process, its NVML session and every GPU's health.
PER_NODE_PREFIXES = ("resource_name", "sharing.", "allocate.", "mig.")
MIG_STRATEGIES = ("none", "single", "mixed")
MAX_NAMED_CONFIGS = 64
_CONFIG_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?")  # a label value


class ConfigError(Exception):
    """The configuration is invalid; the message lists every problem, one a line."""


class MigLayoutError(Exception):
    """The node's MIG layout does not fit mig.strategy single (NVIDIA's plugin exits on these too)."""


@dataclass(frozen=True)
class MountSpec:
    """A host path mounted into every GPU container (e.g. driver libraries)."""

    host_path: str
    container_path: str
    read_only: bool = True


@dataclass(frozen=True)
class Advertised:
    """What a configuration advertises as far as the configuration alone says, before any GPU is read: the
    resource a node serving it reports, and how many devices each GPU adds to it (None when the GPUs
    decide: one per GiB of memory, or the MIG devices of the node's layout)."""

    resource: str
    per_gpu: int | None


@dataclass(frozen=True)
class Config:
    """The validated configuration; attribute names are the dotted setting names with underscores."""

    node_name: str = ""
    socket_dir: str = DEFAULT_SOCKET_DIR
    host_root: str = "/"
    resource_name: str = WHOLE_GPU_RESOURCE
    nvml_on_init_failure: str = "retry"
    nvml_retry_interval: float = 10.0
    health_enabled: bool = True
    health_ignored_xids: tuple[int, ...] = tuple(sorted(DEFAULT_IGNORED_XIDS))
    health_probe_interval: float = 5.0
    health_probe_timeout: float = 5.0
    allocate_device_id_strategy: str = "uuid"
    allocate_pass_device_specs: bool = True
    allocate_driver_mounts: tuple[MountSpec, ...] = ()
    allocate_cdi_enabled: bool = False
    allocate_cdi_kind: str = "nvidia.com/gpu"
    mig_strategy: str = "none"
    sharing_mode: str = "none"
    sharing_time_slicing_replicas: int = 2
    sharing_time_slicing_rename: str = ""
    sharing_memory_resource_name: str = GPU_MEM_RESOURCE
    sharing_memory_mps: bool = False
    sharing_memory_mps_pipe_dir: str = "/run/nvidia-mps"
    sharing_memory_mps_log_dir: str = "/var/log/nvidia-mps"
    sharing_memory_mps_container_pipe_dir: str = "/tmp/nvidia-mps"
    sharing_memory_mps_container_log_dir: str = "/var/log/nvidia-mps"
    labels_enabled: bool = True
    labels_prefix: str = LABEL_PREFIX
    labels_gfd: str = "auto"
    http_port: int = 0
    http_address: str = "0.0.0.0"
    telemetry_enabled: bool = True
    telemetry_interval: float = 10.0
    telemetry_gpu_timeout: float = 2.0
    telemetry_pod_resources_socket: str = POD_RESOURCES_SOCKET
    log_level: str = "info"
    log_format: str = "kv"
    kubernetes_kubeconfig: str = ""
    source: Mapping[str, str] = field(default_factory=dict, compare=False)  # setting -> where it came from
    # Named configurations (empty: none, the plain single-config plugin). ``config_name`` is the one this
    # Config is; ``named`` holds every one, each already merged and validated, for the node label to pick.
    config_label: str = DEFAULT_CONFIG_LABEL
    config_default: str = ""
    config_name: str = ""
    named: Mapping[str, Config] = field(default_factory=dict, compare=False, repr=False)

    def select(self, name: str | None) -> Config:
        """The named configuration ``name`` (None or empty: the default); ConfigError for an unknown one."""
        if not self.named:
            raise ConfigError("no named configurations (configs.named) in this plugin's configuration")
        wanted = name or self.config_default
        found = self.named.get(wanted)
        if found is None:
            raise ConfigError(
                f"unknown device plugin configuration {reprlib.repr(wanted)} (label {self.config_label}); "
                f"known: {', '.join(sorted(self.named))}"
            )
        return found

    def resources(self, inventory: NodeInventory | None = None) -> list[ResourceSpec]:
        """The resources this configuration advertises on a node with these GPUs (MIG strategies single
        and mixed depend on them; without an inventory, or with strategy none, MIG is not looked at).

        Raises MigLayoutError when strategy single meets a layout it cannot serve."""
        if self.mig_strategy != "none" and inventory is not None:
            return _mig_resources(self.mig_strategy, self.resource_name, inventory)
        if self.sharing_mode == "time-slicing":
            name = self.sharing_time_slicing_rename or self.resource_name
            return [ResourceSpec(name, ResourceKind.REPLICA, self.sharing_time_slicing_replicas)]
        if self.sharing_mode == "memory":
            return [ResourceSpec(self.sharing_memory_resource_name, ResourceKind.MEMORY)]
        return [ResourceSpec(self.resource_name, ResourceKind.GPU)]

    def advertised(self) -> Advertised:
        """The first resource of :meth:`resources` (with MIG strategy single or mixed too: the whole-GPU
        name) and its devices per GPU, without NVML: whole GPUs one, time-slicing its replicas."""
        if self.mig_strategy != "none":
            return Advertised(self.resource_name, None)
        spec = self.resources()[0]
        per_gpu = {ResourceKind.GPU: 1, ResourceKind.REPLICA: spec.replicas}.get(spec.kind)
        return Advertised(spec.name, per_gpu)

    @property
    def pod_resources_in_use(self) -> str:
        """The kubelet's PodResources socket the plugin connects to, "" when none: telemetry's, which runs
        only where /metrics is served (http.port) and telemetry is enabled."""
        return self.telemetry_pod_resources_socket if self.http_port and self.telemetry_enabled else ""

    @property
    def running_label(self) -> str:
        """The node label where the plugin publishes the named configuration it runs (labels.enabled)."""
        return f"{self.labels_prefix}/{CONFIG_LABEL_NAME}"


def mig_resource_name(resource_name: str, profile: str) -> str:
    """`nvidia.com/mig-1g.10gb`: the domain of the whole-GPU resource, `mig-` and the profile (with the
    default resource name, `MIG_RESOURCE_PREFIX` and the profile), spelled as NVIDIA's plugin and GFD do:
    `1g.18gb+me` → `nvidia.com/mig-1g.18gb.me` (a `+` is not allowed in a resource name)."""
    return f"{resource_name.partition('/')[0]}/mig-{gfd_profile(profile)}"


def _mig_resources(strategy: str, resource_name: str, inventory: NodeInventory) -> list[ResourceSpec]:
    enabled = [g for g in inventory.gpus if g.mig_enabled]
    # Both strategies, as NVIDIA's plugin: a GPU in MIG mode without a single MIG device is refused.
    empty = [g.index for g in enabled if not g.mig_devices]
    if empty:
        raise MigLayoutError(
            f"mig.strategy {strategy}: GPU(s) {_ints(empty)} have MIG enabled but no MIG devices"
        )
    if strategy == "mixed":
        profiles = sorted({m.profile for g in enabled for m in g.mig_devices})
        whole = ResourceSpec(resource_name, ResourceKind.GPU, skip_mig=True)
        return [whole] + [
            ResourceSpec(mig_resource_name(resource_name, p), ResourceKind.MIG, mig_profile=p)
            for p in profiles
        ]
    # single, as NVIDIA's plugin: no GPU with MIG enabled -> whole GPUs (strategy none); some enabled and
    # some not, or two profiles -> refused.
    if not enabled:
        log_event("mig_strategy_fallback", strategy=strategy, to="none", reason="no GPU has MIG enabled")
        return [ResourceSpec(resource_name, ResourceKind.GPU)]
    disabled = [g.index for g in inventory.gpus if not g.mig_enabled]
    if disabled:
        raise MigLayoutError(
            f"mig.strategy single: every GPU must have MIG enabled, GPU(s) {_ints(disabled)} have it disabled"
        )
    profiles = sorted({m.profile for g in enabled for m in g.mig_devices})
    if len(profiles) > 1:
        raise MigLayoutError(
            f"mig.strategy single: every MIG device must have one profile, found {', '.join(profiles)} "
            "(use mig.strategy mixed)"
        )
    return [ResourceSpec(resource_name, ResourceKind.MIG)]


def _ints(values: Sequence[int]) -> str:
    return ", ".join(map(str, values))


# ----- parsers: raw value (YAML scalar or string from flag/env) -> typed value, ValueError on bad input --
# The scalar ones are gpufleet.layered's, shared with the extender; these are the device plugin's own.
_interval = seconds(MAX_INTERVAL_S)


def _xids(v: Any) -> tuple[int, ...]:
    items = [p for p in v.replace(" ", ",").split(",") if p] if isinstance(v, str) else v
    if not isinstance(items, list):
        raise ValueError(f"expected a list of XID numbers, got {reprlib.repr(v)}")
    return tuple(sorted({int_in(1, 1 << 16)(x) for x in items}))


def _resource_name(v: Any) -> str:
    name = as_str(v)
    domain, _slash, short = name.partition("/")
    if not domain or not short or "." not in domain or "/" in short:
        raise ValueError(
            f"expected an extended resource name like vendor.example/name, got {reprlib.repr(v)}"
        )
    return name


def _label_prefix(v: Any) -> str:
    prefix = as_str(v)
    if len(prefix) > MAX_LABEL_PREFIX or not _DNS_SUBDOMAIN.fullmatch(prefix):
        raise ValueError(f"expected a DNS subdomain like gpufleet.io, got {reprlib.repr(v)}")
    if prefix == GFD_DOMAIN:
        raise ValueError(
            f"{GFD_DOMAIN} is gpu-feature-discovery's domain, whose labels the plugin writes with "
            "labels.gfd; its own labels need a domain of their own, such as gpufleet.io"
        )
    return prefix


def _abs_path(v: Any) -> str:
    path = as_str(v)
    if not path.startswith("/") or "\0" in path:
        raise ValueError(f"expected an absolute path, got {reprlib.repr(v)}")
    return path


def _optional_abs_path(v: Any) -> str:
    return "" if as_str(v) == "" else _abs_path(v)


def _mounts(v: Any) -> tuple[MountSpec, ...]:
    if not isinstance(v, list):
        raise ValueError("expected a list of {host_path, container_path, read_only}")
    out = []
    for n, item in enumerate(v):
        if (
            not isinstance(item, dict)
            or "host_path" not in item
            or set(item)
            - {
                "host_path",
                "container_path",
                "read_only",
            }
        ):
            raise ValueError(
                f"item {n}: expected keys host_path, container_path (optional), read_only (optional)"
            )
        host = _abs_path(item["host_path"])
        out.append(
            MountSpec(host, _abs_path(item.get("container_path", host)), as_bool(item.get("read_only", True)))
        )
    return tuple(out)


@dataclass(frozen=True)
class Setting:
    """One configurable value: its dotted name, parser, and extra environment names (aliases)."""

    name: str
    parse: Callable[[Any], Any]
    env_aliases: tuple[str, ...] = ()
    flag_ok: bool = True  # structured values are file-only
    help: str = ""

    @property
    def attr(self) -> str:
        return self.name.replace(".", "_")

    @property
    def flag(self) -> str:
        return "--" + self.name.replace(".", "-").replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.replace(".", "_").upper()


SETTINGS: tuple[Setting, ...] = (
    Setting("node_name", as_str, ("NODE_NAME",), help="this node's name (labels, GPU-memory hand-off)"),
    Setting("socket_dir", _abs_path, help="directory holding kubelet.sock and the plugin's socket"),
    Setting("host_root", _abs_path, ("GPUFLEET_HOST_ROOT",), help="where the host's /dev is visible"),
    Setting("resource_name", _resource_name, help="resource for whole GPUs"),
    Setting("nvml.on_init_failure", choice("retry", "fail"), help="NVML unusable at start: retry or exit"),
    Setting("nvml.retry_interval", _interval, help="seconds between NVML retries"),
    Setting("health.enabled", as_bool, help="watch XID/ECC events and probe GPUs"),
    Setting("health.ignored_xids", _xids, help="XIDs that never make a GPU unhealthy (comma-separated)"),
    Setting("health.probe_interval", _interval, help="seconds between lost/recovered probes"),
    Setting("health.probe_timeout", _interval, help="seconds one GPU's probe may take before it is hung"),
    Setting("allocate.device_id_strategy", choice("uuid", "index"), help="NVIDIA_VISIBLE_DEVICES form"),
    Setting("allocate.pass_device_specs", as_bool, help="return /dev/nvidia* device specs"),
    Setting("allocate.driver_mounts", _mounts, flag_ok=False),
    Setting("allocate.cdi.enabled", as_bool, help="return CDI device names"),
    Setting("allocate.cdi.kind", as_str, help="CDI kind, e.g. nvidia.com/gpu"),
    Setting("mig.strategy", choice(*MIG_STRATEGIES), help="MIG devices: none, single or mixed (as NVIDIA's)"),
    Setting("sharing.mode", choice("none", "time-slicing", "memory"), help="how GPUs are advertised"),
    Setting("sharing.time_slicing.replicas", int_in(1, 1024), help="devices per GPU with time-slicing"),
    Setting("sharing.time_slicing.rename", as_str, help="resource name for time-sliced GPUs"),
    Setting("sharing.memory.resource_name", _resource_name, help="GPU-memory resource (GiB units)"),
    Setting("sharing.memory.mps", as_bool, help="enforce GPU-memory shares with MPS"),
    Setting("sharing.memory.mps_pipe_dir", _abs_path, help="host MPS pipe directory"),
    Setting("sharing.memory.mps_log_dir", _abs_path, help="host MPS log directory"),
    Setting("sharing.memory.mps_container_pipe_dir", _abs_path, help="MPS pipe directory in containers"),
    Setting("sharing.memory.mps_container_log_dir", _abs_path, help="MPS log directory in containers"),
    Setting("labels.enabled", as_bool, help="publish node labels and the gpus annotation"),
    Setting("labels.prefix", _label_prefix, help="label domain"),
    Setting("labels.gfd", choice(*GFD_MODES), help="GFD's nvidia.com labels: auto, on, off"),
    Setting("http.port", int_in(0, 65535), help="port for /metrics and /healthz (0: off)"),
    Setting("http.address", as_str, help="address for /metrics and /healthz"),
    Setting("telemetry.enabled", as_bool, help="GPU series (dcgm-exporter's names) on /metrics (http.port)"),
    Setting("telemetry.interval", _interval, help="seconds between two readings of every GPU"),
    Setting("telemetry.gpu_timeout", _interval, help="seconds one GPU's reading may take before it is hung"),
    Setting(
        "telemetry.pod_resources_socket",
        _optional_abs_path,
        help="the kubelet's PodResources socket, for pod labels (empty: none)",
    ),
    Setting("log.level", choice("debug", "info", "warning", "error")),
    Setting("log.format", choice("kv", "json")),
    Setting("kubernetes.kubeconfig", as_str, help="kubeconfig path (empty: in-cluster, then ~/.kube/config)"),
)
_BY_NAME = {s.name: s for s in SETTINGS}
# The mappings that group settings (`health`, `allocate.cdi`): the only ones the file loader descends into,
# so an aliased mapping under an unknown key is reported, never walked.
_SECTIONS = {s.name.rsplit(".", n)[0] for s in SETTINGS for n in range(1, s.name.count(".") + 1)}


def _flatten(doc: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in doc.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and name in _SECTIONS:
            out.update(_flatten(value, name + "."))
        else:
            out[name] = value
    return out


CONFIGS_KEY = "configs"  # load_file's entry for the raw `configs` section (not a setting)


def _named_section(path: str, raw: Any) -> tuple[dict[str, Any], list[str]]:
    """The `configs` section, checked for shape: {label, default, named: {name: {flat per-node settings}}}."""
    where = f"{path}: configs"
    if not isinstance(raw, dict):
        return {}, [f"{where}: expected a mapping with label, default and named"]
    errors = [f"{where}.{key}: unknown key (expected label, default, named)"
              for key in raw if key not in ("label", "default", "named")]  # fmt: skip
    named = raw.get("named")
    out: dict[str, Any] = {"label": raw.get("label", DEFAULT_CONFIG_LABEL), "default": raw.get("default")}
    if not isinstance(named, dict) or not named:
        errors.append(f"{where}.named: expected a mapping of configuration names to settings")
        return out, errors
    if len(named) > MAX_NAMED_CONFIGS:
        errors.append(f"{where}.named: {len(named)} configurations, at most {MAX_NAMED_CONFIGS}")
        return out, errors
    out["named"] = {}
    for name, doc in named.items():
        here = f"{where}.named.{name}"
        if not isinstance(name, str) or not _CONFIG_NAME.fullmatch(name):
            errors.append(f"{where}.named: {reprlib.repr(name)} is not a valid label value for a name")
            continue
        if doc is None:
            doc = {}
        if not isinstance(doc, dict):
            errors.append(f"{here}: expected a mapping of settings")
            continue
        flat = _flatten(doc)
        for setting in flat:
            if setting not in _BY_NAME:
                errors.append(f"{here}: {setting}: unknown setting")
            elif not setting.startswith(PER_NODE_PREFIXES):
                errors.append(f"{here}: {setting}: process-wide; set it outside configs (file, env or flag)")
        out["named"][name] = flat
    return out, errors


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config file into {setting name: raw value} (plus the raw `configs` section under
    CONFIGS_KEY); raise ConfigError on any problem."""
    try:
        doc = read_yaml(path, MAX_CONFIG_BYTES)
    except YamlFileError as exc:
        raise ConfigError(f"{reprlib.repr(str(path))}: {exc}") from None
    return _file_values(doc, path)


def load_text(text: str, where: str) -> dict[str, Any]:
    """:func:`load_file` for a config file's content, which ``where`` names in messages; nothing is read
    or written (the Ansible module checks the file it is about to deploy)."""
    try:
        doc = parse_yaml(text, MAX_CONFIG_BYTES)
    except YamlFileError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    return _file_values(doc, where)


def _file_values(doc: Any, path: str | os.PathLike[str]) -> dict[str, Any]:
    """A config file's parsed document as load_file returns it; ConfigError naming ``path``."""
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    errors = []
    version = doc.pop("version", None)
    if version != CONFIG_VERSION:
        errors.append(f"{path}: version: expected {CONFIG_VERSION!r}, got {reprlib.repr(version)}")
    section = doc.pop(CONFIGS_KEY, None)
    flat = _flatten(doc)
    errors += [f"{path}: {name}: unknown setting" for name in flat if name not in _BY_NAME]
    if section is not None:
        flat[CONFIGS_KEY], problems = _named_section(str(path), section)
        errors += problems
    if errors:
        raise ConfigError("\n".join(errors))
    return flat


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add `--config` and one flag per setting (all default to None: unset)."""
    parser.add_argument("--config", help=f"YAML config file (version: {CONFIG_VERSION}); env {CONFIG_ENV}")
    for s in SETTINGS:
        if s.flag_ok:
            parser.add_argument(s.flag, dest=s.attr, default=None, help=f"{s.help} (env {s.env})")


def build(
    args: argparse.Namespace | None = None,
    environ: Mapping[str, str] | None = None,
    file_values: Mapping[str, Any] | None = None,
    file_name: str | None = None,
) -> Config:
    """Merge defaults < file < environment < flags and validate; raise ConfigError listing every problem.
    ``file_name`` names the file of ``file_values`` in messages (else --config's path or its variable's)."""
    environ = os.environ if environ is None else environ
    errors: list[str] = []
    config_path = file_name or getattr(args, "config", None) or environ.get(CONFIG_ENV)
    if file_values is None and config_path:
        try:
            file_values = load_file(config_path)
        except ConfigError as exc:
            errors.append(str(exc))
    file_values = dict(file_values or {})
    section = file_values.pop(CONFIGS_KEY, None)
    in_file = {name: (raw, f"{config_path}: {name}") for name, raw in file_values.items() if name in _BY_NAME}
    in_env = dict(found for s in SETTINGS if (found := _from_env(s, environ)))
    in_flags = {
        s.name: (getattr(args, s.attr), s.flag) for s in SETTINGS if getattr(args, s.attr, None) is not None
    }
    cfg, problems = _merged([Layer("file", in_file), Layer("env", in_env), Layer("flag", in_flags)])
    errors += problems
    if section is not None and not errors:
        cfg, problems = _with_named(cfg, section, config_path, in_file, in_env, in_flags)
        errors += problems
    if errors:
        raise ConfigError("\n".join(errors))
    return cfg


def _merged(
    layers: Sequence[Layer], extra: Mapping[str, Any] | None = None, where: str = ""
) -> tuple[Config, list[str]]:
    """One Config from the layers (defaults below them), cross-checked; and the problems found (those of
    the cross-check, which name no source, prefixed with ``where``)."""
    merged = merge({s.name: s.parse for s in SETTINGS}, layers)
    values = {_BY_NAME[name].attr: value for name, value in merged.values.items()}
    cfg = Config(**values, **(extra or {}), source=merged.source)
    if merged.errors:
        return cfg, merged.errors
    return cfg, [f"{where}{problem}" for problem in _cross_check(cfg)]


def _with_named(
    base: Config,
    section: Mapping[str, Any],
    config_path: str | None,
    in_file: Mapping[str, tuple[Any, str]],
    in_env: Mapping[str, tuple[Any, str]],
    in_flags: Mapping[str, tuple[Any, str]],
) -> tuple[Config, list[str]]:
    """The named configurations, each merged file < named < env < flags and validated; the result is the
    default one, carrying them all."""
    errors: list[str] = []
    label, default = section.get("label"), section.get("default")
    try:
        label = _label_key(label)
    except ValueError as exc:
        errors.append(f"{config_path}: configs.label: {exc}")
    named_raw: Mapping[str, Mapping[str, Any]] = section.get("named") or {}
    if default not in named_raw:
        errors.append(f"{config_path}: configs.default: expected one of {', '.join(sorted(named_raw))}, "
                      f"got {reprlib.repr(default)}")  # fmt: skip
    built: dict[str, Config] = {}
    for name, settings in named_raw.items():
        layer = {key: (raw, f"{config_path}: configs.named.{name}.{key}") for key, raw in settings.items()}
        extra = {"config_label": label, "config_default": default, "config_name": name}
        layers = [Layer("file", in_file), Layer(f"config {name}", layer), Layer("env", in_env),
                  Layer("flag", in_flags)]  # fmt: skip
        cfg, problems = _merged(layers, extra, where=f"{config_path}: configs.named.{name}: ")
        errors += problems
        built[name] = cfg
    if errors:
        return base, errors
    for cfg in built.values():
        object.__setattr__(cfg, "named", built)  # frozen: every one knows them all, for the label's choice
    return built[str(default)], []


def _label_key(v: Any) -> str:
    key = as_str(v)
    prefix, _slash, name = key.rpartition("/")
    if (
        not name
        or len(name) > 63
        or not _CONFIG_NAME.fullmatch(name)
        or (prefix and not _DNS_SUBDOMAIN.fullmatch(prefix))
    ):
        raise ValueError(f"expected a label key like nvidia.com/device-plugin.config, got {reprlib.repr(v)}")
    return key


def _from_env(s: Setting, environ: Mapping[str, str]) -> tuple[str, tuple[Any, str]] | None:
    """The setting's value from its first variable that is set and not empty."""
    for name in (s.env, *s.env_aliases):
        if environ.get(name):
            return s.name, (environ[name], f"env {name}")
    return None


def _cross_check(cfg: Config) -> list[str]:
    errors = []
    if cfg.sharing_time_slicing_rename and cfg.sharing_mode != "time-slicing":
        errors.append("sharing.time_slicing.rename: only valid with sharing.mode time-slicing")
    if cfg.sharing_time_slicing_rename:
        try:
            _resource_name(cfg.sharing_time_slicing_rename)
        except ValueError as exc:
            errors.append(f"sharing.time_slicing.rename: {exc}")
    if cfg.sharing_mode == "memory" and not cfg.node_name:
        errors.append("node_name: required with sharing.mode memory (the hand-off looks up this node's pods)")
    if cfg.sharing_memory_mps and cfg.sharing_mode != "memory":
        errors.append("sharing.memory.mps: only valid with sharing.mode memory")
    if cfg.mig_strategy != "none" and cfg.sharing_mode != "none":
        errors.append(
            f"mig.strategy: {cfg.mig_strategy} cannot be combined with sharing.mode {cfg.sharing_mode} "
            "(MIG devices are advertised whole; sharing applies to whole GPUs only)"
        )
    return errors


def from_text(text: str, where: str, environ: Mapping[str, str] | None = None) -> Config:
    """The Config a plugin starts with when its config file holds ``text``, with no flags and ``environ``
    (default: none) as its environment; ``where`` names the text in messages. ConfigError as :func:`build`."""
    return build(None, environ or {}, load_text(text, where), file_name=where)


def parse(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> Config:
    """Parse the command line (and the environment and file it points at) into a Config."""
    parser = argparse.ArgumentParser(
        prog="gpufleet-device-plugin", description="gpufleet's kubelet device plugin for NVIDIA GPUs."
    )
    add_flags(parser)
    return build(parser.parse_args(argv), environ)


__all__ = [
    "CONFIG_LABEL_NAME",
    "CONFIG_VERSION",
    "DEFAULT_CONFIG_LABEL",
    "SETTINGS",
    "Advertised",
    "Config",
    "ConfigError",
    "MigLayoutError",
    "MountSpec",
    "build",
    "from_text",
    "load_file",
    "load_text",
    "parse",
]
