"""Fixtures: a fake clock, an in-memory API, and extenders running over it."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from extender_builders import FakeClock, load_fixture, serve

from gpufleet.extender.server import ExtenderServer
from gpufleet.extender.service import Extender
from gpufleet.extender.settings import Settings
from gpufleet_harness.memapi import InMemoryCluster


@pytest.fixture
def clock() -> FakeClock:
    """A fake clock shared by the cluster and the extender."""
    return FakeClock()


@pytest.fixture
def cluster(clock: FakeClock) -> InMemoryCluster:
    """An empty in-memory API."""
    return InMemoryCluster(clock)


@pytest.fixture
def start_extender(cluster: InMemoryCluster, clock: FakeClock) -> Iterator[Callable[..., Extender]]:
    """Start extenders over `cluster` (several calls: several replicas); all stop at teardown."""
    started: list[Extender] = []

    def start(target: InMemoryCluster | None = None, **overrides: Any) -> Extender:
        extender = Extender(Settings(**overrides), target or cluster, clock)
        extender.start()
        assert extender.wait_synced(5.0)
        started.append(extender)
        return extender

    yield start
    for extender in started:
        extender.stop()


@pytest.fixture
def world(cluster, start_extender):  # type: ignore[no-untyped-def]
    """The fixture cluster loaded, the scheduled pod created, one extender synced."""
    doc = load_fixture("cluster.json")
    for n in doc["nodes"]:
        cluster.add_node(n)
    for p in doc["pods"]:
        cluster.add_pod(p)
    cluster.add_pod(load_fixture("filter_nodenames.json")["Pod"])
    return start_extender()


@pytest.fixture
def server(world) -> Iterator[ExtenderServer]:  # type: ignore[no-untyped-def]
    """`world`'s extender served over HTTP on a free loopback port, under the prefix /gpufleet."""
    settings = Settings(listen_address="127.0.0.1", port=0, url_prefix="/gpufleet")
    srv = serve(world, settings)
    yield srv
    srv.shutdown()
    srv.server_close()
