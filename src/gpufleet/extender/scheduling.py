"""Filter and prioritize over many nodes: the per-node decisions of `placement`, made fast and scored.

One-container GPU-memory requests (any model/capability constraint, any GPU count) and whole-GPU requests
are decided from the index the state keeps current on every cache change (gpufleet.extender.index): a
dict lookup and a few comparisons per node, the same for a request shape never seen before as for a
familiar one. Every other case, and every node the index leaves open, goes through `placement.evaluate`,
the single source of truth (tests check that both agree, also across randomized cache histories), with
verdicts reused per node version.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gpufleet.extender.bindlocks import DECIDED
from gpufleet.extender.index import ERROR, PASS, SHARING, WHOLE, Record
from gpufleet.extender.ledger import NodeEntry
from gpufleet.extender.model import NodeInfo, node_info
from gpufleet.extender.placement import (
    ALL,
    LEFT_TO_KUBELET,
    NOT_SHARING,
    SHARES_MEMORY,
    RequestPlan,
    Verdict,
    too_few_free,
    too_few_gpus,
    whole_misfits,
)
from gpufleet.extender.request import GpuRequest, Policy
from gpufleet.extender.rules import (
    capability_rank,
    composites,
    fits,
    gpu_busy,
    node_utilization,
    policy_cards,
    wish,
)
from gpufleet.extender.state import ClusterState

MAX_PRIORITY = 10  # k8s.io/kube-scheduler/extender/v1 MaxExtenderPriority

UNKNOWN_NODE = "node unknown to the extender (not in its cache yet)"


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
        # A newer Node: its GPUs are parsed again only if their annotation changed.
        return name, node_info(obj, entry.info if entry is not None else None), ""
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


# What `_judge` keeps of a Verdict: the Placement's figures (None: no fit), the reason, unresolvable.
# Plain data, small and outside the garbage collector's work, unlike Verdict and Placement objects.
Outcome = tuple[tuple[float, float, tuple[int, int, int]] | None, str, bool]


def _outcome(verdict: Verdict) -> Outcome:
    p = verdict.placement
    return (
        ((p.utilization, p.topology, p.capability) if p is not None else None),
        verdict.reason,
        verdict.unresolvable,
    )


def _judge(
    state: ClusterState,
    plan: RequestPlan,
    rest: Sequence[str | Mapping[str, Any]],
    policy: Policy,
    now: float,
    own_node: str | None,
) -> list[tuple[str, Outcome | None, str, float, str]]:
    """`state.evaluate` for the candidates the index leaves open: (name, outcome or None with the error,
    and the node's cached lock expiry and holder).

    Outcomes are kept in the node's memo (so only until the node or its ledger changes) per request
    shape; not for the pod's own node (its claim is subtracted) nor under a live lock (depends on the
    pod). Constraints count by which of the node's GPUs they leave (the signature's kinds that qualify)
    when that is not none of them and the request is for GPU memory: the verdict, reason included, is
    then the same for every constraint that leaves the same GPUs, and a new model or capability wish is
    served from the memo. Otherwise by the constraints themselves (their words are in the reason).
    """
    req = plan.req
    shape = (tuple((c.gib, c.gpus) for c in req.mem), req.whole, req.most_capable, policy)
    exact = state.shape_ids.id((shape, req.models, req.min_cc))
    by_mode: dict[int, int] = {}
    memory = req.kind == "mem"
    get = state.index.get
    modes = plan.modes
    out: list[tuple[str, Outcome | None, str, float, str]] = []
    for cand in rest:
        info: NodeInfo | None = None
        if isinstance(cand, str):
            name, error = cand, ""
            r = get(name)
        else:
            name, info, error = _from_object(state, cand)
            r = get(name)
            entry = state.entry(name)
            if entry is not None and entry.info is info:
                info = None  # the cached node: as by name
            elif info is None:
                out.append((name, None, error, 0.0, ""))
                continue
        if r is None:
            if info is None:
                out.append((name, None, error or UNKNOWN_NODE, 0.0, ""))
                continue
            outcome = _outcome(state.evaluate(req, info, policy, now))
            out.append((name, outcome, "", *_lock_of(state.entry(name))))
            continue
        cache = None
        if info is None and name != own_node and r.lock_expires <= now:
            facts = r.facts
            mode = modes.get(r.sig)
            if mode is None:
                mode = plan.mode(r.sig)
            key = exact
            if memory and mode and r.n:
                key = by_mode.get(mode, -1)
                if key < 0:
                    key = by_mode[mode] = state.shape_ids.id((shape, mode))
            cache = facts.memo
            if cache is None:
                cache = facts.memo = {}
            else:
                known = cache.get(key)
                if known is not None:
                    out.append((name, known, "", r.lock_expires, r.lock_uid))
                    continue
        if info is None:
            entry = state.entry(name)
            assert entry is not None and entry.info is not None
            info = entry.info
        outcome = _outcome(state.evaluate(req, info, policy, now))
        if cache is not None:
            if len(cache) >= _MEMO:
                cache.clear()
            cache[key] = outcome
        out.append((name, outcome, "", r.lock_expires, r.lock_uid))
    return out


# Entries a node's memo keeps (request shapes); then it starts over.
_MEMO = 16


def _lock_of(entry: NodeEntry | None) -> tuple[float, str]:
    return (entry.lock_expires, entry.lock_uid) if entry is not None else (0.0, "")


def _split(state: ClusterState, candidates: Candidates) -> tuple[list[str], list[str | Mapping[str, Any]]]:
    """Candidates the index decides (by name) and the others (unknown, or Nodes newer than the cache).

    Nodes sent twice (never by a real scheduler) all go the second way, in their order: two versions of
    one node must be decided in the order they came, as evaluating one after the other would.
    """
    if not candidates or isinstance(candidates[0], str):
        return list(cast(Sequence[str], candidates)), []
    objects = cast(Sequence[Mapping[str, Any]], candidates)
    if len({_name(obj) for obj in objects}) != len(objects):
        return [], list(objects)
    names: list[str] = []
    rest: list[str | Mapping[str, Any]] = []
    index = state.index
    for obj in objects:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name") or "")
        entry = state.entry(name)
        if (
            name in index
            and entry is not None
            and entry.info is not None
            and entry.info.resource_version == str(meta.get("resourceVersion") or "")
        ):
            names.append(name)
        else:
            rest.append(obj)
    return names, rest


def _filter_mem(
    state: ClusterState,
    plan: RequestPlan,
    names: list[str],
    own_node: str | None,
    now: float,
    out: FilterOutcome,
) -> list[str | Mapping[str, Any]]:
    """Decide a one-container GPU-memory request per node from the index; return what it leaves open.

    `placement._evaluate_mem`'s order: a static misfit is unresolvable; a live lock that blocks and
    whole-GPU pods go to `evaluate` (for their messages); then the fit (`rules.fits`) against the ledger.
    """
    get = state.index.get
    fitting, failed, unresolvable = out.fits, out.failed, out.unresolvable
    rest: list[str | Mapping[str, Any]] = []
    share, last = plan.share, plan.count - 1
    short, static = plan.shortfall, plan.static_misfit
    unconstrained = not plan.constrained
    every = frozenset() if unconstrained else plan.all_qualify()
    sharing = SHARING
    own = own_node or ""
    for name in names:
        r = get(name)
        if r is None or name == own:
            rest.append(name)
            continue
        if r.plain and (unconstrained or r.sig in every):
            # The common case: a memory-sharing node without lock or whole-GPU pods, every GPU
            # qualifying, decided by `rules.fits` on the record's free and total GiB, unrolled here: a
            # call per node would cost a third of the filter. The k-th most free GPU never has more than
            # the k-th largest.
            if not last:
                if r.most_free >= share:
                    fitting.append(name)
                elif r.largest >= share:
                    failed[name] = short(r.most_free)
                else:
                    unresolvable[name] = static(r.largest)
            elif r.n > last and r.free[last] >= share:
                fitting.append(name)
            elif r.n > last and r.total[last] >= share:
                failed[name] = short(r.most_free)
            else:
                unresolvable[name] = static(r.largest)
        elif r.code != sharing:
            unresolvable[name] = r.facts.shape.error if r.code == ERROR else NOT_SHARING
        else:
            _filter_view(state, plan, name, r, now, out, rest)
    return rest


def _filter_view(
    state: ClusterState,
    plan: RequestPlan,
    name: str,
    r: Record,
    now: float,
    out: FilterOutcome,
    rest: list[str | Mapping[str, Any]],
) -> None:
    """`_filter_mem` for a memory-sharing node with a lock or whole-GPU pods, or where only some of the
    GPUs (or none) meet the request's wishes: from the view of the GPUs that do."""
    mode = plan.mode(r.sig)
    free: tuple[int, ...] = ()
    total: tuple[int, ...] = ()
    if mode:
        view = r.facts.view if mode == ALL else r.facts.view_for(mode)
        free, total = view.free, view.total
    share, count, uid = plan.share, plan.count, plan.req.uid
    if not fits(total, share, count):
        out.unresolvable[name] = plan.static_misfit(total[0] if total else -1)
    elif r.whole or (r.lock_expires > now and state.lock_blocks(name, r.lock_uid, r.lock_expires, uid, now)):
        rest.append(name)  # evaluate says why (whole-GPU pods, node busy)
    elif fits(free, share, count):
        out.fits.append(name)
    else:
        out.failed[name] = plan.shortfall(free[0])


