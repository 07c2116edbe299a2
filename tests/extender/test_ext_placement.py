"""Per-node decisions (placement) and their many-node forms (scheduling), on the state directly."""

from __future__ import annotations

import json
import random

import pytest
from extender_builders import gpu, machine, node, pod

from gpufleet.extender.model import node_info
from gpufleet.extender.placement import evaluate, set_topology
from gpufleet.extender.request import Policy, parse_pod
from gpufleet.extender.scheduling import filter_nodes, prioritize_nodes
from gpufleet.extender.state import ClusterState
from gpufleet.handoff import PRODUCT_LABEL, PRODUCT_MIXED, product_label_value

NOW = 1_700_000_000.0


def info(gpus, **kw):  # type: ignore[no-untyped-def]
    return node_info(node("n", gpus, **kw))


def req(**kw):  # type: ignore[no-untyped-def]
    return parse_pod(pod("p", **kw))


def test_binpack_takes_the_fullest_gpu_that_fits_and_spread_the_emptiest() -> None:
    n = info(machine("x", 3, mesh=False, mem=24))
    used = {"GPU-x-0": 20, "GPU-x-1": 10}
    r = req(mem=[4])
    assert evaluate(n, used, 0, r, Policy.BINPACK, NOW).placement.containers[0].gpus == ("GPU-x-0",)
    assert evaluate(n, used, 0, r, Policy.SPREAD, NOW).placement.containers[0].gpus == ("GPU-x-2",)
    # 5 GiB no longer fits GPU 0 (4 free): binpack moves to the next fullest.
    assert evaluate(n, used, 0, req(mem=[5]), Policy.BINPACK, NOW).placement.containers[0].gpus == (
        "GPU-x-1",
    )


def test_heterogeneous_gpus_are_accounted_per_card_not_by_average() -> None:
    n = info([gpu(0, "GPU-big", mem=40), gpu(1, "GPU-small", model="Tesla T4", mem=16, cc="7.5")])
    # 30 GiB used on the big card: the node has 26 GiB free "on average", but no card has 20.
    v = evaluate(n, {"GPU-big": 30}, 0, req(mem=[20]), Policy.BINPACK, NOW)
    assert not v.fits and not v.unresolvable and "most free on a qualifying GPU is 16 GiB" in v.reason
    # Binpack by free memory left on the card: 8 GiB leaves 2 on the big card, 8 on the small one.
    assert evaluate(n, {"GPU-big": 30}, 0, req(mem=[8]), Policy.BINPACK, NOW).placement.containers[
        0
    ].gpus == ("GPU-big",)
    assert evaluate(n, {"GPU-big": 30}, 0, req(mem=[12]), Policy.BINPACK, NOW).placement.containers[
        0
    ].gpus == ("GPU-small",)


def test_request_larger_than_every_healthy_gpu_is_unresolvable() -> None:
    n = info([gpu(0, "GPU-a", mem=80, healthy=False), gpu(1, "GPU-b", mem=16)])
    v = evaluate(n, {}, 0, req(mem=[24]), Policy.BINPACK, NOW)
    assert v.unresolvable and "largest qualifying healthy GPU has 16 GiB" in v.reason


def test_model_and_capability_constraints_pick_qualifying_cards_only() -> None:
    n = info([gpu(0, "GPU-t4", model="Tesla T4", mem=16, cc="7.5"), gpu(1, "GPU-a100", mem=80)])
    assert evaluate(
        n, {}, 0, req(mem=[4], annotations={"gpufleet.io/gpu-model": "a100"}), Policy.BINPACK, NOW
    ).placement.containers[0].gpus == ("GPU-a100",)
    assert evaluate(
        n, {}, 0, req(mem=[4], annotations={"gpufleet.io/gpu-min-cc": "8.0"}), Policy.BINPACK, NOW
    ).placement.containers[0].gpus == ("GPU-a100",)
    v = evaluate(n, {}, 0, req(mem=[4], annotations={"gpufleet.io/gpu-model": "H100"}), Policy.BINPACK, NOW)
    assert v.unresolvable and "no healthy GPU with model h100" in v.reason


