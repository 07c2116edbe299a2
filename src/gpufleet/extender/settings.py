"""The extender's settings: defaults, then a YAML file, then GPUFLEET_EXTENDER_* variables, then flags.

Each later source overrides the earlier ones, so a flag on the command line always wins and a Deployment
can pin a value with an env var over a shared ConfigMap file. Everything is validated at start with a
message naming the setting and its source.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import yaml

from gpufleet.extender.request import Policy

ENV_PREFIX = "GPUFLEET_EXTENDER_"
CONFIG_VERSION = "v1"


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
    bind_wait: float = field(
        default=5.0,
        metadata={"help": "seconds a bind waits for another bind to the same node in this process"},
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


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = next(f for f in fields(Settings) if f.name == name).type
    try:
        if kind in ("int", int):
            if isinstance(value, bool):
                raise ValueError
            return int(value)
        if kind in ("float", float):
            if isinstance(value, bool):
                raise ValueError
            return float(value)
        if kind in ("Policy", Policy):
            return Policy(str(value).strip().lower())
        return str(value)
    except ValueError:
        raise SettingsError(f"{name} from {source}: {value!r} is not a valid {kind}") from None


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
    for name in ("lock_ttl", "reservation_ttl", "bind_wait", "api_timeout", "sweep_interval"):
        if getattr(s, name) <= 0:
            raise SettingsError(f"{name} must be positive")
    if s.lock_wait < 0:
        raise SettingsError("lock_wait must not be negative")
    if s.max_body_mib <= 0:
        raise SettingsError("max_body_mib must be positive")


def load_settings(
    path: str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Merge defaults < file < environment < flags (flags with value None are unset) and validate."""
    names = {f.name for f in fields(Settings)}
    values: dict[str, Any] = {}
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                doc = yaml.safe_load(fh) or {}
        except OSError as exc:
            raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise SettingsError(f"config file {path} is not YAML: {exc}") from None
        if not isinstance(doc, dict):
            raise SettingsError(f"config file {path} must be a mapping")
        version = doc.pop("version", CONFIG_VERSION)
        if version != CONFIG_VERSION:
            raise SettingsError(f"config file {path}: version {version!r} is not {CONFIG_VERSION!r}")
        for key, value in doc.items():
            if key not in names:
                raise SettingsError(f"config file {path}: unknown setting {key!r}")
            values[key] = _coerce(key, value, f"file {path}")
    for key, value in (env if env is not None else os.environ).items():
        if key.startswith(ENV_PREFIX):
            name = key[len(ENV_PREFIX) :].lower()
            if name not in names:
                raise SettingsError(f"environment variable {key} names no setting")
            values[name] = _coerce(name, value, f"env {key}")
    for key, value in (flags or {}).items():
        if value is not None:
            values[key] = _coerce(key, value, f"flag --{key.replace('_', '-')}")
    settings = dataclasses.replace(Settings(), **values)
    if settings.url_prefix != "/":
        settings = dataclasses.replace(settings, url_prefix=settings.url_prefix.rstrip("/"))
    _validate(settings)
    return settings
