# Copyright: gpufleet contributors
# Apache-2.0
"""Filters reading container runtime configs as TOML on the controller (a host's Python may lack tomllib).

containerd's CRI plugin IDs and how a config dump names its runtimes live in the collection's module_utils
(containerd_config.py), which the nvidia_containerd_runtime module uses on the host: one home for both.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ansible.errors import AnsibleFilterError
from ansible_collections.gpufleet.nvidia.plugins.module_utils.containerd_config import cri_runtime

try:
    import tomllib  # Python 3.11+, which ansible-core 2.18+ requires on the controller
except ImportError:  # pragma: no cover - older controllers with the tomli backport
    import tomli as tomllib  # type: ignore[no-redef]

# The runtimes nvidia-ctk copies a CRI-O runtime's options from, after CRI-O's own default runtime
# (pkg/config/engine/engine.go, GetLowLevelRuntimes), and the ones nvidia-container-runtime looks up
# in PATH by default (internal/config: nvidia-container-runtime.runtimes).
CRIO_BASE_RUNTIMES = ("runc", "crun")
NVIDIA_DEFAULT_LOW_LEVEL_RUNTIMES = ["docker-runc", "runc", "crun"]
# Keys of a CRI-O runtime that must not be copied into the nvidia runtime: a per-platform path replaces
# runtime_path on that platform, so a copied one would run the base runtime instead of NVIDIA's.
CRIO_NOT_COPIED = ("platform_runtime_paths",)
BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def from_toml(text: str) -> dict[str, Any]:
    """Parse TOML text (a runtime's config dump) into a dict."""
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise AnsibleFilterError(f"not TOML: {err}") from err


def containerd_cri_runtime(dump: str, name: str) -> dict[str, Any]:
    """The CRI runtime `name` of a `containerd config dump` (1.x or 2.x), plus the CRI default runtime.

    Returns {"default_runtime_name": ..., "runtime": {...} or {}} whatever quoting or version the dump uses.
    """
    return cri_runtime(from_toml(dump), name)


def crio_nvidia_runtime(config: str, path: str, base: str = "") -> dict[str, Any]:
    """The nvidia runtime for CRI-O's config (`crio config` output), built as nvidia-ctk builds it.

    Copies the options of a base runtime (`base` if CRI-O defines it, else CRI-O's default runtime unless it
    is an nvidia one, else runc, else crun), then sets runtime_path to `path`. runtime_type is "oci", as
    nvidia-ctk sets it, except after a "pod" (conmon-rs) base: its monitor_path names conmon-rs, which only
    drives "pod" runtimes. Returns {"base": name or "", "base_path": its runtime_path, "table": {...}}.
    """
    runtime = from_toml(config).get("crio", {}).get("runtime", {})
    runtimes = runtime.get("runtimes", {})
    default = runtime.get("default_runtime", "")
    candidates = [base] if base else []
    if default and not default.startswith("nvidia"):
        candidates.append(default)
    chosen = next((c for c in [*candidates, *CRIO_BASE_RUNTIMES] if c in runtimes), "")
    table = {k: v for k, v in runtimes.get(chosen, {}).items() if k not in CRIO_NOT_COPIED}
    base_type = table.get("runtime_type", "")
    table["runtime_path"] = path
    table["runtime_type"] = "pod" if base_type == "pod" else "oci"
    return {"base": chosen, "base_path": runtimes.get(chosen, {}).get("runtime_path", ""), "table": table}


def nvidia_low_level_runtimes(base_path: str) -> list[str]:
    """nvidia-container-runtime's `runtimes` list: the CRI-O base runtime first, then NVIDIA's defaults."""
    return ([base_path] if base_path else []) + [
        r for r in NVIDIA_DEFAULT_LOW_LEVEL_RUNTIMES if r != base_path
    ]


def toml_value(value: Any) -> str:
    """One TOML value (string, bool, number, array, inline table) as text."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)  # JSON's escapes are all valid in a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        items = (f"{k if BARE_KEY.match(k) else json.dumps(k)} = {toml_value(v)}" for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    raise AnsibleFilterError(f"no TOML form for {type(value).__name__} {value!r}")


class FilterModule:
    """Container runtime config filters of the nvidia_container_toolkit role."""

    def filters(self) -> dict[str, Any]:
        return {
            "from_toml": from_toml,
            "containerd_cri_runtime": containerd_cri_runtime,
            "crio_nvidia_runtime": crio_nvidia_runtime,
            "nvidia_low_level_runtimes": nvidia_low_level_runtimes,
            "toml_value": toml_value,
        }
