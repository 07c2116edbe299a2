"""The placement rules, each written once: fit, card pick, utilisation and score.

`placement` calls these, both in its reference (`evaluate`, one node at a time) and in its decisions on
index records (`decide_mem`, `decide_whole`, called for thousands of nodes per request). They are small
and call no more than one other rule per node, so a decision pays a Python call or two per rule and node;
the score runs once per request over all nodes (`composites`).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from typing import Any

from gpufleet.extender.model import Gpu

# Relative weights of the score terms; NVLink and capability wishes outrank packing when present.
W_POLICY = 1.0
W_TOPOLOGY = 2.0
W_CAPABILITY = 3.0
# Pair weights for multi-GPU sets: NVLink is what the request is about; a shared NUMA node only breaks ties.
_NVLINK = 1.0
_SAME_NUMA = 0.25


# ---------------------------------------------------------------------- fit


def fits(free: Sequence[int], share: int, count: int) -> bool:
    """Whether `count` GPUs with `share` GiB each fit GPUs of these free GiB, largest first: the count-th
    largest has room. With total GiB instead of free: whether they fit the idle GPUs at all."""
    return len(free) >= count and free[count - 1] >= share


# ---------------------------------------------------------------------- card pick


def link(a: Gpu, b: Gpu) -> float:
    """How well two GPUs talk: NVLink beats a shared NUMA node beats nothing."""
    if b.uuid in a.nvlink_peers or a.uuid in b.nvlink_peers:
        return _NVLINK
    if a.numa is not None and a.numa == b.numa:
        return _SAME_NUMA
    return 0.0


def card_key(
    free: int, index: int, binpack: bool, capability: tuple[int, int, int] | None = None
) -> tuple[int, ...]:
    """A GPU's place in the GPU policy's order, first taken first: binpack the least free GiB (after the
    share), spread the most; then the lowest index; "most capable" (`capability` given) orders by it first."""
    fill = free if binpack else -free
    if capability is None:
        return (fill, index)
    major, minor, memory = capability
    return (-major, -minor, -memory, fill, index)


def policy_cards(pick: tuple[int, ...], k: int, share: int, count: int, binpack: bool) -> tuple[int, ...]:
    """The `count` GPUs the policy takes among those with room for `share` GiB, when the policy alone decides
    (one GPU, or every set equally linked): their positions.

    `pick` holds the node's k GPUs' free GiB ascending, their positions in binpack order (`card_key`, which
    is the same order), then in spread order; the caller knows `count` of them have room.
    """
    if binpack:
        first = k + bisect_left(pick, share, 0, k)
        return pick[first : first + count]
    return pick[2 * k : 2 * k + count]


# ---------------------------------------------------------------------- utilisation


def gpu_busy(used: int, memory: int) -> float:
    """How busy a GPU is, in [0, 1]: the share of its memory in use (a GPU without memory counts as busy).
    Exactly `min(1.0, used / memory)`, without the call."""
    return (used / memory if used < memory else 1.0) if memory else 1.0


def busy_after(
    nums: Sequence[int], sums: Sequence[float], n: int, chosen: Sequence[int], share: int
) -> float:
    """The `busy` of `node_utilization` once `share` more GiB are on each of the `chosen` GPUs (positions):
    the node's n `gpu_busy` terms summed in their order, the chosen GPUs' as they become.

    `nums` holds the GiB used on each GPU and then each GPU's GiB, `sums` each GPU's term and then what the
    sum has added up before each term (`index.NodeFacts`): for one GPU, the sum from there on starts from
    what came before it plus its new term, which adds exactly what summing every term in order does."""
    if len(chosen) == 1:
        p = chosen[0]
        return sum(sums[p + 1 : n], sums[n + p] + gpu_busy(nums[p] + share, nums[n + p]))
    terms = list(sums[:n])
    for p in chosen:
        terms[p] = gpu_busy(nums[p] + share, nums[n + p])
    return sum(terms)


def node_utilization(busy: float, whole: int, healthy: int) -> float:
    """The share of a node's healthy GPU capacity in use, in [0, 1]: its GPUs' `gpu_busy` figures summed in
    their order (`busy`) plus the whole GPUs held at unknown places, over its healthy GPUs; each GPU counts
    equally."""
    return (x if (x := (busy + whole) / healthy) < 1.0 else 1.0) if healthy else 0.0


# ---------------------------------------------------------------------- score


def capability_rank(capabilities: Mapping[str, tuple[int, int, int]]) -> dict[str, float]:
    """Each node's best offered capability as a rank in [0, 1] among the candidates."""
    levels = sorted(set(capabilities.values()))
    if len(levels) < 2:
        return dict.fromkeys(capabilities, 1.0)
    position = {level: i / (len(levels) - 1) for i, level in enumerate(levels)}
    return {name: position[c] for name, c in capabilities.items()}


def composites(figures: dict[str, Any], binpack: bool, multi: bool, most: bool) -> dict[str, float]:
    """Each fitting node's score before scaling: the node policy's fill (utilisation for binpack, its
    complement for spread), plus NVLink when the pod wants several GPUs and the capability rank when it
    wants the most capable, weighted by W_POLICY, W_TOPOLOGY and W_CAPABILITY.

    `figures` holds per node the utilisation alone when neither is asked for, else (utilisation,
    topology, capability). One expression for every node (no call per node: prioritize sends thousands);
    a weight left out is 0.0, which leaves each sum exactly as adding only the terms asked for would.
    """
    sign, base = (1.0, 0.0) if binpack else (-1.0, 1.0)
    if not multi and not most:
        # W_POLICY * (base + sign * u) / W_POLICY, exactly; for binpack that is u itself.
        return figures if binpack else {n: base + sign * u for n, u in figures.items()}
    ranks: dict[str, float] = {}
    if most and len({cap for _, _, cap in figures.values()}) > 1:
        ranks = capability_rank({n: cap for n, (_, _, cap) in figures.items()})
    rank = ranks.get  # one capability level: every rank is 1.0
    wp = W_POLICY
    wt = W_TOPOLOGY if multi else 0.0
    wc = W_CAPABILITY if most else 0.0
    weight = wp + wt + wc
    return {
        n: (wp * (base + sign * u) + wt * t + wc * rank(n, 1.0)) / weight for n, (u, t, _) in figures.items()
    }


def wish(topology: float, rank: float, multi: bool, most: bool) -> float:
    """What a pod's wishes (NVLink, most capable) make of a node's placement, the score's wish terms."""
    return (W_TOPOLOGY * topology if multi else 0.0) + (W_CAPABILITY * rank if most else 0.0)
