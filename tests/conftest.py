"""Fixtures shared by every test folder: the simulator library and sim roots.

pynvml loads libnvidia-ml.so.1 once per process and the loader reads LD_LIBRARY_PATH only at start-up, so
tests that touch NVML do it in child processes pointed at a sim root (see each folder's helpers).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from gpufleet.sim import build as simbuild
from gpufleet.sim import machine as simmachine


@pytest.fixture(scope="session")
def sim_lib() -> Path:
    """The simulator library, built once (and cached across sessions by source hash)."""
    return simbuild.build_library()


@pytest.fixture(scope="session")
def sim_root(sim_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A sim root per fixture, materialized once per session. Never inject failures into these."""
    cache: dict[str, Path] = {}

    def get(fixture: str) -> Path:
        if fixture not in cache:
            cache[fixture] = simmachine.materialize(fixture, tmp_path_factory.mktemp(fixture) / "root",
                                                    library=sim_lib)
        return cache[fixture]

    return get


@pytest.fixture
def fresh_root(sim_lib: Path, tmp_path: Path) -> Callable[[str], Path]:
    """A private sim root, for tests that inject failures."""

    def make(fixture: str) -> Path:
        return simmachine.materialize(fixture, tmp_path / f"root-{Path(fixture).stem}", library=sim_lib)

    return make
