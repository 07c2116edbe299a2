"""Per-node decisions, free of I/O and locks: does a request fit this node, and on which GPUs.

`evaluate` is the reference: it sees a node through three facts, its published GPUs (`NodeInfo`), GiB in
use per GPU uuid, and the number of whole GPUs held by pods whose devices the kubelet chose (their
positions are unknown to us), and says where on the node the request would go. Bind plans with it, and
filter and prioritize fall back on it.

Right after each request kind's reference (`_evaluate_mem`, `_evaluate_whole`) stands the same decision
made on the node's index record (`decide_mem`, `decide_whole`; `gpufleet.extender.index.Record`: free and
total GiB largest first, the card pick orders, the utilisation terms, kept current on every change), with
a `RequestPlan` that works out once per request what does not depend on the node. Filter and prioritize
call them for every candidate node; where a record cannot tell (a reason only `evaluate` words, a card
pick that weighs NVLink links), they answer None or `FITS` and the caller asks `evaluate`. A change to a
decision is made in both, side by side; tests check over randomized histories that they agree, bit for
bit.

Every function here is deterministic so filter, prioritize and bind agree given the same inputs. The rules
themselves (fit, card pick, utilisation) are `gpufleet.extender.rules`, which both call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gpufleet.extender.index import ERROR, PASS, SHARING, Record, Signatures
from gpufleet.extender.model import Gpu, NodeInfo
from gpufleet.extender.request import ContainerRequest, GpuRequest, Policy
from gpufleet.extender.rules import (
    busy_after,
    card_key,
    fits,
    gpu_busy,
    link,
    node_utilization,
    policy_cards,
)
from gpufleet.handoff import SHARING_LABEL, SHARING_MEMORY, ContainerAssignment

# Why a node can never take a request of the other kind.
NOT_SHARING = f"node does not share GPU memory (label {SHARING_LABEL}={SHARING_MEMORY} absent)"
SHARES_MEMORY = "node shares GPU memory; whole GPUs (nvidia.com/gpu) are not offered there"


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a request would go on one node, and the figures prioritize scores it by."""

    containers: tuple[ContainerAssignment, ...]
    whole: int
    utilization: float
    topology: float
    capability: tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Verdict:
    """A node's answer: a placement, or why not and whether freeing GPUs (preemption) could help."""

    placement: Placement | None
    reason: str = ""
    unresolvable: bool = False

    @property
    def fits(self) -> bool:
        """Whether the request fits."""
        return self.placement is not None


def _fail(reason: str, unresolvable: bool = False) -> Verdict:
    return Verdict(None, reason, unresolvable)


# (utilisation after placement, topology, capability): what prioritize scores a fitting node by.
Figures = tuple[float, float, tuple[int, int, int]]

# A Verdict as filter and prioritize keep it per node and request (plain data: small, and outside the
# garbage collector's work, unlike Verdict and Placement objects): the Placement's figures, () when the
# request fits but only `evaluate` can work out the figures, or None when it does not fit; the reason; and
# whether it is unresolvable.
Outcome = tuple[Figures | tuple[()] | None, str, bool]

# The request fits; the figures are `evaluate`'s to work out.
FITS: Outcome = ((), "", False)

NO_CAPABILITY = (0, 0, 0)


def outcome(verdict: Verdict) -> Outcome:
    """The Verdict as an Outcome."""
    p = verdict.placement
    figures = (p.utilization, p.topology, p.capability) if p is not None else None
    return figures, verdict.reason, verdict.unresolvable


def set_topology(gpus: Sequence[Gpu]) -> float:
    """Mean pair link quality of a GPU set, in [0, 1]; a single GPU is perfect."""
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    if not pairs:
        return 1.0
    return sum(link(a, b) for a, b in pairs) / len(pairs)


