"""What the real kube-scheduler needs from bind: a node whose GPU-memory hand-off is about to finish stays a
candidate and the bind waits for it (`lock_wait`); a bind queued for a node holds its reservation at once.

Why: kube-scheduler (1.20 measured in tests/cluster/test_extender_scheduler.py; later releases up to
their QueueingHints likewise) puts a pod that no node accepts, or whose bind failed, in its unschedulable
queue for 60 s or more, and a node's annotations changing (the lock going away) does not wake it. A
"node busy" refusal therefore costs a pod a minute or more, where the device plugin releases the lock
within about a second of the kubelet admitting the pod.
"""

from __future__ import annotations

import json
import random
import threading
import time

import pytest
from extender_builders import gpu, machine, node, pod, settle

from gpufleet.extender.request import Policy, parse_pod
from gpufleet.extender.scheduling import filter_nodes
from gpufleet.extender.settings import SettingsError, load_settings
from gpufleet.extender.state import ClusterState

LOCK = "gpufleet.io/bind-lock"
ASSIGNMENT = "gpufleet.io/assignment"


def bind(ext, name: str, node_name: str) -> str:  # type: ignore[no-untyped-def]
    return ext.api.bind(
        {"PodName": name, "PodNamespace": "default", "PodUID": f"uid-default-{name}", "Node": node_name}
    )["Error"]


def pod_now(cluster, name: str) -> dict:  # type: ignore[no-untyped-def]
    return next(p for p in cluster.pods() if p["metadata"]["name"] == name)


@pytest.fixture
def two_nodes(cluster):  # type: ignore[no-untyped-def]
    cluster.add_node(node("n1", machine("a", 2, mem=16)))
    cluster.add_node(node("n2", machine("b", 2, mem=16)))
    return cluster


def lock_node(cluster, node_name: str, holder: str, taken_ago: float, clock) -> None:  # type: ignore[no-untyped-def]
    """A bind-lock of `holder` taken `taken_ago` seconds ago (TTL 60 s), as another replica wrote it."""
    value = f"uid-default-{holder} default/{holder} {int(clock() - taken_ago) + 60}"
    cluster.update_node(node_name, lambda n: n["metadata"]["annotations"].update({LOCK: value}))


def test_bound_lock_holder_keeps_the_node_a_candidate_and_bind_waits_for_the_release(
    two_nodes, start_extender
) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    cluster.add_pod(pod("q", mem=[4]))
    ext = start_extender(lock_wait=10)
    assert bind(ext, "p", "n1") == ""
    settle(cluster)
    # p is bound and waits for the kubelet: its lock goes away soon, so n1 still fits q, and binpack
    # chooses it (one hand-off ahead is well within bind_wait).
    filtered = ext.api.filter({"Pod": pod("q", mem=[4]), "NodeNames": ["n1", "n2"]})
    assert filtered["NodeNames"] == ["n1"] and filtered["FailedNodes"] == {}
    # The device plugin allocates p a little later; q's bind waits for that instead of refusing.
    plugin = threading.Timer(0.3, cluster.complete_allocations)
    plugin.start()
    assert bind(ext, "q", "n1") == ""
    plugin.join()
    settle(cluster)
    assert pod_now(cluster, "q")["spec"]["nodeName"] == "n1"
    assert cluster.node("n1")["metadata"]["annotations"][LOCK].startswith("uid-default-q ")
    assert ext.metrics.get("gpufleet_extender_lock_waits_total") == 1
    used = {g["uuid"]: g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]}
    assert sum(used.values()) == 8


def test_bind_gives_up_after_lock_wait_and_undoes_its_reservation(two_nodes, start_extender, clock) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("other", mem=[4]))
    cluster.add_pod(pod("q", mem=[4]))
    lock_node(cluster, "n1", "other", 0, clock)  # another replica is binding `other` right now
    ext = start_extender(lock_wait=0.5, bind_wait=0.5)  # the turn comes at once: 1 s for the hand-off
    # A young lock: that bind is still running, so n1 stays a candidate.
    assert ext.api.filter({"Pod": pod("q", mem=[4]), "NodeNames": ["n1"]})["NodeNames"] == ["n1"]
    started = time.monotonic()
    error = bind(ext, "q", "n1")  # nobody releases the lock
    assert time.monotonic() - started >= 0.5
    assert "busy: GPU-memory hand-off in progress for default/other" in error
    settle(cluster)
    assert not pod_now(cluster, "q")["spec"].get("nodeName")
    assert ASSIGNMENT not in pod_now(cluster, "q")["metadata"]["annotations"]
    assert cluster.node("n1")["metadata"]["annotations"][LOCK].startswith("uid-default-other ")
    assert ext.state.reservation_count() == 0