def _filter_containers(
    state: ClusterState,
    plan: RequestPlan,
    names: list[str],
    own_node: str | None,
    now: float,
    out: FilterOutcome,
) -> list[str | Mapping[str, Any]]:
    """The nodes where a pod of several GPU-memory containers surely fits, from the index; the rest is
    left to `evaluate` (which also names the container that does not fit).

    placement._place_containers gives the containers GPUs one after another, each taking `gpus` cards
    among those with room for its share. When the qualifying GPUs include at least as many cards with room
    for the largest share as all containers take together, every container finds enough of them that no
    earlier one has touched: the pod fits, whatever order the policy and the NVLink links choose, and it
    fits the idle node too (no static misfit). Locks, whole-GPU pods and the pod's own node go to
    `evaluate`, as in `_filter_mem`.
    """
    get = state.index.get
    req = plan.req
    largest = max(c.share for c in req.mem)
    cards = sum(c.gpus for c in req.mem)
    uid = req.uid
    own = own_node or ""
    every = plan.all_qualify() if plan.constrained else None
    modes = plan.modes
    fitting = out.fits
    rest: list[str | Mapping[str, Any]] = []
    for name in names:
        r = get(name)
        if r is None or name == own or r.code != SHARING or r.whole or r.n < cards:
            rest.append(name)
            continue
        if every is None or r.sig in every:
            free = r.free  # r.n >= cards of them
        else:
            known = modes.get(r.sig)
            mode = plan.mode(r.sig) if known is None else known
            free = r.facts.view_for(mode).free if mode else ()
            if len(free) < cards:
                rest.append(name)
                continue
        # `rules.fits(free, largest, cards)`, unrolled as in `_filter_mem`.
        if free[cards - 1] >= largest and not (
            r.lock_expires > now and state.lock_blocks(name, r.lock_uid, r.lock_expires, uid, now)
        ):
            fitting.append(name)
        else:
            rest.append(name)
    return rest