def choose_gpus(
    candidates: Sequence[Gpu],
    count: int,
    share: int,
    used: Mapping[str, int],
    policy: Policy,
    most_capable: bool,
) -> tuple[list[Gpu], float] | None:
    """Pick `count` GPUs for `share` GiB each; multi-GPU sets favour NVLink, then the policy."""
    if len(candidates) < count:
        return None

    binpack = policy is Policy.BINPACK

    def order(gpu: Gpu) -> tuple[int, ...]:
        free_after = gpu.memory_gib - used.get(gpu.uuid, 0) - share
        return card_key(free_after, gpu.index, binpack, gpu.capability if most_capable else None)

    if count == 1:
        return [min(candidates, key=order)], 1.0
    ranked = sorted(candidates, key=order)
    best: tuple[float, int, list[Gpu]] | None = None
    for rank, seed in enumerate(ranked):
        chosen = [seed]
        rest = [g for g in ranked if g is not seed]
        while len(chosen) < count:
            # Greedy growth: the candidate best linked to the set so far; `rest` is in policy order,
            # so max() keeps the policy's favourite among equally linked ones.
            pick = max(rest, key=lambda g: sum(link(g, c) for c in chosen))
            chosen.append(pick)
            rest.remove(pick)
        quality = set_topology(chosen)
        if best is None or quality > best[0] + 1e-9:
            best = (quality, rank, chosen)
    assert best is not None
    return best[2], best[0]


def qualifying(info: NodeInfo, req: GpuRequest) -> Sequence[Gpu]:
    """The node's healthy GPUs that meet the request's model and capability constraints."""
    if not req.constrained:
        return info.healthy
    verdicts = [req.gpu_qualifies(tokens, cc) for tokens, cc in info.kinds]
    if all(verdicts):
        return info.healthy
    if not any(verdicts):
        return ()
    return [g for g in info.healthy if req.gpu_qualifies(g.tokens, g.cc)]


def utilization(info: NodeInfo, used: Mapping[str, int], whole_held: int) -> float:
    """`rules.node_utilization` of the node with this ledger and `whole_held` GPUs held at unknown places."""
    healthy = info.healthy
    busy = sum([gpu_busy(used.get(g.uuid, 0), g.memory_gib) for g in healthy])
    return node_utilization(busy, whole_held, len(healthy))


def _place_containers(
    gpus: Sequence[Gpu],
    containers: Sequence[ContainerRequest],
    used: Mapping[str, int],
    most_capable: bool,
    policy: Policy,
) -> tuple[list[ContainerAssignment], dict[str, int], float, tuple[int, int, int]] | ContainerRequest:
    """Place the containers on the qualifying `gpus` one after another; the misfit container on failure."""
    now_used = dict(used)
    out: list[ContainerAssignment] = []
    topologies: list[float] = []
    capability = (0, 0, 0)
    for container in containers:
        share = container.share
        free = [g.memory_gib - now_used.get(g.uuid, 0) for g in gpus]
        if not fits(sorted(free, reverse=True), share, container.gpus):
            return container
        candidates = [g for g, room in zip(gpus, free, strict=True) if room >= share]
        picked = choose_gpus(candidates, container.gpus, share, now_used, policy, most_capable)
        assert picked is not None
        chosen, quality = picked
        for gpu in chosen:
            now_used[gpu.uuid] = now_used.get(gpu.uuid, 0) + share
            capability = max(capability, gpu.capability)
        if container.gpus > 1:
            topologies.append(quality)
        out.append(ContainerAssignment(container.name, container.gib, tuple(g.uuid for g in chosen)))
    topology = sum(topologies) / len(topologies) if topologies else 1.0
    return out, now_used, topology, capability


def needs(share: int, count: int) -> str:
    """What a container asks for, in failure messages."""
    return f"{share} GiB on each of {count} GPUs" if count > 1 else f"{share} GiB on one GPU"


def shortfall(share: int, count: int, most_free: int) -> str:
    """The reason a node with room in principle has too little free memory now."""
    return (
        f"not enough free GPU memory: needs {needs(share, count)}; "
        f"the most free on a qualifying GPU is {most_free} GiB"
    )


def too_few_gpus(healthy: int, wanted: int) -> str:
    """The reason a node can never take `wanted` whole GPUs."""
    return f"node has {healthy} healthy GPUs; the pod needs {wanted}"


