"""gpufleet's pods under Pod Security admission, which kube-apiserver enables from 1.25 (on 1.37 here).

The lab's API server keeps PSA's default (``privileged`` wherever a namespace says nothing), as kubeadm does;
operators tighten it per namespace with the ``pod-security.kubernetes.io/enforce`` label (or for the whole
cluster in an AdmissionConfiguration). Each test deploys into a namespace it labels itself:

- the extender needs nothing a ``restricted`` namespace forbids, so its pods must be admitted there;
- the device plugin needs hostPath (the kubelet's device-plugins directory, the host root) and so a
  ``privileged`` namespace: in a ``baseline`` one the DaemonSet controller's pods are refused, and the
  module's wait must say so rather than "no pods yet".
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.rest import ApiException
from labstack import LabStack, run_tasks, wait_until
from modargs import DEVICE_PLUGIN, EXTENDER, admin_args, lab_extender_args, lab_plugin_args

pytestmark = pytest.mark.cluster

ENFORCE = "pod-security.kubernetes.io/enforce"


@pytest.fixture
def labelled_namespace(stack: LabStack) -> Iterator[Any]:
    """``labelled_namespace(level)``: a fresh namespace with PSA's enforce label at ``level``; the module
    deployments in it and the namespace are removed after the test."""
    if stack.control_plane.legacy:  # only with GPUFLEET_K8S_VERSION=1.20
        pytest.skip(f"Pod Security admission came in 1.25; this lab runs {stack.lab.artifacts.git_version}")
    core = stack.control_plane.core_v1()
    made: list[str] = []

    def make(level: str) -> str:
        name = f"psa-{level}-{secrets.token_hex(3)}"
        core.create_namespace({"metadata": {"name": name, "labels": {ENFORCE: level}}})
        made.append(name)
        return name

    yield make
    for name in made:
        with contextlib.suppress(ApiException):
            core.delete_namespace(name, grace_period_seconds=0)


def _into(stack: LabStack, ns: str, name: str, lab_args: dict[str, Any], **extra: Any) -> dict[str, Any]:
    """Module arguments deploying ``name`` into ``ns``, which the test made (never the module)."""
    return admin_args(stack, **lab_args) | {"name": name, "namespace": ns, "create_namespace": False} | extra


def _warnings(stack: LabStack, namespace: str) -> list[str]:
    core = stack.control_plane.core_v1()
    events = core.list_namespaced_event(namespace, field_selector="type=Warning").items
    return [f"{e.involved_object.kind} {e.reason}: {e.message}" for e in events]


def test_the_extender_is_admitted_in_a_restricted_namespace(
    stack: LabStack, labelled_namespace: Any, tmp_path: Path
) -> None:
    """Non-root, no privilege escalation, no capabilities, RuntimeDefault seccomp: ``restricted`` admits
    the module's extender pods (its own deploy/extender/deployment.yaml sets the same). Asked for the host's
    network, which restricted forbids, the module's wait names PodSecurity's refusal."""
    stack.nodes()
    ns = labelled_namespace("restricted")
    args = _into(
        stack, ns, "gpufleet-extender", lab_extender_args(stack),
        host_network=False,  # host namespaces are not for restricted (nor baseline) namespaces
        replicas=1, node_selector={"kubernetes.io/hostname": "gpu-a"}, service_type="ClusterIP", wait=False,
    )  # fmt: skip
    core = stack.control_plane.core_v1()
    try:
        # host network is beyond restricted: the Deployment's ReplicaSet gets no pod, and the wait names why
        host = run_tasks([{EXTENDER: args | {"host_network": True, "wait": True, "wait_timeout": 20}}],
                         tmp_path).task()  # fmt: skip
        assert host["failed"], host
        assert f"Deployment {ns}/gpufleet-extender not rolled out after 20s" in host["msg"], host["msg"]
        assert 'event FailedCreate: Error creating: pods "gpufleet-extender-' in host["msg"], host["msg"]
        assert 'violates PodSecurity "restricted:latest": host namespaces (hostNetwork=true)' in host["msg"]

        result = run_tasks([{EXTENDER: args}], tmp_path).task()
        assert not result.get("failed"), result.get("msg")

        def admitted() -> list[str]:
            return [p.metadata.name for p in core.list_namespaced_pod(ns).items]

        def refused() -> list[str]:
            return [w for w in _warnings(stack, ns) if "FailedCreate" in w]

        wait_until("an extender pod admitted", admitted, 120)
        assert all("hostNetwork" in w for w in refused()), refused()  # only the first Deployment's
        pod = core.read_namespaced_pod(admitted()[0], ns)
        assert pod.spec.security_context.seccomp_profile.type == "RuntimeDefault"
        assert pod.spec.security_context.run_as_non_root is True
    finally:
        run_tasks([{EXTENDER: {**args, "state": "absent"}}], tmp_path)


def test_the_device_plugin_refused_by_a_baseline_namespace_is_named(
    stack: LabStack, labelled_namespace: Any, tmp_path: Path
) -> None:
    """hostPath is beyond ``baseline``: the DaemonSet gets no pod, and the module's failure carries the
    DaemonSet controller's FailedCreate event with PSA's reason, not only "no pods yet"."""
    stack.nodes()
    ns = labelled_namespace("baseline")
    args = _into(stack, ns, "gpufleet-device-plugin", lab_plugin_args(stack),
                 node_selector={"gpufleet.io/lab-gpus": "whole"}, expected_gpus={"gpu-a": 8},
                 wait_timeout=30)  # fmt: skip
    try:
        result = run_tasks([{DEVICE_PLUGIN: args}], tmp_path).task()
        assert result["failed"], result
        msg = result["msg"]
        assert f"DaemonSet {ns}/gpufleet-device-plugin not rolled out after 30s" in msg, msg
        assert "event FailedCreate:" in msg and 'violates PodSecurity "baseline:latest"' in msg, msg
        assert "hostPath volumes" in msg, msg
    finally:
        run_tasks([{DEVICE_PLUGIN: {**args, "state": "absent"}}], tmp_path)
