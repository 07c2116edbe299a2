"""Fixtures for the test-host tooling and the roles' molecule scenarios."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet.testhosts import molecule
from gpufleet.testhosts.workspace import HOST_PACKAGES, missing_tools

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def host_tools() -> None:
    """Fail (not skip) with the apt command when the test-host tools are missing: CI must install them."""
    missing = missing_tools()
    if missing:
        pytest.fail(
            "the molecule scenarios need "
            + ", ".join(missing)
            + f"; install with: apt-get install -y {' '.join(HOST_PACKAGES)}",
            pytrace=False,
        )
    if os.geteuid() != 0:
        pytest.fail("the molecule scenarios need root (podman with systemd test hosts)", pytrace=False)


@pytest.fixture(scope="session")
def repo_url(host_tools: None) -> Iterator[str]:
    """The signed stand-in NVIDIA repository, served for the whole session; its URL as test hosts see it."""
    molecule.prepare_images(molecule.selected_scenarios(ROOT), ROOT)
    with molecule.served_repo() as (_repo, url):
        yield url