def whole_misfits(req: GpuRequest, misfits: int, healthy: int) -> str:
    """The reason a node where `misfits` of the healthy GPUs miss the request's wishes cannot take whole GPUs.

    The kubelet, not the extender, picks whole GPUs; only a node where every GPU qualifies guarantees the
    pod the GPU it asked for.
    """
    if misfits == healthy:
        return f"no healthy GPU with {req.describe_constraints()}"
    return (
        f"node mixes GPUs; {misfits} of its healthy GPUs lack "
        f"{req.describe_constraints()} and the kubelet may pick any"
    )


def too_few_free(wanted: int, available: int) -> str:
    """The reason a node has too few free GPUs for `wanted` whole ones now."""
    return f"not enough free GPUs: needs {wanted}, {max(0, available)} free"


def static_shortfall(req: GpuRequest, what: str, biggest: int) -> str:
    """The reason a container needing `what` fits no qualifying GPU even idle; `biggest`: the largest
    qualifying healthy GPU's GiB, -1 if there is none."""
    if biggest < 0:
        wanted = req.describe_constraints()
        return f"no healthy GPU{' with ' + wanted if wanted else ''} (needs {what})"
    return f"needs {what}; the largest qualifying healthy GPU has {biggest} GiB"


def _mem_shortfall(
    gpus: Sequence[Gpu], used: Mapping[str, int], req: GpuRequest, container: ContainerRequest, static: bool
) -> str:
    what = needs(container.share, container.gpus)
    if not gpus or static:
        return static_shortfall(req, what, max((g.memory_gib for g in gpus), default=-1))
    most_free = max(g.memory_gib - used.get(g.uuid, 0) for g in gpus)
    return shortfall(container.share, container.gpus, most_free)


def _static_misfit(gpus: Sequence[Gpu], req: GpuRequest, policy: Policy) -> ContainerRequest | None:
    """The container that could not fit even on the idle node (preemption cannot help), if any."""
    if len(req.mem) == 1:
        container = req.mem[0]
        total = sorted((g.memory_gib for g in gpus), reverse=True)
        return None if fits(total, container.share, container.gpus) else container
    empty = _place_containers(gpus, req.mem, {}, req.most_capable, policy)
    return empty if isinstance(empty, ContainerRequest) else None


def _evaluate_mem(
    info: NodeInfo, used: Mapping[str, int], whole_held: int, req: GpuRequest, policy: Policy, now: float
) -> Verdict:
    if not info.sharing or info.passthrough:  # MIG strategy single: its devices are MIG devices
        return _fail(NOT_SHARING, True)
    gpus = qualifying(info, req)
    misfit = _static_misfit(gpus, req, policy)
    if misfit is not None:
        return _fail(_mem_shortfall(gpus, {}, req, misfit, static=True), True)
    lock = info.lock
    if lock is not None and lock.live(now) and lock.pod_uid != req.uid:
        return _fail(
            f"node busy: GPU-memory hand-off in progress for {lock.pod_key} "
            f"(lock expires in {max(0, int(lock.expires - now))}s)"
        )
    if whole_held:
        return _fail(
            f"node runs {whole_held} whole-GPU pod device(s) at GPUs unknown to the extender; "
            "memory sharing resumes when they end"
        )
    placed = _place_containers(gpus, req.mem, used, req.most_capable, policy)
    if isinstance(placed, ContainerRequest):
        return _fail(_mem_shortfall(gpus, used, req, placed, static=False))
    containers, now_used, topology, capability = placed
    return Verdict(Placement(tuple(containers), 0, utilization(info, now_used, 0), topology, capability))


