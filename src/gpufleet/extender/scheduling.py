"""Filter and prioritize over many nodes: the per-node decisions of `placement`, made fast and scored.

The filter's fast path covers single-container requests (any model/capability constraint, any GPU
count) from per-node views the state caches, so 5,000 nodes cost about a microsecond each; every other
case, and every node the fast path is unsure about, goes through `placement.evaluate`, which is the
single source of truth (a test checks that both agree).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gpufleet.extender.model import NodeInfo, node_info
from gpufleet.extender.placement import Placement, Verdict, shortfall
from gpufleet.extender.request import GpuRequest, Policy
from gpufleet.extender.state import ClusterState

MAX_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority

UNKNOWN_NODE = "node unknown to the extender (not in its cache yet)"

# Relative weights of the score terms; NVLink and capability wishes outrank packing when present.
_W_POLICY = 1.0
_W_TOPOLOGY = 2.0
_W_CAPABILITY = 3.0


@dataclass(slots=True)
class FilterOutcome:
    """Which candidates fit, which do not for now, and which never can."""

    fits: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    unresolvable: dict[str, str] = field(default_factory=dict)
    error: str = ""


Candidates = Sequence[str] | Sequence[Mapping[str, Any]]


def _from_object(state: ClusterState, obj: Mapping[str, Any]) -> tuple[str, NodeInfo | None, str]:
    """A Node object's name and parsed info (the cached parse when the resourceVersion matches)."""
    meta = obj.get("metadata") or {}
    name = str(meta.get("name") or "")
    entry = state.entry(name)
    if (
        entry is not None
        and entry.info is not None
        and entry.info.resource_version == str(meta.get("resourceVersion") or "")
    ):
        return name, entry.info, ""
    try:
        return name, node_info(obj), ""
    except ValueError as exc:
        return name, None, str(exc)


def _infos(state: ClusterState, candidates: Candidates) -> list[tuple[str, NodeInfo | None, str]]:
    """(name, NodeInfo or None, parse error) per candidate."""
    out: list[tuple[str, NodeInfo | None, str]] = []
    with state.lock:
        for cand in candidates:
            if isinstance(cand, str):
                entry = state.entry(cand)
                out.append((cand, entry.info if entry else None, ""))
            else:
                out.append(_from_object(state, cand))
    return out


def filter_nodes(
    state: ClusterState, req: GpuRequest, candidates: Candidates, gpu_policy: Policy, now: float
) -> FilterOutcome:
    """Split the candidates into fitting, failed (maybe later) and unresolvable (never, as things stand)."""
    out = FilterOutcome()
    if req.kind == "none":
        out.fits = [name for name, _, _ in _infos(state, candidates)] if candidates else []
        return out
    policy = req.gpu_policy or gpu_policy
    own = state.own_usage(req.uid)
    own_node = own.node if own is not None else None
    uid = req.uid
    # Fast path: one container (any constraint, any GPU count), decided from the node's summaries
    # (unconstrained single GPU) or its cached view; it must agree with placement._evaluate_mem, and
    # anything it is unsure of (including every unresolvable case, for its message) falls through.
    fast = len(req.mem) == 1
    share = req.mem[0].share if fast else 0
    count = req.mem[0].gpus if fast else 0
    plain = fast and count == 1 and not req.constrained
    key = (req.models, req.min_cc)
    fits, failed = out.fits, out.failed
    with state.lock:
        if plain and own_node is None and candidates and isinstance(candidates[0], str):
            # The common request by name: one dict lookup per node; nodes not in the index (not
            # memory-ready, unknown) and misfits the index cannot explain go on to the loop below.
            index = state.plain_index
            rest: list[str] = []
            for name in cast(Sequence[str], candidates):
                hit = index.get(name)
                if hit is not None and (
                    hit[2] <= now or hit[3] == uid or not state.lock_blocks(name, hit[3], hit[2], uid, now)
                ):
                    most_free, biggest = hit[0], hit[1]
                    if most_free >= share:
                        fits.append(name)
                        continue
                    if biggest >= share:
                        failed[name] = shortfall(share, 1, most_free)
                        continue
                rest.append(name)
            candidates = rest
        entries = state.entries()
        for cand in candidates:
            if isinstance(cand, str):
                name, error = cand, ""
                entry = entries.get(name)
                info = entry.info if entry is not None else None
            else:
                name, info, error = _from_object(state, cand)
                entry = entries.get(name)
            if info is None:
                failed[name] = error or UNKNOWN_NODE
                continue
            if (
                fast
                and entry is not None
                and entry.ready
                and entry.info is info
                and name != own_node
                and (
                    entry.lock_expires <= now
                    or entry.lock_uid == uid
                    or not state.lock_blocks(name, entry.lock_uid, entry.lock_expires, uid, now)
                )
            ):
                if plain:
                    if entry.max_free >= share:
                        fits.append(name)
                        continue
                    if entry.largest >= share:
                        failed[name] = shortfall(share, 1, entry.max_free)
                        continue
                else:
                    cached = entry.views.get(key)
                    free, total = (
                        (cached[1], cached[2])
                        if cached is not None and cached[0] == entry.version
                        else entry.view(req)
                    )
                    if len(free) >= count and free[count - 1] >= share:
                        fits.append(name)
                        continue
                    if len(total) >= count and total[count - 1] >= share:
                        failed[name] = shortfall(share, count, free[0])
                        continue
            verdict = state.evaluate(req, info, policy, now)
            if verdict.fits:
                fits.append(name)
            elif verdict.unresolvable:
                out.unresolvable[name] = verdict.reason
            else:
                failed[name] = verdict.reason
    if not out.fits:
        out.error = _absurd(state, req, candidates)
    return out


