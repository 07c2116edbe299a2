"""The extender's settings: defaults, then a YAML file, then GPUFLEET_EXTENDER_* variables, then flags.

Each later source overrides the earlier ones, so a flag on the command line always wins and a Deployment
can pin a value with an env var over a shared ConfigMap file. Everything is validated at start with a
message naming the setting and its source.
"""

from __future__ import annotations

import dataclasses
import os
import reprlib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from ..layered import Layer, Parser, as_int, as_number, as_str, merge
from ..yamlfile import YamlFileError, parse_yaml, read_yaml
from .request import Policy

ENV_PREFIX = "GPUFLEET_EXTENDER_"
CONFIG_VERSION = "v1"

MAX_SETTINGS_BYTES = 16 * 1024  # every setting with comments fits in 2 KiB; more is not a settings file
MAX_SECONDS = 86_400.0  # a day: a longer TTL or wait is a typo, and huge ones overflow timer arithmetic
MAX_BODY_MIB = 4096  # 16x the default, far above a 5000-node cluster's full Nodes list
MAX_RESERVATIONS = 1_000_000  # about 1 GiB of reservations: more is a typo


class SettingsError(ValueError):
    """A setting is missing, malformed or inconsistent."""


@dataclass(frozen=True)
class Settings:
    """Every knob of `gpufleet-extender serve`: file keys, env suffixes and flags share these names, and
    each field's `help` metadata is the flag's help text."""

    listen_address: str = field(default="0.0.0.0", metadata={"help": "address to listen on"})
    port: int = field(default=8800, metadata={"help": "port to listen on (0: any free port)"})
    url_prefix: str = field(
        default="/gpufleet",
        metadata={"help": "path before the verbs; the scheduler's urlPrefix is scheme://host:port + this"},
    )
    tls_cert_file: str = field(
        default="", metadata={"help": "server certificate (PEM); with tls_key_file turns on HTTPS"}
    )
    tls_key_file: str = field(default="", metadata={"help": "server key (PEM)"})
    tls_client_ca_file: str = field(
        default="", metadata={"help": "CA whose client certificates are required (the scheduler's)"}
    )
    node_policy: Policy = field(
        default=Policy.BINPACK, metadata={"help": "binpack or spread across nodes (pods override)"}
    )
    gpu_policy: Policy = field(
        default=Policy.BINPACK, metadata={"help": "binpack or spread across a node's GPUs (pods override)"}
    )
    lock_ttl: float = field(
        default=60.0,
        metadata={"help": "seconds a node bind-lock lives if the device plugin never releases it"},
    )
    reservation_ttl: float = field(
        default=300.0, metadata={"help": "seconds a settled reservation waits for the watch to confirm it"}
    )
    decision_ttl: float = field(
        default=30.0,
        metadata={"help": "seconds the placement filter chose for a pod is held for its bind (then dropped)"},
    )
    max_reservations: int = field(
        default=10_000,
        metadata={
            "help": "most placements held at once (decided, binding, settling); filter refuses past it"
        },
    )
    filter_wait: float = field(
        default=2.0,
        metadata={
            "help": "seconds filter may wait for a node's queue of hand-offs to shorten when every fitting "
            "node's is long (0: never; holds the scheduler to the pace of the nodes' hand-offs)"
        },
    )
    bind_wait: float = field(
        default=5.0,
        metadata={
            "help": "seconds a bind waits for its turn behind other binds to the same node in this process"
        },
    )
    lock_wait: float = field(
        default=3.0,
        metadata={
            "help": "seconds a bind waits for another pod's GPU-memory hand-off on the node to finish "
            "(0: refuse at once, and filter skips nodes with a live bind-lock)"
        },
    )
    api_timeout: float = field(default=10.0, metadata={"help": "seconds per Kubernetes API call"})
    kubeconfig: str = field(
        default="",
        metadata={"help": "kubeconfig file; empty: in-cluster service account, else ~/.kube/config"},
    )
    log_format: str = field(default="kv", metadata={"help": "kv (key=value) or json, one event per line"})
    log_level: str = field(default="info", metadata={"help": "debug, info, warning or error"})
    max_body_mib: int = field(
        default=256, metadata={"help": "largest request body in MiB (full Nodes lists are big)"}
    )
    sweep_interval: float = field(
        default=5.0, metadata={"help": "seconds between sweeps of expired reservations and claims"}
    )

    @property
    def https(self) -> bool:
        """Whether the server speaks TLS."""
        return bool(self.tls_cert_file)


_CHOICES = {"log_format": ("kv", "json"), "log_level": ("debug", "info", "warning", "error")}


def _policy(value: Any) -> Policy:
    try:
        return Policy(as_str(value).strip().lower())
    except ValueError:
        names = ", ".join(p.value for p in Policy)
        raise ValueError(f"expected one of {names}, got {reprlib.repr(value)}") from None


