"""The GPU-memory hand-off with the extender: pure decisions, the recording, and a concurrent burst."""

from __future__ import annotations

import json
import queue
import random
import threading
import time
from dataclasses import replace

import grpc
import pytest
from dp_helpers import (
    FakeKubelet,
    FakeSource,
    make_config,
    make_inventory,
    plugin_channel,
    running_plugin,
    wait_for,
)

from gpufleet.deviceplugin.api import pb, pb_grpc
from gpufleet.deviceplugin.gpumem.handoff import MemoryHandoff, decide
from gpufleet.deviceplugin.gpumem.resolver import Conflict, InMemoryCluster, PodView
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions
from gpufleet.deviceplugin.rm.errors import DeviceUnhealthy, HandoffError
from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.handoff import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION
from gpufleet.handoff import BIND_LOCK_ANNOTATION as LOCK_ANNOTATION

NOW = 1_700_000_000.0
G0, G1 = "GPU-00000000-0000-0000-0000-000000000000", "GPU-00000001-0000-0000-0000-000000000000"


def assignment(*containers: tuple[str, int, str], node: str = "n1") -> str:
    return json.dumps(
        {
            "node": node,
            "containers": [{"name": n, "gpu_mem_gib": g, "gpus": [u]} for n, g, u in containers],
            "ts": NOW,
        }
    )


def pod(
    uid: str, *containers: tuple[str, int, str], allocated: str = "", node: str = "n1", phase: str = "Pending"
):
    annotations = {ASSIGNMENT_ANNOTATION: assignment(*containers)} if containers else {}
    if allocated:
        annotations[ALLOCATED_ANNOTATION] = allocated
    return PodView(uid, "default", f"p-{uid}", node, phase, annotations)


def lock(uid: str, expires: float = NOW + 60) -> str:
    return f"{uid} default/p-{uid} {expires:.0f}"


# ----- decide(): pure -----------------------------------------------------------------------------------


def test_lock_holder_with_matching_size_is_chosen() -> None:
    d = decide("n1", lock("a"), [pod("a", ("c0", 4, G0))], NOW, 4)
    assert (d.pod.uid, d.container.name, d.container.gpus, d.last) == ("a", "c0", (G0,), True)


def test_containers_are_allocated_in_assignment_order() -> None:
    pods = [pod("a", ("init", 2, G0), ("main", 4, G1), allocated="init")]
    d = decide("n1", lock("a"), pods, NOW, 4)
    assert (d.container.name, d.allocated, d.last) == ("main", ("init",), True)
    first = decide("n1", lock("a"), [pod("a", ("init", 2, G0), ("main", 4, G1))], NOW, 2)
    assert (first.container.name, first.last) == ("init", False)


def test_no_lock_is_an_error_never_a_guess() -> None:
    with pytest.raises(HandoffError, match=r"no pod holds gpufleet.io/bind-lock \(absent\).*default/p-a"):
        decide("n1", None, [pod("a", ("c0", 4, G0))], NOW, 4)


def test_expired_lock_is_an_error() -> None:
    with pytest.raises(HandoffError, match="expired"):
        decide("n1", lock("a", NOW - 1), [pod("a", ("c0", 4, G0))], NOW, 4)


def test_two_unallocated_pods_are_ambiguous_even_with_the_same_size() -> None:
    pods = [pod("a", ("c0", 4, G0)), pod("b", ("c0", 4, G1))]
    with pytest.raises(HandoffError, match=r"cannot tell which pod.*default/p-a, default/p-b"):
        decide("n1", lock("b"), pods, NOW, 4)


def test_late_allocate_for_an_expired_pod_is_not_mistaken_for_the_new_holder() -> None:
    # Lock expired for a, the extender bound b; a's Allocate arrives: both unallocated → refuse.
    pods = [pod("a", ("c0", 4, G0)), pod("b", ("c0", 4, G0))]
    with pytest.raises(HandoffError, match="cannot tell"):
        decide("n1", lock("b"), pods, NOW, 4)