def _absurd(state: ClusterState, req: GpuRequest, candidates: Candidates) -> str:
    """An error for requests no node of the cluster could ever satisfy, empty otherwise."""
    infos = [i for _, i, _ in _infos(state, candidates) if i is not None]
    with state.lock:
        known = [e.info for e in state.entries().values() if e.info is not None]
    gpus = [g for info in (*known, *infos) for g in info.gpus if g.healthy]
    if req.kind == "mem":
        largest = max((g.memory_gib for g in gpus), default=0)
        if req.max_share > largest:
            return (
                f"pod {req.key} asks {req.max_share} GiB on one GPU; the largest healthy GPU in the cluster "
                f"has {largest} GiB"
            )
    elif req.kind == "whole":
        most = max((sum(1 for g in i.gpus if g.healthy) for i in (*known, *infos)), default=0)
        if req.whole > most:
            return f"pod {req.key} asks {req.whole} whole GPUs; no node has more than {most} healthy GPUs"
    return ""


def _capability_rank(placements: Mapping[str, Placement]) -> dict[str, float]:
    """Each node's best offered capability as a rank in [0, 1] among the candidates."""
    levels = sorted({p.capability for p in placements.values()})
    if len(levels) < 2:
        return dict.fromkeys(placements, 1.0)
    position = {level: i / (len(levels) - 1) for i, level in enumerate(levels)}
    return {name: position[p.capability] for name, p in placements.items()}


def prioritize_nodes(
    state: ClusterState,
    req: GpuRequest,
    candidates: Candidates,
    node_policy: Policy,
    gpu_policy: Policy,
    now: float,
) -> list[tuple[str, int]]:
    """Score each candidate 0-10 from node policy (utilisation after placement), NVLink and capability."""
    infos = _infos(state, candidates)
    if req.kind == "none":
        return [(name, 0) for name, _, _ in infos]
    npolicy = req.node_policy or node_policy
    gpolicy = req.gpu_policy or gpu_policy
    placements: dict[str, Placement] = {}
    # Fitting nodes whose bind-lock another pod holds (see ClusterState.lock_blocks): a bind there waits
    # for that hand-off, so they come last while a node without one fits.
    handing_off: set[str] = set()
    own = state.own_usage(req.uid)
    own_node = own.node if own is not None else None
    # Verdicts are reused while the node and its ledger are unchanged, for requests of the same shape
    # (container names aside): in a burst of similar pods only the nodes that changed are evaluated.
    # Not for the pod's own node (its claim is subtracted) nor under a live lock (depends on the pod).
    shape = (
        tuple((c.gib, c.gpus) for c in req.mem),
        req.whole,
        req.models,
        req.min_cc,
        req.most_capable,
        gpolicy,
    )
    with state.lock:
        for name, info, _ in infos:
            if info is None:
                continue
            entry = state.entry(name)
            usable = (
                entry is not None and entry.info is info and name != own_node and entry.lock_expires <= now
            )
            cache = entry.verdicts if usable and entry is not None else None
            version = entry.version if entry is not None else -1
            hit = cache.get(shape) if cache is not None else None
            if hit is not None and hit[0] == version:
                verdict: Verdict = hit[1]
            else:
                verdict = state.evaluate(req, info, gpolicy, now)
                if cache is not None:
                    if len(cache) >= 32:
                        cache.clear()
                    cache[shape] = (version, verdict)
            if verdict.placement is not None:
                placements[name] = verdict.placement
                if entry is not None and entry.lock_expires > now and entry.lock_uid != req.uid:
                    handing_off.add(name)
    multi = req.whole > 1 or any(c.gpus > 1 for c in req.mem)
    ranks = _capability_rank(placements) if req.most_capable else {}
    composite: dict[str, float] = {}
    for name, placement in placements.items():
        fill = placement.utilization if npolicy is Policy.BINPACK else 1.0 - placement.utilization
        total, weight = _W_POLICY * fill, _W_POLICY
        if multi:
            total += _W_TOPOLOGY * placement.topology
            weight += _W_TOPOLOGY
        if req.most_capable:
            total += _W_CAPABILITY * ranks[name]
            weight += _W_CAPABILITY
        composite[name] = total / weight
    # Relative scores: integer 0-10 on absolute figures would tie most nodes. The best fitting node
    # gets 10, the worst fitting 1 (so fitting always beats not fitting, which gets 0).
    if handing_off and len(handing_off) < len(composite):
        ranked = {n: c for n, c in composite.items() if n not in handing_off}
    else:
        ranked, handing_off = composite, set()
    low = min(ranked.values(), default=0.0)
    high = max(ranked.values(), default=0.0)
    span = high - low
    scores = []
    for name, _, _ in infos:
        if name not in composite:
            scores.append((name, 0))
        elif name in handing_off:
            scores.append((name, 1))
        elif span < 1e-9:
            scores.append((name, MAX_PRIORITY))
        else:
            scores.append((name, 1 + round((MAX_PRIORITY - 1) * (composite[name] - low) / span)))
    return scores
