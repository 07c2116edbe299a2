"""The cluster and workload suites against the lab: real kube-apiserver, kube-scheduler with the extender,
kubelets with simulated GPUs, everything deployed by gpufleet's modules through ansible-playbook.

gpu-a (dgx-a100, whole GPUs) and gpu-b (pcie-2x-t4, GPU-memory sharing): the suites pass, with Debian's
Prometheus scraping both plugins' /metrics for the GPU metrics checks; then the whole-GPU plugin is removed
and the cluster suite fails naming gpu-a, and the metrics check naming its GPUs.
"""

from __future__ import annotations

import contextlib
import json
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client.rest import ApiException
from labstack import SIM_DIR, LabStack, run_tasks, timed, wait_until
from validation_run import validate

from gpufleet_harness.prometheus import Prometheus, ScrapeTarget

pytestmark = pytest.mark.cluster

DP = "gpufleet.nvidia.gpu_device_plugin"
NAMESPACE = "gpufleet-system"
EXT = "gpufleet.nvidia.gpu_scheduler_extender"
METRICS_PORT = 9402  # the plugins' /metrics, on each node's network (host network pods)


def _plugin_args(
    stack: LabStack, name: str, selector: dict[str, str], expected: dict[str, int], config: dict[str, Any]
) -> dict[str, Any]:
    return {
        "kubeconfig": str(stack.control_plane.kubeconfig()),
        "name": name,
        "namespace": NAMESPACE,
        "image": stack.image.name,
        "image_pull_policy": "Never",
        "host_network": True,
        "env": stack.pod_env(),
        "host_root": f"{SIM_DIR}/host",
        "extra_volumes": stack.sim_volumes(),
        "node_selector": selector,
        "expected_gpus": expected,
        "plugin_config": {"http": {"port": METRICS_PORT}, "telemetry": {"interval": 1}, **config},
        "wait_timeout": 180,
    }


