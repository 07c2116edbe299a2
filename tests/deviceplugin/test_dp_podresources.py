"""Pod attribution through the kubelet's PodResources API v1: the generated API against the published
field numbers, then ``PodAttributor`` against a fake kubelet serving it on a unix socket (the real
kubelet 1.20 proves it in tests/cluster/test_telemetry_kubelet.py)."""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator

import grpc
import pytest
from dp_helpers import make_inventory, short_dir
from telemetry_helpers import FakePodResources, events

from gpufleet.deviceplugin.api import podresources_pb2 as pr
from gpufleet.deviceplugin.telemetry.pods import (
    AssignmentCache,
    Holder,
    MemoryShare,
    PodAttributor,
    PodResourcesClient,
)
from gpufleet.handoff import ASSIGNMENT_ANNOTATION, GPU_MEM_RESOURCE, Assignment, ContainerAssignment

GIB = 1 << 30
# (message, field, number, type) as k8s.io/kubelet pkg/apis/podresources/v1/api.proto of Kubernetes 1.20.2;
# "repeated" in the type where the field is.
PUBLISHED = [
    ("ListPodResourcesResponse", "pod_resources", 1, "repeated PodResources"),
    ("PodResources", "name", 1, "string"),
    ("PodResources", "namespace", 2, "string"),
    ("PodResources", "containers", 3, "repeated ContainerResources"),
    ("ContainerResources", "name", 1, "string"),
    ("ContainerResources", "devices", 2, "repeated ContainerDevices"),
    ("ContainerResources", "cpu_ids", 3, "repeated int64"),
    ("ContainerDevices", "resource_name", 1, "string"),
    ("ContainerDevices", "device_ids", 2, "repeated string"),
    ("ContainerDevices", "topology", 3, "TopologyInfo"),
    ("TopologyInfo", "nodes", 1, "repeated NUMANode"),
    ("NUMANode", "ID", 1, "int64"),
]
_SCALARS = {9: "string", 3: "int64"}  # FieldDescriptor.TYPE_STRING, TYPE_INT64


@pytest.mark.parametrize(("message", "name", "number", "kind"), PUBLISHED)
def test_field_numbers_and_types_match_the_published_v1_api(
    message: str, name: str, number: int, kind: str
) -> None:
    field = pr.DESCRIPTOR.message_types_by_name[message].fields_by_name[name]
    assert field.number == number
    base = field.message_type.name if field.message_type else _SCALARS[field.type]
    assert ("repeated " if field.is_repeated else "") + base == kind


def test_messages_have_no_fields_beyond_the_published_ones() -> None:
    published: dict[str, set[str]] = {}
    for message, name, _, _ in PUBLISHED:
        published.setdefault(message, set()).add(name)
    for message, names in published.items():
        assert set(pr.DESCRIPTOR.message_types_by_name[message].fields_by_name) == names


def test_the_service_is_v1_podresourceslister_list() -> None:
    service = pr.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert service.full_name == "v1.PodResourcesLister"
    assert [m.name for m in service.methods] == ["List"]


def test_a_newer_kubelets_extra_fields_are_skipped() -> None:
    # ContainerResources.memory (4) and dynamic_resources (5) came after 1.20: a length-delimited field 4
    # with an arbitrary payload must not break the parse.
    container = pr.ContainerResources(
        name="c", devices=[pr.ContainerDevices(resource_name="r", device_ids=["d"])]
    )
    wire = container.SerializeToString() + b"\x22\x03abc" + b"\x2a\x02xy"
    parsed = pr.ContainerResources.FromString(wire)
    assert parsed.name == "c" and list(parsed.devices[0].device_ids) == ["d"]


@pytest.fixture
def kubelet() -> Iterator[FakePodResources]:
    directory = short_dir("pr")
    fake = FakePodResources(os.path.join(directory, "kubelet.sock")).start()
    yield fake
    fake.stop()
    os.rmdir(directory)


INV = make_inventory(4)
U = [g.uuid for g in INV.gpus]
MIG = "MIG-7a3c1f52-0000-5000-8000-000000000001"


def attributor(socket_path: str, pods: dict[tuple[str, str], dict[str, str]] | None = None) -> PodAttributor:
    def read_pod(namespace: str, name: str) -> dict[str, str] | None:
        if pods is None:
            raise RuntimeError("no API access in this test")
        return pods.get((namespace, name))

    return PodAttributor(PodResourcesClient(socket_path), {GPU_MEM_RESOURCE}, AssignmentCache(read_pod))