def _filter_whole(
    state: ClusterState,
    plan: RequestPlan,
    names: list[str],
    own_node: str | None,
    out: FilterOutcome,
) -> list[str | Mapping[str, Any]]:
    """Decide a whole-GPU request per node from the index, in `placement._evaluate_whole`'s order and with its
    reasons."""
    get = state.index.get
    fitting, failed, unresolvable = out.fits, out.failed, out.unresolvable
    rest: list[str | Mapping[str, Any]] = []
    req = plan.req
    wanted = req.whole
    constrained = plan.constrained
    messages = plan.messages
    for name in names:
        r = get(name)
        if r is None or name == own_node:
            rest.append(name)
            continue
        code = r.code
        if code != WHOLE:
            if code == PASS:
                fitting.append(name)  # the kubelet counts its devices
            else:
                unresolvable[name] = r.facts.shape.error if code == ERROR else SHARES_MEMORY
            continue
        healthy = r.n
        if healthy < wanted:
            unresolvable[name] = too_few_gpus(healthy, wanted)
            continue
        if constrained:
            mode = plan.mode(r.sig)
            if mode != ALL:
                misfits = healthy - (len(r.facts.view_for(mode).total) if mode else 0)
                unresolvable[name] = whole_misfits(req, misfits, healthy)
                continue
        available = r.idle - r.whole
        if available >= wanted:
            fitting.append(name)
        else:
            known_reason = messages.get(available)
            if known_reason is None:
                known_reason = messages[available] = too_few_free(wanted, available)
            failed[name] = known_reason
    return rest


