"""What README.md and the role READMEs say about the code is what the code has (issue 30 item 7).

README's module list and fixture count and list are generated (gpufleet_harness.docfacts: `python -m
gpufleet_harness.docfacts --write` rewrites them); each role README's variables table lists exactly the
options of the role's meta/argument_specs.yml. Before: "five machine fixtures" (six), six modules named
(eight), gpufleet_kubernetes without a README, gpu_host_prep's without its EL variables, nvidia_driver's
without nvidia_driver_smi_expected_rc.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from gpufleet_harness import docfacts

README = docfacts.README.read_text()


def test_readme_spans_are_what_the_code_says_now() -> None:
    assert set(docfacts.spans(README)) == set(docfacts.GENERATORS), "a generated span lost its markers"
    assert docfacts.stale(README) == [], "run: python -m gpufleet_harness.docfacts --write"


def test_the_module_list_is_every_module_of_the_collection() -> None:
    listed = re.findall(r"`([a-z_]+)`", docfacts.spans(README)["modules"])
    on_disk = sorted(p.stem for p in docfacts.MODULES_DIR.glob("*.py"))
    assert listed == on_disk and len(on_disk) >= 8
    count = docfacts.spans(README)["modules"].split()[0]
    assert count == docfacts.number(len(on_disk))


def test_the_fixtures_are_what_gpufleet_sim_list_prints() -> None:
    argv = [sys.executable, "-m", "gpufleet.cli", "sim", "list"]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=120).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    listed = re.findall(r"^- `([a-z0-9-]+)`: ", docfacts.spans(README)["fixtures"], re.M)
    assert listed == names and len(names) >= 6
    assert docfacts.spans(README)["fixture-count"] == f"{docfacts.number(len(names))} machine fixtures"


def test_a_stale_span_is_found_and_rewritten(tmp_path) -> None:  # type: ignore[no-untyped-def]
    readme = tmp_path / "README.md"
    readme.write_text(README.replace(docfacts.spans(README)["fixture-count"], "five machine fixtures"))
    assert docfacts.main(["--readme", str(readme)]) == 1
    assert docfacts.main(["--readme", str(readme), "--write"]) == 0
    assert readme.read_text() == README


@pytest.mark.parametrize("role", docfacts.roles())
def test_each_role_readme_lists_every_variable_of_its_argument_spec(role: str) -> None:
    missing, unknown = docfacts.role_readme_gaps(role)
    rows = "\n".join(docfacts.variable_row(role, name) for name in missing)
    assert not missing, f"roles/{role}/README.md lacks (rows from the argument spec):\n{rows}"
    assert not unknown, f"roles/{role}/README.md lists variables its argument spec lacks: {unknown}"
