"""The device plugin's GPU-memory hand-off against the lab's real kube-apiserver 1.20 (issue 31).

The plugin's own code (:class:`~gpufleet.deviceplugin.gpumem.handoff.MemoryHandoff` over
:class:`~gpufleet.deviceplugin.gpumem.resolver.KubernetesPodResolver`) answers ``Allocate`` calls for a
kubelet-less Node, playing the kubelet's part by calling it; the extender's part is played by its writes
(the node's bind-lock with the Node's resourceVersion as precondition, the pod's assignment, the Binding).
What only a real API server shows:

- the plugin's view of the node's pods is one watch (``fieldSelector=spec.nodeName``), listed once from the
  watch cache; an ``Allocate`` reads the Node and writes the pod, and lists no pods (the client's calls are
  counted);
- a pod bound to the node while an ``Allocate`` decides, before it records ``allocated``, is in the view
  once the view has reached that record: the plugin undoes the record and refuses (the ``Allocate`` may be
  that pod's), and keeps the lock;
- a pod asking for GPU memory, bound without the extender (no assignment), is never given the lock holder's
  memory; once the kubelet has failed it, the holder's ``Allocate`` goes through.

The real kubelet's side (the plugin as a process, its socket, a pod that runs on the assigned GPU) is
tests/cluster/test_deviceplugin_kubelet.py::test_gpu_memory_pod_gets_the_gpu_the_extender_assigned.
No test asserts a duration.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kubernetes import client as k8s

from gpufleet.deviceplugin.gpumem.handoff import MemoryHandoff
from gpufleet.deviceplugin.gpumem.resolver import KubernetesPodResolver, PodView
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions
from gpufleet.deviceplugin.rm.errors import HandoffError
from gpufleet.deviceplugin.rm.model import GpuInfo
from gpufleet.handoff import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    BIND_LOCK_ANNOTATION,
    GPU_MEM_RESOURCE,
)

pytestmark = pytest.mark.cluster

GIB = 1 << 30
UUIDS = [f"GPU-handoff-{k}" for k in range(2)]


class CountingCore:
    """A CoreV1Api passed through, every call recorded as (method, keyword arguments)."""

    def __init__(self, core: k8s.CoreV1Api) -> None:
        self._core = core
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        target = getattr(self._core, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            with self._lock:
                self.calls.append((name, dict(kwargs)))
            return target(*args, **kwargs)

        return call

    def named(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return [kwargs for called, kwargs in self.calls if called == name]


def _gpus() -> dict[str, GpuInfo]:
    return {
        u: GpuInfo(index=k, uuid=u, minor=k, model="NVIDIA A100-SXM4-80GB", cc=(8, 0), memory_bytes=80 * GIB,
                   numa=0, bus_id=f"0000:{k + 1:02x}:00.0")
        for k, u in enumerate(UUIDS)
    }  # fmt: skip


@pytest.fixture
def memory_node(fake_node: Callable[..., k8s.V1Node]) -> str:
    name = f"handoff-{secrets.token_hex(3)}"
    fake_node(name, {GPU_MEM_RESOURCE: 160}, labels={"gpufleet.io/gpu-sharing": "memory"})
    return name


@pytest.fixture
def plugin(core: k8s.CoreV1Api, memory_node: str) -> Iterator[tuple[MemoryHandoff, CountingCore]]:
    """The node's hand-off as the plugin builds it, over a call-counting client; its watch stops after."""
    counting = CountingCore(core)
    resolver = KubernetesPodResolver(counting)
    handoff = MemoryHandoff(resolver, memory_node, _gpus, dict, AllocateOptions(pass_device_specs=False))
    try:
        yield handoff, counting
    finally:
        resolver.close()


def create_pod(core: k8s.CoreV1Api, namespace: str, name: str, gib: int, node: str = "") -> str:
    """A pod of one container asking ``gib`` GiB that no scheduler takes (``node``: bound at creation)."""
    spec: dict[str, Any] = {
        "schedulerName": "nobody", "automountServiceAccountToken": False,
        "containers": [{"name": "c", "image": "registry.example/job:v1",
                        "resources": {"limits": {GPU_MEM_RESOURCE: str(gib)}}}],
    }  # fmt: skip
    if node:
        spec["nodeName"] = node
    body: Any = {"metadata": {"name": name}, "spec": spec}
    return str(api_json(core.create_namespaced_pod, namespace, body)["metadata"]["uid"])


def lock_node(core: k8s.CoreV1Api, node: str, uid: str, ref: str) -> None:
    """The extender's lock: the Node's resourceVersion as precondition."""
    rv = api_json(core.read_node, node)["metadata"]["resourceVersion"]
    lock = f"{uid} {ref} {int(time.time()) + 120}"
    core.patch_node(node, {"metadata": {"resourceVersion": rv, "annotations": {BIND_LOCK_ANNOTATION: lock}}})


def assign(core: k8s.CoreV1Api, namespace: str, name: str, node: str, gib: int, gpu: str) -> None:
    doc = {"node": node, "containers": [{"name": "c", "gpu_mem_gib": gib, "gpus": [gpu]}], "ts": time.time()}
    core.patch_namespaced_pod(
        name, namespace, {"metadata": {"annotations": {ASSIGNMENT_ANNOTATION: json.dumps(doc)}}}
    )


def bind(core: k8s.CoreV1Api, namespace: str, name: str, node: str) -> None:
    binding = k8s.V1Binding(
        metadata=k8s.V1ObjectMeta(name=name),
        target=k8s.V1ObjectReference(api_version="v1", kind="Node", name=node),
    )
    reply: Any = core.create_namespaced_pod_binding(name, namespace, binding, _preload_content=False)
    assert reply.status == 201