def filter_nodes(
    state: ClusterState, req: GpuRequest, candidates: Candidates, gpu_policy: Policy, now: float
) -> FilterOutcome:
    """Split the candidates into fitting, failed (maybe later) and unresolvable (never, as things stand).

    One-container GPU-memory requests (any constraint, any GPU count) and whole-GPU requests are decided
    from the index (gpufleet.extender.index); everything else, and every node the index leaves open,
    goes through `placement.evaluate`, the single source of truth (tests check that both agree).
    """
    out = FilterOutcome()
    if req.kind == "none":
        out.fits = [name for name, _, _ in _infos(state, candidates)] if candidates else []
        return out
    policy = req.gpu_policy or gpu_policy
    with state.lock:
        # Everything is read under the lock every change to the state and its index holds, the pod's own
        # claim too (a bind that re-plans replaces it): no read sees a record older than the ledger.
        own = state.own_usage(req.uid)
        own_node = own.node if own is not None else None
        plan = RequestPlan(req, state.signatures)
        names, rest = _split(state, candidates)
        objects = len(rest)  # Nodes newer than the cache, ahead of `names` in `rest`
        if req.kind == "mem" and len(req.mem) == 1:
            rest += _filter_mem(state, plan, names, own_node, now, out)
        elif req.kind == "whole":
            rest += _filter_whole(state, plan, names, own_node, out)
        else:
            rest += _filter_containers(state, plan, names, own_node, now, out)
        if rest:
            fast_fits = len(out.fits)
            in_order = not fast_fits and (not objects or len(rest) == objects)
            for name, outcome, error, _, _ in _judge(state, plan, rest, policy, now, own_node):
                if outcome is None:
                    out.failed[name] = error
                    continue
                placed, reason, unresolvable = outcome
                if placed is not None:
                    out.fits.append(name)
                elif unresolvable:
                    out.unresolvable[name] = reason
                else:
                    out.failed[name] = reason
            if not in_order and len(out.fits) > max(1, fast_fits):
                out.fits = _in_order(out.fits, candidates)
    if not out.fits:
        out.error = _absurd(state, req, candidates)
    return out


def _in_order(fits: list[str], candidates: Candidates) -> list[str]:
    """`fits` in the candidates' order (a name sent n times fits n times or not at all)."""
    wanted = set(fits)
    return [name for name in map(_name, cast(Sequence[Any], candidates)) if name in wanted]


def _name(cand: str | Mapping[str, Any]) -> str:
    return cand if isinstance(cand, str) else str((cand.get("metadata") or {}).get("name") or "")