# Each setting's parser by its field's type (gpufleet.layered's, shared with the device plugin); ranges and
# cross-setting rules are _validate's.
_PARSER_OF_TYPE: dict[Any, Parser] = {"int": as_int, "float": as_number, "Policy": _policy, "str": as_str}
PARSERS: dict[str, Parser] = {f.name: _PARSER_OF_TYPE[f.type] for f in fields(Settings)}


def _validate(s: Settings) -> None:
    if not 0 <= s.port <= 65535:
        raise SettingsError(f"port {s.port} is out of range")
    if not s.url_prefix.startswith("/"):
        raise SettingsError(f"url_prefix {s.url_prefix!r} must start with '/'")
    if bool(s.tls_cert_file) != bool(s.tls_key_file):
        raise SettingsError("tls_cert_file and tls_key_file go together")
    if s.tls_client_ca_file and not s.tls_cert_file:
        raise SettingsError("tls_client_ca_file needs tls_cert_file and tls_key_file (HTTPS)")
    for path_field in ("tls_cert_file", "tls_key_file", "tls_client_ca_file"):
        path = getattr(s, path_field)
        if path and not os.path.isfile(path):
            raise SettingsError(f"{path_field} {path!r} does not exist")
    for name, allowed in _CHOICES.items():
        if getattr(s, name) not in allowed:
            raise SettingsError(f"{name} {getattr(s, name)!r}: choose one of {', '.join(allowed)}")
    durations = ("lock_ttl", "reservation_ttl", "decision_ttl", "bind_wait", "api_timeout", "sweep_interval")
    for name in durations:
        if getattr(s, name) <= 0:
            raise SettingsError(f"{name} must be positive")
    for name in ("lock_wait", "filter_wait"):
        if getattr(s, name) < 0:
            raise SettingsError(f"{name} must not be negative")
    if not 1 <= s.max_reservations <= MAX_RESERVATIONS:
        raise SettingsError(f"max_reservations must be from 1 to {MAX_RESERVATIONS}")
    for name in (*durations, "lock_wait", "filter_wait"):
        if getattr(s, name) > MAX_SECONDS:
            raise SettingsError(f"{name} must be at most {MAX_SECONDS:g} seconds")
    if not 0 < s.max_body_mib <= MAX_BODY_MIB:
        raise SettingsError(f"max_body_mib must be positive and at most {MAX_BODY_MIB}")


def load_settings(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    *,
    text: str | None = None,
) -> Settings:
    """Merge defaults < file < environment < flags (flags with value None are unset) and validate; raise
    SettingsError naming every setting that is wrong and where it came from. With ``text``, that is the
    file's content and ``path`` only names it in messages: nothing is read (the Ansible module's check)."""
    errors: list[str] = []
    in_file: dict[str, tuple[Any, str]] = {}
    if path:
        doc = _read_yaml(path, text)
        version = doc.pop("version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise SettingsError(
                f"config file {path}: version {reprlib.repr(version)} is not {CONFIG_VERSION!r}"
            )
        in_file = {key: (value, f"{_key(key)} from config file {path}") for key, value in doc.items()}
    in_env: dict[str, tuple[Any, str]] = {}
    for key, value in (env if env is not None else os.environ).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name in PARSERS:
                in_env[name] = (value, f"{name} from env {key}")
            else:
                errors.append(f"environment variable {key} names no setting")
    set_flags = {key: value for key, value in (flags or {}).items() if value is not None}
    in_flags = {key: (value, f"{key} from flag {_flag(key)}") for key, value in set_flags.items()}
    merged = merge(PARSERS, [Layer("file", in_file), Layer("env", in_env), Layer("flag", in_flags)])
    errors += merged.errors
    if errors:
        raise SettingsError("; ".join(errors))
    settings = dataclasses.replace(Settings(), **merged.values)
    if settings.url_prefix != "/":
        settings = dataclasses.replace(settings, url_prefix=settings.url_prefix.rstrip("/"))
    _validate(settings)
    return settings


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _key(key: Any) -> str:
    """A file key for a message: a setting's name as is, anything else (a hostile key) shortened."""
    return key if isinstance(key, str) and key in PARSERS else reprlib.repr(key)


def _read_yaml(path: str, text: str | None = None) -> dict[Any, Any]:
    """The settings file (or its ``text``) as a mapping; SettingsError when unreadable, oversized or not a
    YAML mapping."""
    try:
        parsed = read_yaml(path, MAX_SETTINGS_BYTES) if text is None else parse_yaml(text, MAX_SETTINGS_BYTES)
        doc = parsed or {}
    except YamlFileError as exc:
        raise SettingsError(f"config file {reprlib.repr(path)}: {exc}") from None
    if not isinstance(doc, dict):
        raise SettingsError(f"config file {path} must be a mapping")
    return doc