def test_stale_lock_of_an_unbound_pod_still_makes_the_node_busy(two_nodes, start_extender, clock) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("ghost", mem=[4]))  # its binder died after locking: never bound
    cluster.add_pod(pod("q", mem=[4]))
    lock_node(cluster, "n1", "ghost", 20, clock)
    ext = start_extender(lock_wait=3)
    filtered = ext.api.filter({"Pod": pod("q", mem=[4]), "NodeNames": ["n1", "n2"]})
    assert filtered["NodeNames"] == ["n2"] and "node busy" in filtered["FailedNodes"]["n1"]
    started = time.monotonic()
    assert "busy" in bind(ext, "q", "n1")
    assert time.monotonic() - started < 2.5  # refused at once: waiting cannot help
    assert ext.metrics.get("gpufleet_extender_lock_waits_total") == 0


def test_prioritize_puts_a_node_in_hand_off_last_while_another_fits(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[8]))
    cluster.add_pod(pod("q", mem=[4]))
    ext = start_extender(lock_wait=3)
    assert bind(ext, "p", "n1") == ""
    settle(cluster)
    # Binpack alone would prefer the fuller n1; its hand-off makes n2 the better choice now.
    scores = ext.api.prioritize({"Pod": pod("q", mem=[4]), "NodeNames": ["n1", "n2"]})
    assert {s["Host"]: s["Score"] for s in scores} == {"n1": 1, "n2": 10}
    # Only n1 left: it is still the best there is.
    alone = ext.api.prioritize({"Pod": pod("q", mem=[4]), "NodeNames": ["n1"]})
    assert alone == [{"Host": "n1", "Score": 10}]
    cluster.complete_allocations()
    settle(cluster)
    scores = ext.api.prioritize({"Pod": pod("q", mem=[4]), "NodeNames": ["n1", "n2"]})
    assert {s["Host"]: s["Score"] for s in scores} == {"n1": 10, "n2": 1}


def test_lock_wait_setting() -> None:
    assert load_settings(env={}).lock_wait == 3.0
    assert load_settings(env={}, flags={"lock_wait": "0"}).lock_wait == 0.0
    with pytest.raises(SettingsError, match="lock_wait"):
        load_settings(env={}, flags={"lock_wait": "-1"})


NOW = 1_700_000_000.0


@pytest.mark.parametrize("seed", range(3))
def test_filter_fast_path_agrees_with_full_evaluation_under_lock_wait(seed: int) -> None:
    """Locks of every kind — expired, stale, young, held by a pod bound to the node — are judged alike by
    the filter's fast path and by the full evaluation."""
    rng = random.Random(seed)
    state = ClusterState(clock=lambda: NOW, lock_wait=3.0)
    nodes, pods, kinds = [], [], {}
    for i in range(80):
        gpus = machine(f"n{i}", rng.randint(1, 4), mesh=False, mem=rng.choice([16, 24, 80]))
        holder = f"h{i}"
        kind = kinds[f"n{i}"] = rng.choice(["none", "expired", "stale", "young", "bound"])
        expires = {"expired": NOW - 1, "stale": NOW + 30, "young": NOW + 59, "bound": NOW + 30}.get(kind)
        lock = None if expires is None else f"uid-default-{holder} default/{holder} {int(expires)}"
        nodes.append(node(f"n{i}", gpus, lock=lock))
        for g in gpus:
            if rng.random() < 0.5:
                share = rng.randint(1, g["memory_gib"])
                p = pod(f"p{i}-{g['index']}", mem=[share], node_name=f"n{i}")
                container = {"name": "c0", "gpu_mem_gib": share, "gpus": [g["uuid"]]}
                assignment = {"node": f"n{i}", "containers": [container], "ts": NOW - 100}
                p["metadata"]["annotations"][ASSIGNMENT] = json.dumps(assignment)
                pods.append(p)
        if kind == "bound":
            pods.append(pod(holder, mem=[1], node_name=f"n{i}"))
    state.replace_nodes(nodes)
    state.replace_pods(pods)
    names = [f"n{i}" for i in range(80)]
    busy: set[str] = set()
    for share in (1, 8, 20):
        r = parse_pod(pod("q", mem=[share]))
        out = filter_nodes(state, r, names, Policy.BINPACK, NOW)
        for name in names:
            verdict = state.evaluate(r, state.entry(name).info, Policy.BINPACK, NOW)
            assert (name in out.fits) == verdict.fits, name
            if not verdict.fits:
                assert (out.unresolvable if verdict.unresolvable else out.failed)[name] == verdict.reason
            if "node busy" in verdict.reason:
                busy.add(name)
    # Only the stale locks keep pods off; some of them did (the others' GPUs are too small anyway).
    assert busy and all(kinds[name] == "stale" for name in busy)


