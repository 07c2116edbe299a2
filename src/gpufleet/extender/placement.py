"""Per-node decisions, free of I/O and locks: does a request fit this node, and on which GPUs.

A node is seen through three facts: its published GPUs (`NodeInfo`), GiB in use per GPU uuid, and the
number of whole GPUs held by pods whose devices the kubelet chose (their positions are unknown to us).
Every function here is deterministic so filter, prioritize and bind agree given the same inputs. The rules
themselves (fit, card pick, utilisation) are `gpufleet.extender.rules`, which the fast path calls too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpufleet.extender.index import Signatures
from gpufleet.extender.model import Gpu, NodeInfo
from gpufleet.extender.request import ContainerRequest, GpuRequest, Policy
from gpufleet.extender.rules import card_key, fits, gpu_busy, link, node_utilization
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


def _mem_shortfall(
    gpus: Sequence[Gpu], used: Mapping[str, int], req: GpuRequest, container: ContainerRequest, static: bool
) -> str:
    what = needs(container.share, container.gpus)
    if not gpus:
        wanted = req.describe_constraints()
        return f"no healthy GPU{' with ' + wanted if wanted else ''} (needs {what})"
    if static:
        biggest = max(g.memory_gib for g in gpus)
        return f"needs {what}; the largest qualifying healthy GPU has {biggest} GiB"
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


# A node whose nvidia.com/gpu devices the kubelet counts (time-slicing, MIG single): the extender lets it
# pass and scores it as idle; it has no view of those devices' use and records no GPU for the pod.
LEFT_TO_KUBELET = Placement((), 0, 0.0, 1.0, (0, 0, 0))


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


class RequestPlan:
    """What one request needs per signature and per figure, worked out once per request, not per node."""

    __slots__ = (
        "_short",
        "_sigs",
        "_static",
        "constrained",
        "count",
        "messages",
        "modes",
        "req",
        "share",
        "what",
    )

    def __init__(self, req: GpuRequest, sigs: Signatures) -> None:
        self.req = req
        self._sigs = sigs
        self.constrained = req.constrained
        first = req.mem[0] if req.mem else None
        self.share = first.share if first else 0
        self.count = first.gpus if first else 0
        self.what = needs(self.share, self.count)
        # Signature id -> ALL, 0 (no kind qualifies) or the bit mask of the kinds that do.
        self.modes: dict[int, int] = {}
        self.messages: dict[Any, str] = {}
        self._short: dict[int, str] = {}
        self._static: dict[int, str] = {}

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

    def all_qualify(self) -> frozenset[int]:
        """The signatures (known so far) all of whose kinds qualify."""
        return frozenset(sig for sig in range(len(self._sigs.kinds)) if self.mode(sig) == ALL)

    def static_misfit(self, biggest: int) -> str:
        """placement._mem_shortfall(static=True) for a single container; `biggest` -1: no GPU qualifies."""
        reason = self._static.get(biggest)
        if reason is None:
            if biggest >= 0:
                reason = f"needs {self.what}; the largest qualifying healthy GPU has {biggest} GiB"
            else:
                wanted = self.req.describe_constraints()
                reason = f"no healthy GPU{' with ' + wanted if wanted else ''} (needs {self.what})"
            self._static[biggest] = reason
        return reason

    def shortfall(self, most_free: int) -> str:
        """placement.shortfall for the single container, memoised by the figure it names."""
        reason = self._short.get(most_free)
        if reason is None:
            reason = self._short[most_free] = shortfall(self.share, self.count, most_free)
        return reason