def test_node_selector_on_the_published_product_label_places_per_gpu() -> None:
    # The label value exactly as the device plugin publishes it for an A100 node.
    a100 = product_label_value(["NVIDIA A100-SXM4-80GB"])
    selector = {PRODUCT_LABEL: a100}
    assert (PRODUCT_LABEL, a100) == ("gpufleet.io/gpu.product", "NVIDIA-A100-SXM4-80GB")
    n = info(
        [
            gpu(0, "GPU-t4", model="Tesla T4", mem=16, cc="7.5"),
            gpu(1, "GPU-a100", mem=80),
            gpu(2, "GPU-a100-40", model="NVIDIA A100-PCIE-40GB", mem=40),
        ]
    )
    # Binpack alone would take the fullest card (the T4), and the PCIe A100 shares only some words.
    r = req(mem=[4], node_selector=selector)
    assert evaluate(n, {"GPU-t4": 8}, 0, r, Policy.BINPACK, NOW).placement.containers[0].gpus == ("GPU-a100",)
    v = evaluate(n, {}, 0, req(mem=[100], node_selector=selector), Policy.BINPACK, NOW)
    assert v.unresolvable and "largest qualifying healthy GPU has 80 GiB" in v.reason
    t4_only = info([gpu(0, "GPU-t4", model="Tesla T4", mem=16, cc="7.5")])
    v = evaluate(t4_only, {}, 0, r, Policy.BINPACK, NOW)
    assert v.unresolvable and "no healthy GPU with model" in v.reason
    # `mixed` constrains nothing: binpack takes the fullest card.
    r = req(mem=[4], node_selector={PRODUCT_LABEL: PRODUCT_MIXED})
    assert evaluate(n, {"GPU-t4": 8}, 0, r, Policy.BINPACK, NOW).placement.containers[0].gpus == ("GPU-t4",)


def test_most_capable_prefers_higher_compute_capability_over_packing() -> None:
    n = info([gpu(0, "GPU-a100", mem=80), gpu(1, "GPU-h100", model="NVIDIA H100 80GB HBM3", cc="9.0")])
    r = req(mem=[8], annotations={"gpufleet.io/gpu-prefer": "most-capable"})
    assert evaluate(n, {"GPU-a100": 40}, 0, r, Policy.BINPACK, NOW).placement.containers[0].gpus == (
        "GPU-h100",
    )


def test_multi_gpu_memory_request_prefers_an_nvlink_pair() -> None:
    gpus = [
        gpu(0, "A", numa=0),
        gpu(1, "B", numa=0),
        gpu(2, "C", numa=1, nvlink=["D"]),
        gpu(3, "D", numa=1, nvlink=["C"]),
    ]
    r = req(mem=[16], annotations={"gpufleet.io/gpu-count": "2"})
    placement = evaluate(info(gpus), {"A": 8}, 0, r, Policy.BINPACK, NOW).placement
    assert set(placement.containers[0].gpus) == {"C", "D"} and placement.topology == 1.0


def test_set_topology_weighs_nvlink_above_numa() -> None:
    a, b, c = node_info(node("n", [gpu(0, "A", nvlink=["B"]), gpu(1, "B"), gpu(2, "C", numa=0)])).gpus
    assert set_topology([a, b]) == 1.0 and set_topology([b, c]) == 0.25 and set_topology([a]) == 1.0


def test_containers_are_placed_one_after_another_on_shared_state() -> None:
    n = info(machine("x", 2, mem=16))
    v = evaluate(n, {}, 0, req(mem=[10, 10, 6]), Policy.BINPACK, NOW)
    gpus = [c.gpus[0] for c in v.placement.containers]
    assert gpus[0] != gpus[1] and gpus[2] in gpus[:2]
    assert not evaluate(n, {}, 0, req(mem=[10, 10, 10]), Policy.BINPACK, NOW).fits