def test_whole_gpus_replicas_and_mig_devices_are_attributed_by_their_ids(kubelet: FakePodResources) -> None:
    kubelet.pods = [
        ("team-a", "train", [("main", {"nvidia.com/gpu": [U[0], U[1]]}), ("sidecar", {})]),
        ("team-b", "infer", [("app", {"nvidia.com/gpu.shared": [f"{U[2]}::1"]})]),
        ("team-c", "slice", [("m", {"nvidia.com/mig-1g.10gb": [MIG]})]),
        # other plugins' devices, and IDs of GPUs this node does not have, are nobody's GPU
        ("team-d", "nic", [("n", {"example.com/nic": ["eth0"], "nvidia.com/gpu": ["GPU-not-here"]})]),
    ]
    got = attributor(kubelet.socket_path)(U, [MIG])
    assert got.ok
    assert got.holders == {
        U[0]: (Holder("team-a", "train", "main"),),
        U[1]: (Holder("team-a", "train", "main"),),
        U[2]: (Holder("team-b", "infer", "app", vgpu="1"),),
        MIG: (Holder("team-c", "slice", "m"),),
    }
    assert kubelet.calls == 1


def test_gpu_memory_units_are_placed_by_the_pods_assignment(kubelet: FakePodResources) -> None:
    # the kubelet's units name GPU 0, but the extender put the pod on GPU 3 (docs/handoff.md)
    kubelet.pods = [("ml", "small", [("c0", {GPU_MEM_RESOURCE: [f"{U[0]}::{k}" for k in range(6)]})])]
    assignment = Assignment("n1", (ContainerAssignment("c0", 6, (U[3],)),), 1.0)
    pods = {("ml", "small"): {ASSIGNMENT_ANNOTATION: assignment.to_json()}}
    got = attributor(kubelet.socket_path, pods)(U, [])
    holder = Holder("ml", "small", "c0")
    assert got.memory == (MemoryShare(holder, U[3], 6 * GIB),)
    assert got.holders == {U[3]: (holder,)}


def test_gpu_memory_split_over_two_gpus(kubelet: FakePodResources) -> None:
    kubelet.pods = [("ml", "wide", [("c0", {GPU_MEM_RESOURCE: [f"{U[0]}::{k}" for k in range(8)]})])]
    assignment = Assignment("n1", (ContainerAssignment("c0", 8, (U[1], U[2])),), 1.0)
    pods = {("ml", "wide"): {ASSIGNMENT_ANNOTATION: assignment.to_json()}}
    got = attributor(kubelet.socket_path, pods)(U, [])
    holder = Holder("ml", "wide", "c0")
    assert set(got.memory) == {MemoryShare(holder, U[1], 4 * GIB), MemoryShare(holder, U[2], 4 * GIB)}


def test_gpu_memory_without_a_readable_assignment_is_left_unattributed_with_one_log_line(
    kubelet: FakePodResources, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpufleet")
    kubelet.pods = [("ml", "odd", [("c0", {GPU_MEM_RESOURCE: [f"{U[0]}::0", f"{U[0]}::1"]})])]
    assignment = Assignment("n1", (ContainerAssignment("c0", 5, (U[3],)),), 1.0)  # 5 GiB, the kubelet says 2
    pods = {("ml", "odd"): {ASSIGNMENT_ANNOTATION: assignment.to_json()}}
    attribute = attributor(kubelet.socket_path, pods)
    for _ in range(3):
        got = attribute(U, [])
        assert got.ok and got.memory == () and got.holders == {}
    [line] = events(caplog, "telemetry_memory_unattributed")
    assert line.fields["pod"] == "ml/odd" and "GiB" in line.fields["reason"]
    kubelet.pods = [("ml", "noapi", [("c0", {GPU_MEM_RESOURCE: [f"{U[0]}::0"]})])]
    assert attributor(kubelet.socket_path, None)(U, []).memory == ()
    assert "no API access" in events(caplog, "telemetry_memory_unattributed")[-1].fields["reason"]


def test_no_socket_means_no_pod_labels_and_one_clear_log_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpufleet")
    path = os.path.join(short_dir("pr"), "kubelet.sock")
    attribute = attributor(path)
    for _ in range(5):
        got = attribute(U, [])
        assert not got.ok and got.holders == {}
    [line] = events(caplog, "pod_resources_unavailable")
    assert path in line.fields["reason"] and "does not exist" in line.fields["reason"]
    # the kubelet comes: labels without a restart, and one line saying so
    fake = FakePodResources(path).start()
    try:
        fake.pods = [("a", "p", [("c", {"nvidia.com/gpu": [U[0]]})])]
        assert attribute(U, []).holders == {U[0]: (Holder("a", "p", "c"),)}
        assert len(events(caplog, "pod_resources_available")) == 1
    finally:
        fake.stop()


def test_a_failing_or_silent_kubelet_costs_one_bounded_call(
    kubelet: FakePodResources, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gpufleet")
    kubelet.fail = grpc.StatusCode.UNAVAILABLE
    attribute = attributor(kubelet.socket_path)
    assert not attribute(U, []).ok
    assert "scripted failure" in events(caplog, "pod_resources_unavailable")[0].fields["reason"]
    kubelet.fail = None
    kubelet.block = threading.Event()  # List never answers
    attribute.client.timeout_s = 0.3
    done = threading.Event()
    threading.Thread(target=lambda: (attribute(U, []), done.set()), daemon=True).start()
    assert done.wait(30), "a List on a kubelet that does not answer was not bounded by its timeout"
    kubelet.block.set()
    kubelet.block = None
    assert attribute(U, []).ok
