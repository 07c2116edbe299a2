# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""containerd's config.toml read and edited as TOML: the one home of the CRI plugin IDs.

The nvidia_containerd_runtime module edits containerd's main config and writes its drop-in with tomlkit,
which keeps the operator's comments, quoting and layout (docs/roles.md, "containerd configuration"). The
module runs on the managed host, so tomlkit must be importable by the Python Ansible uses there: the
nvidia_container_toolkit role installs the distribution's package (python3-tomlkit) first. tomlkit is
imported when present, so that the role's filters (roles/nvidia_container_toolkit/filter_plugins), which
read `containerd config dump` with the controller's tomllib, can share the plugin IDs and `cri_runtime`
without it.

Written for the Python versions ansible-core 2.19 runs modules with (3.8 and later) and every tomlkit the
distributions ship (0.9.2 on Ubuntu 22.04 up to 0.13 on Debian 13/sid); tests/contracts runs each of them.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

try:
    import tomlkit
    from tomlkit.exceptions import ParseError, TOMLKitError
    from tomlkit.parser import Parser

    TOMLKIT_IMPORT_ERROR = None
except ImportError as err:  # the module says what to install; the filters need none of it
    tomlkit = None  # type: ignore[assignment]
    TOMLKitError = ParseError = ValueError  # type: ignore[misc,assignment]
    Parser = None  # type: ignore[assignment,misc]
    TOMLKIT_IMPORT_ERROR = err

# The plugin holding the CRI runtimes, by config version (containerd 1.x dumps version 2, 2.x dumps 3).
CRI_RUNTIME_PLUGINS = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
# Any of these in disabled_plugins leaves containerd without a CRI service ("cri" is version 1's short ID,
# Docker CE's containerd.io ships it; 2.x's CRI service needs both of its cri.v1 plugins).
CRI_PLUGIN_IDS = (
    "cri", "io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images",
)
# Config versions each containerd major loads: 2.x migrates version 2 on every start.
ACCEPTED_VERSIONS = {1: (2,), 2: (2, 3)}
MANAGED = "Managed by gpufleet (role nvidia_container_toolkit): regenerated each run; edit config.toml."
GLOB_CHARACTERS = "*?["


class ConfigError(ValueError):
    """A config that is not TOML, or not the TOML containerd expects."""


def parse(text: str, name: str) -> Any:
    """The tomlkit document of ``text`` (what tomlkit.parse does); ConfigError names ``name``, the parser's
    error and the line it stopped at."""
    parser = Parser(text)
    try:
        return parser.parse()
    except TOMLKitError as err:
        where = ""
        if getattr(err, "line", None) is None:  # tomlkit 0.9: a key or table defined twice, without a line
            stopped = parser.parse_error(ParseError, "")
            where = f" (the parser stopped at line {stopped.line} col {stopped.col})"
        raise ConfigError(f"{name} is not valid TOML: {err}{where}") from err


def plain(document: Any) -> Any:
    """A tomlkit document as plain dicts, lists, strings, numbers and booleans (0.9 has no unwrap())."""
    return json.loads(json.dumps(document))


def config_version(document: Mapping[str, Any]) -> int:
    """containerd's config version: the top-level ``version``, 1 when absent."""
    return int(document.get("version", 1))


def imports_of(document: Mapping[str, Any]) -> list[str]:
    return [str(entry) for entry in document.get("imports", [])]


def absolute(entry: str, config_dir: str) -> str:
    """An ``imports`` entry as a path: relative ones are relative to the main config's directory."""
    return os.path.normpath(os.path.join(config_dir, entry))


def covers(entry: str, path: str, config_dir: str) -> bool:
    """Whether an ``imports`` entry (a path or a glob pattern) loads ``path``.

    Patterns match per path segment, as Go's filepath.Match does: ``*`` does not cross a ``/``."""
    pattern = absolute(entry, config_dir)
    if not any(c in pattern for c in GLOB_CHARACTERS):
        return pattern == path
    return PurePosixPath(path).match(pattern)


def with_import(text: str, path: str, config_dir: str, name: str) -> str:
    """``text`` with ``path`` in its ``imports``, unless an entry already loads it; the rest stays as is."""
    entries = imports_of(parse(text, name))
    if any(covers(entry, path, config_dir) for entry in entries):
        return text
    return _edit_imports(text, name, [*entries, path])


def without_import(text: str, path: str, config_dir: str, name: str) -> str:
    """``text`` without the ``imports`` entries naming ``path`` (an emptied key goes); patterns stay."""
    entries = imports_of(parse(text, name))
    kept = [entry for entry in entries if absolute(entry, config_dir) != path]
    return text if kept == entries else _edit_imports(text, name, kept)


