"""Builders for Nodes and Pods as the API serves them, a fake clock, and fixture loading."""

from __future__ import annotations

import http.client
import json
import threading
import uuid as uuidlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufleet.extender.server import ExtenderServer, make_server
from gpufleet.extender.settings import Settings
from gpufleet_harness.memapi import InMemoryCluster

FIXTURES = Path(__file__).parent / "fixtures"


def load_fixture(name: str) -> Any:
    """A JSON fixture from tests/extender/fixtures."""
    return json.loads((FIXTURES / name).read_text())


class FakeClock:
    """A settable clock; starts at a fixed, realistic unix time."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def gpu(
    index: int,
    uuid: str | None = None,
    model: str = "NVIDIA A100-SXM4-80GB",
    mem: int = 80,
    cc: str = "8.0",
    numa: int | None = 0,
    healthy: bool = True,
    nvlink: Sequence[str] = (),
) -> dict[str, Any]:
    """One entry of the gpufleet.io/gpus annotation."""
    return {
        "index": index,
        "uuid": uuid or f"GPU-{index:08x}-0000-0000-0000-000000000000",
        "model": model,
        "memory_gib": mem,
        "cc": cc,
        "numa": numa,
        "healthy": healthy,
        "nvlink": {peer: 12 for peer in nvlink},
    }


def machine(prefix: str, count: int, mesh: bool = True, **kwargs: Any) -> list[dict[str, Any]]:
    """`count` identical GPUs with uuids GPU-<prefix>-<i>; `mesh` links all pairs (NVSwitch)."""
    ids = [f"GPU-{prefix}-{i}" for i in range(count)]
    return [
        gpu(i, ids[i], nvlink=[p for p in ids if p != ids[i]] if mesh else (), **kwargs) for i in range(count)
    ]


def node(
    name: str,
    gpus: Sequence[dict[str, Any]] | None,
    sharing: bool = True,
    lock: str | None = None,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node with GPUs published as the device plugin does (None: no annotation at all)."""
    annotations: dict[str, str] = {"node.alpha.kubernetes.io/ttl": "0"}
    if gpus is not None:
        annotations["gpufleet.io/gpus"] = json.dumps(list(gpus))
    if lock is not None:
        annotations["gpufleet.io/bind-lock"] = lock
    all_labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})}
    if sharing:
        all_labels["gpufleet.io/gpu-sharing"] = "memory"
    total = sum(g["memory_gib"] for g in gpus or [] if g["healthy"])
    resource = {"gpufleet.io/gpu-mem": str(total)} if sharing else {"nvidia.com/gpu": str(len(gpus or []))}
    return {
        "metadata": {
            "name": name,
            "uid": str(uuidlib.uuid5(uuidlib.NAMESPACE_DNS, name)),
            "labels": all_labels,
            "annotations": annotations,
        },
        "spec": {},
        "status": {
            "capacity": {"cpu": "64", "memory": "528012Mi", "pods": "110", **resource},
            "allocatable": {"cpu": "63", "memory": "520012Mi", "pods": "110", **resource},
            "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
        },
    }


def pod(
    name: str,
    mem: Sequence[int] = (),
    whole: int = 0,
    init_mem: Sequence[int] = (),
    annotations: dict[str, str] | None = None,
    uid: str | None = None,
    node_name: str | None = None,
    namespace: str = "default",
    node_selector: dict[str, str] | None = None,
    phase: str = "Pending",
) -> dict[str, Any]:
    """A Pod: one container per entry of `mem` (GiB of gpufleet.io/gpu-mem), or `whole` nvidia.com/gpu."""

    def container(cname: str, resources: dict[str, str]) -> dict[str, Any]:
        return {
            "name": cname,
            "image": "registry.local/cuda-sample:12.2",
            "resources": {"limits": dict(resources), "requests": dict(resources)},
        }

    containers = [container(f"c{i}", {"gpufleet.io/gpu-mem": str(g)}) for i, g in enumerate(mem)]
    if whole:
        containers.append(container("main", {"nvidia.com/gpu": str(whole)}))
    if not containers:
        containers.append(container("main", {}))
    spec: dict[str, Any] = {"containers": containers, "schedulerName": "default-scheduler"}
    if init_mem:
        spec["initContainers"] = [
            container(f"init{i}", {"gpufleet.io/gpu-mem": str(g)}) for i, g in enumerate(init_mem)
        ]
    if node_selector:
        spec["nodeSelector"] = node_selector
    if node_name:
        spec["nodeName"] = node_name
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or f"uid-{namespace}-{name}",
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
        "status": {"phase": phase},
    }


def settle(cluster: InMemoryCluster) -> None:
    """Wait until every replica has seen every change."""
    assert cluster.wait_delivered(5.0)


# ----- the HTTP server on an ephemeral loopback port


def serve(extender: Any, settings: Settings) -> ExtenderServer:
    server = make_server(extender, settings)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return server


def request(
    conn: http.client.HTTPConnection,
    method: str,
    path: str,
    body: Any = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = conn.getresponse()
    payload = response.read()
    kind = response.getheader("Content-Type", "")
    return response.status, json.loads(payload) if kind.startswith("application/json") else payload.decode()


def connect(server: ExtenderServer) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
