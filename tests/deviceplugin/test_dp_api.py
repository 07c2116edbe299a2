"""The generated API matches the published kubelet v1beta1 protocol, field number by field number."""

from __future__ import annotations

import pytest

from gpufleet.deviceplugin.api import pb

# (message, field name, number) as in k8s.io/kubelet pkg/apis/deviceplugin/v1beta1/api.proto.
PUBLISHED_FIELDS = [
    ("DevicePluginOptions", "pre_start_required", 1),
    ("DevicePluginOptions", "get_preferred_allocation_available", 2),
    ("RegisterRequest", "version", 1),
    ("RegisterRequest", "endpoint", 2),
    ("RegisterRequest", "resource_name", 3),
    ("RegisterRequest", "options", 4),
    ("ListAndWatchResponse", "devices", 1),
    ("TopologyInfo", "nodes", 1),
    ("NUMANode", "ID", 1),
    ("Device", "ID", 1),
    ("Device", "health", 2),
    ("Device", "topology", 3),
    ("PreStartContainerRequest", "devices_ids", 1),
    ("PreferredAllocationRequest", "container_requests", 1),
    ("ContainerPreferredAllocationRequest", "available_deviceIDs", 1),
    ("ContainerPreferredAllocationRequest", "must_include_deviceIDs", 2),
    ("ContainerPreferredAllocationRequest", "allocation_size", 3),
    ("PreferredAllocationResponse", "container_responses", 1),
    ("ContainerPreferredAllocationResponse", "deviceIDs", 1),
    ("AllocateRequest", "container_requests", 1),
    ("ContainerAllocateRequest", "devices_ids", 1),
    ("CDIDevice", "name", 1),
    ("AllocateResponse", "container_responses", 1),
    ("ContainerAllocateResponse", "envs", 1),
    ("ContainerAllocateResponse", "mounts", 2),
    ("ContainerAllocateResponse", "devices", 3),
    ("ContainerAllocateResponse", "annotations", 4),
    ("ContainerAllocateResponse", "cdi_devices", 5),
    ("Mount", "container_path", 1),
    ("Mount", "host_path", 2),
    ("Mount", "read_only", 3),
    ("DeviceSpec", "container_path", 1),
    ("DeviceSpec", "host_path", 2),
    ("DeviceSpec", "permissions", 3),
]


@pytest.mark.parametrize(("message", "name", "number"), PUBLISHED_FIELDS)
def test_field_numbers_match_the_published_api(message: str, name: str, number: int) -> None:
    assert pb.DESCRIPTOR.message_types_by_name[message].fields_by_name[name].number == number


def test_messages_have_no_fields_beyond_the_published_ones() -> None:
    published: dict[str, set[str]] = {}
    for message, name, _ in PUBLISHED_FIELDS:
        published.setdefault(message, set()).add(name)
    for message, names in published.items():
        assert set(pb.DESCRIPTOR.message_types_by_name[message].fields_by_name) == names


def test_services_and_method_paths_are_the_kubelets() -> None:
    assert pb.DESCRIPTOR.package == "v1beta1"
    plugin = pb.DESCRIPTOR.services_by_name["DevicePlugin"]
    assert [m.name for m in plugin.methods] == [
        "GetDevicePluginOptions",
        "ListAndWatch",
        "GetPreferredAllocation",
        "Allocate",
        "PreStartContainer",
    ]
    assert plugin.methods_by_name["ListAndWatch"].server_streaming
    assert [m.name for m in pb.DESCRIPTOR.services_by_name["Registration"].methods] == ["Register"]


def test_allocate_request_bytes_are_what_a_go_kubelet_sends() -> None:
    # Field 1 (container_requests, length-delimited) holding field 1 (devices_ids) = "GPU-a".
    wire = bytes([0x0A, 0x07, 0x0A, 0x05]) + b"GPU-a"
    request = pb.AllocateRequest.FromString(wire)
    assert list(request.container_requests[0].devices_ids) == ["GPU-a"]
