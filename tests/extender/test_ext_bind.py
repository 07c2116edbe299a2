"""The bind sequence: lock, annotate, re-check against the watch, Binding — and every way it can fail
without harm."""

from __future__ import annotations

import json
import threading
import time

import pytest
from extender_builders import gpu, machine, node, pod, settle

from gpufleet.extender import binder as binder_module
from gpufleet.extender.cluster import ConflictError, InvalidError, NotFoundError, UnavailableError

LOCK = "gpufleet.io/bind-lock"
ASSIGNMENT = "gpufleet.io/assignment"


def bind(ext, name: str, node_name: str, namespace: str = "default") -> str:  # type: ignore[no-untyped-def]
    return ext.api.bind(
        {"PodName": name, "PodNamespace": namespace, "PodUID": f"uid-{namespace}-{name}", "Node": node_name}
    )["Error"]


def pod_now(cluster, name: str) -> dict:  # type: ignore[no-untyped-def]
    return next(p for p in cluster.pods() if p["metadata"]["name"] == name)


def annotations(obj: dict) -> dict:
    return obj["metadata"].get("annotations") or {}


@pytest.fixture
def two_nodes(cluster):  # type: ignore[no-untyped-def]
    cluster.add_node(node("n1", machine("a", 2, mem=16)))
    cluster.add_node(node("n2", machine("b", 2, mem=16)))
    return cluster


def assert_clean(cluster, ext, name: str, node_name: str) -> None:  # type: ignore[no-untyped-def]
    """After a failed bind: no lock, no annotation, no binding, no claim."""
    settle(cluster)
    p = pod_now(cluster, name)
    assert not p["spec"].get("nodeName")
    assert ASSIGNMENT not in annotations(p)
    assert LOCK not in annotations(cluster.node(node_name))
    assert ext.state.reservation_count() == 0
    assert all(g["used_gib"] == 0 for g in ext.state.inspect_node(node_name)["gpus"])


def test_bind_annotates_locks_and_binds_then_the_device_plugin_unlocks(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[6, 4]))
    ext = start_extender()
    assert bind(ext, "p", "n1") == ""
    settle(cluster)
    p = pod_now(cluster, "p")
    assert p["spec"]["nodeName"] == "n1"
    assignment = json.loads(annotations(p)[ASSIGNMENT])
    assert assignment["node"] == "n1" and [c["name"] for c in assignment["containers"]] == ["c0", "c1"]
    assert annotations(cluster.node("n1"))[LOCK].split()[:2] == ["uid-default-p", "default/p"]
    assert cluster.complete_allocations() == ["default/p"]
    settle(cluster)
    assert LOCK not in annotations(cluster.node("n1"))
    assert ext.state.reservation_count() == 0  # the watch took over from the reservation
    used = {g["uuid"]: g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]}
    assert sum(used.values()) == 10