def bind_as_the_extender(
    core: k8s.CoreV1Api, namespace: str, node: str, name: str, gib: int, gpu: str
) -> str:
    """Lock, assignment, Binding: what the extender writes for a GPU-memory pod (docs/handoff.md)."""
    uid = create_pod(core, namespace, name, gib)
    lock_node(core, node, uid, f"{namespace}/{name}")
    assign(core, namespace, name, node, gib, gpu)
    bind(core, namespace, name, node)
    return uid


def api_json(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a client method without its models: the API's JSON."""
    return json.loads(call(*args, _preload_content=False, **kwargs).data)


def annotations_of(core: k8s.CoreV1Api, namespace: str | None, name: str) -> dict[str, str]:
    """A pod's annotations (a node's without a namespace)."""
    doc = api_json(core.read_namespaced_pod, name, namespace) if namespace else api_json(core.read_node, name)
    return doc["metadata"].get("annotations") or {}  # type: ignore[no-any-return]


def test_allocates_read_the_node_write_the_pod_and_list_pods_only_to_start_the_watch(
    core: k8s.CoreV1Api, namespace: str, memory_node: str, plugin: tuple[MemoryHandoff, CountingCore]
) -> None:
    handoff, counting = plugin
    for i, gpu in enumerate([UUIDS[1], UUIDS[0], UUIDS[1]]):
        name = f"mem-{i}"
        bind_as_the_extender(core, namespace, memory_node, name, 4, gpu)
        response = handoff([f"{UUIDS[0]}::{k}" for k in range(4)])  # the kubelet's units only count GiB
        assert response.envs["NVIDIA_VISIBLE_DEVICES"] == gpu
        assert annotations_of(core, namespace, name)[ALLOCATED_ANNOTATION] == "c"
        assert BIND_LOCK_ANNOTATION not in annotations_of(core, None, memory_node)
    lists = counting.named("list_pod_for_all_namespaces")
    plain = [c for c in lists if not c.get("watch")]
    # One list, when the view started, from the watch cache (resourceVersion 0): never a quorum list.
    assert [c["resource_version"] for c in plain] == ["0"]
    assert all(c["field_selector"] == f"spec.nodeName={memory_node}" for c in lists)
    assert all(c.get("resource_version") for c in lists)
    assert len(counting.named("read_node")) == 3  # the lock, once per Allocate; the release reused it
    assert len(counting.named("patch_namespaced_pod")) == 3
    assert not counting.named("read_namespaced_pod") and not counting.named("list_namespaced_pod")


def test_a_pod_bound_while_the_allocate_decides_makes_it_undo_the_record_and_refuse(
    core: k8s.CoreV1Api, namespace: str, memory_node: str, plugin: tuple[MemoryHandoff, CountingCore]
) -> None:
    handoff, _ = plugin
    create_pod(core, namespace, "late", 4)
    assign(core, namespace, "late", memory_node, 4, UUIDS[0])
    holder = bind_as_the_extender(core, namespace, memory_node, "holder", 4, UUIDS[1])
    record = handoff.resolver.set_allocated

    def bind_late_then_record(pod: PodView, value: str | None) -> int:
        # The decision is made; before the plugin's record lands, another GPU-memory pod is bound to the
        # node (a bind that landed after its lock expired): the Allocate under way may be that pod's.
        if value:
            bind(core, namespace, "late", memory_node)
        return record(pod, value)

    handoff.resolver.set_allocated = bind_late_then_record  # type: ignore[method-assign]
    with pytest.raises(
        HandoffError, match=rf"lock held by {namespace}/holder .*also waiting: {namespace}/late"
    ):
        handoff([f"{UUIDS[0]}::{k}" for k in range(4)])
    assert ALLOCATED_ANNOTATION not in annotations_of(core, namespace, "holder")  # the record was undone
    assert annotations_of(core, None, memory_node)[BIND_LOCK_ANNOTATION].startswith(holder + " ")  # lock kept


def test_a_gpu_memory_pod_bound_without_the_extender_never_gets_the_holders_memory(
    core: k8s.CoreV1Api, namespace: str, memory_node: str, plugin: tuple[MemoryHandoff, CountingCore]
) -> None:
    handoff, _ = plugin
    stray = create_pod(
        core, namespace, "stray", 4, node=memory_node
    )  # nodeName set: no extender, no assignment
    bind_as_the_extender(core, namespace, memory_node, "holder", 4, UUIDS[1])
    with pytest.raises(HandoffError, match=rf"cannot tell which pod.*{namespace}/holder, {namespace}/stray"):
        handoff([f"{UUIDS[0]}::{k}" for k in range(4)])
    assert ALLOCATED_ANNOTATION not in annotations_of(core, namespace, "holder")
    # The kubelet fails the stray pod (UnexpectedAdmissionError); then the holder's Allocate is certain.
    core.patch_namespaced_pod_status("stray", namespace, {"status": {"phase": "Failed"}})
    # (Until the plugin's view shows that status, the stray pod still looks admissible and the holder's
    # Allocate would be refused as well: the plugin cannot tell the two apart.)
    handoff.pods.wait(lambda v: getattr(v.get(stray), "phase", "") == "Failed", 30)
    response = handoff([f"{UUIDS[0]}::{k}" for k in range(4)])
    assert response.envs["NVIDIA_VISIBLE_DEVICES"] == UUIDS[1]
    assert annotations_of(core, namespace, "holder")[ALLOCATED_ANNOTATION] == "c"
