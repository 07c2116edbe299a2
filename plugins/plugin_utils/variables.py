# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Which variable names gpufleet takes from an inventory (or ``-e``), and which set ones it ignores.

Ansible silently ignores a variable nothing reads: ``gpufleet_driver_verison: 535.216.01`` in group_vars
changes nothing, and the run installs the default driver. :func:`unknown_variables` finds such names among
what an inventory sets, with the closest known name.

Known names have one source, the collection's own files, read when the check runs:

- every option of every role's ``meta/argument_specs.yml`` and every key of its ``defaults/main.yml``;
- every name with a gpufleet prefix that ``site.yml``, ``playbooks/*.yml`` or a role's tasks, handlers,
  templates, defaults or vars read, less those they assign themselves (``vars:``, ``register:``,
  ``set_fact``, a role's ``vars/*.yml``, a loop variable): an inventory value of an assigned name would be
  overridden, so it is reported too (with where it is assigned).

Checked names are those with a gpufleet prefix: ``gpufleet_``, ``esxi_`` (playbooks/esxi.yml's) and each
role's name followed by ``_`` (``nvidia_driver_``, ``gpu_host_prep_``, ...). A name the inventory itself
reads (a helper such as ``gpufleet_lab_sim_env`` used in another value) is not reported.

Controller side only (the action plugin ``gpufleet.nvidia.check_variables``); PyYAML is Ansible's own
dependency.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

PLAYBOOK_PREFIXES = ("gpufleet_", "esxi_")
# Content whose text is searched for the names it reads (Jinja in YAML, templates, inline Python).
READ_DIRS = ("tasks", "handlers", "templates", "defaults", "vars")
READ_SUFFIXES = (".yml", ".yaml", ".j2")
# Task keywords whose mapping assigns variables.
SET_FACT = ("set_fact", "ansible.builtin.set_fact", "ansible.legacy.set_fact")
SET_FACT_OPTIONS = ("cacheable",)


def collection_root() -> Path:
    """The collection this file belongs to (…/plugins/plugin_utils/variables.py -> …)."""
    return Path(__file__).resolve().parents[2]


class _Loader(yaml.SafeLoader):
    """YAML as Ansible writes it: ``!unsafe``, ``!vault`` and other tags read as plain values."""


def _any_tag(loader: yaml.SafeLoader, suffix: str, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


_Loader.add_multi_constructor("!", _any_tag)


def _load(path: Path) -> Any:
    try:
        return yaml.load(path.read_text(), Loader=_Loader)
    except (OSError, yaml.YAMLError):
        return None


def roles(root: Path) -> list[str]:
    """The collection's roles: those with an argument spec."""
    return sorted(p.parent.parent.name for p in (root / "roles").glob("*/meta/argument_specs.yml"))


def prefixes(root: Path) -> tuple[str, ...]:
    """The prefixes whose names are checked, longest first."""
    found = set(PLAYBOOK_PREFIXES) | {f"{role}_" for role in roles(root)}
    return tuple(sorted(found, key=lambda p: (-len(p), p)))


def _name_pattern(prefix_list: Iterable[str]) -> re.Pattern[str]:
    alternatives = "|".join(re.escape(p) for p in prefix_list)
    return re.compile(rf"(?<![A-Za-z0-9_])(?:{alternatives})[a-z0-9_]*[a-z0-9]")


def role_variables(root: Path) -> dict[str, str]:
    """Name -> where: each role's argument spec options and defaults."""
    known: dict[str, str] = {}
    for role in roles(root):
        spec = _load(root / "roles" / role / "meta" / "argument_specs.yml") or {}
        for entry in (spec.get("argument_specs") or {}).values():
            for name in (entry or {}).get("options") or {}:
                known.setdefault(str(name), f"roles/{role}/meta/argument_specs.yml")
        defaults = _load(root / "roles" / role / "defaults" / "main.yml")
        if isinstance(defaults, Mapping):
            for name in defaults:
                known.setdefault(str(name), f"roles/{role}/defaults/main.yml")
    return known


def content_files(root: Path) -> list[Path]:
    """site.yml, playbooks/*.yml and the roles' tasks, handlers, templates, defaults and vars."""
    files = [root / "site.yml", *sorted((root / "playbooks").glob("*.yml"))]
    for role in roles(root):
        for sub in READ_DIRS:
            files += sorted(p for p in (root / "roles" / role / sub).rglob("*") if p.suffix in READ_SUFFIXES)
    return [f for f in files if f.is_file()]


