"""Each molecule scenario of the roles, run against podman systemd test hosts (root, several minutes).

Select scenarios with GPUFLEET_MOLECULE_SCENARIOS=a,b (default: all). Logs and wall times land in the
test-host state dir (.lab/hosts/logs, .lab/hosts/timings.jsonl).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gpufleet.testhosts import molecule
from gpufleet.testhosts.workspace import state_dir

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.root
@pytest.mark.parametrize("scenario", molecule.selected_scenarios(ROOT))
def test_scenario(scenario: str, repo_url: str) -> None:
    log = state_dir() / "logs" / f"{scenario}.log"
    run = molecule.run_scenario(scenario, repo_url, project=ROOT, log=log)
    print(f"molecule {scenario}: {run.seconds:.1f} s")
    assert run.ok, (
        f"molecule test -s {scenario} failed (rc {run.returncode}, {run.seconds:.0f} s); "
        f"full log: {log}\n{molecule.log_tail(log)}"
    )