def test_a_bind_queued_for_the_node_is_counted_at_once(cluster, start_extender) -> None:  # type: ignore[no-untyped-def]
    """kube-scheduler decides the next pod while earlier binds run: a bind waiting for the node's turn
    already holds its reservation, so the next filter does not offer the same GiB again (also when no filter
    of this process decided it: another replica's, or one before a restart)."""
    cluster.add_node(node("n1", machine("a", 1, mem=16)))
    cluster.add_pod(pod("q", mem=[10]))
    ext = start_extender(lock_wait=0)
    assert ext.binder.turns.acquire("n1", 1.0) == (True, False)  # another bind to n1 is running
    result: list[str] = []
    waiter = threading.Thread(target=lambda: result.append(bind(ext, "q", "n1")))
    waiter.start()
    deadline = time.monotonic() + 5
    while ext.state.reservation_count() == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    filtered = ext.api.filter({"Pod": pod("r", mem=[10]), "NodeNames": ["n1"]})
    assert filtered["NodeNames"] == [] and "not enough free GPU memory" in filtered["FailedNodes"]["n1"]
    ext.binder.turns.release("n1")
    waiter.join(10)
    assert result == [""]


def test_a_bind_that_cannot_get_the_node_drops_its_reservation(cluster, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster.add_node(node("n1", machine("a", 1, mem=16)))
    cluster.add_pod(pod("q", mem=[10]))
    ext = start_extender(bind_wait=0.2)
    ext.binder.turns.acquire("n1", 1.0)
    try:
        assert "waiting behind other binds to it in this extender (bind_wait)" in bind(ext, "q", "n1")
    finally:
        ext.binder.turns.release("n1")
    assert ext.state.reservation_count() == 0
    assert ext.state.inspect_node("n1")["gpus"][0]["used_gib"] == 0


def _schedule(ext, wish: dict, gib: int, names: list[str], selector: dict | None = None) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The scores of `names` for a pod (0: does not fit), after the filter that decides its node."""
    p = pod(wish.pop("name"), mem=[gib], annotations=wish, node_selector=selector)
    ext.api.filter({"Pod": p, "NodeNames": names})
    return {s["Host"]: s["Score"] for s in ext.api.prioritize({"Pod": p, "NodeNames": names})}


def test_a_hand_off_ranks_a_node_last_only_when_another_matches_the_pods_wish(  # type: ignore[no-untyped-def]
    cluster, start_extender
) -> None:
    """tests/cluster/test_extender_scheduler.py::test_model_and_capability_requests_land_on_the_right_gpus,
    step by step and without timing: its "best" pod (most capable: the A10 on the mixed node) came while
    the previous pod's hand-off on that node was still running (bound, not yet allocated, bind-lock
    live). Prioritize used to rank such a node last whenever another one fit, so the real scheduler put
    "best" on the A100 node for good (the flake that got the per-node index reverted). Now the penalty
    applies only while another node matches the pod's wish: "best" still scores the A10 highest (its bind
    may wait up to lock_wait), a pod with no wish is sent elsewhere."""
    a100 = [gpu(0, "GPU-a100-0"), gpu(1, "GPU-a100-1")]
    t4 = [gpu(0, "GPU-t4-0", "Tesla T4", 15, "7.5"), gpu(1, "GPU-t4-1", "Tesla T4", 15, "7.5")]
    mixed = [
        gpu(0, "GPU-v100", "Tesla V100-SXM2-32GB", 32, "7.0"),
        gpu(1, "GPU-a10", "NVIDIA A10", 22, "8.6"),
    ]
    product = "nvidia.com/gpu.product"
    cluster.add_node(node("a100", a100, labels={product: "NVIDIA-A100-SXM4-80GB"}))
    cluster.add_node(node("t4", t4, labels={product: "Tesla-T4"}))
    cluster.add_node(node("mixed", mixed, labels={product: "Tesla-V100-SXM2-32GB"}))
    selector = {product: "Tesla-V100-SXM2-32GB"}
    for name, gib, wish in (("sel-v100", 20, {}), ("model-a10", 4, {"gpufleet.io/gpu-model": "A10"}),
                            ("cc80", 12, {"gpufleet.io/gpu-min-cc": "8.0"}),
                            ("best", 2, {"gpufleet.io/gpu-prefer": "most-capable"})):  # fmt: skip
        obj = pod(name, mem=[gib], annotations=wish, node_selector=selector if name == "sel-v100" else None)
        cluster.add_pod(obj)
    ext = start_extender(lock_wait=3)
    names = ["a100", "t4", "mixed"]
    placed = {}
    for name, gib, wish in (("sel-v100", 20, {}), ("model-a10", 4, {"gpufleet.io/gpu-model": "A10"}),
                            ("cc80", 12, {"gpufleet.io/gpu-min-cc": "8.0"})):  # fmt: skip
        scores = _schedule(ext, {"name": name, **wish}, gib, ["mixed"] if name == "sel-v100" else names,
                           selector if name == "sel-v100" else None)  # fmt: skip
        best_node = max(scores, key=scores.__getitem__)
        assert bind(ext, name, best_node) == ""
        settle(cluster)
        placed[name] = best_node
        if name != "cc80":
            cluster.complete_allocations()
            settle(cluster)
    assert placed == {"sel-v100": "mixed", "model-a10": "mixed", "cc80": "mixed"}
    most = {"name": "best", "gpufleet.io/gpu-prefer": "most-capable"}
    # cc80 is bound to the mixed node; the device plugin has not allocated it yet: its lock is live.
    assert ext.state.inspect_node("mixed")["bind_lock"]["uid"] == "uid-default-cc80"
    # The A10 is the most capable card anywhere: the hand-off does not take it away from "best" ...
    assert _schedule(ext, dict(most), 2, names) == {"a100": 5, "t4": 1, "mixed": 10}
    # ... while a pod that asks for nothing in particular goes where no hand-off is running.
    plain = _schedule(ext, {"name": "best"}, 2, names)
    assert plain["mixed"] == 1 and max(plain["a100"], plain["t4"]) == 10, plain
    # Once the hand-off is over, nothing changes for "best"; the plain pod may use the mixed node again.
    cluster.complete_allocations()
    settle(cluster)
    assert ext.state.inspect_node("mixed")["bind_lock"] is None
    assert _schedule(ext, dict(most), 2, names) == {"a100": 5, "t4": 1, "mixed": 10}
    assert _schedule(ext, {"name": "best"}, 2, names)["mixed"] > 1
    assert _schedule(ext, dict(most), 2, names)["mixed"] == 10  # the filter that decides "best"'s bind
    assert bind(ext, "best", "mixed") == ""
    settle(cluster)
    assignment = json.loads(pod_now(cluster, "best")["metadata"]["annotations"][ASSIGNMENT])
    assert assignment["containers"][0]["gpus"] == ["GPU-a10"]


def test_a_bind_behind_a_lagging_node_watch_waits_for_the_hand_off_instead_of_refusing(
    two_nodes, start_extender
) -> None:  # type: ignore[no-untyped-def]
    """The API server's node and pod watches are separate streams; under load the node's lags. A bind whose
    cache shows the node before another replica's bind-lock gets a 409, reads the node, sees that lock: it
    must wait for the hand-off (the holder is bound), not compare against its older cache, patch with it
    again and again and give up as "lock_conflict" within milliseconds."""
    cluster = two_nodes
    cluster.add_pod(pod("h", mem=[4]))
    cluster.add_pod(pod("q", mem=[4]))
    ext = start_extender(lock_wait=5)
    other = start_extender(lock_wait=5)
    settle(cluster)
    cluster.lagging.add("node")  # node events are held back from now on; pod events flow
    assert bind(other, "h", "n1") == ""  # the other replica locks n1 and binds h there
    assert LOCK in cluster.node("n1")["metadata"]["annotations"]

    def device_plugin() -> None:  # allocates h once q's bind waits for the hand-off
        deadline = time.monotonic() + 5
        while ext.metrics.get("gpufleet_extender_lock_waits_total") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        cluster.complete_allocations("n1")

    plugin = threading.Thread(target=device_plugin)
    plugin.start()
    error = bind(ext, "q", "n1")
    plugin.join()
    assert error == ""
    assert pod_now(cluster, "q")["spec"]["nodeName"] == "n1"
    assert cluster.node("n1")["metadata"]["annotations"][LOCK].startswith("uid-default-q ")
    # One 409 from the cache behind the other replica's lock, then no more: nothing patched with a cache
    # known to be older than what was read.
    assert ext.metrics.get("gpufleet_extender_lock_conflicts_total") == 1
    assert ext.metrics.get("gpufleet_extender_lock_waits_total") == 1
    cluster.lagging.clear()
    settle(cluster)
    used = {g["uuid"]: g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]}
    assert sum(used.values()) == 8
