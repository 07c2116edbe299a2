"""Fixtures for tests against a real Kubernetes control plane and kubelet (``gpufleet_harness.cluster``; 1.37
by default).

The lab is the session's shared one (fixture ``stack`` in tests/conftest.py, also used by tests/k8s_modules
and tests/validation): ``control_plane`` (~5 s) starts on first use, ``kubelet_node`` (~20 s) adds this
folder's ``lab-node`` to it; both stop at session end. Schedulers, fake nodes and namespaces are per test,
and so is every change a test makes to ``lab-node`` (labels, annotations, plugins): the node and the
control plane outlive the test and are shared with the other folders' tests.
"""

from __future__ import annotations

import contextlib
import secrets
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from labstack import LabStack

from gpufleet_harness.cluster.cluster import DEFAULT_SCHEDULER, ControlPlane, Scheduler, TestCluster
from gpufleet_harness.cluster.node import KubeletNode
from gpufleet_harness.cluster.process import wait_for


@pytest.fixture(scope="session")
def lab(stack: LabStack) -> TestCluster:
    """The session lab's directory and processes (see ``stack``); stopped and removed at session end."""
    return stack.lab


@pytest.fixture(scope="session")
def control_plane(stack: LabStack) -> ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager (nodelifecycle off) on free loopback ports."""
    return stack.control_plane


@pytest.fixture(scope="session")
def kubelet_node(stack: LabStack, lab: TestCluster, control_plane: ControlPlane) -> KubeletNode:
    """A real kubelet on containerd CRI, Ready and untainted; device plugins go in ``.device_plugin_dir``."""
    started = time.monotonic()
    node = lab.start_kubelet_node("lab-node", labels={"gpufleet.io/lab-node": "true"})
    stack.timings["kubelet node lab-node Ready"] = time.monotonic() - started
    return node


@pytest.fixture
def scheduler_factory(
    stack: LabStack, lab: TestCluster, control_plane: ControlPlane
) -> Iterator[Callable[..., Scheduler]]:
    """``scheduler_factory(extender_config=None, scheduler_name="default-scheduler")`` -> running scheduler.

    ``extender_config``: a path to YAML, a mapping with an ``extenders`` list, or the list. Every scheduler
    started through the factory stops when the test ends. While the test runs a ``default-scheduler`` of
    its own, the lab's (``stack.scheduler()``, if started) is paused, so only the test's places pods.
    """
    started: list[Scheduler] = []
    paused = contextlib.ExitStack()

    def factory(extender_config: Any = None, scheduler_name: str = DEFAULT_SCHEDULER) -> Scheduler:
        if scheduler_name == DEFAULT_SCHEDULER:
            paused.enter_context(stack.scheduler_paused())
        scheduler = lab.start_scheduler(extender_config, scheduler_name)
        started.append(scheduler)
        return scheduler

    with paused:
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
def namespace(core: k8s.CoreV1Api, control_plane: ControlPlane) -> Iterator[str]:
    """A fresh namespace whose ``default`` ServiceAccount exists (pods need it); deleted after."""
    name = f"t-{secrets.token_hex(4)}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))

    def default_sa() -> bool:
        try:
            account = core.read_namespaced_service_account("default", name)
        except ApiException:
            return False
        # 1.20's ServiceAccount admission refuses pods until the tokens controller made the token Secret;
        # from 1.24 pods get a projected token and no Secret is made
        return bool(account.secrets) or not control_plane.legacy

    wait_for(f"ServiceAccount {name}/default", default_sa, 30, interval=0.2)
    yield name
    core.delete_namespace(name, grace_period_seconds=0)


@pytest.fixture
def lab_timings(stack: LabStack) -> dict[str, float]:
    """Wall times a test adds to the lab's terminal summary (``name -> seconds``)."""
    return stack.timings
