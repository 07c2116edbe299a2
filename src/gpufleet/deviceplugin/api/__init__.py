"""The kubelet device plugin API v1beta1: generated messages and stubs, plus the protocol's constants.
The kubelet's PodResources API v1 (podresources.proto, for telemetry's pod labels) sits beside it, imported
where it is used."""

from gpufleet.deviceplugin.api import api_pb2 as pb
from gpufleet.deviceplugin.api import api_pb2_grpc as pb_grpc
from gpufleet.deviceplugin.api.constants import (
    DEFAULT_SOCKET_DIR,
    HEALTHY,
    KUBELET_SOCKET,
    MAX_DEVICE_ID_LENGTH,
    UNHEALTHY,
    VERSION,
)

__all__ = [
    "DEFAULT_SOCKET_DIR",
    "HEALTHY",
    "KUBELET_SOCKET",
    "MAX_DEVICE_ID_LENGTH",
    "UNHEALTHY",
    "VERSION",
    "pb",
    "pb_grpc",
]
