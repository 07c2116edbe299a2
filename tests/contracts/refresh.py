"""Re-read every Ubuntu fact from the live archive and rewrite the recorded fixtures, then the docs table.

    .venv/bin/python tests/contracts/refresh.py           # fixtures, facts' sources, docs/roles.md table
    .venv/bin/python tests/contracts/refresh.py --table   # only the docs/roles.md table
    (python -m tests.contracts.refresh works the same from the repository root)

Every facts entry with an Ubuntu `probe` is recorded automatically in fixtures/<facts file>.json: adding the
entry is all it takes. A fixture that probes cannot express is registered with one line in EXTRA_FIXTURES.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import contractlib

# fixture name -> "module:function" (module importable from tests/contracts); the function reads the live
# Ubuntu archive and returns the records, which refresh writes to fixtures/<name>.json. One line per fixture.
EXTRA_FIXTURES: dict[str, str] = {
    "arm64-ubuntu": "test_arm64:ubuntu_records",
    "container_runtimes-ubuntu": "test_container_runtimes:ubuntu_records",
    "driver-builds-ubuntu": "test_driver_builds:ubuntu_records",
}


def _extra(name: str, target: str) -> Path:
    module, _, function = target.partition(":")
    produce: Callable[[], list[dict[str, Any]]] = getattr(importlib.import_module(module), function)
    path = contractlib.FIXTURES_DIR / f"{name}.json"
    body = {"refreshed_by": "python tests/contracts/refresh.py", "facts": produce()}
    path.write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    return path


def update_sources(facts: list[contractlib.Fact]) -> list[Path]:
    """Rewrite each Ubuntu fact's `source` to the package its probe reads now (text edit: comments stay)."""
    changed: dict[Path, str] = {}
    for fact in facts:
        if not fact.probe or fact.checked != "fixture":
            continue
        now = contractlib.read_live(fact.probe).where
        if now != fact.source:
            path = contractlib.FACTS_DIR / f"{fact.file}.yaml"
            text = changed.get(path, path.read_text())
            changed[path] = text.replace(f"source: {fact.source}\n", f"source: {now}\n")
    for path, text in changed.items():
        path.write_text(text)
    return list(changed)


def write_table() -> Path:
    table = contractlib.render_table(contractlib.load_facts())
    doc = contractlib.ROLES_DOC
    doc.write_text(contractlib.doc_with_table(doc.read_text(), table))
    return doc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--table", action="store_true", help="only regenerate the docs/roles.md table")
    args = parser.parse_args(argv)
    if not args.table:
        if not contractlib.ubuntu_live():
            print(
                f"the Ubuntu archive ({contractlib.real.Archive.ubuntu().mirror}) does not answer: "
                "fixtures left as they are",
                file=sys.stderr,
            )
            return 1
        facts = contractlib.load_facts()
        for path in contractlib.write_fixtures(facts) + [_extra(n, t) for n, t in EXTRA_FIXTURES.items()]:
            print(f"wrote {path.relative_to(contractlib.REPO)}")
        for path in update_sources(facts):
            print(f"updated sources in {path.relative_to(contractlib.REPO)}")
    print(f"wrote the table in {write_table().relative_to(contractlib.REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
