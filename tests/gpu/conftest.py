"""Fixtures for GPU discovery tests: hand-built host trees, sim roots, no NVML in the test process.

pynvml loads libnvidia-ml.so.1 once per process and the loader reads LD_LIBRARY_PATH only at start-up,
so everything that touches NVML runs in a child interpreter (gpu_helpers.run_in_sim). The test process
itself is kept away from NVML: this machine may have a real, driverless libnvidia-ml.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import FakeHost

from gpufleet.gpu import NvmlUnavailable
from gpufleet.gpu import nvml as gpu_nvml
from gpufleet.sim import build as simbuild
from gpufleet.sim import machine as simmachine


@pytest.fixture(autouse=True)
def _no_nvml_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> Any:
        raise NvmlUnavailable("NVML is only used in child processes in these tests")

    monkeypatch.setattr(gpu_nvml, "load_pynvml", refuse)


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    """An empty hand-built host tree."""
    return FakeHost(tmp_path / "host")


@pytest.fixture(scope="session")
def sim_lib() -> Path:
    """The simulator library, built once (and cached across sessions by source hash)."""
    return simbuild.build_library()


@pytest.fixture(scope="session")
def sim_root(sim_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A sim root per fixture, materialized once per session. Never inject into these."""
    cache: dict[str, Path] = {}

    def get(fixture: str) -> Path:
        if fixture not in cache:
            root = tmp_path_factory.mktemp(fixture)
            cache[fixture] = simmachine.materialize(fixture, root, library=sim_lib)
        return cache[fixture]

    return get


@pytest.fixture
def fresh_root(sim_lib: Path, tmp_path: Path) -> Callable[[str], Path]:
    """A private sim root, for tests that inject failures."""

    def make(fixture: str) -> Path:
        return simmachine.materialize(fixture, tmp_path / fixture, library=sim_lib)

    return make