def test_second_memory_pod_waits_while_the_node_is_locked(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    cluster.add_pod(pod("q", mem=[4]))
    ext = start_extender(lock_wait=0)  # strict: no waiting for the hand-off (test_ext_lock_wait.py)
    assert bind(ext, "p", "n1") == ""
    settle(cluster)
    assert "busy: GPU-memory hand-off in progress for default/p" in bind(ext, "q", "n1")
    filtered = ext.api.filter({"Pod": pod("q", mem=[4]), "NodeNames": ["n1", "n2"]})
    assert filtered["NodeNames"] == ["n2"] and "node busy" in filtered["FailedNodes"]["n1"]
    cluster.complete_allocations()
    settle(cluster)
    assert bind(ext, "q", "n1") == ""


def test_lock_conflicts_are_retried_with_a_fresh_read(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.inject("patch_node_annotations", ConflictError("modified"), times=2)
    assert bind(ext, "p", "n1") == ""
    assert ext.metrics.get("gpufleet_extender_lock_conflicts_total") == 2


def test_persistent_lock_conflicts_fail_cleanly(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.inject("patch_node_annotations", ConflictError("modified"), times=3)
    assert "kept changing" in bind(ext, "p", "n1")
    assert_clean(cluster, ext, "p", "n1")


def test_unreachable_api_server_gives_an_error_and_no_placement(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.unreachable = True
    assert "connection refused" in bind(ext, "p", "n1")
    cluster.unreachable = False
    assert_clean(cluster, ext, "p", "n1")
    assert ext.metrics.get("gpufleet_extender_binds_total", result="error", reason="api_unavailable") == 1


@pytest.mark.parametrize(
    ("op", "error", "times"),
    [
        ("patch_pod_annotations", InvalidError("uid changed", 422), 1),
        ("patch_pod_annotations", UnavailableError("timeout"), 1),
        ("patch_pod_annotations", ConflictError("pod changed"), 2),  # once is re-read and retried
        ("bind_pod", NotFoundError("pod deleted"), 1),
    ],
)
def test_failure_after_the_lock_undoes_everything(two_nodes, start_extender, op, error, times) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.inject(op, error, times=times)
    message = bind(ext, "p", "n1")
    assert message and "gpufleet extender" in message
    assert_clean(cluster, ext, "p", "n1")


def test_binding_refused_after_annotation_removes_the_annotation(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.inject("bind_pod", InvalidError("forbidden", 403))
    assert "refused" in bind(ext, "p", "n1")
    assert_clean(cluster, ext, "p", "n1")


def test_binding_that_landed_despite_a_lost_reply_counts_as_done(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.inject("bind_pod", UnavailableError("read timeout"), land=True)
    assert bind(ext, "p", "n1") == ""
    settle(cluster)
    p = pod_now(cluster, "p")
    assert p["spec"]["nodeName"] == "n1" and ASSIGNMENT in annotations(p)
    assert LOCK in annotations(cluster.node("n1"))  # kept for the device plugin


def test_binding_with_unknown_outcome_keeps_lock_and_annotation_until_they_expire(
    two_nodes, start_extender, clock
) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.inject("bind_pod", UnavailableError("read timeout"))
    cluster.inject("get_pod", UnavailableError("read timeout"))  # the pod itself came from the watch
    assert "outcome unknown" in bind(ext, "p", "n1")
    settle(cluster)
    assert LOCK in annotations(cluster.node("n1"))
    # The annotated-but-unbound pod still holds its GiB ("binding") until the lock would have expired.
    gpus = ext.state.inspect_node("n1")["gpus"]
    assert sum(g["used_gib"] for g in gpus) == 4
    assert [pp["status"] for g in gpus for pp in g["pods"]] == ["binding"]
    clock.advance(61)
    ext.state.sweep()
    assert sum(g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]) == 0
    assert bind(ext, "p", "n2") == ""  # the scheduler's retry elsewhere


def test_retried_bind_of_an_already_bound_pod_succeeds_without_rewriting(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    assert bind(ext, "p", "n1") == ""
    before = pod_now(cluster, "p")
    assert bind(ext, "p", "n1") == ""
    assert pod_now(cluster, "p") == before
    assert "already bound to n1" in bind(ext, "p", "n2")


def test_recreated_pod_with_another_uid_is_refused(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4], uid="new-uid"))
    ext = start_extender()
    assert "recreated" in bind(ext, "p", "n1")


def catch_up(cluster, pod_name: str = "p") -> None:  # type: ignore[no-untyped-def]
    """Let a paused watch deliver again once the bind has written the pod's assignment (it then waits for
    its watch to show that write)."""

    def run() -> None:
        while ASSIGNMENT not in annotations(pod_now(cluster, pod_name)):
            time.sleep(0.005)
        cluster.paused = False

    threading.Thread(target=run, daemon=True).start()


def test_a_watch_that_never_shows_the_assignment_fails_the_bind_cleanly(
    two_nodes, start_extender, monkeypatch
) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    monkeypatch.setattr(binder_module, "WATCH_WAIT", 0.3)
    cluster.paused = True
    assert "watch did not show pod default/p's assignment" in bind(ext, "p", "n1")
    cluster.paused = False
    assert_clean(cluster, ext, "p", "n1")
    assert ext.metrics.get("gpufleet_extender_binds_total", result="error", reason="watch_lag") == 1


def test_recheck_sees_binds_the_cache_missed(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[12]))
    ext = start_extender()
    cluster.paused = True  # this replica's watch lags behind another replica's bind
    other = pod("other", mem=[12], node_name="n1")
    other["metadata"]["annotations"][ASSIGNMENT] = json.dumps(
        {"node": "n1", "containers": [{"name": "c0", "gpu_mem_gib": 12, "gpus": ["GPU-a-0"]}], "ts": 1.7e9}
    )
    other["metadata"]["annotations"]["gpufleet.io/allocated"] = "c0"  # running: the plugin allocated it
    cluster.add_pod(other)
    # The bind waits until its own watch shows its assignment: by then the watch has shown `other` too.
    catch_up(cluster)
    assert bind(ext, "p", "n1") == ""
    settle(cluster)
    assignment = json.loads(annotations(pod_now(cluster, "p"))[ASSIGNMENT])
    assert assignment["containers"][0]["gpus"] == ["GPU-a-1"]  # not the card the other replica filled
    assert ext.metrics.get("gpufleet_extender_recheck_replans_total") == 1


def test_recheck_uses_the_nodes_current_gpu_health(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    cluster.paused = True

    def sick(obj: dict) -> None:
        gpus = json.loads(obj["metadata"]["annotations"]["gpufleet.io/gpus"])
        gpus[0]["healthy"] = False
        obj["metadata"]["annotations"]["gpufleet.io/gpus"] = json.dumps(gpus)

    cluster.update_node("n1", sick)
    catch_up(cluster)
    assert bind(ext, "p", "n1") == ""  # the lock's precondition fails on the cached Node: read, then locked
    settle(cluster)
    assert json.loads(annotations(pod_now(cluster, "p"))[ASSIGNMENT])["containers"][0]["gpus"] == ["GPU-a-1"]


def test_recheck_refuses_when_the_node_is_full_in_truth(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[12]))
    ext = start_extender()
    cluster.paused = True
    for i, uuid in enumerate(("GPU-a-0", "GPU-a-1")):
        other = pod(f"o{i}", mem=[10], node_name="n1")
        other["metadata"]["annotations"][ASSIGNMENT] = json.dumps(
            {"node": "n1", "containers": [{"name": "c0", "gpu_mem_gib": 10, "gpus": [uuid]}], "ts": 1.7e9}
        )
        other["metadata"]["annotations"]["gpufleet.io/allocated"] = "c0"
        cluster.add_pod(other)
    catch_up(cluster)
    assert "no longer fits" in bind(ext, "p", "n1")
    settle(cluster)
    assert LOCK not in annotations(cluster.node("n1")) and ext.state.reservation_count() == 0


def test_whole_gpu_pods_bind_without_lock_or_annotation(cluster, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster.add_node(node("w", machine("w", 2), sharing=False))
    cluster.add_pod(pod("p", whole=2))
    cluster.add_pod(pod("q", whole=1))
    ext = start_extender()
    assert bind(ext, "p", "w") == ""
    settle(cluster)
    assert LOCK not in annotations(cluster.node("w")) and ASSIGNMENT not in annotations(pod_now(cluster, "p"))
    assert ext.state.inspect_node("w")["whole_gpus_held"] == 2
    assert "not enough free GPUs" in bind(ext, "q", "w")


def test_pod_without_gpus_is_simply_bound(cluster, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster.add_node(node("cpu", None, sharing=False))
    cluster.add_pod(pod("web"))
    ext = start_extender()
    assert bind(ext, "web", "cpu") == ""
    assert pod_now(cluster, "web")["spec"]["nodeName"] == "cpu"


def test_reservation_of_a_pod_deleted_between_filter_and_bind_is_released(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    p = pod("p", mem=[8])
    cluster.add_pod(p)
    ext = start_extender()
    assert ext.api.filter({"Pod": p, "NodeNames": ["n1", "n2"]})["NodeNames"] == ["n1"]
    assert ext.state.reservation_count("decided") == 1
    assert sum(g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]) == 8
    cluster.remove_pod("default", "p")
    settle(cluster)
    assert ext.state.reservation_count() == 0
    assert sum(g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]) == 0
    assert "not found" in bind(ext, "p", "n1")  # the scheduler's bind, late


def test_gpus_freed_when_pod_finishes(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[8]))
    ext = start_extender()
    assert bind(ext, "p", "n1") == ""
    cluster.complete_allocations()
    cluster.set_pod_phase("default", "p", "Succeeded")
    settle(cluster)
    assert sum(g["used_gib"] for g in ext.state.inspect_node("n1")["gpus"]) == 0


def test_gpu_replaced_under_a_running_pod_shows_as_orphan(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[8]))
    ext = start_extender()
    assert bind(ext, "p", "n1") == ""
    cluster.complete_allocations()

    def swap(obj: dict) -> None:
        obj["metadata"]["annotations"]["gpufleet.io/gpus"] = json.dumps([gpu(0, "GPU-new", mem=16)])

    cluster.update_node("n1", swap)
    settle(cluster)
    view = ext.state.inspect_node("n1")
    assert [g["uuid"] for g in view["gpus"]] == ["GPU-new"] and list(view["orphans"]) == ["GPU-a-0"]


def test_no_bind_while_another_bound_pod_awaits_allocation(two_nodes, start_extender, clock) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    cluster.add_pod(pod("q", mem=[4]))
    ext = start_extender()
    assert bind(ext, "p", "n1") == ""
    clock.advance(61)  # p's lock expires before its Allocate ever happened
    message = bind(ext, "q", "n1")
    assert "default/p is bound but its GPU-memory containers c0 are not allocated yet" in message
    assert LOCK not in annotations(cluster.node("n1"))  # q took the expired lock over, then gave it back
    cluster.set_pod_phase("default", "p", "Failed")  # the kubelet gave up on it
    settle(cluster)
    assert bind(ext, "q", "n1") == ""


def test_deleted_node_is_unknown_while_its_pods_stay_accounted(two_nodes, start_extender) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()
    assert bind(ext, "p", "n1") == ""
    cluster.complete_allocations()
    cluster.remove_node("n1")
    cluster.remove_node("n2")
    settle(cluster)
    result = ext.api.filter({"Pod": pod("q", mem=[4]), "NodeNames": ["n1", "n2"]})
    assert result["NodeNames"] == [] and set(result["FailedNodes"]) == {"n1", "n2"}
    view = ext.state.inspect()["nodes"]
    assert "n2" not in view and view["n1"]["known"] is False and view["n1"]["whole_gpus_held"] == 0
    assert [u for u in view["n1"]["orphans"]] == ["GPU-a-0"]  # p still runs there as far as the API says
    cluster.remove_pod("default", "p")
    settle(cluster)
    assert "n1" not in ext.state.inspect()["nodes"]


def test_an_unexpected_error_mid_bind_still_undoes_everything(two_nodes, start_extender, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cluster = two_nodes
    cluster.add_pod(pod("p", mem=[4]))
    ext = start_extender()

    def broken(*args: object, **kwargs: object) -> None:
        raise KeyError("surprise")

    monkeypatch.setattr(cluster, "bind_pod", broken)
    assert "internal error" in bind(ext, "p", "n1")
    assert_clean(cluster, ext, "p", "n1")
