"""Which pod holds which GPU: the kubelet's PodResources API (v1 ``List``, over its unix socket), and for
GPU-memory shares the extender's assignment on the pod (docs/handoff.md).

Device IDs are read by their shape, whatever resource they came under (a renamed time-sliced resource, or
one a previous named configuration served): a GPU UUID is the whole GPU, ``<uuid>::<n>`` a time-slicing
replica, a ``MIG-`` UUID a MIG device. GPU-memory units (``<uuid>::<k>`` of a memory resource) name no GPU:
only their count means something, and the pod's ``gpufleet.io/assignment`` says which GPU they are on.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpufleet.deviceplugin.rm.devices import ID_SEPARATOR
from gpufleet.handoff import ASSIGNMENT_ANNOTATION, Assignment
from gpufleet.logs import log_event

POD_RESOURCES_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"
LIST_TIMEOUT_S = 2.0  # one List; the kubelet answers from memory
API_TIMEOUT_S = 2.0  # one pod read for its assignment
ASSIGNMENT_TTL_S = 300.0  # PodResources v1 carries no pod UID: a pod recreated under its name is re-read
ASSIGNMENT_RETRY_S = 30.0  # after a failed read (API down, annotation missing)
MAX_RESPONSE_BYTES = 16 << 20  # a List of every pod on a full node is far smaller
GIB = 1 << 30


@dataclass(frozen=True, order=True)
class Holder:
    """A container holding (part of) a GPU; `vgpu` is the time-slicing replica it holds ("" otherwise)."""

    namespace: str
    pod: str
    container: str
    vgpu: str = ""


@dataclass(frozen=True, order=True)
class MemoryShare:
    """GPU memory a container holds on one GPU, as the extender assigned it."""

    holder: Holder
    gpu: str  # the GPU's UUID
    bytes: int


@dataclass(frozen=True)
class Attribution:
    """Holders by GPU or MIG device UUID, and the GPU-memory shares; `ok` False when the kubelet could not
    be asked (every series is then served without pod labels)."""

    holders: Mapping[str, tuple[Holder, ...]]
    memory: tuple[MemoryShare, ...] = ()
    ok: bool = True


NOBODY = Attribution({}, (), ok=False)


@dataclass(frozen=True)
class MemoryRequest:
    """A container holding GPU-memory units: how many (GiB), from the kubelet."""

    holder: Holder
    units: int


def parse_list(
    response: Any, gpus: Collection[str], migs: Collection[str], memory_resources: Collection[str]
) -> tuple[dict[str, list[Holder]], list[MemoryRequest]]:
    """(holders by GPU or MIG UUID, GPU-memory requests) in a ListPodResourcesResponse. IDs of other
    plugins' resources, and IDs naming GPUs this plugin does not know, are ignored."""
    holders: dict[str, list[Holder]] = {}
    memory: list[MemoryRequest] = []
    for pod in response.pod_resources:
        for container in pod.containers:
            units = 0
            for devices in container.devices:
                if devices.resource_name in memory_resources:
                    units += len(devices.device_ids)
                    continue
                for device in devices.device_ids:
                    base, sep, replica = device.partition(ID_SEPARATOR)
                    if base in gpus or base in migs:
                        holder = Holder(pod.namespace, pod.name, container.name, replica if sep else "")
                        holders.setdefault(base, []).append(holder)
            if units:
                memory.append(MemoryRequest(Holder(pod.namespace, pod.name, container.name), units))
    return holders, memory


