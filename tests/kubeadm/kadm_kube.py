"""The kubeadm tests' cluster, and what they ask its API server for: a namespace, a pod Running."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.process import ClusterError, wait_for
from gpufleet_harness.lab.hostsetup import HostError
from gpufleet_harness.lab.kubeadm import KubeadmCluster


def new_namespace(core: k8s.CoreV1Api, prefix: str) -> str:
    """A new namespace ``<prefix>-<random>``, once its ``default`` ServiceAccount exists (the ServiceAccount
    controller makes it; pods cannot be created before)."""
    name = f"{prefix}-{secrets.token_hex(3)}"
    core.create_namespace(k8s.V1Namespace(metadata=k8s.V1ObjectMeta(name=name)))
    wait_for(
        f"ServiceAccount default in {name}",
        lambda: any(sa.metadata.name == "default" for sa in core.list_namespaced_service_account(name).items),
        60,
    )
    return name


def running(core: k8s.CoreV1Api, namespace: str, name: str, timeout: float = 180) -> k8s.V1Pod:
    """The pod once Running; AssertionError with its phase, node and events otherwise."""

    def probe() -> Any:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status.phase == "Running" else None

    try:
        return wait_for(f"pod {namespace}/{name} Running", probe, timeout, interval=1)
    except ClusterError as err:
        pod = core.read_namespaced_pod(name, namespace)
        events = core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}").items
        said = "; ".join(f"{e.reason}: {e.message}" for e in events)
        raise AssertionError(
            f"{err}: phase {pod.status.phase}, node {pod.spec.node_name}, events: {said}"
        ) from None


@contextlib.contextmanager
def kubeadm_cluster(artifacts: K8sArtifacts, *workers: tuple[str, str]) -> Iterator[KubeadmCluster]:
    """``kubeadm init`` on containerd 2.1 and ``kubeadm join`` of each (role, containerd minor) worker; the
    test fails with kubeadm's words when that does not work. Everything is removed afterwards."""
    with KubeadmCluster(artifacts) as made:
        try:
            made.init("2.1")
            for role, containerd in workers:
                made.join(role, containerd)
        except (HostError, ClusterError) as err:
            pytest.fail(f"kubeadm cluster: {err}")
        yield made


@contextlib.contextmanager
def core_api(cluster: KubeadmCluster) -> Iterator[k8s.CoreV1Api]:
    """The core API as kubeadm's admin."""
    api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    try:
        yield k8s.CoreV1Api(api)
    finally:
        api.close()