def _absurd(state: ClusterState, req: GpuRequest, candidates: Candidates) -> str:
    """An error for requests no node of the cluster could ever satisfy, empty otherwise."""
    largest, most = state.maxima()
    if candidates and not isinstance(candidates[0], str):
        # Nodes sent in full may be newer than the cache.
        for _, info, _ in _infos(state, candidates):
            if info is not None:
                largest = max(largest, max((g.memory_gib for g in info.healthy), default=0))
                most = max(most, len(info.healthy))
    if req.kind == "mem":
        if req.max_share > largest:
            return (
                f"pod {req.key} asks {req.max_share} GiB on one GPU; the largest healthy GPU in the cluster "
                f"has {largest} GiB"
            )
    elif req.kind == "whole" and req.whole > most:
        return f"pod {req.key} asks {req.whole} whole GPUs; no node has more than {most} healthy GPUs"
    return ""


def _wish_not_better(figures: dict[str, Any], handing_off: set[str], multi: bool, most: bool) -> set[str]:
    """The nodes in a hand-off that a free fitting node matches on what the pod asked for (NVLink, most
    capable): only those are ranked last. Waiting up to `lock_wait` beats a worse card for the pod's life."""
    free = [n for n in figures if n not in handing_off]
    if not free:
        return handing_off
    ranks = capability_rank({n: cap for n, (_, _, cap) in figures.items()}) if most else {}

    def wished(name: str) -> float:
        _, topology, _ = figures[name]
        return wish(topology, ranks.get(name, 1.0), multi, most)

    best_free = max(wished(n) for n in free)
    return {n for n in handing_off if n not in figures or wished(n) <= best_free + 1e-9}


# (utilization after placement, topology, capability) of a fitting node.
_Figures = tuple[float, float, tuple[int, int, int]]


def _figures_mem(
    state: ClusterState,
    plan: RequestPlan,
    names: Sequence[str],
    own_node: str | None,
    now: float,
    binpack: bool,
    figures: dict[str, Any],
    handing_off: set[str],
) -> list[str]:
    """Where a one-container GPU-memory request would go on each node, from the index.

    The policy alone picks the cards (`rules.policy_cards`) for one GPU, and for several when all the
    node's GPUs are NVLinked to each other (every set is then perfect). Fills `figures` with the
    utilisation (one GPU, no "most capable": all the score needs) or `_Figures`. Unlocked nodes where
    every GPU qualifies keep their figure in the node's memo: it depends on the node version and the
    request's size, count, policy and "most capable" alone, so a burst of similar pods computes it once
    per node change. Returns the nodes only `evaluate` can place: unknown, the pod's own node, multi-GPU
    sets on other topologies, "most capable" among cards of different capability.
    """
    get = state.index.get
    uid = plan.req.uid
    share, count = plan.share, plan.count
    last = count - 1
    most = plan.req.most_capable
    bare = count == 1 and not most
    every = plan.all_qualify() if plan.constrained else None
    modes = plan.modes
    lock_blocks = state.lock_blocks
    own = own_node or ""
    sharing = SHARING
    key = state.shape_ids.id(("figures", share, count, binpack, most))
    undecided: list[str] = []
    for name in names:
        r = get(name)
        if r is None or name == own:
            undecided.append(name)
            continue
        if r.code != sharing or r.whole or r.most_free < share:
            continue  # no placement: not memory sharing, whole-GPU pods, no GPU with room
        memo = None
        if every is None or r.sig in every:
            mode = ALL
            if r.lock_expires <= now and (not most or r.cap is not None):
                # Every GPU qualifies, no lock: the figure depends on the node version and `key` alone.
                memo = r.facts.memo
                if memo is None:
                    memo = r.facts.memo = {}
                else:
                    known = memo.get(key)
                    if known is not None:
                        figures[name] = known
                        continue
        else:
            known_mode = modes.get(r.sig)
            mode = plan.mode(r.sig) if known_mode is None else known_mode
        # The k-th most free GPU never has more than the k-th largest: no static check needed.
        if mode == ALL:
            if last and (r.n <= last or r.free[last] < share):
                continue
            pick, k, cap = r.pick, r.n, r.cap
        elif not mode:
            continue
        else:
            view = r.facts.view_for(mode)
            k = len(view.free)
            if k <= last or view.free[last] < share:
                continue
            pick, cap = view.pick, view.cap
        if (last and not r.meshed) or (most and cap is None):
            undecided.append(name)  # choose_gpus weighs the links, or orders by capability first
            continue
        locked = False
        if r.lock_expires > now:
            locked = r.lock_uid != uid
            if locked and lock_blocks(name, r.lock_uid, r.lock_expires, uid, now):
                continue
        chosen = policy_cards(pick, k, share, count, binpack)
        # The utilisation after placement: the node's `gpu_busy` terms with the chosen cards' replaced,
        # summed in their order as `placement.utilization` sums them (from the prefix sums for one card).
        facts = r.facts
        n, nums, sums = facts.n, facts.nums, facts.sums
        if not last:
            (p,) = chosen
            busy = sum(sums[p + 1 : n], sums[n + p] + gpu_busy(nums[p] + share, nums[n + p]))
        else:
            terms = sums[:n]
            for p in chosen:
                terms[p] = gpu_busy(nums[p] + share, nums[n + p])
            busy = sum(terms)
        util = node_utilization(busy, 0, n)
        if bare:
            figure: Any = util
        else:
            if cap is None:  # cards of different capability: placement reports the best it took
                cap = max(_NO_CAPABILITY, *map(facts.shape.caps.__getitem__, chosen))
            figure = (util, 1.0, cap)
        figures[name] = figure
        if memo is not None:
            if len(memo) >= _MEMO:
                memo.clear()
            memo[key] = figure
        if locked:
            handing_off.add(name)
    return undecided


