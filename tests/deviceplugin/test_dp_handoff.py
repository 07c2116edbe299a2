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
from gpufleet.deviceplugin.gpumem.handoff import VIEW_WAIT_S, MemoryHandoff, decide
from gpufleet.deviceplugin.gpumem.resolver import (
    Conflict,
    InMemoryCluster,
    KubernetesPodResolver,
    NodePods,
    PodView,
    pod_view,
)
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions
from gpufleet.deviceplugin.rm.errors import DeviceUnhealthy, HandoffError
from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.handoff import ALLOCATED_ANNOTATION, ASSIGNMENT_ANNOTATION, GPU_MEM_RESOURCE
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


def test_a_pod_asking_for_gpu_memory_without_an_assignment_makes_the_allocate_ambiguous() -> None:
    # Bound without the extender (another scheduler, spec.nodeName by hand): the kubelet admits it too, and
    # its Allocate looks exactly like the holder's.
    stray = PodView("s", "default", "p-s", "n1", "Pending", {}, frozenset({GPU_MEM_RESOURCE, "cpu"}))
    with pytest.raises(HandoffError, match=r"cannot tell which pod.*default/p-a, default/p-s"):
        decide("n1", lock("a"), [pod("a", ("c0", 4, G0)), stray], NOW, 4)
    # Started or finished, or asking for something else, it is not the pod being admitted.
    for other in (
        replace(stray, phase="Running"),
        replace(stray, phase="Failed"),
        replace(stray, requests=frozenset({"nvidia.com/gpu"})),
    ):
        assert decide("n1", lock("a"), [pod("a", ("c0", 4, G0)), other], NOW, 4).pod.uid == "a"
    # The resource is the one the plugin serves (`sharing.memory.resource_name`).
    renamed = replace(stray, requests=frozenset({"example.com/gpu-mem"}))
    assert decide("n1", lock("a"), [pod("a", ("c0", 4, G0)), renamed], NOW, 4).pod.uid == "a"
    with pytest.raises(HandoffError, match="cannot tell"):
        decide("n1", lock("a"), [pod("a", ("c0", 4, G0)), renamed], NOW, 4, "example.com/gpu-mem")


def test_pod_view_reads_the_api_servers_json() -> None:
    obj = {
        "metadata": {"uid": "u1", "namespace": "ns", "name": "p", "resourceVersion": "7",
                     "annotations": {ASSIGNMENT_ANNOTATION: "{}", "other": "x"}},
        "spec": {"nodeName": "n1",
                 "initContainers": [{"name": "i", "resources": {"requests": {"cpu": "1"}}}],
                 "containers": [{"name": "c", "resources": {"limits": {GPU_MEM_RESOURCE: "4"}}},
                                {"name": "d"}]},
    }  # fmt: skip
    view = pod_view(obj)
    assert (view.uid, view.ref, view.node, view.phase) == ("u1", "ns/p", "n1", "Pending")
    assert view.annotations == {ASSIGNMENT_ANNOTATION: "{}"}  # only what the hand-off reads is kept
    assert view.requests == {"cpu", GPU_MEM_RESOURCE}
    assert pod_view({**obj, "spec": {}, "status": {"phase": "Running"}}).phase == "Running"
    with pytest.raises(ValueError, match="uid"):
        pod_view({"metadata": {"name": "p"}})


# ----- MemoryHandoff: recording and the response ------------------------------------------------------