def decide_mem(name: str, r: Record, plan: RequestPlan, now: float) -> Outcome | None:
    """`_evaluate_mem` (above), with `evaluate`'s check of the GPUs, decided on node `name`'s index record:
    the same steps, on the qualifying GPUs' free and total GiB largest first.

    None where only `evaluate` can tell, and says why: another pod's bind-lock that keeps the pod off (the
    reason names the holder), whole-GPU pods on the node (and how many), several containers that may not
    fit (which one does not). `FITS` where more than the GPU policy picks the cards: several GPUs on a
    node whose GPUs are not all NVLinked to each other, "most capable" among cards of different capability
    (`choose_gpus` weighs the links, or the capability first).
    """
    if not plan.single:
        return _surely_fits(name, r, plan, now)
    if r.code != SHARING:  # `evaluate`'s unreadable GPUs, then no memory sharing
        return plan.unresolvable(r.facts.shape.error if r.code == ERROR else NOT_SHARING)
    gpus = r if plan.every else plan.qualifying(r)
    share, count = plan.share, plan.count
    room = fits(gpus.free, share, count)  # free GiB never exceed the total: room now is no static misfit
    if not room and not fits(gpus.total, share, count):  # `_static_misfit`
        return plan.static_misfit(gpus.total[0] if gpus.total else -1)
    if r.lock_expires > now and plan.blocks(name, r.lock_uid, r.lock_expires, plan.uid, now):
        return None
    if r.whole:
        return None
    if not room:  # `_place_containers`
        return plan.shortfall(gpus.free[0])
    cap = gpus.cap
    if (count > 1 and not r.meshed) or (plan.most and cap is None):
        return FITS
    # Every set the policy could take is perfect: the policy's cards (`choose_gpus`), and the figures.
    chosen = policy_cards(gpus.pick, len(gpus.free), share, count, plan.binpack)
    utilization = node_utilization(busy_after(r.nums, r.sums, r.n, chosen, share), 0, r.n)
    if cap is None:  # cards of different capability: placement reports the best it took
        caps = r.facts.shape.caps
        cap = max(NO_CAPABILITY, *[caps[p] for p in chosen])
    return (utilization, 1.0, cap), "", False


def _surely_fits(name: str, r: Record, plan: RequestPlan, now: float) -> Outcome | None:
    """`decide_mem` for several containers: `FITS` where the qualifying GPUs include at least as many cards
    with room for the largest share as the containers take together, else None.

    `_place_containers` gives the containers GPUs one after another, each taking its count of cards among
    those with room for its share. With that many cards, every container finds enough that no earlier one
    has touched: the pod fits, whatever order the policy and the NVLink links choose, and it fits the idle
    node too (no static misfit). Every other node, with its reason, is `evaluate`'s.
    """
    if r.code != SHARING or r.whole:
        return None
    if not fits(plan.qualifying(r).free, plan.largest, plan.cards):
        return None
    if r.lock_expires > now and plan.blocks(name, r.lock_uid, r.lock_expires, plan.uid, now):
        return None
    return FITS


# A node whose nvidia.com/gpu devices the kubelet counts (time-slicing, MIG single): the extender lets it
# pass and scores it as idle; it has no view of those devices' use and records no GPU for the pod.
LEFT_TO_KUBELET = Placement((), 0, 0.0, 1.0, (0, 0, 0))
LEFT: Outcome = ((0.0, 1.0, (0, 0, 0)), "", False)  # its Outcome


def _evaluate_whole(
    info: NodeInfo, used: Mapping[str, int], whole_held: int, req: GpuRequest, policy: Policy
) -> Verdict:
    if info.passthrough:
        return Verdict(LEFT_TO_KUBELET)
    if info.sharing:
        return _fail(SHARES_MEMORY, True)
    healthy = info.healthy
    if len(healthy) < req.whole:
        return _fail(too_few_gpus(len(healthy), req.whole), True)
    if req.constrained:
        misfits = [g for g in healthy if not req.gpu_qualifies(g.tokens, g.cc)]
        if misfits:
            return _fail(whole_misfits(req, len(misfits), len(healthy)), True)
    free = [g for g in healthy if used.get(g.uuid, 0) == 0]
    available = len(free) - whole_held
    if available < req.whole:
        return _fail(too_few_free(req.whole, available))
    # Which GPUs the kubelet takes is its choice (steered NVLink-first by the device plugin), so the
    # topology figure is the best set among GPUs that carry no shares; exact only when none are held.
    picked = choose_gpus(free, req.whole, 0, used, policy, False) if req.whole > 1 else (free[:1], 1.0)
    topology = picked[1] if picked else 0.0
    capability = min(g.capability for g in free)
    return Verdict(
        Placement((), req.whole, utilization(info, used, whole_held + req.whole), topology, capability)
    )


