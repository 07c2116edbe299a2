"""Test doubles for the GPU telemetry: scripted GPU readings, a fake kubelet PodResources server, and
/metrics read with prometheus_client's parser."""

from __future__ import annotations

import os
import threading
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

from gpufleet.deviceplugin.api import podresources_pb2 as pr
from gpufleet.deviceplugin.api import podresources_pb2_grpc as pr_grpc
from gpufleet.deviceplugin.rm.model import GpuInfo
from gpufleet.deviceplugin.telemetry.exporter import GpuSample
from gpufleet.gpu.telemetry import CALLS, Reading

# What a busy H200 answered (load-series.jsonl, t = 12.1 s), for every key the reader knows.
FULL: dict[str, float] = {
    "fb_free_bytes": 148_000 * (1 << 20),
    "fb_used_bytes": 1_138 * (1 << 20),
    "fb_reserved_bytes": 615 * (1 << 20),
    "gpu_util_pct": 100,
    "mem_copy_util_pct": 25,
    "enc_util_pct": 0,
    "dec_util_pct": 0,
    "sm_clock_mhz": 1515,
    "mem_clock_mhz": 3201,
    "gpu_temp_c": 52,
    "memory_temp_c": 43,
    "power_mw": 692_410,
    "energy_mj": 5_435_894,
    "pcie_replays": 1,
    "clock_event_reasons": 4,
    "remapped_rows_correctable": 0,
    "remapped_rows_uncorrectable": 0,
    "remap_pending": 0,
    "remap_failure": 0,
    "ecc_sbe_volatile": 0,
    "ecc_dbe_volatile": 0,
    "ecc_sbe_aggregate": 0,
    "ecc_dbe_aggregate": 0,
    "nvlink_data_tx_kib": 1000,
    "nvlink_data_rx_kib": 24,
    "nvlink_stamp_us": 1_795_000_000_000_000,
}
assert set(FULL) == set(CALLS), "the scripted reading must cover every key of gpufleet.gpu.telemetry"


def reading(**overrides: float | None) -> Reading:
    """FULL with some keys changed; a key set to None is absent (NOT_SUPPORTED)."""
    values = dict(FULL)
    absent = {}
    for key, value in overrides.items():
        if value is None:
            values.pop(key)
            absent[key] = "Not Supported"
        else:
            values[key] = value
    return Reading(values, absent)


class ScriptedReader:
    """A GPU reader whose answer per GPU index the test sets: a Reading, an exception, or a callable."""

    def __init__(self) -> None:
        self.answers: dict[int, Any] = {}
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, gpu: GpuInfo) -> GpuSample:
        with self.lock:
            self.calls += 1
        answer = self.answers.get(gpu.index, reading())
        if callable(answer):
            answer = answer(gpu)
        if isinstance(answer, BaseException):
            raise answer
        if isinstance(answer, GpuSample):
            return answer
        return GpuSample(answer)


# ----- /metrics through prometheus_client -----------------------------------------------------------------


def families(text: str) -> dict[str, Any]:
    """The text's metric families by name (prometheus_client's parser)."""
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(text: str, name: str, **labels: str) -> list[Any]:
    """Samples of family `name` whose labels include `labels`."""
    family = families(text).get(name)
    if family is None:
        return []
    return [s for s in family.samples if all(s.labels.get(k) == v for k, v in labels.items())]


def scrape(port: int, path: str = "/metrics") -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return str(response.read().decode())


# ----- the kubelet's PodResources service ----------------------------------------------------------------

PodSpec = tuple[
    str, str, Iterable[tuple[str, Mapping[str, Iterable[str]]]]
]  # ns, pod, [(container, {res: ids})]


def list_response(pods: Iterable[PodSpec]) -> Any:
    """A ListPodResourcesResponse as the kubelet builds it."""
    return pr.ListPodResourcesResponse(
        pod_resources=[
            pr.PodResources(
                name=name,
                namespace=namespace,
                containers=[
                    pr.ContainerResources(
                        name=container,
                        devices=[
                            pr.ContainerDevices(resource_name=resource, device_ids=list(ids))
                            for resource, ids in devices.items()
                        ],
                    )
                    for container, devices in containers
                ],
            )
            for namespace, name, containers in pods
        ]
    )


class FakePodResources(pr_grpc.PodResourcesListerServicer):
    """The kubelet's PodResources v1 service on a unix socket; the test sets what `List` answers, or a
    status code to fail with, or an event it blocks on."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.pods: list[PodSpec] = []
        self.fail: grpc.StatusCode | None = None
        self.block: threading.Event | None = None
        self.calls = 0
        self.server: grpc.Server | None = None

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        self.calls += 1
        if self.block is not None:
            self.block.wait(30)
        if self.fail is not None:
            context.abort(self.fail, "scripted failure")
        return list_response(self.pods)

    def start(self) -> FakePodResources:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pr_grpc.add_PodResourcesListerServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix://" + self.socket_path)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.block is not None:
            self.block.set()
        if self.server is not None:
            self.server.stop(0).wait()
            self.server = None
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)


def events(caplog: Any, name: str) -> list[Any]:
    """Log records of event `name` (gpufleet.logs puts the event in the message)."""
    return [r for r in caplog.records if r.getMessage() == name]


def until(predicate: Callable[[], Any], what: str, timeout: float = 30.0) -> Any:
    from dp_helpers import wait_for

    return wait_for(predicate, what, timeout)