def test_node_kind_must_match_request_kind() -> None:
    sharing = info(machine("x", 2))
    whole = info(machine("x", 2), sharing=False)
    v = evaluate(whole, {}, 0, req(mem=[4]), Policy.BINPACK, NOW)
    assert v.unresolvable and "does not share GPU memory" in v.reason
    v = evaluate(sharing, {}, 0, req(whole=1), Policy.BINPACK, NOW)
    assert v.unresolvable and "not offered" in v.reason


def test_whole_gpus_count_unknown_positions_and_any_memory_share_blocks_a_gpu() -> None:
    n = info(machine("x", 4), sharing=False)
    assert evaluate(n, {}, 2, req(whole=2), Policy.BINPACK, NOW).fits
    v = evaluate(n, {}, 3, req(whole=2), Policy.BINPACK, NOW)
    assert not v.fits and not v.unresolvable and "1 free" in v.reason
    # A GPU holding any shared memory (e.g. after the node left sharing mode) is not free.
    assert not evaluate(n, {"GPU-x-0": 1}, 2, req(whole=2), Policy.BINPACK, NOW).fits
    assert evaluate(n, {}, 0, req(whole=5), Policy.BINPACK, NOW).unresolvable


def test_whole_gpu_model_request_needs_every_gpu_to_qualify_because_the_kubelet_picks() -> None:
    mixed = info([gpu(0, "A"), gpu(1, "T", model="Tesla T4", mem=16, cc="7.5")], sharing=False)
    v = evaluate(
        mixed, {}, 0, req(whole=1, annotations={"gpufleet.io/gpu-model": "A100"}), Policy.BINPACK, NOW
    )
    assert v.unresolvable and "kubelet may pick any" in v.reason
    uniform = info(machine("x", 2), sharing=False)
    assert evaluate(
        uniform, {}, 0, req(whole=1, annotations={"gpufleet.io/gpu-model": "A100"}), Policy.BINPACK, NOW
    ).fits


def test_live_lock_of_another_pod_makes_the_node_busy_for_memory_pods() -> None:
    locked = info(machine("x", 1), lock=f"other ns/other {int(NOW) + 30}")
    v = evaluate(locked, {}, 0, req(mem=[4]), Policy.BINPACK, NOW)
    assert not v.fits and not v.unresolvable and "node busy" in v.reason and "ns/other" in v.reason
    assert evaluate(locked, {}, 0, req(mem=[4]), Policy.BINPACK, NOW + 31).fits  # expired
    own = info(machine("x", 1), lock=f"uid-default-p default/p {int(NOW) + 30}")
    assert evaluate(own, {}, 0, req(mem=[4]), Policy.BINPACK, NOW).fits


def test_whole_gpu_pods_on_a_sharing_node_pause_memory_sharing() -> None:
    v = evaluate(info(machine("x", 2)), {}, 1, req(mem=[4]), Policy.BINPACK, NOW)
    assert not v.fits and "whole-GPU" in v.reason


def test_gpu_annotation_problems_fail_the_node_not_the_call() -> None:
    v = evaluate(node_info(node("n", None)), {}, 0, req(mem=[4]), Policy.BINPACK, NOW)
    assert v.unresolvable and "publishes no GPUs" in v.reason


MODELS = [
    ("NVIDIA A100-SXM4-80GB", "8.0"),
    ("Tesla T4", "7.5"),
    ("NVIDIA H100 80GB HBM3", "9.0"),
    ("NVIDIA A10", "8.6"),
]


