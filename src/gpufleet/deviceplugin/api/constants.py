"""The kubelet device plugin protocol's constants (v1beta1), apart from the generated messages: the plugin's
settings read them without grpc or protobuf (the collection links this file, see docs/architecture.md)."""

VERSION = "v1beta1"
HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
DEFAULT_SOCKET_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
# The kubelet rejects device IDs longer than this (a Kubernetes label-value-like limit).
MAX_DEVICE_ID_LENGTH = 63
# The kubelet's PodResources API (v1) socket: which pod holds which device (docs/metrics.md).
POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
