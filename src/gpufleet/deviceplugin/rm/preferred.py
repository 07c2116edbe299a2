"""Topology-aware choice of devices for GetPreferredAllocation; pure functions over the inventory.

A set of GPUs is scored by what joins its members, pair by pair, compared in this order:
NVLinks (the sum of links over all pairs), pairs behind one PCIe switch (NVML SINGLE/MULTIPLE, i.e. PIX/PXB
in `nvidia-smi topo -m`), pairs on one NUMA node. Among equal sets the one that breaks the fewest such
bonds with the GPUs left free wins, so a lone request takes the GPU whose partner is already gone and keeps
intact pairs for later requests. Remaining ties go to the lowest GPU indexes, so answers are reproducible.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Sequence

from gpufleet.deviceplugin.rm.devices import ResourceKind, ResourceSpec, gpu_of
from gpufleet.deviceplugin.rm.model import GpuInfo, NodeInventory, TopologyLevel

# Above this many candidate sets the search turns greedy (40 GPUs choose 20 is ~1.4e11 sets).
EXHAUSTIVE_LIMIT = 3000

Affinity = tuple[int, int, int]
_ZERO: Affinity = (0, 0, 0)


class PreferenceError(ValueError):
    """The request cannot be satisfied as asked (sizes, must-include outside the available set)."""


def affinity(inv: NodeInventory, a: GpuInfo, b: GpuInfo) -> Affinity:
    """What joins two GPUs: (NVLinks, same PCIe switch, same NUMA node)."""
    links = max(a.nvlinks.get(b.uuid, 0), b.nvlinks.get(a.uuid, 0))
    level = inv.level(a.uuid, b.uuid)
    same_switch = level is not None and level <= TopologyLevel.MULTIPLE
    if a.numa is not None and b.numa is not None:
        same_numa = a.numa == b.numa
    else:
        same_numa = level is not None and level <= TopologyLevel.NODE
    return (links, int(same_switch), int(same_numa))


class _Scorer:
    def __init__(self, inv: NodeInventory, gpus: Sequence[GpuInfo]) -> None:
        self.gpus = list(gpus)
        n = len(self.gpus)
        self.aff = [
            [affinity(inv, self.gpus[i], self.gpus[j]) if i != j else _ZERO for j in range(n)]
            for i in range(n)
        ]

    def inner(self, members: Sequence[int]) -> Affinity:
        return _sum(self.aff[i][j] for i, j in itertools.combinations(members, 2))

    def broken(self, members: Sequence[int]) -> Affinity:
        chosen = set(members)
        return _sum(self.aff[i][j] for i in members for j in range(len(self.gpus)) if j not in chosen)

    def key(self, members: Sequence[int]) -> tuple[Affinity, Affinity, list[int]]:
        # Larger is better for every part; negate what should be small.
        broken = self.broken(members)
        indexes = sorted(self.gpus[i].index for i in members)
        return (self.inner(members), (-broken[0], -broken[1], -broken[2]), [-x for x in indexes])


def _sum(values: Iterable[Affinity]) -> Affinity:
    links = switch = numa = 0
    for a, b, c in values:
        links, switch, numa = links + a, switch + b, numa + c
    return (links, switch, numa)


def choose_gpus(inv: NodeInventory, available: Sequence[str], must: Sequence[str], size: int) -> list[str]:
    """Pick `size` GPU UUIDs from `available` (which includes `must`), best-connected first."""
    by_uuid = inv.by_uuid()
    # An ID that names no GPU of this node cannot be honoured (and must not be dropped: the answer would
    # then lack a device the kubelet said it has to include).
    unknown = [u for u in must if u not in by_uuid]
    if unknown:
        raise PreferenceError(f"must-include devices are not GPUs of this node: {', '.join(unknown)}")
    gpus = sorted((by_uuid[u] for u in set(available) if u in by_uuid), key=lambda g: g.index)
    pos = {g.uuid: i for i, g in enumerate(gpus)}
    forced = sorted({pos[u] for u in must if u in pos})
    if size > len(gpus) or len(forced) > size:
        raise PreferenceError(f"cannot choose {size} of {len(gpus)} GPUs including {len(forced)} required")
    scorer = _Scorer(inv, gpus)
    free = [i for i in range(len(gpus)) if i not in forced]
    need = size - len(forced)
    if math.comb(len(free), need) <= EXHAUSTIVE_LIMIT:
        best = max((forced + list(extra) for extra in itertools.combinations(free, need)), key=scorer.key)
    else:
        best = _greedy(scorer, forced, free, need)
    return [gpus[i].uuid for i in sorted(best, key=lambda i: gpus[i].index)]


def _greedy(scorer: _Scorer, forced: list[int], free: list[int], need: int) -> list[int]:
    """Grow sets one GPU at a time, from every possible seed when nothing is forced; keep the best."""
    seeds = [forced] if forced else [[i] for i in free]
    results = []
    for seed in seeds:
        members = list(seed)
        pool = [i for i in free if i not in members]
        while len(members) < len(forced) + need:
            pick = max(pool, key=lambda i, m=members: scorer.key([*m, i]))  # type: ignore[misc]
            members.append(pick)
            pool.remove(pick)
        results.append(members)
    return max(results, key=scorer.key)


def preferred_allocation(
    spec: ResourceSpec, inv: NodeInventory, available: Sequence[str], must: Sequence[str], size: int
) -> list[str]:
    """Device IDs the plugin would pick for one container; raises PreferenceError on impossible input."""
    avail = list(dict.fromkeys(available))
    if size <= 0:
        raise PreferenceError(f"allocation size must be positive, got {size}")
    if size > len(avail):
        raise PreferenceError(f"allocation size {size} exceeds the {len(avail)} available devices")
    offered = set(avail)
    missing = [d for d in must if d not in offered]
    if missing:
        raise PreferenceError(f"must-include devices are not available: {', '.join(missing)}")
    must = list(dict.fromkeys(must))
    if len(must) > size:
        raise PreferenceError(f"{len(must)} must-include devices exceed allocation size {size}")
    if spec.kind is ResourceKind.GPU:
        return choose_gpus(inv, avail, must, size)
    if spec.kind is ResourceKind.REPLICA:
        return _replicas(inv, avail, must, size)
    if spec.kind is ResourceKind.MIG:
        # MIG devices are isolated slices with no links between them: the must-include ones, then the
        # rest in the kubelet's order (NVIDIA's plugin offers no preference for MIG devices either).
        return (must + [d for d in avail if d not in set(must)])[:size]
    return _memory_units(inv, avail, must, size)


def _replicas(inv: NodeInventory, avail: list[str], must: list[str], size: int) -> list[str]:
    """Spread replicas over distinct, well-connected GPUs; double up on a GPU only when out of GPUs."""
    free_by_gpu: dict[str, list[str]] = {}
    forced = set(must)
    for dev in avail:
        if dev not in forced:
            free_by_gpu.setdefault(gpu_of(dev), []).append(dev)
    must_gpus = list(dict.fromkeys(gpu_of(d) for d in must))
    must_set = set(must_gpus)
    other = [g for g in free_by_gpu if g not in must_set]
    extra = min(size - len(must), len(other))
    known = inv.by_uuid()
    if all(g in known for g in must_gpus + other):
        chosen = choose_gpus(inv, must_gpus + other, must_gpus, len(must_gpus) + extra)
    else:  # a GPU vanished from discovery since the kubelet listed its devices: keep the kubelet's order
        chosen = must_gpus + other[:extra]
    result = list(must)
    chosen_set = set(chosen)
    for gpu in chosen:
        if gpu not in must_set and len(result) < size:
            result.append(free_by_gpu[gpu].pop(0))
    leftovers = [d for g in chosen for d in free_by_gpu.get(g, [])]
    leftovers += [d for g, devs in free_by_gpu.items() if g not in chosen_set for d in devs]
    result.extend(leftovers[: size - len(result)])
    return result


def _memory_units(inv: NodeInventory, avail: list[str], must: list[str], size: int) -> list[str]:
    """Take memory units from as few GPUs as possible: the must-include GPUs, then the emptiest GPU."""
    free_by_gpu: dict[str, list[str]] = {}
    forced = set(must)
    for dev in avail:
        if dev not in forced:
            free_by_gpu.setdefault(gpu_of(dev), []).append(dev)
    order = {u: n for n, u in enumerate(g.uuid for g in inv.gpus)}
    must_gpus = {gpu_of(d) for d in must}
    ranked = sorted(
        free_by_gpu, key=lambda g: (g not in must_gpus, -len(free_by_gpu[g]), order.get(g, 1 << 30))
    )
    result = list(must)
    for gpu in ranked:
        take = free_by_gpu[gpu][: size - len(result)]
        result.extend(take)
        if len(result) == size:
            break
    return result