def _random_state(rng: random.Random, count: int) -> ClusterState:
    state = ClusterState(clock=lambda: NOW)
    nodes, pods = [], []
    for i in range(count):
        gpus = [
            gpu(
                j,
                f"G{i}-{j}",
                mem=rng.choice([16, 24, 40, 80]),
                healthy=rng.random() > 0.1,
                **dict(zip(("model", "cc"), rng.choice(MODELS), strict=True)),
            )
            for j in range(rng.randint(0, 4))
        ]
        lock = rng.choice([None, None, f"other ns/o {int(NOW) + 30}", f"other ns/o {int(NOW) - 1}"])
        nodes.append(
            node(f"n{i}", gpus if rng.random() > 0.05 else None, sharing=rng.random() > 0.15, lock=lock)
        )
        for k, g in enumerate(gpus):
            if rng.random() < 0.5:
                share = rng.randint(1, g["memory_gib"])
                p = pod(f"p{i}-{k}", mem=[share], node_name=f"n{i}")
                p["metadata"]["annotations"]["gpufleet.io/assignment"] = json.dumps(
                    {
                        "node": f"n{i}",
                        "containers": [{"name": "c0", "gpu_mem_gib": share, "gpus": [g["uuid"]]}],
                        "ts": NOW,
                    }
                )
                pods.append(p)
        if rng.random() < 0.05:
            pods.append(pod(f"w{i}", whole=1, node_name=f"n{i}"))
    state.replace_nodes(nodes)
    state.replace_pods(pods)
    return state


FAST_PATH_REQUESTS = [{"mem": [share]} for share in (1, 8, 20, 40, 81)] + [
    {"mem": [8], "annotations": {"gpufleet.io/gpu-model": "T4, H100"}},
    {"mem": [8], "annotations": {"gpufleet.io/gpu-min-cc": "8.6"}},
    {"mem": [16], "annotations": {"gpufleet.io/gpu-count": "2"}},
    {"mem": [60], "annotations": {"gpufleet.io/gpu-count": "3", "gpufleet.io/gpu-model": "A100"}},
]


@pytest.mark.parametrize("seed", range(4))
def test_filter_fast_path_agrees_with_full_evaluation(seed: int) -> None:
    rng = random.Random(seed)
    state = _random_state(rng, 120)
    names = [f"n{i}" for i in range(120)] + ["ghost"]
    for kwargs in FAST_PATH_REQUESTS:
        r = req(**kwargs)
        for _ in range(2):  # the second round reads the cached views
            out = filter_nodes(state, r, names, Policy.BINPACK, NOW)
            for name in names[:-1]:
                verdict = state.evaluate(r, state.entry(name).info, Policy.BINPACK, NOW)
                if verdict.fits:
                    assert name in out.fits
                elif verdict.unresolvable:
                    assert out.unresolvable[name] == verdict.reason
                else:
                    assert out.failed[name] == verdict.reason
            assert "ghost" in out.failed


def test_absurd_request_gets_an_error_naming_the_largest_gpu() -> None:
    state = _random_state(random.Random(1), 10)
    out = filter_nodes(state, req(mem=[500]), [f"n{i}" for i in range(10)], Policy.BINPACK, NOW)
    assert not out.fits and "largest healthy GPU in the cluster has 80 GiB" in out.error
    out = filter_nodes(state, req(whole=64), [f"n{i}" for i in range(10)], Policy.BINPACK, NOW)
    assert "no node has more than" in out.error


def _state(nodes: list[dict], pods: list[dict] = ()) -> ClusterState:  # type: ignore[assignment]
    state = ClusterState(clock=lambda: NOW)
    state.replace_nodes(nodes)
    state.replace_pods(list(pods))
    return state


def _assigned(name: str, node_name: str, gib: int, uuid: str) -> dict:
    p = pod(name, mem=[gib], node_name=node_name)
    p["metadata"]["annotations"]["gpufleet.io/assignment"] = json.dumps(
        {"node": node_name, "containers": [{"name": "c0", "gpu_mem_gib": gib, "gpus": [uuid]}], "ts": NOW}
    )
    return p


def test_prioritize_binpack_prefers_the_fuller_node_and_spread_the_emptier() -> None:
    state = _state(
        [node("full", machine("f", 2, mem=16)), node("empty", machine("e", 2, mem=16))],
        [_assigned("x", "full", 8, "GPU-f-0")],
    )
    r = req(mem=[4])
    scores = dict(prioritize_nodes(state, r, ["full", "empty"], Policy.BINPACK, Policy.BINPACK, NOW))
    assert scores == {"full": 10, "empty": 1}
    scores = dict(prioritize_nodes(state, r, ["full", "empty"], Policy.SPREAD, Policy.BINPACK, NOW))
    assert scores == {"full": 1, "empty": 10}
    override = req(mem=[4], annotations={"gpufleet.io/node-policy": "spread"})
    assert (
        dict(prioritize_nodes(state, override, ["full", "empty"], Policy.BINPACK, Policy.BINPACK, NOW))[
            "empty"
        ]
        == 10
    )