def test_lock_held_by_an_invisible_pod_while_another_waits_is_refused() -> None:
    with pytest.raises(HandoffError, match="does not hold"):
        decide("n1", lock("ghost"), [pod("a", ("c0", 4, G0))], NOW, 4)


def test_size_mismatch_is_refused() -> None:
    with pytest.raises(HandoffError, match="assigned 4 GiB but Allocate asked for 3"):
        decide("n1", lock("a"), [pod("a", ("c0", 4, G0))], NOW, 3)


def test_assignment_for_another_node_is_refused() -> None:
    with pytest.raises(HandoffError, match="assigned to node n2"):
        decide(
            "n1",
            lock("a"),
            [
                replace(
                    pod("a", ("c0", 4, G0)),
                    annotations={ASSIGNMENT_ANNOTATION: assignment(("c0", 4, G0), node="n2")},
                )
            ],
            NOW,
            4,
        )


def test_fully_allocated_holder_has_nothing_left() -> None:
    with pytest.raises(HandoffError, match="no unallocated GPU-memory container"):
        decide("n1", lock("a"), [pod("a", ("c0", 4, G0), allocated="c0")], NOW, 4)


def test_finished_pods_do_not_count() -> None:
    pods = [pod("old", ("c0", 4, G0), phase="Failed"), pod("a", ("c0", 4, G0))]
    assert decide("n1", lock("a"), pods, NOW, 4).pod.uid == "a"


@pytest.mark.parametrize("value", ["garbage", "uid default/p soon", "uid nopodref 123"])
def test_malformed_lock_is_refused(value: str) -> None:
    with pytest.raises(HandoffError, match="bind-lock"):
        decide("n1", value, [pod("a", ("c0", 4, G0))], NOW, 4)


def test_malformed_assignment_is_refused() -> None:
    bad = PodView("a", "default", "p-a", "n1", "Pending", {ASSIGNMENT_ANNOTATION: "{not json"})
    with pytest.raises(HandoffError, match="malformed"):
        decide("n1", lock("a"), [bad], NOW, 4)


@pytest.mark.parametrize(
    "doc",
    [
        {"node": "n1", "containers": [{"name": "c0", "gpu_mem_gib": "4", "gpus": [G0]}]},
        {"node": "n1", "containers": [{"name": "c0", "gpu_mem_gib": 4.5, "gpus": [G0]}]},
        {"node": "n1", "containers": [{"name": "c0", "gpu_mem_gib": 4, "gpus": G0}]},
        {"node": "n1", "containers": [{"gpu_mem_gib": 4, "gpus": [G0]}]},
        {"node": "n1"},
    ],
)
def test_assignment_is_read_as_strictly_as_the_extender_writes_it(doc: dict[str, object]) -> None:
    bad = PodView("a", "default", "p-a", "n1", "Pending", {ASSIGNMENT_ANNOTATION: json.dumps(doc)})
    with pytest.raises(HandoffError, match="malformed"):
        decide("n1", lock("a"), [bad], NOW, 4)


# ----- MemoryHandoff: recording and the response ------------------------------------------------------


def handoff(
    cluster: InMemoryCluster, health: dict[str, GpuHealth] | None = None, mps: bool = False
) -> MemoryHandoff:
    inv = make_inventory(2, memory_gib=16)
    return MemoryHandoff(
        cluster,
        "n1",
        inv.by_uuid,
        lambda: health or {},
        AllocateOptions(pass_device_specs=False, mps=mps),
        clock=lambda: NOW,
    )


def cluster_with(*pods: tuple[str, tuple[tuple[str, int, str], ...]], holder: str) -> InMemoryCluster:
    c = InMemoryCluster()
    c.add_node("n1")
    for uid, containers in pods:
        c.add_pod(uid, "default", f"p-{uid}", "n1", {ASSIGNMENT_ANNOTATION: assignment(*containers)})
    c.patch_node_annotations("n1", {LOCK_ANNOTATION: lock(holder)})
    return c