def _edit_imports(text: str, name: str, entries: list[str]) -> str:
    """``text`` whose ``imports`` are ``entries``: the array edited in place (its layout and comments kept),
    checked by parsing the result back. tomlkit 0.9 (Ubuntu 22.04) can close a multi-line array inside the
    comment of its last entry; then the array is written anew on one line, and checked again."""
    expected = plain(parse(text, name))
    expected.pop("imports", None)
    if entries:
        expected["imports"] = entries
    for in_place in (True, False):
        document = parse(text, name)
        if in_place and "imports" in document:
            array = document["imports"]
            for index in reversed(range(len(array))):
                if str(array[index]) not in entries:
                    del array[index]
            for entry in entries[len(array) :]:
                array.append(entry)
            if not len(array):
                del document["imports"]
        elif entries:
            document["imports"] = entries
        else:
            document.pop("imports", None)
        rendered = str(tomlkit.dumps(document))
        try:
            if plain(tomlkit.parse(rendered)) == expected:
                return rendered
        except TOMLKitError:
            pass
    raise ConfigError(f"tomlkit {tomlkit.__version__} cannot rewrite the imports of {name} to {entries}")


def resolved_imports(entries: list[str], config_dir: str, path: str, replacement: str | None) -> list[str]:
    """The files ``entries`` load, in order, patterns expanded (sorted, as Go's filepath.Glob returns them),
    with ``path`` replaced by ``replacement``, or left out when that is None.

    Used for the copies of the main config the module asks containerd about: they live in a scratch
    directory, so relative entries are made absolute, and ``path`` (the module's drop-in) is taken out to
    see what the host has without it, or swapped for the candidate drop-in."""
    files: list[str] = []
    for entry in entries:
        pattern = absolute(entry, config_dir)
        if any(c in pattern for c in GLOB_CHARACTERS):
            matched = sorted(glob.glob(pattern))
            if path not in matched and covers(entry, path, config_dir):
                matched = sorted([*matched, path])
        else:
            matched = [pattern]
        for found in matched:
            if found != path:
                files.append(found)
            elif replacement is not None:
                files.append(replacement)
    return files


def with_imports(text: str, files: list[str], name: str) -> str:
    """``text`` whose ``imports`` are exactly ``files`` (the key goes when there are none)."""
    document = parse(text, name)
    if files:
        document["imports"] = files
    elif "imports" in document:
        del document["imports"]
    return str(tomlkit.dumps(document))


def cri_runtime(config: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The CRI runtime ``name`` of a parsed `containerd config dump` (1.x or 2.x) and the CRI default runtime:
    {"plugin": ID or None, "default_runtime_name": ..., "runtime": {...} or {}}."""
    plugins = config.get("plugins", {})
    for plugin in (CRI_RUNTIME_PLUGINS[3], CRI_RUNTIME_PLUGINS[2]):
        containerd = plugins.get(plugin, {}).get("containerd")
        if containerd is not None:
            return {
                "plugin": plugin,
                "default_runtime_name": containerd.get("default_runtime_name", ""),
                "runtime": containerd.get("runtimes", {}).get(name, {}),
            }
    return {"plugin": None, "default_runtime_name": "", "runtime": {}}


# The CRI runtime plugin's CDI keys (containerd 1.7's io.containerd.grpc.v1.cri, 2.x's
# io.containerd.cri.v1.runtime; both from `containerd config default`): 1.7 ships enable_cdi = false,
# 2.x true; 1.6 has neither (its dump lacks the key).
CDI_KEYS = ("enable_cdi", "cdi_spec_dirs")


def drop_in_text(
    version: int, section: dict[str, Any], runtime: dict[str, Any], cdi: list[str] | None = None
) -> str:
    """The drop-in: ``section`` (the CRI runtime plugin's table to carry, plain) with ``runtime`` merged in.

    ``runtime`` is {"name", "binary", "set_default", "systemd_cgroup"}. An old entry of that name is
    replaced whole, and default_runtime_name points at it when ``set_default``. ``cdi``, a list of spec
    directories, turns containerd's CDI device injection on (``enable_cdi``, ``cdi_spec_dirs``)."""
    section = json.loads(json.dumps(section))
    if cdi is not None:
        section["enable_cdi"] = True
        section["cdi_spec_dirs"] = list(cdi)
    containerd = section.setdefault("containerd", {})
    if runtime["set_default"]:
        containerd["default_runtime_name"] = runtime["name"]
    runtimes = containerd.setdefault("runtimes", {})
    runtimes.pop(runtime["name"], None)
    runtimes[runtime["name"]] = {
        "runtime_type": "io.containerd.runc.v2",
        "privileged_without_host_devices": False,
        "options": {"BinaryName": runtime["binary"], "SystemdCgroup": bool(runtime["systemd_cgroup"])},
    }
    document = tomlkit.document()
    document.add(tomlkit.comment(MANAGED))
    document.add("version", version)
    document.add("plugins", {CRI_RUNTIME_PLUGINS[version]: section})
    return str(tomlkit.dumps(document))
