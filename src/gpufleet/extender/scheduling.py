"""Filter and prioritize over many nodes: each node's decision (`placement.decide_mem`, `decide_whole`),
and the scores.

For every candidate the state indexes, filter and prioritize call the request kind's decision on the
node's index record (gpufleet.extender.index: kept current on every cache change, so a decision is a few
comparisons, the same for a request shape never seen before as for a familiar one), and keep its outcome in
the node's memo until the node or its ledger changes. Where a record cannot tell (an unknown node, the
pod's own node, whose claim is left out, a Node object newer than the cache, a reason only the reference
words), they ask `placement.evaluate`, the single source of truth. Tests check that both agree, also across
randomized cache histories.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from gpufleet.extender.bindlocks import DECIDED
from gpufleet.extender.model import NodeInfo
from gpufleet.extender.placement import FITS, Outcome, RequestPlan, decide_mem, decide_whole, outcome
from gpufleet.extender.request import GpuRequest, Policy
from gpufleet.extender.rules import capability_rank, composites, wish
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


def _name(cand: str | Mapping[str, Any]) -> str:
    return cand if isinstance(cand, str) else str((cand.get("metadata") or {}).get("name") or "")


def _infos(state: ClusterState, candidates: Candidates) -> list[tuple[str, NodeInfo | None, str]]:
    """(name, NodeInfo or None, parse error) per candidate."""
    with state.lock:
        return [
            (cand, state.node_info(cand), "") if isinstance(cand, str) else state.parse_node(cand)
            for cand in candidates
        ]


def _split(state: ClusterState, candidates: Candidates) -> tuple[list[str], list[str | Mapping[str, Any]]]:
    """Candidates decided on their index records (by name) and the others (Nodes newer than the cache).

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
    for obj in objects:
        name = state.current(obj)
        if name is not None:
            names.append(name)
        else:
            rest.append(obj)
    return names, rest


# Outcomes a node's memo keeps (request keys); then it starts over.
_MEMO = 16


def _decide_all(
    state: ClusterState,
    plan: RequestPlan,
    names: Sequence[str],
    own_node: str | None,
    now: float,
    out: FilterOutcome | None,
    figures: dict[str, Any] | None = None,
) -> tuple[list[str], list[str]]:
    """Decide each named node on its index record (`decide_mem`, `decide_whole`), in `names`' order, into
    `out` (filter) or else `figures` (prioritize: `placement_figures`'s). The nodes `evaluate` has to decide
    (not indexed, the pod's own node, the decision's None; for figures also `FITS`), and those whose live
    bind-lock is another pod's.

    Outcomes are kept in the node's memo (`index.Record.memo`, so only until the node or its ledger
    changes) under the request's key (`RequestPlan.key_for`), and read from there first: a burst of
    similar pods decides each node once per change. Not while the node has a live bind-lock: the outcome
    then depends on its holder and the time.
    """
    get = state.records().get
    decide = decide_mem if plan.memory else decide_whole
    uid, key, keys, key_for = plan.uid, plan.key, plan.keys, plan.key_for
    bare = plan.bare
    own = own_node or ""
    rest: list[str] = []
    locked: list[str] = []
    filtering = out is not None
    fits, failed, unresolvable = (out.fits, out.failed, out.unresolvable) if out else ([], {}, {})
    placed_at = figures if figures is not None else {}
    found: Outcome | None
    for name in names:
        r = get(name)
        if r is None or name == own:
            rest.append(name)
            continue
        if r.lock_expires > now:
            if r.lock_uid != uid:
                locked.append(name)
            found = decide(name, r, plan, now) or _OPEN
        else:
            memo = r.memo
            k = key if key >= 0 else keys.get(r.sig)
            if k is None:
                k = key_for(r.sig)
            found = memo.get(k)
            if found is None:
                if len(memo) >= _MEMO:
                    memo.clear()
                found = memo[k] = decide(name, r, plan, now) or _OPEN
        if filtering:
            if found is _OPEN:
                rest.append(name)
            elif found[0] is not None:
                fits.append(name)
            elif found[2]:
                unresolvable[name] = found[1]
            else:
                failed[name] = found[1]
        elif found is _OPEN or found is FITS:
            rest.append(name)
        elif placed := found[0]:
            placed_at[name] = placed[0] if bare else placed
    return rest, locked


# What a node's memo keeps for a decision that left the node to `evaluate`. Its outcome is kept apart (under
# the key's complement, `_judge`), so that a node goes the same way whether or not it has been evaluated
# before: the reply lists the nodes `evaluate` decided after the others.
_OPEN: Outcome = (None, "", False)


