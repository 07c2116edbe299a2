"""README statements that the code answers, generated so that they cannot go stale: the collection's
modules (``plugins/modules/*.py``) and the simulator's machine fixtures (``gpufleet sim list``).

README.md marks each generated span ``<!-- generated:NAME -->...<!-- /generated:NAME -->``; the markers
stay, the text between them is replaced. ``python -m gpufleet_harness.docfacts`` says which spans differ
(exit 1), ``--write`` rewrites them. tests/docs/test_readme_facts.py fails while a span differs.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from gpufleet_harness.sim import machine as simmachine

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
MODULES_DIR = REPO / "plugins" / "modules"
COLLECTION = "gpufleet.nvidia"
WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten", "eleven", "twelve",
    "thirteen", "fourteen", "fifteen", "sixteen", "seventeen", "eighteen", "nineteen", "twenty",
]  # fmt: skip
SPAN = re.compile(r"(<!-- generated:(?P<name>[a-z-]+) -->)(?P<body>.*?)(<!-- /generated:(?P=name) -->)", re.S)


def number(n: int) -> str:
    """A count as the README writes it: a word up to twenty, digits beyond."""
    return WORDS[n] if 0 <= n < len(WORDS) else str(n)


def module_names(directory: Path = MODULES_DIR) -> list[str]:
    """The collection's modules: every ``plugins/modules/*.py`` but ``__init__``."""
    return sorted(p.stem for p in directory.glob("*.py") if not p.stem.startswith("_"))


def modules_text() -> str:
    names = module_names()
    return f"{number(len(names))} modules: " + ", ".join(f"`{n}`" for n in names)


def fixture_count_text() -> str:
    return f"{number(len(simmachine.fixture_names()))} machine fixtures"


def fixtures_text() -> str:
    """The fixtures as `gpufleet sim list` prints them, one bullet each."""
    names = simmachine.fixture_names()
    lines = [f"{number(len(names)).capitalize()} fixtures (`gpufleet sim list`):", ""]
    lines += [f"- `{name}`: {simmachine.fixture_description(name)}" for name in names]
    return "\n" + "\n".join(lines) + "\n"


GENERATORS: dict[str, Callable[[], str]] = {
    "modules": modules_text,
    "fixture-count": fixture_count_text,
    "fixtures": fixtures_text,
}


def render(text: str) -> str:
    """``text`` with every generated span rewritten; an unknown span name is an error."""

    def replace(match: re.Match[str]) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise KeyError(f"README span generated:{name} has no generator (known: {', '.join(GENERATORS)})")
        return f"{match.group(1)}{GENERATORS[name]()}{match.group(4)}"

    return SPAN.sub(replace, text)


def spans(text: str) -> dict[str, str]:
    """Name -> current text of each generated span."""
    return {m.group("name"): m.group("body") for m in SPAN.finditer(text)}


def stale(text: str) -> list[str]:
    """Names of the spans whose text differs from what the code says now (or that are missing)."""
    now, want = spans(text), spans(render(text))
    return [name for name in GENERATORS if name not in now or now[name] != want[name]]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gpufleet_harness.docfacts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help="rewrite the stale spans of README.md")
    parser.add_argument("--readme", type=Path, default=README)
    args = parser.parse_args(argv)
    text = args.readme.read_text()
    differ = stale(text)
    if args.write and differ:
        args.readme.write_text(render(text))
        print(f"rewrote {', '.join(differ)} in {args.readme}")
        return 0
    for name in differ:
        print(f"{args.readme}: generated:{name} is stale (python -m gpufleet_harness.docfacts --write)")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())


# ---------------------------------------------------------------------------------------------- role READMEs
ROLES_DIR = REPO / "roles"
ROW = re.compile(r"^\| `(?P<name>[a-z0-9_]+)` \|", re.M)


def _spec_options(role: str) -> dict[str, dict[str, object]]:
    """Every option of every entry point of the role's argument spec, in spec order."""
    import yaml

    spec = yaml.safe_load((ROLES_DIR / role / "meta" / "argument_specs.yml").read_text())["argument_specs"]
    options: dict[str, dict[str, object]] = {}
    for entry in spec.values():
        for name, option in ((entry or {}).get("options") or {}).items():
            options.setdefault(name, option or {})
    return options


def _value(value: object) -> str:
    """A default as YAML writes it: true, [], {a: b}, a string as it is."""
    import yaml

    if isinstance(value, str):
        return value
    text = str(yaml.safe_dump(value, default_flow_style=True, width=10_000)).strip()
    return text.removesuffix("...").strip()


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def variable_row(role: str, name: str) -> str:
    """One row of a role README's variables table, from the argument spec (as the existing tables are)."""
    option = _spec_options(role)[name]
    default = f"`{_value(option['default'])}`" if "default" in option else "*(see defaults/main.yml)*"
    description = option.get("description", "")
    if isinstance(description, list):
        description = " ".join(str(d) for d in description)
    text = _cell(str(description))
    if option.get("choices"):
        text += " One of " + ", ".join(f"`{c}`" for c in option["choices"]) + "."  # type: ignore[attr-defined]
    return f"| `{name}` | {_cell(str(default))} | {text} |"


def role_readme_gaps(role: str) -> tuple[list[str], list[str]]:
    """(variables of the role's argument spec its README's table lacks, rows naming no such variable)."""
    readme = ROLES_DIR / role / "README.md"
    listed = ROW.findall(readme.read_text()) if readme.is_file() else []
    options = _spec_options(role)
    return [n for n in options if n not in listed], [n for n in listed if n not in options]


def roles() -> list[str]:
    return sorted(p.parent.parent.name for p in ROLES_DIR.glob("*/meta/argument_specs.yml"))
