"""Per-node facts filter and prioritize read, kept current on every cache change instead of per request.

Every change to a node or to its ledger rebuilds that node's `NodeFacts` (a few microseconds, on the
watch or bind thread), and `ClusterState.index` maps node name -> one `Record` (named slots). A request then
costs one dict lookup and a few comparisons per candidate node, whatever its constraints:

* a node's healthy GPUs fall into few *kinds* (model tokens, compute capability) and a node's kinds into
  a *signature* shared by many nodes; a request's model/capability constraint is decided once per
  signature (`placement.RequestPlan.mode`), not per node or GPU, so a request shape never seen before is
  no slower than a familiar one;
* a `View` holds what the decisions need of the GPUs that qualify: free and total GiB largest first (fit,
  static misfit, shortfall), and the GPUs in binpack and spread order (which card prioritize would pick).
  The view of all healthy GPUs and, on mixed nodes, the view of each kind are built with the facts; other
  subsets lazily, once per node version.

The rules themselves (fit, card pick, utilisation) are `gpufleet.extender.rules`, which `placement.evaluate`
calls too; this module keeps only what they read, ready per node. Whatever the index does not cover,
callers hand to `evaluate`; tests check over randomized histories that the index is fresh and that both
decide alike.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufleet.extender.model import NodeInfo
from gpufleet.extender.rules import card_key, gpu_busy, link

# Record codes: what kind of node it is.
ERROR = 0  # its GPUs cannot be read (NodeInfo.gpu_error): unresolvable for any GPU request
SHARING = 1  # shares GPU memory (gpufleet.io/gpu-sharing=memory)
WHOLE = 2  # offers whole GPUs only
PASS = 3  # its nvidia.com/gpu devices are the kubelet's to count (NodeInfo.passthrough): not GPU memory

Kind = tuple[frozenset[str], tuple[int, int]]


@dataclass(slots=True, eq=True)
class Record:
    """A node's index record: what filter and prioritize read of one node, rebuilt (`record`) whenever the
    node or its ledger changes. Plain slots: in the hot loops, at 5,000 nodes, reading a field costs what
    indexing a tuple does, and the fields have names."""

    code: int  # ERROR, SHARING, WHOLE or PASS
    sig: int  # signature id (Signatures): which kinds of GPU the node has
    lock_expires: float  # bind-lock expiry (0.0: no lock)
    lock_uid: str  # the lock holder's pod UID ("": none)
    whole: int  # whole GPUs held by pods at positions unknown to the extender
    idle: int  # healthy GPUs without any GiB in use
    n: int  # healthy GPUs
    facts: NodeFacts
    # Over all healthy GPUs (the view of every kind):
    pick: tuple[int, ...]  # View.pick
    nums: tuple[int, ...]  # NodeFacts.nums
    sums: array[float]  # NodeFacts.sums
    free: tuple[int, ...]  # free GiB, largest first
    total: tuple[int, ...]  # GiB per GPU, largest first
    meshed: bool  # every pair of healthy GPUs NVLinked: every multi-GPU set is perfect
    cap: tuple[int, int, int] | None  # View.cap
    # What requests came to on this node version, by request key (an int from ShapeIds, see
    # `placement.RequestPlan.key_for`): their outcomes on this record and `evaluate`'s. It dies with the
    # record, when the node or its ledger changes.
    memo: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)


class View:
    """The GPUs of one node that qualify for some requests: their free/total GiB and pick orders."""

    __slots__ = ("cap", "free", "pick", "total")

    def __init__(
        self,
        positions: tuple[int, ...],
        free_p: tuple[int, ...],
        shape: NodeShape,
    ) -> None:
        index = shape.index
        self.free = tuple(sorted((free_p[p] for p in positions), reverse=True))
        self.total = tuple(sorted((shape.mem[p] for p in positions), reverse=True))
        # The GPU policy's orders (`rules.card_key`; the share, the same for every card, leaves them
        # alone). One flat tuple of k free GiB ascending, the k positions in binpack order (the same) and
        # the k positions in spread order, so a pick (`rules.policy_cards`) touches one object.
        asc = sorted(positions, key=lambda p: card_key(free_p[p], index[p], True))
        desc = sorted(positions, key=lambda p: card_key(free_p[p], index[p], False))
        self.pick = (*(free_p[p] for p in asc), *asc, *desc)
        caps = {shape.caps[p] for p in positions}
        # The capability every card of the view shares ("most capable" then orders as the policy does),
        # as placement reports it for any set of them (the max with (0, 0, 0) it starts from).
        self.cap = max((0, 0, 0), caps.pop()) if len(caps) == 1 else None


class NodeShape:
    """What the decisions need of a NodeInfo alone (not its ledger); built once per node version."""

    __slots__ = (
        "caps",
        "code",
        "error",
        "full",
        "index",
        "kind_of",
        "kinds",
        "mem",
        "meshed",
        "n",
        "sig",
        "uuids",
    )

    def __init__(self, info: NodeInfo, sig: int) -> None:
        healthy = info.healthy
        self.code = (
            PASS if info.passthrough else ERROR if info.gpu_error else SHARING if info.sharing else WHOLE
        )
        self.error = info.gpu_error or ""
        self.sig = sig
        self.kinds: tuple[Kind, ...] = info.kinds
        self.full = (1 << len(info.kinds)) - 1
        where = {kind: i for i, kind in enumerate(info.kinds)}
        self.kind_of = tuple(where[(g.tokens, g.cc)] for g in healthy)
        self.uuids = tuple(g.uuid for g in healthy)
        self.mem = tuple(g.memory_gib for g in healthy)
        self.index = tuple(g.index for g in healthy)
        self.caps = tuple(g.capability for g in healthy)
        self.n = len(healthy)
        # Every pair NVLinked (NVSwitch): every multi-GPU set is perfect, so `choose_gpus` takes the first
        # cards in policy order.
        self.meshed = all(link(a, b) == 1.0 for i, a in enumerate(healthy) for b in healthy[i + 1 :])

    def positions(self, mask: int) -> tuple[int, ...]:
        """Positions (in `info.healthy`) of the GPUs whose kind is in `mask`."""
        kind_of = self.kind_of
        return tuple(p for p in range(self.n) if mask >> kind_of[p] & 1)


class NodeFacts:
    """One node version with its ledger: free GiB and utilisation terms per healthy GPU, and views.

    `nums` is (GiB used per healthy GPU..., GiB per healthy GPU...) and `sums` (`rules.gpu_busy` per
    healthy GPU..., what sum() has added up before each term...), flat so that the utilisation after a
    placement touches two objects: sum(sums[p + 1 : n], sums[n + p] + x) is exactly the sum of the terms
    with term p replaced by x.
    """

    __slots__ = (
        "busy",
        "free_p",
        "idle",
        "idle_cap",
        "n",
        "nums",
        "shape",
        "sums",
        "view",
        "views",
    )

    def __init__(self, shape: NodeShape, used: Mapping[str, int]) -> None:
        self.shape = shape
        mem = shape.mem
        self.n = n = shape.n
        used_p = tuple(used.get(u, 0) for u in shape.uuids)
        self.nums = used_p + mem
        self.free_p = free_p = tuple(m - u for m, u in zip(mem, used_p, strict=True))
        terms = tuple(gpu_busy(u, m) for m, u in zip(mem, used_p, strict=True))
        prefix: list[float] = [0]
        for term in terms:
            prefix.append(prefix[-1] + term)
        self.sums = array("d", terms + tuple(prefix))
        self.busy = sum(terms)
        idle = [p for p in range(n) if used_p[p] == 0]
        self.idle = len(idle)
        self.idle_cap = min((shape.caps[p] for p in idle), default=None)
        self.view = View(tuple(range(n)), free_p, shape)
        self.views: dict[int, View] = {shape.full: self.view}
        if len(shape.kinds) > 1:
            for k in range(len(shape.kinds)):
                self.views[1 << k] = View(shape.positions(1 << k), free_p, shape)

    def view_for(self, mask: int) -> View:
        """The view of the GPUs whose kind is in `mask` (built on first use for this version)."""
        view = self.views.get(mask)
        if view is None:
            view = self.views[mask] = View(self.shape.positions(mask), self.free_p, self.shape)
        return view


class Signatures:
    """Interns each distinct tuple of GPU kinds as a small integer (cluster-wide, grows with variety)."""

    def __init__(self) -> None:
        self.ids: dict[tuple[Kind, ...], int] = {}
        self.kinds: list[tuple[Kind, ...]] = []

    def id(self, kinds: tuple[Kind, ...]) -> int:
        """The signature's id."""
        sig = self.ids.get(kinds)
        if sig is None:
            sig = self.ids[kinds] = len(self.kinds)
            self.kinds.append(kinds)
        return sig


class ShapeIds:
    """Request shapes (and constraint modes) as small ints, so a record's memo finds an outcome by an int,
    not by hashing nested tuples per node. One per ClusterState. Ids are never reused: forgetting the table
    (at 4,096 shapes) only costs cache misses."""

    __slots__ = ("_ids", "_next")

    def __init__(self) -> None:
        self._ids: dict[Any, int] = {}
        self._next = 0

    def id(self, shape: Any) -> int:
        """The shape's id."""
        found = self._ids.get(shape)
        if found is None:
            if len(self._ids) >= 4096:
                self._ids.clear()
            found = self._ids[shape] = self._next
            self._next += 1
        return found


def record(shape: NodeShape, facts: NodeFacts, lock_expires: float, lock_uid: str, whole: int) -> Record:
    """A node's index record."""
    view = facts.view
    free, total = view.free, view.total
    return Record(
        code=shape.code,
        sig=shape.sig,
        lock_expires=lock_expires,
        lock_uid=lock_uid,
        whole=whole,
        idle=facts.idle,
        n=shape.n,
        facts=facts,
        pick=view.pick,
        nums=facts.nums,
        sums=facts.sums,
        free=free,
        total=total,
        meshed=shape.meshed,
        cap=view.cap,
    )