def test_prioritize_gives_zero_to_nodes_that_do_not_fit() -> None:
    state = _state([node("small", machine("s", 1, mem=16)), node("big", machine("b", 1, mem=80))])
    assert dict(
        prioritize_nodes(state, req(mem=[40]), ["small", "big", "ghost"], Policy.BINPACK, Policy.BINPACK, NOW)
    ) == {"small": 0, "big": 10, "ghost": 0}


def test_prioritize_prefers_nvlink_for_multi_gpu_requests() -> None:
    linked = machine("l", 2)
    unlinked = machine("u", 2, mesh=False)
    state = _state([node("linked", linked, sharing=False), node("unlinked", unlinked, sharing=False)])
    scores = dict(
        prioritize_nodes(state, req(whole=2), ["linked", "unlinked"], Policy.BINPACK, Policy.BINPACK, NOW)
    )
    assert scores["linked"] > scores["unlinked"]


def test_prioritize_most_capable_ranks_by_the_best_gpu_offered() -> None:
    state = _state(
        [
            node("a100", machine("a", 1)),
            node("h100", machine("h", 1, model="NVIDIA H100 80GB HBM3", cc="9.0")),
            node("t4", machine("t", 1, model="Tesla T4", mem=16, cc="7.5")),
        ]
    )
    r = req(mem=[8], annotations={"gpufleet.io/gpu-prefer": "most-capable"})
    scores = dict(prioritize_nodes(state, r, ["a100", "h100", "t4"], Policy.BINPACK, Policy.BINPACK, NOW))
    assert scores["h100"] == 10 and scores["t4"] < scores["a100"] < scores["h100"]


def test_a_pods_own_claim_does_not_block_it() -> None:
    # A retried pod whose earlier bind left an annotation (fresh, unbound) still fits its own GiB.
    state = _state([node("n", machine("x", 1, mem=16))])
    p = pod("p", mem=[12])
    p["metadata"]["annotations"]["gpufleet.io/assignment"] = json.dumps(
        {"node": "n", "containers": [{"name": "c0", "gpu_mem_gib": 12, "gpus": ["GPU-x-0"]}], "ts": NOW}
    )
    state.replace_pods([p])
    r = parse_pod(p)
    assert filter_nodes(state, r, ["n"], Policy.BINPACK, NOW).fits == ["n"]
    other = parse_pod(pod("q", mem=[12]))
    assert filter_nodes(state, other, ["n"], Policy.BINPACK, NOW).fits == []


@pytest.mark.parametrize("mem", [[4], [2, 2]], ids=["index", "cached-verdicts"])
def test_prioritize_reuses_verdicts_only_while_the_node_is_unchanged(mem: list[int]) -> None:
    # One container: decided from the index; two: by `evaluate`, with verdicts cached per node version.
    state = _state([node("a", machine("a", 1, mem=16)), node("b", machine("b", 1, mem=16))])
    r = req(mem=mem)
    first = dict(prioritize_nodes(state, r, ["a", "b"], Policy.BINPACK, Policy.BINPACK, NOW))
    assert first == {"a": 10, "b": 10}
    assert state.index["a"].memo  # verdicts (two containers) or placement figures (one) kept
    state.upsert_pod(_assigned("x", "b", 8, "GPU-b-0"))
    assert dict(prioritize_nodes(state, r, ["a", "b"], Policy.BINPACK, Policy.BINPACK, NOW)) == {
        "a": 1,
        "b": 10,
    }
    state.upsert_pod(_assigned("y", "a", 10, "GPU-a-0"))
    assert dict(prioritize_nodes(state, r, ["a", "b"], Policy.BINPACK, Policy.BINPACK, NOW)) == {
        "a": 10,
        "b": 1,
    }
