"""Node taints through the API: the one helper the control plane and the kubelet nodes both use."""

from __future__ import annotations

from typing import Any

from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpufleet_harness.cluster.process import ClusterError


def remove_taint(core: k8s.CoreV1Api, node: str, key: str) -> bool:
    """Remove every taint with ``key`` from ``node``; True if one was there."""
    for _ in range(5):
        current = core.read_node(node)
        taints = (current.spec.taints or []) if current.spec else []
        keep = [t for t in taints if t.key != key]
        if len(keep) == len(taints):
            return False
        version = current.metadata.resource_version if current.metadata else None
        patch: list[dict[str, Any]] = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": version},
            {
                "op": "replace",
                "path": "/spec/taints",
                "value": k8s.ApiClient().sanitize_for_serialization(keep),
            },
        ]
        try:
            core.patch_node(node, patch)
            return True
        except ApiException as err:
            if err.status not in (409, 422):
                raise
    raise ClusterError(f"could not remove taint {key} from node {node}: kept conflicting")
