"""Fixtures for tests against a real Kubernetes 1.20 control plane and kubelet (``gpufleet.lab``).

One lab per test session: ``control_plane`` (~5 s) and ``kubelet_node`` (~20 s) start on first use and
stop at session end. Schedulers, fake nodes and namespaces are per test. Needs root and the binaries
built from Debian's source (``python -m gpufleet.lab.k8s_build``; a cold build takes ~8 min and is cached).
Set ``GPUFLEET_LAB_KEEP=1`` to keep the lab directory (logs, configs) after the run.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpufleet.lab.cluster import ControlPlane, Lab, Scheduler
from gpufleet.lab.k8s_build import BuildError, K8sArtifacts, ensure_k8s
from gpufleet.lab.node import KubeletNode
from gpufleet.lab.process import wait_for

TIMINGS: dict[str, float] = {}


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Print how long the lab took to come up (build/cache, control plane, node Ready)."""
    if TIMINGS:
        parts = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in TIMINGS.items())
        terminalreporter.write_line(f"gpufleet lab timings: {parts}")


@pytest.fixture(scope="session")
def k8s_binaries() -> K8sArtifacts:
    """The cached Kubernetes 1.20 build, built now if missing; fails (never skips) when it cannot be."""
    if os.geteuid() != 0:
        pytest.fail("cluster tests need root (namespaces, mounts, veth, cgroups)")
    started = time.monotonic()
    try:
        artifacts = ensure_k8s()
    except BuildError as err:
        pytest.fail(f"Kubernetes binaries unavailable: {err}")
    TIMINGS["k8s binaries"] = time.monotonic() - started
    return artifacts


@pytest.fixture(scope="session")
def lab(k8s_binaries: K8sArtifacts) -> Iterator[Lab]:
    """The session's lab directory; everything started in it is stopped and removed at the end."""
    with Lab(k8s_binaries, keep=os.environ.get("GPUFLEET_LAB_KEEP") == "1") as the_lab:
        yield the_lab


@pytest.fixture(scope="session")
def control_plane(lab: Lab) -> ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager (nodelifecycle off) on free loopback ports."""
    started = time.monotonic()
    cp = lab.start_control_plane()
    TIMINGS["control plane up"] = time.monotonic() - started
    return cp


@pytest.fixture(scope="session")
def kubelet_node(lab: Lab, control_plane: ControlPlane) -> KubeletNode:
    """A real kubelet + dockerd node, Ready and untainted; device plugins go in ``.device_plugin_dir``."""
    started = time.monotonic()
    node = lab.start_kubelet_node("lab-node", labels={"gpufleet.io/lab-node": "true"})
    TIMINGS["kubelet node Ready"] = time.monotonic() - started
    return node


@pytest.fixture
def scheduler_factory(lab: Lab, control_plane: ControlPlane) -> Iterator[Callable[..., Scheduler]]:
    """``scheduler_factory(extender_config=None, scheduler_name="default-scheduler")`` -> running scheduler.

    ``extender_config``: a path to YAML, a mapping with an ``extenders`` list, or the list. Every scheduler
    started through the factory stops when the test ends.
    """
    started: list[Scheduler] = []

    def factory(extender_config: Any = None, scheduler_name: str = "default-scheduler") -> Scheduler:
        scheduler = lab.start_scheduler(extender_config, scheduler_name)
        started.append(scheduler)
        return scheduler

    yield factory
    for scheduler in started:
        scheduler.stop()


@pytest.fixture
def kube_client(control_plane: ControlPlane) -> Callable[..., k8s.ApiClient]:
    """``kube_client(user="admin", token=None)`` -> a ``kubernetes`` ApiClient for the lab."""

    def make(user: str = "admin", token: str | None = None) -> k8s.ApiClient:
        return control_plane.api_client(user, token=token)

    return make


@pytest.fixture
def core(control_plane: ControlPlane) -> k8s.CoreV1Api:
    """CoreV1Api as the lab admin."""
    return control_plane.core_v1()


@pytest.fixture
def fake_node(control_plane: ControlPlane) -> Iterator[Callable[..., k8s.V1Node]]:
    """``fake_node(name, capacity=None, labels=None, annotations=None)``: a Ready kubelet-less Node,
    deleted when the test ends."""
    created: list[str] = []
    core = control_plane.core_v1()

    def make(
        name: str,
        capacity: Mapping[str, str | int] | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> k8s.V1Node:
        node = control_plane.fake_node(name, capacity, labels, annotations)
        created.append(name)
        return node

    yield make
    for name in created:
        try:
            core.delete_node(name)
        except ApiException as err:
            if err.status != 404:
                raise


@pytest.fixture
def namespace(core: k8s.CoreV1Api) -> Iterator[str]:
    """A fresh namespace whose ``default`` ServiceAccount has its token (pods need it); deleted after."""
    name = f"t-{secrets.token_hex(4)}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))

    def default_sa_token() -> bool:
        try:
            account = core.read_namespaced_service_account("default", name)
        except ApiException:
            return False
        # the ServiceAccount admission plugin refuses pods until the tokens controller made the secret
        return bool(account.secrets)

    wait_for(f"ServiceAccount {name}/default and its token", default_sa_token, 30, interval=0.2)
    yield name
    core.delete_namespace(name, grace_period_seconds=0)


@pytest.fixture
def lab_timings() -> dict[str, float]:
    """Wall times a test adds to the lab's terminal summary (``name -> seconds``)."""
    return TIMINGS
