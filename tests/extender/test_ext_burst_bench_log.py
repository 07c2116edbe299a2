"""bench/burst_bench.py counts kube-scheduler's bind rejections on 1.20 and 1.37 alike.

The lines (fixtures/kube-scheduler-*.log) are kube-scheduler's own, from burst bench runs on this project's
cached builds (1.20.2 and 1.37.2, November 2026); 1.37 no longer wraps a failed bind as "binding rejected"
(schedule_one.go passes the extender's error through), so a count of that phrase reported 0 rejections on 1.37
whatever happened.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "burst_bench.py"
FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("burst_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("burst_bench", module)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("version", "expected"), [("1.20.2", (1, 1)), ("1.37.2", (2, 1))])
def test_bind_rejections_and_other_errors_are_told_apart_on_both_versions(bench, version, expected) -> None:  # type: ignore[no-untyped-def]
    assert bench.scheduler_rejections(FIXTURES / f"kube-scheduler-{version}.log") == expected