@pytest.fixture(scope="module")
def deployed(stack: LabStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """Both plugins, the extender and the scheduler configured for it, through the modules; all removed
    and the lab's scheduler back without the extender afterwards (the lab is shared with other folders)."""
    tmp = tmp_path_factory.mktemp("deploy")
    nodes = stack.nodes()
    stack.expose_probe_port(8800)
    stack.expose_probe_port(METRICS_PORT)  # the plugins' liveness probe (/healthz beside /metrics)
    whole = _plugin_args(stack, "gpufleet-device-plugin", {"gpufleet.io/lab-gpus": "whole"}, {"gpu-a": 8}, {})
    memory = _plugin_args(
        stack,
        "gpufleet-device-plugin-mem",
        {"gpufleet.io/gpu-sharing": "memory"},
        {"gpu-b": 2},
        {"sharing": {"mode": "memory"}},
    )
    config_file = tmp / "scheduler-config.yaml"
    extender = {
        "kubeconfig": str(stack.control_plane.kubeconfig()),
        "image": stack.image.name,
        "image_pull_policy": "Never",
        "replicas": 1,
        "host_network": True,
        "service_type": "ClusterIP",
        "env": {k: v for k, v in stack.pod_env().items() if k.startswith("KUBERNETES_")},
        "node_selector": {"kubernetes.io/hostname": "gpu-a"},
        "settings": {"lock_ttl": 30},
        # the lab's scheduler reads v1 (1.25 and later; v1beta1 with the opt-in 1.20)
        "scheduler_config_version": "v1beta1" if stack.control_plane.legacy else "v1",
        "scheduler_config_file": str(config_file),
        "scheduler_config": {"url": f"http://{nodes['gpu-a'].node.peer_ip}:8800/gpufleet"},
        "wait_timeout": 120,
    }
    try:
        with timed(stack.timings, "deploy both plugins + extender (3 module tasks)"):
            run = run_tasks([{DP: whole}, {DP: memory}, {EXT: extender}], tmp)
        for result in run.results:
            assert not result.get("failed"), result.get("msg")
        stack.scheduler(str(config_file))  # the lab's kube-scheduler, now calling the extender
        yield {"whole": whole, "memory": memory, "tmp": tmp}
    finally:
        stack.scheduler()  # the lab's kube-scheduler as it was: no extender
        # Removed without waiting for the namespace to be finalized (a minute or more on a busy machine):
        # what matters to the next test is that no plugin or extender pod is left.
        absent = {"state": "absent", "wait": False}
        with timed(stack.timings, "remove both plugins + extender"):
            undo = run_tasks([{EXT: {**extender, **absent}}, {DP: {**memory, **absent}},
                              {DP: {**whole, **absent}}], tmp)  # fmt: skip
            for result in undo.results:
                assert not result.get("failed"), result.get("msg")
            core = stack.control_plane.core_v1()
            with contextlib.suppress(ApiException):  # 404: the modules removed it already
                core.delete_namespace(NAMESPACE)
            wait_until(f"no pod left in {NAMESPACE}",
                       lambda: not core.list_namespaced_pod(NAMESPACE).items, 180)  # fmt: skip


@pytest.fixture(scope="module")
def prometheus(stack: LabStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    """Debian's Prometheus scraping both nodes' device plugins, each target labelled with its node."""
    nodes = stack.nodes()
    targets = [ScrapeTarget(f"{n.node.peer_ip}:{METRICS_PORT}", {"node": name}) for name, n in nodes.items()]
    with Prometheus(tmp_path_factory.mktemp("prometheus"), targets, interval_s=1) as server:
        yield server


def _with_prometheus(expectations: dict[str, Any], prometheus: Prometheus) -> dict[str, Any]:
    expectations["cluster"]["prometheus"] = {"url": prometheus.url, "timeout": 20}
    return expectations


def _expectations(stack: LabStack) -> dict[str, Any]:
    return {
        "hosts": {
            "gpu-a": {"gpu_count": 8, "gpu_model": "A100", "nvlink": True},
            "gpu-b": {"gpu_count": 2, "gpu_model": "T4", "sharing": "memory"},
        },
        "cluster": {
            "kubeconfig": str(stack.control_plane.kubeconfig()),
            "namespace": f"validate-{secrets.token_hex(3)}",
            "workload": {
                "image": stack.image.name,
                "image_pull_policy": "Never",
                "timeout": 90,
                "gpu_mem_gib": 4,
                "env": {k: v for k, v in stack.pod_env().items() if not k.startswith("KUBERNETES_")},
                "volumes": stack.sim_volumes(),
            },
        },
    }


def test_cluster_and_workload_suites_pass_on_the_lab(
    stack: LabStack, deployed: dict[str, Any], tmp_path: Path
) -> None:
    with timed(stack.timings, "validation: cluster + workload suites"):
        run = validate(_expectations(stack), tmp_path, "cluster,workload")
    assert run.rc == 0, run.proc.stdout[-4000:] + run.proc.stderr[-2000:]
    outcomes = run.outcomes()
    assert outcomes[("gpu-a", "gpu_allocatable")] == "passed"
    assert outcomes[("gpu-b", "gpu_capacity")] == "passed"
    assert outcomes[("gpu-a", "one_gpu_pod_sees_exactly_one_gpu")] == "passed"
    assert outcomes[("gpu-a", "two_gpu_pod_gets_an_nvlink_pair")] == "passed"
    assert outcomes[("gpu-b", "gpu_memory_pod_lands_where_the_extender_put_it")] == "passed"
    assert run.report["hosts"]["gpu-a"] == {"cluster": "PASS 4/4", "workload": "PASS 2/2"}
    # every host has a workload check that applies to it: no SKIP row
    assert run.report["hosts"]["gpu-b"] == {"cluster": "PASS 4/4", "workload": "PASS 1/1"}


METRICS_CHECKS = ("gpu_series_in_prometheus", "gpu_pod_series_carry_its_pod_and_namespace")


def test_gpu_metrics_checks_pass_with_prometheus_scraping_the_plugins(
    stack: LabStack, deployed: dict[str, Any], prometheus: Prometheus, tmp_path: Path
) -> None:
    prometheus.wait_for('count(DCGM_FI_DEV_FB_USED{node="gpu-a"}) == 8', 120)
    expectations = _with_prometheus(_expectations(stack), prometheus)
    with timed(stack.timings, "validation: cluster suite with GPU metrics"):
        run = validate(expectations, tmp_path, "cluster")
    assert run.rc == 0, run.proc.stdout[-4000:] + run.proc.stderr[-2000:]
    for host in ("gpu-a", "gpu-b"):
        for check in METRICS_CHECKS:
            assert run.outcomes()[(host, check)] == "passed", run.table
    assert run.report["hosts"]["gpu-b"] == {"cluster": "PASS 6/6"}


def test_plugin_killed_fails_the_cluster_suite_naming_the_node(
    stack: LabStack, deployed: dict[str, Any], prometheus: Prometheus, tmp_path: Path
) -> None:
    core = stack.control_plane.core_v1()
    removed = run_tasks([{DP: {**deployed["whole"], "state": "absent", "wait_timeout": 60}}], tmp_path).task()
    assert not removed.get("failed"), removed.get("msg")
    # the shared namespace stays: the GPU-memory plugin and the extender still live there
    namespace = next(o for o in removed["objects"] if o["kind"] == "Namespace")
    assert namespace["action"] == "skipped" and "DaemonSet gpufleet-device-plugin-mem" in namespace["note"]

    def allocatable() -> bool:
        node = core.api_client.sanitize_for_serialization(core.read_node("gpu-a"))
        return node["status"]["allocatable"].get("nvidia.com/gpu") == "0"

    wait_until("gpu-a's allocatable GPUs to drop to 0", allocatable, 30)
    run = validate(_expectations(stack), tmp_path, "cluster")
    assert run.rc == 1
    failed = {key for key, outcome in run.outcomes().items() if outcome == "failed"}
    assert failed == {("gpu-a", "gpu_allocatable")}, run.table
    assert run.message("gpu-a", "gpu_allocatable") == (
        "gpu-a: node gpu-a has allocatable nvidia.com/gpu=0, expected 8 (capacity 8): "
        "the device plugin is not running or not registered on it"
    )
    assert "gpu-a cluster/gpu_allocatable: FAILED" in run.table

    # gpu-a's exporter went with its plugin: the metrics check names every one of its GPUs, gpu-b passes
    machine = json.loads((stack.nodes()["gpu-a"].sim_root / "machine.json").read_text())
    uuids = [g["uuid"] for g in machine["gpus"]]
    wait_until("gpu-a's scrape target down", lambda: not prometheus.query('up{node="gpu-a"} == 1'), 60)
    run = validate(_with_prometheus(_expectations(stack), prometheus), tmp_path / "metrics", "cluster",
                   "--", "-k", "gpu_series_in_prometheus")  # fmt: skip
    assert run.rc == 1
    assert run.outcomes()[("gpu-b", "gpu_series_in_prometheus")] == "passed", run.table
    message = run.message("gpu-a", "gpu_series_in_prometheus")
    assert message.startswith("gpu-a: node gpu-a: GPU 0 ("), message
    assert all(uuid in message for uuid in uuids), message
    assert "no DCGM_FI_DEV_FB_USED series in Prometheus" in message and "is down" in message, message


def test_time_sliced_node_passes_with_pods_sharing_a_gpu(
    stack: LabStack, deployed: dict[str, Any], tmp_path: Path
) -> None:
    """gpu-b switches from GPU-memory sharing to time-slicing (the operator's label: the memory plugin's
    DaemonSet leaves it, a time-slicing plugin, nvidia.com/gpu x 2 replicas, serves it). The extender leaves
    a time-sliced node's devices to the kubelet; the cluster suite counts 4 devices and the workload suite
    runs 3 pods at once there, two of them sharing a GPU."""
    core = stack.control_plane.core_v1()
    sliced = _plugin_args(
        stack,
        "gpufleet-device-plugin-ts",
        {"gpufleet.io/gpu-sharing": "time-slicing"},
        {"gpu-b": 2},
        {"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 2}}},
    )
    core.patch_node("gpu-b", {"metadata": {"labels": {"gpufleet.io/gpu-sharing": "time-slicing"}}})
    try:
        added = run_tasks([{DP: sliced}], tmp_path).task()
        assert not added.get("failed"), added.get("msg")
        expectations = _expectations(stack)
        expectations["hosts"] = {
            "gpu-b": {"gpu_count": 2, "gpu_model": "T4", "sharing": "time-slicing", "replicas": 2}
        }
        run = validate(expectations, tmp_path, "cluster,workload")
        assert run.rc == 0, run.proc.stdout[-4000:] + run.proc.stderr[-2000:]
        outcomes = run.outcomes()
        assert outcomes[("gpu-b", "gpu_capacity")] == "passed"
        assert outcomes[("gpu-b", "time_sliced_gpu_is_shared_by_pods_running_at_once")] == "passed"
        assert run.report["hosts"]["gpu-b"] == {"cluster": "PASS 4/4", "workload": "PASS 2/2"}
    finally:
        removed = run_tasks([{DP: {**sliced, "state": "absent", "wait_timeout": 60}}], tmp_path).task()
        core.patch_node("gpu-b", {"metadata": {"labels": {"gpufleet.io/gpu-sharing": "memory"}}})
        assert not removed.get("failed"), removed.get("msg")
