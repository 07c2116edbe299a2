"""Fixtures for the Kubernetes modules' tests against the lab (see labstack.py): one lab per session."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from labstack import LabStack


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How long the lab's pieces took (build cache, control plane, nodes, image)."""
    stack = _STACKS[0] if _STACKS else None
    if stack and stack.timings:
        parts = ", ".join(f"{k} {v:.1f}s" for k, v in stack.timings.items())
        terminalreporter.write_line(f"gpufleet k8s-modules lab timings: {parts}")


_STACKS: list[LabStack] = []


@pytest.fixture(scope="session")
def stack(sim_lib: Path) -> Iterator[LabStack]:
    """The session's lab: control plane on first use, GPU nodes on ``stack.nodes()``."""
    if os.geteuid() != 0:
        pytest.fail("cluster tests need root (namespaces, mounts, veth, cgroups)")
    the_stack = LabStack(sim_lib)
    _STACKS.append(the_stack)
    try:
        yield the_stack
    finally:
        the_stack.close()