class PodResourcesClient:
    """``List`` on the kubelet's PodResources socket, one short-lived connection per call."""

    def __init__(self, socket_path: str = POD_RESOURCES_SOCKET, timeout_s: float = LIST_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.timeout_s = timeout_s

    def available(self) -> bool:
        return os.path.exists(self.socket_path)

    def list(self) -> Any:
        """The kubelet's ListPodResourcesResponse; raises grpc.RpcError on failure or after the timeout."""
        import grpc

        from gpufleet.deviceplugin.api import podresources_pb2 as pr
        from gpufleet.deviceplugin.api import podresources_pb2_grpc as pr_grpc

        options = [("grpc.max_receive_message_length", MAX_RESPONSE_BYTES)]
        with grpc.insecure_channel(f"unix://{self.socket_path}", options=options) as channel:
            stub = pr_grpc.PodResourcesListerStub(channel)
            return stub.List(pr.ListPodResourcesRequest(), timeout=self.timeout_s)


class AssignmentCache:
    """The ``gpufleet.io/assignment`` of pods holding GPU memory, read once per pod through the API."""

    def __init__(
        self, read_pod: Callable[[str, str], Mapping[str, str] | None], ttl_s: float = ASSIGNMENT_TTL_S
    ):
        self.read_pod = read_pod  # (namespace, name) -> the pod's annotations, None when it does not exist
        self.ttl_s = ttl_s
        self._cache: dict[tuple[str, str], tuple[float, Assignment | None]] = {}
        self._reported: set[tuple[str, str]] = set()

    def get(self, namespace: str, name: str, units: Mapping[str, int]) -> Assignment | None:
        """The pod's assignment if it accounts for `units` (GiB by container, from the kubelet)."""
        key, now = (namespace, name), time.monotonic()
        cached = self._cache.get(key)
        ttl = self.ttl_s if cached is None or cached[1] is not None else min(self.ttl_s, ASSIGNMENT_RETRY_S)
        if cached is None or now - cached[0] > ttl or not _fits(cached[1], units):
            cached = (now, self._fetch(namespace, name))
            self._cache[key] = cached
        found = cached[1]
        if found is not None and not _fits(found, units):
            self._report(key, f"assignment does not match the kubelet's GiB per container {dict(units)}")
            return None
        return found

    def keep_only(self, pods: Collection[tuple[str, str]]) -> None:
        """Forget pods that no longer hold GPU memory."""
        for key in set(self._cache) - set(pods):
            del self._cache[key]
            self._reported.discard(key)

    def _fetch(self, namespace: str, name: str) -> Assignment | None:
        try:
            annotations = self.read_pod(namespace, name)
        except Exception as exc:  # the API client raises several unrelated types
            self._report((namespace, name), f"cannot read the pod: {exc}")
            return None
        raw = (annotations or {}).get(ASSIGNMENT_ANNOTATION)
        if raw is None:
            self._report((namespace, name), f"no {ASSIGNMENT_ANNOTATION} annotation")
            return None
        try:
            return Assignment.from_json(raw)
        except ValueError as exc:
            self._report((namespace, name), str(exc))
            return None

    def _report(self, key: tuple[str, str], why: str) -> None:
        if key not in self._reported:
            self._reported.add(key)
            log_event("telemetry_memory_unattributed", level="warning", pod=f"{key[0]}/{key[1]}", reason=why)


def _fits(assignment: Assignment | None, units: Mapping[str, int]) -> bool:
    if assignment is None:
        return True  # nothing to compare; re-read only after the TTL
    given = {c.name: c.gpu_mem_gib for c in assignment.containers}
    return all(given.get(name) == gib for name, gib in units.items())


def memory_shares(requests: list[MemoryRequest], assignments: AssignmentCache) -> list[MemoryShare]:
    """Each GPU-memory container's share of each GPU, from its pod's assignment."""
    by_pod: dict[tuple[str, str], dict[str, int]] = {}
    for req in requests:
        by_pod.setdefault((req.holder.namespace, req.holder.pod), {})[req.holder.container] = req.units
    assignments.keep_only(by_pod)
    shares: list[MemoryShare] = []
    for (namespace, pod), units in sorted(by_pod.items()):
        assignment = assignments.get(namespace, pod, units)
        if assignment is None:
            continue
        for container in assignment.containers:
            if container.name not in units:
                continue  # an init container (the kubelet lists spec.containers only), or not admitted yet
            holder = Holder(namespace, pod, container.name)
            shares += [MemoryShare(holder, gpu, gib * GIB) for gpu, gib in sorted(container.shares().items())]
    return shares


class PodAttributor:
    """One attribution per call: the kubelet's list, then the GPU-memory assignments. Logs one line when
    the kubelet's socket is missing or failing, and one when it answers again."""

    def __init__(
        self,
        client: PodResourcesClient,
        memory_resources: Collection[str],
        assignments: AssignmentCache | None,
    ) -> None:
        self.client = client
        self.memory_resources = frozenset(memory_resources)
        self.assignments = assignments
        self._problem: str | None = None  # the last reported failure, None while the kubelet answers
        self._lock = threading.Lock()

    def __call__(self, gpus: Iterable[str], migs: Iterable[str]) -> Attribution:
        with self._lock:
            if not self.client.available():
                self._failed(f"socket {self.client.socket_path} does not exist")
                return NOBODY
            try:
                response = self.client.list()
            except Exception as exc:  # grpc.RpcError, or a connection that never came up
                detail = getattr(exc, "details", lambda: None)() or str(exc)
                self._failed(f"List on {self.client.socket_path} failed: {detail}")
                return NOBODY
            if self._problem is not None:
                log_event(
                    "pod_resources_available", socket=self.client.socket_path, action="pod labels served"
                )
                self._problem = None
            holders, requests = parse_list(response, set(gpus), set(migs), self.memory_resources)
            shares: list[MemoryShare] = []
            if requests and self.assignments is not None:
                shares = memory_shares(requests, self.assignments)
            for share in shares:
                holders.setdefault(share.gpu, []).append(share.holder)
            return Attribution({k: tuple(sorted(set(v))) for k, v in holders.items()}, tuple(shares))

    def _failed(self, why: str) -> None:
        if self._problem is None:
            log_event(
                "pod_resources_unavailable",
                level="warning",
                reason=why,
                action="GPU series without pod labels until the kubelet answers",
            )
        self._problem = why