def _assigned_in(node: Any, found: set[str]) -> None:
    """Names a play, block or task list assigns (vars, register, set_fact, loop_var)."""
    if isinstance(node, list):
        for item in node:
            _assigned_in(item, found)
        return
    if not isinstance(node, Mapping):
        return
    for key, value in node.items():
        if key == "vars" and isinstance(value, Mapping):
            found.update(str(k) for k in value)
        elif key == "register" and isinstance(value, str):
            found.add(value)
        elif key in SET_FACT and isinstance(value, Mapping):
            found.update(str(k) for k in value if k not in SET_FACT_OPTIONS)
        elif key == "loop_control" and isinstance(value, Mapping) and value.get("loop_var"):
            found.add(str(value["loop_var"]))
        if isinstance(value, (list, Mapping)):
            _assigned_in(value, found)


def read_and_assigned(root: Path) -> tuple[dict[str, str], dict[str, str]]:
    """(names with a checked prefix that the content reads, names it assigns), each -> the first file."""
    pattern = _name_pattern(prefixes(root))
    read: dict[str, str] = {}
    assigned: dict[str, str] = {}
    for path in content_files(root):
        where = str(path.relative_to(root))
        yaml_file = path.suffix in (".yml", ".yaml")
        doc = _load(path) if yaml_file else None
        # YAML: its keys and values (comments say nothing about what is read); templates: their text
        for text in _strings(doc) if yaml_file else [path.read_text()]:
            for name in pattern.findall(text):
                read.setdefault(name, where)
        if not yaml_file or path.parent.name == "defaults":
            continue
        names: set[str] = set()
        if path.parent.name == "vars" and isinstance(doc, Mapping):
            names.update(str(k) for k in doc)  # a role's vars/ win over the inventory
        else:
            _assigned_in(doc, names)
        for name in names:
            assigned.setdefault(name, where)
    return read, assigned


def known_variables(root: Path | None = None) -> dict[str, str]:
    """Every name gpufleet takes from an inventory -> where it is declared or read."""
    root = root or collection_root()
    known = role_variables(root)
    read, assigned = read_and_assigned(root)
    for name, where in read.items():
        if name not in assigned:
            known.setdefault(name, where)
    return known


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield str(key)
            yield from _strings(item)
    elif isinstance(value, (list, tuple, set)):
        for item in value:
            yield from _strings(item)


def unknown_variables(
    host_vars: Mapping[str, Mapping[str, Any]],
    root: Path | None = None,
    allowed: Iterable[str] = (),
) -> list[dict[str, Any]]:
    """Names with a checked prefix that some host's variables set but nothing reads.

    ``host_vars``: host -> its raw (untemplated) variables, as the inventory and ``-e`` give them. Each
    finding: ``{name, hosts, suggestion, assigned_in}`` (``assigned_in``: the playbook or role file that
    sets the name itself, so the inventory's value is overridden; else None), sorted by name.
    """
    root = root or collection_root()
    pattern = _name_pattern(prefixes(root))
    known = known_variables(root)
    assigned = read_and_assigned(root)[1]
    allowed = set(allowed)
    set_by: dict[str, list[str]] = {}
    referenced: set[str] = set()
    for host, variables in host_vars.items():
        for name, value in variables.items():
            name = str(name)
            if pattern.fullmatch(name):
                set_by.setdefault(name, []).append(host)
            for text in _strings(value):
                referenced.update(n for n in pattern.findall(text) if n != name)
    findings = []
    candidates = sorted(known)
    for name in sorted(set_by):
        if name in known or name in referenced or name in allowed:
            continue
        close = difflib.get_close_matches(name, candidates, n=1, cutoff=0.75)
        findings.append({
            "name": name,
            "hosts": sorted(set(set_by[name])),
            "suggestion": close[0] if close else None,
            "assigned_in": assigned.get(name),
        })
    return findings


def describe(finding: Mapping[str, Any], every: Iterable[str] = (), limit: int = 3) -> str:
    """One finding as a phrase: the name, where it is set, why it does nothing, the closest known name.
    ``every``: the hosts checked; a name set for all of them is said to come from group all or -e."""
    hosts = list(finding["hosts"])
    if set(every) and set(every) <= set(hosts):
        where = "every host (group all's variables or -e)"
    else:
        where = ", ".join(hosts[:limit]) + (f" and {len(hosts) - limit} more" if len(hosts) > limit else "")
    if finding.get("assigned_in"):
        why = f"{finding['assigned_in']} sets it itself, so this value is never used"
    else:
        why = "no role or playbook of gpufleet reads it"
    hint = f" (did you mean {finding['suggestion']}?)" if finding.get("suggestion") else ""
    return f"{finding['name']}, set for {where}: {why}{hint}"
