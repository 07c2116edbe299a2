"""The placement rules (`gpufleet.extender.rules`) are exactly the formulas they name, and the reference
(`placement`) and the fast path (`index`) reach the same cards and figures through them."""

from __future__ import annotations

import random

import pytest
from extender_builders import machine, node

from gpufleet.extender.index import NodeFacts, NodeShape, Signatures
from gpufleet.extender.model import node_info
from gpufleet.extender.placement import choose_gpus, utilization
from gpufleet.extender.request import Policy
from gpufleet.extender.rules import busy_after, composites, fits, gpu_busy, node_utilization, policy_cards


def test_gpu_busy_is_exactly_the_memory_share_in_use_capped_at_one() -> None:
    rng = random.Random(5)
    pairs = [(rng.randint(0, 200), rng.choice([0, 1, 3, 16, 24, 40, 80, 141])) for _ in range(5000)]
    for used, memory in [*pairs, (0, 0), (7, 0), (80, 80), (81, 80)]:
        expected = min(1.0, used / memory) if memory else 1.0
        assert gpu_busy(used, memory) == expected  # float equality: bit for bit


def test_node_utilization_is_exactly_busy_plus_whole_over_healthy_capped_at_one() -> None:
    rng = random.Random(6)
    rows = [(rng.random() * 9, rng.randint(0, 4), rng.randint(0, 8)) for _ in range(3000)]
    for busy, whole, healthy in [*rows, (0.0, 0, 0), (8.0, 1, 8)]:
        expected = min(1.0, (busy + whole) / healthy) if healthy else 0.0
        assert node_utilization(busy, whole, healthy) == expected


@pytest.mark.parametrize(
    ("free", "share", "count", "expected"),
    [
        ((), 1, 1, False),
        ((10,), 10, 1, True),
        ((10,), 11, 1, False),
        ((30, 20, 5), 20, 2, True),
        ((30, 20, 5), 21, 2, False),
        ((30, 20), 1, 3, False),
    ],
)
def test_fits_when_count_gpus_have_room_for_the_share(
    free: tuple[int, ...], share: int, count: int, expected: bool
) -> None:
    assert fits(free, share, count) is expected


def _random_node(rng: random.Random, name: str):  # type: ignore[no-untyped-def]
    count = rng.randint(1, 8)
    info = node_info(node(name, machine(name, count, mem=rng.choice([24, 40, 80]))))
    used = {g.uuid: rng.randint(0, g.memory_gib) for g in info.healthy if rng.random() < 0.6}
    return info, used


@pytest.mark.parametrize("policy", [Policy.BINPACK, Policy.SPREAD])
@pytest.mark.parametrize("count", [1, 2, 3])
def test_the_fast_card_pick_takes_the_references_cards_on_meshed_nodes(policy: Policy, count: int) -> None:
    """`policy_cards` on a node's pick order takes the cards `choose_gpus` takes (all sets equally linked)."""
    rng = random.Random(count * 10 + (policy is Policy.BINPACK))
    signatures = Signatures()
    for _ in range(300):
        share = rng.randint(1, 40)
        info, used = _random_node(rng, "n")
        facts = NodeFacts(NodeShape(info, signatures.id(info.kinds)), used)
        if not fits(facts.view.free, share, count):
            continue
        chosen = policy_cards(facts.view.pick, facts.n, share, count, policy is Policy.BINPACK)
        candidates = [g for g in info.healthy if g.memory_gib - used.get(g.uuid, 0) >= share]
        picked = choose_gpus(candidates, count, share, used, policy, False)
        assert picked is not None
        reference, _ = picked
        assert sorted(info.healthy[p].uuid for p in chosen) == sorted(g.uuid for g in reference)


def test_the_ledgers_utilisation_is_the_references() -> None:
    rng = random.Random(9)
    signatures = Signatures()
    for _ in range(500):
        info, used = _random_node(rng, "n")
        facts = NodeFacts(NodeShape(info, signatures.id(info.kinds)), used)
        whole = rng.randint(0, 2)
        assert node_utilization(facts.busy, whole, facts.n) == utilization(info, used, whole)


def test_busy_after_a_placement_is_exactly_the_sum_of_the_gpus_terms_after_it() -> None:
    """`busy_after` on a node's facts equals summing every GPU's `gpu_busy` in order once the chosen GPUs
    carry the share too, bit for bit, for one GPU (prefix sums) and several."""
    rng = random.Random(10)
    signatures = Signatures()
    for _ in range(500):
        info, used = _random_node(rng, "n")
        facts = NodeFacts(NodeShape(info, signatures.id(info.kinds)), used)
        share = rng.randint(1, 40)
        chosen = tuple(sorted(rng.sample(range(facts.n), rng.randint(1, facts.n))))
        after = dict(used)
        for p in chosen:
            uuid = info.healthy[p].uuid
            after[uuid] = after.get(uuid, 0) + share
        expected = sum([gpu_busy(after.get(g.uuid, 0), g.memory_gib) for g in info.healthy])
        assert busy_after(facts.nums, facts.sums, facts.n, chosen, share) == expected


@pytest.mark.parametrize("binpack", [True, False])
def test_a_score_of_utilisation_alone_is_the_fill_of_the_node_policy(binpack: bool) -> None:
    rng = random.Random(11)
    figures = {f"n{i}": rng.random() for i in range(500)}
    scores = composites(figures, binpack, multi=False, most=False)
    assert scores == {n: (u if binpack else 1.0 - u) for n, u in figures.items()}
