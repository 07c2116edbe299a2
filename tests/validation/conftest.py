"""Fixtures for the validation tests. The lab pieces (cluster, GPU nodes, image) come from
tests/k8s_modules/labstack.py; running the validation CLI from validation_run.py."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s_modules"))


_STACKS: list[Any] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How long the lab's pieces and the suites took."""
    if _STACKS and _STACKS[0].timings:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in _STACKS[0].timings.items())
        terminalreporter.write_line(f"gpufleet validation lab timings: {parts}")


@pytest.fixture(scope="session")
def stack(sim_lib: Path) -> Iterator[Any]:
    """The lab of tests/k8s_modules/labstack.py (a separate one for this folder's session)."""
    from labstack import LabStack

    if os.geteuid() != 0:
        pytest.fail("cluster tests need root (namespaces, mounts, veth, cgroups)")
    the_stack = LabStack(sim_lib)
    _STACKS.append(the_stack)
    try:
        yield the_stack
    finally:
        the_stack.close()
