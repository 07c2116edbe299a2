"""Fixtures for the device plugin tests."""

from __future__ import annotations

import shutil
from collections.abc import Iterator

import pytest
from dp_helpers import FakeKubelet, short_dir


@pytest.fixture
def socket_dir() -> Iterator[str]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def kubelet(socket_dir: str) -> Iterator[FakeKubelet]:
    fake = FakeKubelet(socket_dir).start()
    yield fake
    fake.stop()


@pytest.fixture(scope="session")
def sim_library() -> str:
    """The simulated libnvidia-ml.so.1 (built once, cached); skips when it cannot be built here."""
    from gpufleet_harness.sim import build

    try:
        return str(build.build_library())
    except build.BuildError as exc:
        pytest.skip(f"GPU simulator unavailable: {exc}")
