"""The kubelet device plugin API v1beta1: generated messages and stubs, plus the protocol's constants."""

from gpufleet.deviceplugin.api import api_pb2 as pb
from gpufleet.deviceplugin.api import api_pb2_grpc as pb_grpc

VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEFAULT_SOCKET_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
# The kubelet rejects device IDs longer than this (a Kubernetes label-value-like limit).
MAX_DEVICE_ID_LENGTH = 63

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
