"""The seam between the extender and a Kubernetes API: what it reads, watches and writes.

Objects cross this seam as Kubernetes JSON (dicts, camelCase), the form the scheduler also sends, so the
rest of the extender never depends on the client library's models. Two implementations: `KubeCluster`
(the `kubernetes` client, `kube.py`) and `InMemoryCluster` (tests and benchmarks, `memory.py`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any, Protocol


class ApiError(Exception):
    """A Kubernetes API call failed; `status` is the HTTP status when there was one."""

    status: int | None = None

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status


class ConflictError(ApiError):
    """409: a resourceVersion precondition failed or the object already changed (e.g. already bound)."""

    status = 409


class NotFoundError(ApiError):
    """404: the object does not exist (any more)."""

    status = 404


class InvalidError(ApiError):
    """422 and other 4xx: the request was refused as written (e.g. a UID precondition failed)."""


class UnavailableError(ApiError):
    """The API server could not be reached or did not answer in time; the outcome is unknown."""


class ClusterSink(Protocol):
    """Receives the cluster's state from a watch (implemented by `ClusterState`)."""

    def replace_nodes(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """A full node list."""

    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        """A node was added or modified."""

    def delete_node(self, obj: Mapping[str, Any]) -> None:
        """A node was deleted."""

    def replace_pods(self, objs: Iterable[Mapping[str, Any]]) -> None:
        """A full pod list."""

    def upsert_pod(self, obj: Mapping[str, Any]) -> None:
        """A pod was added or modified."""

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        """A pod was deleted."""

    def set_watch_error(self, message: str | None) -> None:
        """The watch failed (message) or recovered (None)."""


class ClusterSource(Protocol):
    """Reads and writes the extender needs; every failure is an `ApiError` subclass."""

    def watch(self, sink: ClusterSink, stop: threading.Event) -> None:
        """List then watch nodes and pods into `sink` until `stop` is set; relist after any gap."""

    def get_node(self, name: str) -> dict[str, Any]:
        """The node as stored now (a quorum read, not a cache)."""

    def patch_node_annotations(
        self, name: str, annotations: Mapping[str, str | None], resource_version: str
    ) -> dict[str, Any]:
        """Set (or, for None, remove) annotations iff the node is still at `resource_version`."""

    def get_pod(self, namespace: str, name: str) -> dict[str, Any]:
        """The pod as stored now."""

    def patch_pod_annotations(
        self,
        namespace: str,
        name: str,
        uid: str,
        annotations: Mapping[str, str | None],
        resource_version: str | None = None,
    ) -> dict[str, Any]:
        """Set (or remove) pod annotations iff the pod still has `uid` (and `resource_version`, if given)."""

    def bind_pod(self, namespace: str, name: str, uid: str, node: str) -> None:
        """Create the pod's Binding to `node`, with `uid` as precondition."""