def decide_whole(name: str, r: Record, plan: RequestPlan, now: float) -> Outcome | None:
    """`_evaluate_whole` (above), with `evaluate`'s check of the GPUs, decided on node `name`'s index
    record: the same steps, on the record's counts of healthy and idle GPUs. `FITS` for several GPUs on a
    node whose GPUs are not all NVLinked to each other (`choose_gpus` weighs the links for the topology
    figure)."""
    if r.code == PASS:
        return LEFT
    if r.code == ERROR:  # `evaluate`'s unreadable GPUs
        return plan.unresolvable(r.facts.shape.error)
    if r.code == SHARING:
        return plan.unresolvable(SHARES_MEMORY)
    healthy, wanted = r.n, plan.whole
    if healthy < wanted:
        return plan.unresolvable(too_few_gpus(healthy, wanted))
    if plan.constrained:
        misfits = healthy - len(plan.qualifying(r).total)
        if misfits:
            return plan.unresolvable(whole_misfits(plan.req, misfits, healthy))
    available = r.idle - r.whole
    if available < wanted:
        return plan.too_few_free(available)
    if wanted > 1 and not r.meshed:
        return FITS
    facts = r.facts
    capability = facts.idle_cap if facts.idle_cap is not None else NO_CAPABILITY
    return (node_utilization(facts.busy, r.whole + wanted, healthy), 1.0, capability), "", False


def evaluate(
    info: NodeInfo,
    used: Mapping[str, int],
    whole_held: int,
    req: GpuRequest,
    gpu_policy: Policy,
    now: float,
) -> Verdict:
    """Decide one node for one request, and where on it the request would go."""
    if req.kind == "none":
        return Verdict(Placement((), 0, utilization(info, used, whole_held), 1.0, (0, 0, 0)))
    if info.gpu_error and not info.passthrough:
        return _fail(info.gpu_error, True)
    if req.kind == "mem":
        return _evaluate_mem(info, used, whole_held, req, gpu_policy, now)
    return _evaluate_whole(info, used, whole_held, req, gpu_policy)


# RequestPlan.mode: every kind of the signature qualifies.
ALL = -1


class GpuView(Protocol):
    """The GPUs of a node that qualify for a request (`index.View`; a `Record` is the view of all of its
    healthy GPUs): free and total GiB largest first, the pick orders, the capability they share."""

    @property
    def free(self) -> tuple[int, ...]: ...
    @property
    def total(self) -> tuple[int, ...]: ...
    @property
    def pick(self) -> tuple[int, ...]: ...
    @property
    def cap(self) -> tuple[int, int, int] | None: ...


# Whether a node's bind-lock keeps a pod off it: (node, lock holder's UID, lock expiry, pod UID, now).
LockRule = Callable[[str, str, float, str, float], bool]


