# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""APT source definitions as apt reads them: one-line `.list` files and deb822 `.sources` files.

- :func:`read_definitions`: every enabled or disabled definition under an APT configuration directory.
- :func:`lookup`: the definitions of one repository, whether they already cover the suites and components
  a role needs, the Signed-By they agree on, and the conflicts apt refuses to load (a differing Signed-By
  or Trusted for one URI and suite: "Conflicting values set for option ...").
"""

from __future__ import annotations

import glob
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

# One-line format: deb [opt=value opt2=value] URI SUITE [COMPONENT...]
ONE_LINE = re.compile(r"^(deb|deb-src)\s+(?:\[([^\]]*)\]\s+)?(\S+)\s+(\S+)((?:\s+\S+)*)\s*$")


@dataclass
class Definition:
    """One repository definition: a `.list` line or a deb822 stanza (one URI of it)."""

    file: str
    line: int  # 1-based line of the .list entry or of the stanza's first field
    types: list[str]
    uri: str
    suites: list[str]
    components: list[str]
    signed_by: str  # a keyring path, "inline key" for an embedded key, "" when unset
    trusted: str  # "yes", "no", "" when unset
    enabled: bool
    own: bool = field(default=False)


def normalize_uri(uri: str, arch: str) -> str:
    """The URI apt means: $(ARCH) expanded, lower-case scheme and host, one trailing slash."""
    uri = uri.replace("$(ARCH)", arch)
    found = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://([^/]*)(.*)$", uri)
    if found:
        uri = f"{found.group(1).lower()}://{found.group(2).lower()}{found.group(3)}"
    return uri.rstrip("/") + "/"


def without_scheme(uri: str) -> str:
    return uri.split("://", 1)[-1]


def _signed_by(value: str) -> str:
    value = value.strip()
    return "inline key" if "BEGIN PGP" in value else value


def parse_one_line(path: str, text: str, arch: str) -> list[Definition]:
    out = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        found = ONE_LINE.match(line)
        if not found:
            continue
        options = dict([*opt.split("=", 1), ""][:2] for opt in (found.group(2) or "").split() if opt)
        out.append(
            Definition(
                file=path,
                line=number,
                types=[found.group(1)],
                uri=normalize_uri(found.group(3), arch),
                suites=[found.group(4)],
                components=found.group(5).split(),
                signed_by=_signed_by(options.get("signed-by", "")),
                trusted=options.get("trusted", "").lower(),
                enabled=True,
            )
        )
    return out


def _deb822_stanzas(text: str) -> list[tuple[int, dict[str, str]]]:
    stanzas: list[tuple[int, dict[str, str]]] = []
    fields: dict[str, str] = {}
    key, start = "", 0
    for number, raw in enumerate([*text.splitlines(), ""], 1):
        if raw.startswith("#"):
            continue
        if not raw.strip():
            if fields:
                stanzas.append((start, fields))
            fields, key = {}, ""
            continue
        if raw[0] in " \t" and key:
            fields[key] += "\n" + raw.strip()
        elif ":" in raw:
            key, value = raw.split(":", 1)
            key = key.strip().lower()
            fields[key] = value.strip()
            start = start if len(fields) > 1 else number
    return stanzas


def parse_deb822(path: str, text: str, arch: str) -> list[Definition]:
    out = []
    for number, fields in _deb822_stanzas(text):
        enabled = fields.get("enabled", "yes").lower() not in ("no", "false", "0")
        for uri in fields.get("uris", "").split():
            out.append(
                Definition(
                    file=path,
                    line=number,
                    types=fields.get("types", "").split(),
                    uri=normalize_uri(uri, arch),
                    suites=fields.get("suites", "").split(),
                    components=fields.get("components", "").split(),
                    signed_by=_signed_by(fields.get("signed-by", "")),
                    trusted=fields.get("trusted", "").lower(),
                    enabled=enabled,
                )
            )
    return out


def source_files(etc_apt: str) -> list[str]:
    """The files apt reads, in its order: sources.list, then sources.list.d/*.list and *.sources."""
    files = [os.path.join(etc_apt, "sources.list")]
    parts = glob.glob(os.path.join(etc_apt, "sources.list.d", "*.list"))
    parts += glob.glob(os.path.join(etc_apt, "sources.list.d", "*.sources"))
    return [f for f in files + sorted(parts) if os.path.isfile(f)]


def read_definitions(etc_apt: str, arch: str) -> list[Definition]:
    out = []
    for path in source_files(etc_apt):
        with open(path, encoding="utf-8", errors="replace") as handle:
            text = handle.read()
        parser = parse_deb822 if path.endswith(".sources") else parse_one_line
        out += parser(path, text, arch)
    return out


def _conflicts(definitions: list[Definition]) -> list[str]:
    """What apt refuses to load: one URI and suite with two Signed-By keyrings, or two Trusted values."""
    problems = []
    by_target: dict[tuple[str, str], list[Definition]] = {}
    for d in definitions:
        if d.enabled and "deb" in d.types:
            for suite in d.suites:
                by_target.setdefault((d.uri, suite), []).append(d)
    for (uri, suite), defs in by_target.items():
        keyrings = {d.signed_by for d in defs if d.signed_by}
        if len(keyrings) > 1:
            problems.append(
                f"Signed-By differs for {uri} {suite}: "
                + "; ".join(f"{d.file}:{d.line} has {d.signed_by or '(none)'}" for d in defs)
            )
        if len({d.trusted for d in defs}) > 1:
            problems.append(
                f"Trusted differs for {uri} {suite}: "
                + "; ".join(f"{d.file}:{d.line} has {d.trusted or '(unset)'}" for d in defs)
            )
    return problems


def lookup(
    definitions: list[Definition],
    uri: str,
    suites: list[str],
    components: list[str],
    own_file: str,
    arch: str,
) -> dict[str, Any]:
    """Where a repository is already defined, and whether the role may add its own definition of it."""
    wanted = normalize_uri(uri, arch)
    for d in definitions:
        d.own = bool(own_file) and os.path.abspath(d.file) == os.path.abspath(own_file)
    same = [d for d in definitions if without_scheme(d.uri) == without_scheme(wanted)]
    foreign = [d for d in same if not d.own and d.enabled and "deb" in d.types]
    covered = all(
        any(suite in d.suites and (not components or component in d.components) for d in foreign)
        for suite in suites
        for component in (components or [""])
    )
    keyrings = sorted({d.signed_by for d in foreign if d.signed_by})
    return {
        "definitions": [asdict(d) for d in same],
        "reuse": bool(foreign) and covered,
        "files": sorted({d.file for d in foreign}),
        # apt accepts an unset Signed-By beside a set one, not two different ones.
        "signed_by": (keyrings[0] if len(keyrings) == 1 else "" if not keyrings else None)
        if foreign
        else None,
        "conflicts": _conflicts(same),
    }