def test_allocation_is_recorded_and_the_lock_released_after_the_last_container() -> None:
    c = cluster_with(("a", (("c0", 2, G0), ("c1", 4, G1))), holder="a")
    h = handoff(c)
    assert h(["x"] * 2).envs["NVIDIA_VISIBLE_DEVICES"] == G0
    assert c.pod("a").annotations[ALLOCATED_ANNOTATION] == "c0"
    assert LOCK_ANNOTATION in c.node_annotations("n1")
    assert h(["x"] * 4).envs["NVIDIA_VISIBLE_DEVICES"] == G1
    assert c.pod("a").annotations[ALLOCATED_ANNOTATION] == "c0,c1"
    assert LOCK_ANNOTATION not in c.node_annotations("n1")


def test_mps_limits_memory_and_threads_and_mounts_the_pipe() -> None:
    c = cluster_with(("a", (("c0", 4, G1),)), holder="a")
    resp = handoff(c, mps=True)(["x"] * 4)
    assert resp.envs["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"{G1}=4G"
    assert resp.envs["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"
    assert resp.envs["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/nvidia-mps"
    assert {(m.host_path, m.container_path) for m in resp.mounts} == {
        ("/run/nvidia-mps", "/tmp/nvidia-mps"),
        ("/var/log/nvidia-mps", "/var/log/nvidia-mps"),
    }


def test_unhealthy_assigned_gpu_is_refused_and_nothing_recorded() -> None:
    c = cluster_with(("a", (("c0", 4, G1),)), holder="a")
    with pytest.raises(DeviceUnhealthy, match="XID 79"):
        handoff(c, {G1: GpuHealth(False, "XID 79")})(["x"] * 4)
    assert ALLOCATED_ANNOTATION not in c.pod("a").annotations


def test_lock_release_retries_on_conflict_and_leaves_a_new_holders_lock() -> None:
    c = cluster_with(("a", (("c0", 4, G0),)), holder="a")
    real_patch = c.patch_node_annotations
    calls = []

    def flaky(name: str, changes: dict, rv: int | None = None) -> int:
        calls.append(rv)
        if len(calls) == 1:
            real_patch(name, {"unrelated": "status-heartbeat"})  # the node changed under us
        return real_patch(name, changes, rv)

    c.patch_node_annotations = flaky  # type: ignore[method-assign]
    handoff(c)(["x"] * 4)
    assert LOCK_ANNOTATION not in c.node_annotations("n1") and len(calls) == 2
    # A lock that now names another pod is not ours to remove.
    c.patch_node_annotations = real_patch  # type: ignore[method-assign]
    real_patch("n1", {LOCK_ANNOTATION: lock("b")})
    c.release_lock("n1", "a")
    assert c.node_annotations("n1")[LOCK_ANNOTATION] == lock("b")


# ----- a burst: a fake extender binds, a fake kubelet admits, over the real gRPC socket -----------------


class FakeExtender:
    """The extender side of docs/handoff.md in memory: reserve, lock (precondition), annotate, bind."""

    def __init__(self, cluster: InMemoryCluster, capacity: dict[str, int]) -> None:
        self.cluster = cluster
        self.free = dict(capacity)
        self.reserved: dict[str, tuple[str, list[tuple[str, int]]]] = {}
        self.mutex = threading.Lock()

    def bind(self, uid: str, containers: list[tuple[str, int]]) -> bool:
        """True when bound; False when the pod can never fit. Retries while the node is busy."""
        while True:
            with self.mutex:
                gpu = next(
                    (g for g, free in sorted(self.free.items()) if free >= sum(s for _, s in containers)),
                    None,
                )
                if gpu is None:
                    return False
                annotations, rv = self.cluster.read_node("n1")
                held = annotations.get(LOCK_ANNOTATION)
                if held and float(held.split()[2]) > time.time():
                    gpu = None  # node busy: another pod is between bind and Allocate
                else:
                    try:
                        self.cluster.patch_node_annotations(
                            "n1", {LOCK_ANNOTATION: f"{uid} default/p-{uid} {time.time() + 60:.0f}"}, rv
                        )
                    except Conflict:
                        gpu = None
                if gpu is not None:
                    self.free[gpu] -= sum(s for _, s in containers)
                    self.reserved[uid] = (gpu, containers)
                    self.cluster.patch_pod_annotations(
                        uid,
                        {
                            ASSIGNMENT_ANNOTATION: json.dumps(
                                {
                                    "node": "n1",
                                    "ts": time.time(),
                                    "containers": [
                                        {"name": n, "gpu_mem_gib": s, "gpus": [gpu]} for n, s in containers
                                    ],
                                }
                            )
                        },
                    )
                    self.cluster.bind(uid, "n1")
                    return True
            time.sleep(0.002)


def test_burst_of_pods_never_overcommits_and_each_gets_its_reserved_gpu(
    socket_dir: str, kubelet: FakeKubelet
) -> None:
    rng = random.Random(7)
    source = FakeSource(make_inventory(2, memory_gib=16))
    capacity = {g.uuid: g.memory_gib for g in source.inv.gpus}
    cluster = InMemoryCluster()
    cluster.add_node("n1")
    pods = {}
    for n in range(40):
        containers = [(f"c{i}", rng.randint(1, 3)) for i in range(rng.choice([1, 1, 2]))]
        pods[f"u{n}"] = containers
        cluster.add_pod(f"u{n}", "default", f"p-u{n}", "")
    extender = FakeExtender(cluster, capacity)
    cfg = replace(make_config(socket_dir), sharing_mode="memory", node_name="n1")
    endpoint = "gpufleet-gpufleet.io-gpu-mem.sock"
    results: dict[str, list[str]] = {}
    failures: list[str] = []
    admitted: queue.Queue[str] = queue.Queue()

    with running_plugin(cfg, source, resolver=cluster):
        wait_for(lambda: kubelet.requests, "registration")
        stub = pb_grpc.DevicePluginStub(plugin_channel(socket_dir, endpoint))

        def kubelet_worker() -> None:
            # The kubelet calls Allocate per container, in order, for pods bound to its node.
            while (uid := admitted.get()) != "":
                for _name, size in pods[uid]:
                    req = pb.AllocateRequest(
                        container_requests=[
                            pb.ContainerAllocateRequest(devices_ids=[f"{G0}::{k}" for k in range(size)])
                        ]
                    )
                    try:
                        resp = stub.Allocate(req, timeout=20)
                        results.setdefault(uid, []).append(
                            resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"]
                        )
                    except grpc.RpcError as exc:
                        failures.append(f"{uid}: {exc.details()}")

        def binder(uids: list[str]) -> None:
            for uid in uids:
                if extender.bind(uid, pods[uid]):
                    admitted.put(uid)

        workers = [threading.Thread(target=kubelet_worker) for _ in range(4)]
        ids = list(pods)
        binders = [threading.Thread(target=binder, args=(ids[i::8],)) for i in range(8)]
        for t in workers + binders:
            t.start()
        for t in binders:
            t.join(60)
        for _ in workers:
            admitted.put("")
        for t in workers:
            t.join(60)

    assert failures == []
    bound = set(extender.reserved)
    assert bound and bound == set(results)
    used = {g: 0 for g in capacity}
    for uid, (gpu, containers) in extender.reserved.items():
        assert results[uid] == [gpu] * len(containers)  # every container got the GPU reserved for its pod
        used[gpu] += sum(s for _, s in containers)
        assert cluster.pod(uid).annotations[ALLOCATED_ANNOTATION] == ",".join(n for n, _ in containers)
    assert all(used[g] <= capacity[g] for g in capacity)
    assert LOCK_ANNOTATION not in cluster.node_annotations("n1")