class RequestPlan:
    """One request as `decide_mem` and `decide_whole` ask it of every node's record: what does not depend
    on the node, worked out once per request, and per signature (which GPUs meet the wishes), reason and
    figure named in a reason, not per node."""

    __slots__ = (
        "_failed",
        "_free",
        "_id",
        "_short",
        "_sigs",
        "_static",
        "_unresolvable",
        "bare",
        "binpack",
        "blocks",
        "cards",
        "constrained",
        "count",
        "every",
        "exact",
        "key",
        "keys",
        "largest",
        "memory",
        "modes",
        "most",
        "multi",
        "policy",
        "req",
        "shape",
        "share",
        "single",
        "uid",
        "what",
        "whole",
    )

    def __init__(
        self,
        req: GpuRequest,
        policy: Policy,
        sigs: Signatures,
        shape_id: Callable[[Any], int],
        blocks: LockRule,
    ) -> None:
        self.req = req
        self.uid = req.uid
        self._sigs = sigs
        self._id = shape_id
        self.blocks = blocks
        self.constrained = req.constrained
        self.every = not self.constrained  # every healthy GPU qualifies
        self.memory = req.kind == "mem"
        self.single = len(req.mem) == 1
        first = req.mem[0] if req.mem else None
        self.share = first.share if first else 0
        self.count = first.gpus if first else 0
        self.largest = max((c.share for c in req.mem), default=0)
        self.cards = sum(c.gpus for c in req.mem)
        self.whole = req.whole
        self.most = req.most_capable
        self.multi = req.multi
        # Prioritize scores by the utilisation alone (one GPU, no "most capable"): its figures are that.
        self.bare = not self.multi and not self.most
        self.policy = policy
        self.binpack = policy is Policy.BINPACK
        self.what = needs(self.share, self.count)
        self.shape = (tuple((c.gib, c.gpus) for c in req.mem), req.whole, req.most_capable, policy)
        self.exact = shape_id((self.shape, req.models, req.min_cc))
        # Signature id -> ALL, 0 (no kind qualifies) or the bit mask of the kinds that do.
        self.modes: dict[int, int] = {}
        self.keys: dict[int, int] = {}  # signature id -> `key_for`
        # The memo key of every node, when it is one (a wish that leaves every GPU of every kind of node,
        # or none), else -1: `key_for` per node.
        self.key = self.exact
        if self.constrained:
            known = {self.key_for(sig) for sig in range(len(sigs.kinds))}
            self.key = known.pop() if len(known) == 1 else -1
        self._unresolvable: dict[str, Outcome] = {}
        self._failed: dict[str, Outcome] = {}
        self._short: dict[int, Outcome] = {}
        self._static: dict[int, Outcome] = {}
        self._free: dict[int, Outcome] = {}

    def mode(self, sig: int) -> int:
        """Which of the signature's kinds meet the request's model and capability constraints."""
        mode = self.modes.get(sig)
        if mode is None:
            kinds = self._sigs.kinds[sig]
            mode = 0
            if self.constrained:
                qualifies = self.req.gpu_qualifies
                for k, (tokens, cc) in enumerate(kinds):
                    if qualifies(tokens, cc):
                        mode |= 1 << k
            if not self.constrained or mode == (1 << len(kinds)) - 1:
                mode = ALL
            self.modes[sig] = mode
        return mode

    def qualifying(self, r: Record) -> GpuView:
        """`qualifying` on the record: the view of the node's healthy GPUs that meet the wishes."""
        if not self.constrained:
            return r
        mode = self.modes.get(r.sig)
        if mode is None:
            mode = self.mode(r.sig)
        return r if mode == ALL else r.facts.view_for(mode)

    def key_for(self, sig: int) -> int:
        """The int under which nodes of signature `sig` keep this request's outcome in their memo
        (`index.Record.memo`), shared by the requests whose outcome there is the same: the shape alone
        when the wishes leave every GPU (no reason names them then, except that a node has no GPU at all);
        for GPU memory, the shape and the GPUs they leave when that is some; otherwise the wishes too."""
        key = self.keys.get(sig)
        if key is None:
            mode = self.mode(sig)
            if not self.constrained:
                key = self.exact
            elif mode == ALL and (not self.memory or self._sigs.kinds[sig]):
                key = self._id((self.shape, ALL))
            elif self.memory and mode and mode != ALL:
                key = self._id((self.shape, mode))
            else:
                key = self.exact
            self.keys[sig] = key
        return key

    def unresolvable(self, reason: str) -> Outcome:
        """The outcome of a node that can never take the request, for this reason."""
        found = self._unresolvable.get(reason)
        if found is None:
            found = self._unresolvable[reason] = (None, reason, True)
        return found

    def failed(self, reason: str) -> Outcome:
        """The outcome of a node that cannot take the request now, for this reason."""
        found = self._failed.get(reason)
        if found is None:
            found = self._failed[reason] = (None, reason, False)
        return found

    def static_misfit(self, biggest: int) -> Outcome:
        """`static_shortfall` for the one container, kept by the figure it names."""
        found = self._static.get(biggest)
        if found is None:
            found = self._static[biggest] = self.unresolvable(static_shortfall(self.req, self.what, biggest))
        return found

    def shortfall(self, most_free: int) -> Outcome:
        """`shortfall` for the one container, kept by the figure it names."""
        found = self._short.get(most_free)
        if found is None:
            found = self._short[most_free] = self.failed(shortfall(self.share, self.count, most_free))
        return found

    def too_few_free(self, available: int) -> Outcome:
        """`too_few_free` for the whole GPUs asked, kept by the figure it names."""
        found = self._free.get(available)
        if found is None:
            found = self._free[available] = self.failed(too_few_free(self.whole, available))
        return found
