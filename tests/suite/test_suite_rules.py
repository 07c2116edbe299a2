"""The suite's own rules (tests/conftest.py): opt-in suites are deselected unless asked for, and past the time
deadline the tests not yet started fail at once, naming it. Each check runs a small pytest of its own."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# Pure tests (no root, no cluster): two modules whose tests finish in a second.
PURE = ["tests/architecture/test_import_cycles.py"]
LAB = "tests/lab/test_lab_site.py"


def _pytest(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    unwanted = ("GPUFLEET_LAB_TEST", "GPUFLEET_KUBEADM", "GPUFLEET_TEST_DEADLINE")
    clean = {k: v for k, v in os.environ.items() if k not in unwanted}
    clean.pop("PYTEST_ADDOPTS", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-n", "0", *args],
        cwd=REPO, env=clean | env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


def test_tests_past_the_deadline_fail_naming_it() -> None:
    run = _pytest(*PURE, GPUFLEET_TEST_DEADLINE=str(time.time() - 1))
    assert run.returncode == 1, run.stdout + run.stderr
    assert "not run: the run's deadline (GPUFLEET_TEST_DEADLINE" in run.stdout, run.stdout
    assert " passed" not in run.stdout.splitlines()[-1], run.stdout.splitlines()[-1]
    within = _pytest(*PURE, GPUFLEET_TEST_DEADLINE=str(time.time() + 3600))
    assert within.returncode == 0, within.stdout + within.stderr


def test_a_deadline_that_is_not_a_time_is_refused() -> None:
    run = _pytest(*PURE, GPUFLEET_TEST_DEADLINE="soon")
    assert run.returncode != 0
    assert "GPUFLEET_TEST_DEADLINE='soon' is not a Unix time" in run.stdout + run.stderr


def test_the_lab_test_is_deselected_unless_asked_for() -> None:
    unasked = _pytest("--collect-only", LAB)
    assert "deselected" in unasked.stdout.splitlines()[-1], unasked.stdout[-2000:]
    assert "test_site_converges_every_host_and_validation_is_green" not in unasked.stdout
    for asked in (
        _pytest("--collect-only", LAB, GPUFLEET_LAB_TEST="1"),
        _pytest("--collect-only", "-m", "lab", LAB),
    ):
        assert "test_site_converges_every_host_and_validation_is_green" in asked.stdout, asked.stdout[-2000:]
        assert "deselected" not in asked.stdout.splitlines()[-1], asked.stdout[-2000:]