def _figures_whole(
    state: ClusterState,
    plan: RequestPlan,
    names: Sequence[str],
    own_node: str | None,
    now: float,
    figures: dict[str, Any],
    handing_off: set[str],
) -> list[str]:
    """Where a whole-GPU request would go on each node, from the index (`placement._evaluate_whole`'s
    figures)."""
    get = state.index.get
    uid = plan.req.uid
    wanted = plan.req.whole
    bare = wanted == 1 and not plan.req.most_capable
    constrained = plan.constrained
    undecided: list[str] = []
    for name in names:
        r = get(name)
        if r is None or name == own_node:
            undecided.append(name)
            continue
        if r.code == PASS:
            left = LEFT_TO_KUBELET
            figures[name] = left.utilization if bare else (left.utilization, left.topology, left.capability)
            if r.lock_expires > now and r.lock_uid != uid:
                handing_off.add(name)
            continue
        if r.code != WHOLE or r.n < wanted or r.idle - r.whole < wanted:
            continue
        if constrained and plan.mode(r.sig) != ALL:
            continue
        if wanted > 1 and not r.meshed:
            undecided.append(name)
            continue
        util = node_utilization(r.facts.busy, r.whole + wanted, r.n)
        if bare:
            figures[name] = util
        else:
            capability = r.facts.idle_cap if r.facts.idle_cap is not None else _NO_CAPABILITY
            figures[name] = (util, 1.0, capability)
        if r.lock_expires > now and r.lock_uid != uid:
            handing_off.add(name)
    return undecided


_NO_CAPABILITY = (0, 0, 0)


def placement_figures(
    state: ClusterState, req: GpuRequest, candidates: Candidates, gpu_policy: Policy, now: float
) -> tuple[dict[str, Any], set[str]]:
    """Where the request would go on each fitting candidate, and which of them are handing off.

    Per fitting node: the utilisation after placement when that is all the score needs (one GPU, no
    "most capable"), else (utilization, topology, capability) — exactly the figures of the Placement
    `placement.evaluate` would make. Handing off: the node's bind-lock is another pod's (see
    ClusterState.lock_blocks); a bind there waits for that hand-off.
    """
    gpolicy = req.gpu_policy or gpu_policy
    multi = req.whole > 1 or any(c.gpus > 1 for c in req.mem)
    bare = not multi and not req.most_capable
    figures: dict[str, Any] = {}
    handing_off: set[str] = set()
    with state.lock:  # see filter_nodes
        own = state.own_usage(req.uid)
        own_node = own.node if own is not None else None
        plan = RequestPlan(req, state.signatures)
        names, rest = _split(state, candidates)
        if req.kind == "mem" and len(req.mem) == 1:
            binpack = gpolicy is Policy.BINPACK
            rest += _figures_mem(state, plan, names, own_node, now, binpack, figures, handing_off)
        elif req.kind == "whole":
            rest += _figures_whole(state, plan, names, own_node, now, figures, handing_off)
        else:
            rest += names
        if rest:
            for name, outcome, _, lock_expires, lock_uid in _judge(state, plan, rest, gpolicy, now, own_node):
                if outcome is None:
                    continue
                placed, _, _ = outcome
                if placed is None:
                    continue
                utilization, _, _ = placed
                figures[name] = utilization if bare else placed
                if lock_expires > now and lock_uid != req.uid:
                    handing_off.add(name)
    return figures, handing_off