def _judge(
    state: ClusterState,
    plan: RequestPlan,
    rest: Sequence[str | Mapping[str, Any]],
    now: float,
    own_node: str | None,
) -> list[tuple[str, Outcome | None, str]]:
    """`evaluate` for the candidates the records leave open: (name, outcome or None, the error then).

    Outcomes are kept in the node's memo beside `_decide_all`'s, under the complement of its key, and
    read from there; not for the pod's own node (its claim is left out), under a live lock, nor for Node
    objects newer than the cache.
    """
    req, policy = plan.req, plan.policy
    get = state.records().get
    out: list[tuple[str, Outcome | None, str]] = []
    for cand in rest:
        info: NodeInfo | None = None
        if isinstance(cand, str):
            name, error = cand, ""
        else:
            name, info, error = state.parse_node(cand)
            if info is None:
                out.append((name, None, error))
                continue
            if info is state.node_info(name):
                info = None  # the cached node: as by name
        r = get(name)
        if r is None:
            if info is None:
                out.append((name, None, UNKNOWN_NODE))
            else:
                out.append((name, outcome(state.evaluate(req, info, policy, now)), ""))
            continue
        memo, k = None, -1
        if info is None and name != own_node and r.lock_expires <= now:
            memo, k = r.memo, ~(plan.key if plan.key >= 0 else plan.key_for(r.sig))
            known = memo.get(k)
            if known is not None:
                out.append((name, known, ""))
                continue
        if info is None:
            info = state.node_info(name)
            assert info is not None
        found = outcome(state.evaluate(req, info, policy, now))
        if memo is not None:
            if len(memo) >= _MEMO:
                memo.clear()
            memo[k] = found
        out.append((name, found, ""))
    return out


def filter_nodes(
    state: ClusterState, req: GpuRequest, candidates: Candidates, gpu_policy: Policy, now: float
) -> FilterOutcome:
    """Split the candidates into fitting, failed (maybe later) and unresolvable (never, as things stand).

    Each indexed candidate's decision on its record (`_decide_all`), in the candidates' order; then
    `evaluate` for the others, in theirs (`_judge`).
    """
    out = FilterOutcome()
    if req.kind == "none":
        out.fits = [name for name, _, _ in _infos(state, candidates)] if candidates else []
        return out
    fits, failed, unresolvable = out.fits, out.failed, out.unresolvable
    with state.lock:
        # Everything is read under the lock every change to the state and its index holds, the pod's own
        # claim too (a bind that re-plans replaces it): no read sees a record older than the ledger.
        own = state.own_usage(req.uid)
        own_node = own.node if own is not None else None
        plan = state.plan(req, req.gpu_policy or gpu_policy)
        names, rest = _split(state, candidates)
        objects = len(rest)  # Nodes newer than the cache, ahead of the names left open in `rest`
        rest += _decide_all(state, plan, names, own_node, now, out)[0]
        if rest:
            decided = len(fits)
            in_order = not decided and (not objects or len(rest) == objects)
            for name, found, error in _judge(state, plan, rest, now, own_node):
                if found is None:
                    failed[name] = error
                elif found[0] is not None:
                    fits.append(name)
                elif found[2]:
                    unresolvable[name] = found[1]
                else:
                    failed[name] = found[1]
            if not in_order and len(fits) > max(1, decided):
                out.fits = _in_order(fits, candidates)
    if not out.fits:
        out.error = _absurd(state, req, candidates)
    return out


def _in_order(fits: list[str], candidates: Candidates) -> list[str]:
    """`fits` in the candidates' order (a name sent n times fits n times or not at all)."""
    wanted = set(fits)
    if isinstance(candidates[0], str):
        return [name for name in cast(Sequence[str], candidates) if name in wanted]
    return [name for name in map(_name, cast(Sequence[Any], candidates)) if name in wanted]


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


