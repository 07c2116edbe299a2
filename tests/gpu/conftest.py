"""Fixtures for GPU discovery tests: hand-built host trees, sim roots, no NVML in the test process.

pynvml loads libnvidia-ml.so.1 once per process and the loader reads LD_LIBRARY_PATH only at start-up,
so everything that touches NVML runs in a child interpreter (gpu_helpers.run_in_sim). The test process
itself is kept away from NVML: this machine may have a real, driverless libnvidia-ml.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import FakeHost

from gpufleet.gpu import NvmlUnavailable
from gpufleet.gpu import nvml as gpu_nvml


@pytest.fixture(autouse=True)
def _no_nvml_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse() -> Any:
        raise NvmlUnavailable("NVML is only used in child processes in these tests")

    monkeypatch.setattr(gpu_nvml, "load_pynvml", refuse)


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    """An empty hand-built host tree."""
    return FakeHost(tmp_path / "host")