def handoff(
    cluster: InMemoryCluster,
    health: dict[str, GpuHealth] | None = None,
    mps: bool = False,
    view_wait: float = VIEW_WAIT_S,
) -> MemoryHandoff:
    inv = make_inventory(2, memory_gib=16)
    return MemoryHandoff(
        cluster,
        "n1",
        inv.by_uuid,
        lambda: health or {},
        AllocateOptions(pass_device_specs=False, mps=mps),
        clock=lambda: NOW,
        view_wait=view_wait,
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

    def flaky(name: str, changes: dict, rv: int | str | None = None) -> int:
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


# ----- the node's pod view: what an Allocate reads, and what it waits for ------------------------------


def test_an_allocate_reads_the_node_once_writes_the_pod_once_and_reads_no_pods() -> None:
    c = cluster_with(("a", (("c0", 4, G0),)), holder="a")
    handoff(c)(["x"] * 4)
    # The lock's release reused the node as read (no conflict); the pods came from the node's view.
    assert (c.node_reads, c.writes) == (1, 1)
    assert LOCK_ANNOTATION not in c.node_annotations("n1")


def test_allocate_waits_until_the_view_shows_the_lock_holder_bound() -> None:
    c = InMemoryCluster()
    c.add_node("n1")
    h = handoff(c)
    c.hold("n1")  # the watch lags: the kubelet has seen the pod bound, the plugin's view has not
    c.add_pod("a", "default", "p-a", "", {ASSIGNMENT_ANNOTATION: assignment(("c0", 4, G1))})
    c.patch_node_annotations("n1", {LOCK_ANNOTATION: lock("a")})
    c.bind("a", "n1")
    answers: queue.Queue[pb.ContainerAllocateResponse] = queue.Queue()
    allocating = threading.Thread(target=lambda: answers.put(h(["x"] * 4)))
    allocating.start()
    wait_for(lambda: c.node_reads == 1, "the Allocate reading the lock")
    assert c.writes == 0  # nothing is decided, let alone recorded, before the view shows the holder
    c.deliver("n1")
    allocating.join(30)
    assert answers.get_nowait().envs["NVIDIA_VISIBLE_DEVICES"] == G1
    assert c.pod("a").annotations[ALLOCATED_ANNOTATION] == "c0"


def test_a_holder_the_view_never_shows_is_refused_and_nothing_is_recorded() -> None:
    c = InMemoryCluster()
    c.add_node("n1")
    h = handoff(c, view_wait=0.2)
    c.hold("n1")
    c.add_pod("a", "default", "p-a", "n1", {ASSIGNMENT_ANNOTATION: assignment(("c0", 4, G1))})
    c.patch_node_annotations("n1", {LOCK_ANNOTATION: lock("a")})
    with pytest.raises(HandoffError, match=r"lock held by default/p-a .*unallocated pods: none visible"):
        h(["x"] * 4)
    assert c.writes == 0 and c.node_annotations("n1")[LOCK_ANNOTATION] == lock("a")


@pytest.mark.parametrize("late", ["assigned", "stray"])
def test_a_pod_bound_behind_the_views_back_undoes_the_record_and_refuses(late: str) -> None:
    # The view shows the holder b and nothing else; another pod waiting for GPU memory was bound before
    # the Allocate came (a bind that landed after its lock expired, or one without the extender), and the
    # view has not delivered it. Once the view reaches the plugin's own write it shows that pod: the
    # Allocate may be for it, so the record is undone and the Allocate refused; the lock stays.
    c = cluster_with(("b", (("c0", 4, G1),)), holder="b")
    h = handoff(c)
    c.hold("n1")
    if late == "assigned":
        c.add_pod("a", "default", "p-a", "n1", {ASSIGNMENT_ANNOTATION: assignment(("c0", 4, G0))})
    else:
        c.add_pod("a", "default", "p-a", "n1", requests={GPU_MEM_RESOURCE})
    record = c.set_allocated

    def record_then_catch_up(pod_: PodView, value: str | None) -> int:
        written = record(pod_, value)
        c.deliver("n1")  # the watch catches up after the write
        return written

    c.set_allocated = record_then_catch_up  # type: ignore[method-assign]
    with pytest.raises(HandoffError, match=r"lock held by default/p-b \(uid b\), also waiting: default/p-a"):
        h(["x"] * 4)
    assert ALLOCATED_ANNOTATION not in c.pod("b").annotations
    assert c.node_annotations("n1")[LOCK_ANNOTATION] == lock("b")
    assert c.writes == 2  # the record and its undoing


def test_a_view_that_never_reaches_the_write_undoes_it_and_refuses() -> None:
    c = cluster_with(("a", (("init", 2, G0), ("c0", 4, G1))), holder="a")
    h = handoff(c, view_wait=0.2)
    h(["x"] * 2)
    c.hold("n1")
    with pytest.raises(HandoffError, match=r"did not reach its own write to pod default/p-a"):
        h(["x"] * 4)
    assert c.pod("a").annotations[ALLOCATED_ANNOTATION] == "init"  # back to what it was
    assert c.node_annotations("n1")[LOCK_ANNOTATION] == lock("a")


def test_no_list_of_the_nodes_pods_yet_is_refused_with_the_watchs_error() -> None:
    unlisted = NodePods("n1")
    unlisted.failed("HTTP 403 Forbidden")

    class Unlisted(InMemoryCluster):
        def node_pods(self, node: str) -> NodePods:
            return unlisted

    c = Unlisted()
    c.add_node("n1")
    c.add_pod("a", "default", "p-a", "n1", {ASSIGNMENT_ANNOTATION: assignment(("c0", 4, G0))})
    c.patch_node_annotations("n1", {LOCK_ANNOTATION: lock("a")})
    with pytest.raises(HandoffError, match=r"has not listed the node's pods yet \(HTTP 403 Forbidden\)"):
        handoff(c, view_wait=0.1)(["x"] * 4)
    assert c.writes == 0


def test_node_pods_follow_events_in_order_and_keep_only_the_nodes_pods() -> None:
    view = NodePods("n1")
    assert not view.snapshot().synced
    a, b = pod("a", ("c0", 4, G0)), pod("b", ("c0", 4, G0))
    view.replace([a, pod("x", ("c0", 4, G0), node="n2")], 10)
    assert ([p.uid for p in view.snapshot().pods], view.snapshot().version) == (["a"], 10)
    view.apply("ADDED", b, 12)
    view.apply("DELETED", a, 13)
    view.advance(20)  # a bookmark
    view.advance(15)  # never back
    view.failed("connection reset")
    snap = view.snapshot()
    assert ([p.uid for p in snap.pods], snap.version, snap.error) == (["b"], 20, "connection reset")
    view.apply("MODIFIED", replace(b, phase="Running"), 21)
    assert (view.snapshot().get("b").phase, view.snapshot().error) == ("Running", "")  # type: ignore[union-attr]
    assert view.wait(lambda v: v.version >= 21, 0).version == 21
    assert view.wait(lambda v: v.version >= 22, 0.05).version == 21  # times out with the last view


# ----- KubernetesPodResolver's watch, against scripted API replies ---------------------------------------


class _Reply:
    def __init__(self, doc: dict) -> None:
        self.data = json.dumps(doc).encode()


class _Stream:
    """A watch reply: the events' lines cut into chunks that end mid-line; then it blocks until shut."""

    def __init__(self, events: list[dict]) -> None:
        text = b"".join(json.dumps(e).encode() + b"\n" for e in events)
        self.chunks = [text[i : i + 7] for i in range(0, len(text), 7)]
        self.shut = threading.Event()
        self.block = not any(e.get("type") == "ERROR" for e in events)

    def stream(self, amt: int, decode_content: bool = True):
        yield from self.chunks
        if self.block:
            self.shut.wait(30)

    def shutdown(self) -> None:
        self.shut.set()

    def release_conn(self) -> None:
        pass


class _ScriptedCore:
    """The CoreV1Api calls the watch makes, answered from a script, each call recorded."""

    def __init__(self, script: list) -> None:
        self.script = script
        self.calls: list[dict] = []

    def list_pod_for_all_namespaces(self, **kwargs):
        self.calls.append(kwargs)
        step = self.script.pop(0) if self.script else _Stream([])
        if isinstance(step, Exception):
            raise step
        return step


def _api_pod(uid: str, rv: int) -> dict:
    return {"metadata": {"uid": uid, "namespace": "default", "name": f"p-{uid}", "resourceVersion": str(rv)},
            "spec": {"nodeName": "n1"}}  # fmt: skip


def test_the_watch_relists_after_a_gap_never_going_back_and_retries_after_errors() -> None:
    class Gone(Exception):
        status = 410

    class Refused(Exception):
        pass

    core = _ScriptedCore([
        _Reply({"metadata": {"resourceVersion": "100"}, "items": [_api_pod("a", 90)]}),
        _Stream([{"type": "ADDED", "object": _api_pod("b", 101)},
                 {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "150"}}},
                 {"type": "ERROR", "object": {"kind": "Status", "code": 410, "message": "too old"}}]),
        _Reply({"metadata": {"resourceVersion": "160"}, "items": [_api_pod("a", 90), _api_pod("c", 155)]}),
        Refused("connection refused"),
        Gone(),  # the watch from 160 is refused with HTTP 410: list again
        _Reply({"metadata": {"resourceVersion": "170"}, "items": [_api_pod("c", 155)]}),
    ])  # fmt: skip
    resolver = KubernetesPodResolver(core, retry_s=0.01)
    try:
        view = resolver.node_pods("n1").wait(lambda v: v.version >= 170, 10)
        assert ([p.uid for p in view.pods], view.version) == (["c"], 170)
        wait_for(lambda: len(core.calls) == 7, "the watch from 170")
    finally:
        resolver.close()
    plain = [
        {k: v for k, v in call.items() if k in ("resource_version", "resource_version_match", "watch")}
        for call in core.calls
    ]
    assert plain == [
        {"resource_version": "0"},  # the first list: whatever the watch cache holds
        {"resource_version": "100", "watch": True},
        {"resource_version": "150", "resource_version_match": "NotOlderThan"},  # after the gap: not older
        {"resource_version": "160", "watch": True},  # refused: the view stays, the watch is tried again
        {"resource_version": "160", "watch": True},  # 410
        {"resource_version": "160", "resource_version_match": "NotOlderThan"},
        {"resource_version": "170", "watch": True},
    ]
    assert all(call["field_selector"] == "spec.nodeName=n1" for call in core.calls)
    assert all(call.get("allow_watch_bookmarks") for call in core.calls if call.get("watch"))


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
                node = self.cluster.read_node("n1")
                held, rv = node.annotations.get(LOCK_ANNOTATION), node.version
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