def placement_figures(
    state: ClusterState, req: GpuRequest, candidates: Candidates, gpu_policy: Policy, now: float
) -> tuple[dict[str, Any], set[str]]:
    """Where the request would go on each fitting candidate, and which of them are handing off.

    Per fitting node: the utilisation after placement when that is all the score needs (one GPU, no
    "most capable"), else (utilization, topology, capability) — exactly the figures of the Placement
    `placement.evaluate` would make. Handing off: the node's bind-lock is another pod's (see
    ClusterState.lock_blocks); a bind there waits for that hand-off.
    """
    figures: dict[str, Any] = {}
    handing_off: set[str] = set()
    with state.lock:  # see filter_nodes
        own = state.own_usage(req.uid)
        own_node = own.node if own is not None else None
        plan = state.plan(req, req.gpu_policy or gpu_policy)
        bare = plan.bare
        names, rest = _split(state, candidates)
        if req.kind != "none":
            left, locked = _decide_all(state, plan, names, own_node, now, None, figures)
            rest += left
            handing_off.update(name for name in locked if name in figures)
        else:
            rest += names
        if rest:
            get = state.records().get
            for name, found, _ in _judge(state, plan, rest, now, own_node):
                if found is None or not (placed := found[0]):
                    continue
                figures[name] = placed[0] if bare else placed
                r = get(name)
                if r is not None and r.lock_expires > now and r.lock_uid != req.uid:
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
    multi = req.multi
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


def choose(
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
    behind more hand-offs than its share of `bind_wait` allows (`ClusterState.queues`) is taken only when no
    node without such a queue fits as well on what the pod asked for (NVLink, most capable). When every
    node is busy so, the choice waits up to `patience` seconds for a queue to shorten (binds finishing
    their turns), which holds the scheduler to the pace the nodes' hand-offs go at instead of sending binds
    that would wait past `bind_wait` and be refused; then the shortest queue. A pod whose bind is running
    or done keeps its node. `ReservationsFull` when the reservation table is at its cap.
    """
    npolicy = req.node_policy or node_policy
    gpolicy = req.gpu_policy or gpu_policy
    multi = req.multi
    most = req.most_capable
    objects: dict[str, Mapping[str, Any]] = {}
    if fitting and not isinstance(fitting[0], str):
        names = [_name(c) for c in cast(Sequence[Mapping[str, Any]], fitting)]
        objects = dict(zip(names, cast(Sequence[Mapping[str, Any]], fitting), strict=True))
    else:
        names = list(cast(Sequence[str], fitting))
    give_up = time.monotonic() + patience
    waited = False
    while True:
        with state.lock:
            now = state.clock()
            own = state.reservation(req.uid)
            if own is not None and own.stage != DECIDED:  # bound or binding: a retry of the scheduler's
                return (own.usage.node if own.usage.node in names else ""), waited
            figures, handing_off = placement_figures(state, req, fitting, gpu_policy, now)
            composite = composites(figures, npolicy is Policy.BINPACK, multi, most)
            if not composite:
                return "", waited
            ahead = state.queues(composite, handing_off, req.uid, now)
            busy = set(ahead)
            if busy and (multi or most):
                busy = _wish_not_better(figures, busy, multi, most)
            ranked = _ranked(composite, busy, ahead, names)
            first = next(ranked)
            if first not in busy or time.monotonic() >= give_up:
                for name in itertools.chain((first,), ranked):
                    obj = objects.get(name)
                    info = state.node_info(name) if obj is None else state.parse_node(obj)[1]
                    if info is None:
                        continue
                    verdict = state.plan_and_reserve(req, info, gpolicy, now, DECIDED)
                    if verdict.placement is not None:
                        return name, waited
                return "", waited
        waited = True
        time.sleep(DECIDE_POLL)


def _ranked(
    composite: dict[str, float], busy: set[str], ahead: dict[str, int], names: Sequence[str]
) -> Iterator[str]:
    """The fitting nodes in the order `choose` tries them: those without a long queue, the best score first,
    then the others, the shortest queue first and then the best score; ties to the candidates' order (a name
    sent twice: its later place). The first is found without a Python call per node; the rest are ranked
    only if it cannot be reserved."""
    pool = composite if not busy else {n: v for n, v in composite.items() if n not in busy}
    if not pool:
        least = min(ahead[n] for n in busy)
        pool = {n: composite[n] for n in busy if ahead[n] == least}
    top = max(pool.values())
    ties = [n for n, v in pool.items() if v == top]
    order: dict[str, int] = {}
    if len(ties) > 1:
        order = {name: i for i, name in enumerate(names)}
        ties.sort(key=order.__getitem__)
    first = ties[0]
    yield first
    if not order:
        order = {name: i for i, name in enumerate(names)}

    def rank(name: str) -> tuple[bool, int, float, int]:
        queued = name in busy
        return queued, ahead[name] if queued else 0, -composite[name], order[name]

    yield from (name for name in sorted(composite, key=rank) if name != first)


# Seconds between two looks at the queues while a decision waits for one to shorten.
DECIDE_POLL = 0.02
