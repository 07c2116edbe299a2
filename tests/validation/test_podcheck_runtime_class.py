"""The validation pods' RuntimeClass: a host's own ``runtime_class`` wins over the cluster section's
``workload.runtime_class_name``; with neither the pod names none (nvidia is the default runtime)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "validation"))

from podcheck import Cluster


class _Pods:
    """Records the pods a check would create."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def create_namespaced_pod(self, namespace: str, body: dict[str, Any]) -> None:
        self.bodies.append(body)


def _cluster(workload: dict[str, Any]) -> tuple[Cluster, _Pods]:
    cluster = Cluster.__new__(Cluster)  # no API client: only the pod body is under test
    pods = _Pods()
    cluster.workload, cluster.namespace, cluster._output = workload, "v", "log"
    cluster._namespace_ready, cluster._pods, cluster.core = True, [], pods  # type: ignore[assignment]
    return cluster, pods


@pytest.mark.parametrize(
    ("workload", "host", "want"),
    [
        ({}, None, None),
        ({"runtime_class_name": "fleet"}, None, "fleet"),
        ({"runtime_class_name": "fleet"}, "nvidia", "nvidia"),
        ({}, "nvidia", "nvidia"),
    ],
)
def test_pod_names_the_hosts_runtime_class_else_the_fleets(
    workload: dict[str, Any], host: str | None, want: str | None
) -> None:
    cluster, pods = _cluster(workload)
    cluster._create_gpu_pod("one", {"nvidia.com/gpu": "1"}, node="n1", runtime_class=host)
    cluster._create_gpu_pod("held", {"nvidia.com/gpu": "1"}, node="n1", hold=True, runtime_class=host)
    for body in pods.bodies:
        assert body["spec"].get("runtimeClassName") == want
        assert body["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "n1"}