def prioritize_nodes(
    state: ClusterState,
    req: GpuRequest,
    candidates: Candidates,
    node_policy: Policy,
    gpu_policy: Policy,
    now: float,
) -> list[tuple[str, int]]:
    """Score each candidate 0-10 from node policy (utilisation after placement), NVLink and capability."""
    table = score_table(state, req, candidates, node_policy, gpu_policy, now)
    return list(zip(table.names, table.scores(), strict=True))


@dataclass(slots=True)
class ScoreTable:
    """What prioritize scores the candidates from; `scores()` or `encode()` turn it into the answer.

    Relative scores: integer 0-10 on absolute figures would tie most nodes. The best fitting node gets
    10, the worst fitting 1 (so fitting always beats not fitting, which gets 0); a fitting node in the
    middle of another pod's hand-off gets 1 while a node without one fits as well on what the pod asked
    for (NVLink, most capable).
    """

    names: list[str]  # the candidates, in their order
    composite: dict[str, float]  # per fitting node
    handing_off: set[str]
    low: float
    span: float

    def scores(self) -> list[int]:
        """Each candidate's score, in the candidates' order."""
        get, low, span, top = self.composite.get, self.low, self.span, MAX_PRIORITY - 1
        if not self.handing_off and span >= 1e-9:
            return [
                0 if (v := get(name)) is None else 1 + round(top * (v - low) / span) for name in self.names
            ]
        scores = []
        for name in self.names:
            value = get(name)
            if value is None:
                scores.append(0)
            elif name in self.handing_off:
                scores.append(1)
            elif span < 1e-9:
                scores.append(MAX_PRIORITY)
            else:
                scores.append(1 + round(top * (value - low) / span))
        return scores

    def encode(self, hosts: Mapping[str, str], tails: Sequence[str]) -> list[str]:
        """`hosts[name] + tails[score]` per candidate (pre-encoded JSON pieces), in one pass."""
        get, low, span, top = self.composite.get, self.low, self.span, MAX_PRIORITY - 1
        if not self.handing_off and span >= 1e-9:
            return [
                hosts[name] + tails[0 if (v := get(name)) is None else 1 + round(top * (v - low) / span)]
                for name in self.names
            ]
        return [hosts[name] + tails[score] for name, score in zip(self.names, self.scores(), strict=True)]


def score_table(
    state: ClusterState,
    req: GpuRequest,
    candidates: Candidates,
    node_policy: Policy,
    gpu_policy: Policy,
    now: float,
) -> ScoreTable:
    """The figures `prioritize_nodes` scores by."""
    if not candidates or isinstance(candidates[0], str):
        order = list(cast(Sequence[str], candidates))
    else:
        order = [_name(c) for c in cast(Sequence[Any], candidates)]
    if req.kind == "none":
        return ScoreTable(order, {}, set(), 0.0, 0.0)
    npolicy = req.node_policy or node_policy
    multi = req.whole > 1 or any(c.gpus > 1 for c in req.mem)
    most = req.most_capable
    bare = not multi and not most
    figures, handing_off = placement_figures(state, req, candidates, gpu_policy, now)
    composite = composites(figures, npolicy is Policy.BINPACK, multi, most)
    if handing_off and not bare:
        handing_off = _wish_not_better(figures, handing_off, multi, most)
    if handing_off and len(handing_off) < len(composite):
        ranked = {n: c for n, c in composite.items() if n not in handing_off}
    else:
        ranked, handing_off = composite, set()
    low = min(ranked.values(), default=0.0)
    high = max(ranked.values(), default=0.0)
    return ScoreTable(order, composite, handing_off, low, high - low)


def decide(
    state: ClusterState,
    req: GpuRequest,
    fitting: Candidates,
    node_policy: Policy,
    gpu_policy: Policy,
    patience: float = 0.0,
) -> tuple[str, bool]:
    """Choose the one node (and its GPUs) a GPU-memory pod goes to among the candidates that fit it, and
    reserve that placement (decided) at once: the next pods filter against it, though the scheduler binds
    this one asynchronously while it decides them. The chosen node's name ("" if none could be placed) and
    whether the choice waited.

    The choice is prioritize's: the node policy on the utilisation after placement, NVLink and capability
    wishes (`rules.composites`), ties to the candidates' order. A node where this pod's bind would queue
    behind more hand-offs than its share of `bind_wait` allows (`BindLocks.busy`) is taken only when no
    node without such a queue fits as well on what the pod asked for (NVLink, most capable). When every
    node is busy so, the choice waits up to `patience` seconds for a queue to shorten (binds finishing
    their turns), which holds the scheduler to the pace the nodes' hand-offs go at instead of sending binds
    that would wait past `bind_wait` and be refused; then the shortest queue. A pod whose bind is running
    or done keeps its node. `ReservationsFull` when the reservation table is at its cap.
    """
    npolicy = req.node_policy or node_policy
    gpolicy = req.gpu_policy or gpu_policy
    multi = req.whole > 1 or any(c.gpus > 1 for c in req.mem)
    most = req.most_capable
    names = [_name(c) for c in cast(Sequence[Any], fitting)]
    order = {name: i for i, name in enumerate(names)}
    by_name = {_name(c): c for c in cast(Sequence[Any], fitting)}
    give_up = time.monotonic() + patience
    waited = False
    while True:
        with state.lock:
            now = state.clock()
            own = state.reservation(req.uid)
            if own is not None and own.stage != DECIDED:  # bound or binding: a retry of the scheduler's
                return (own.usage.node if own.usage.node in names else ""), waited
            figures, _ = placement_figures(state, req, fitting, gpu_policy, now)
            composite = composites(figures, npolicy is Policy.BINPACK, multi, most)
            if not composite:
                return "", waited
            locks, index = state.locks, state.index
            ahead: dict[str, int] = {}
            for name in composite:
                r = index.get(name)
                count = locks.ahead(name, req.uid, r.lock_uid, r.lock_expires, now) if r else 0
                if locks.busy(count):
                    ahead[name] = count
            busy = set(ahead)
            if busy and (multi or most):
                busy = _wish_not_better(figures, busy, multi, most)

            def rank(
                name: str, busy: set[str] = busy, ahead: dict[str, int] = ahead, value: Any = composite
            ) -> tuple[bool, int, float, int]:
                queued = name in busy
                return queued, ahead[name] if queued else 0, -value[name], order.get(name, 0)

            first = min(composite, key=rank)
            if first not in busy or time.monotonic() >= give_up:
                for name in itertools.chain((first,), (n for n in sorted(composite, key=rank) if n != first)):
                    ((_, info, _),) = _infos(state, cast(Candidates, [by_name.get(name, name)]))
                    if info is None:
                        continue
                    verdict = state.plan_and_reserve(req, info, gpolicy, now, DECIDED)
                    if verdict.placement is not None:
                        return name, waited
                return "", waited
        waited = True
        time.sleep(DECIDE_POLL)


# Seconds between two looks at the queues while a decision waits for one to shorten.
DECIDE_POLL = 0.02
