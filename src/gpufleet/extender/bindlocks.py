"""Reservations and bind-locks: what this process has decided or is binding, and which nodes' hand-offs
keep a pod off.

A reservation is this process's claim for one pod, keyed by its UID, authoritative over what the pod's
annotations say. It goes through three stages:

- ``decided``: filter chose the pod's node and GPUs (`gpufleet.extender.scheduling.choose`); the pods
  decided after it see the GiB taken at once, although the scheduler binds asynchronously. It lives until
  its bind begins, the pod is deleted or bound by someone else, or `decision_ttl` passes (the scheduler
  never called bind: the pod was preempted, another plugin refused it, the scheduler restarted);
- ``binding``: a bind of this process runs (it ends settled or released, never by time);
- ``settled``: the bind succeeded; it gives way when the watch shows the pod bound, or after
  `reservation_ttl` if the watch never does.

The table has a cap (`max_reservations`): at the cap new reservations are refused (`ReservationsFull`), and
filter says so, so a scheduler that filters without binding cannot grow it without bound.

A node's bind-lock (`gpufleet.io/bind-lock`, taken by some replica's bind and released by the device plugin)
keeps other pods off the node while it is live, unless binds wait for hand-offs about to finish (`blocks`).
The binds queued for one node in this process (decided or binding) and the measured time one hand-off
takes tell filter how long the next pod's bind would wait there (`expected_wait`). Call everything with
the state's lock held.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.extender.ledger import PodUsage
from gpufleet.extender.request import GpuRequest
from gpufleet.extender.watchcache import PodRecord

DECIDED, BINDING, SETTLED = "decided", "binding", "settled"
# A node's hand-off time until binds have measured one (seconds): about what the kubelet and the device
# plugin take to admit a pod once the watch shows it bound, with the extender's own API calls; on the high
# side, since a burst decides many pods before the first hand-off is measured (at 0.5 s, the first seconds
# of a 1,000-pod burst at load 15 queued binds 5 deep where hand-offs took 3.5 s, and 32 were refused).
HANDOFF_PRIOR = 1.0
# Weight of the newest measurement in the running estimate of a hand-off's time.
HANDOFF_ALPHA = 0.2
# Share of `bind_wait` a newly decided pod's bind may expect to spend queued for its node: the rest is
# margin for hand-offs slower than the estimate, so queued binds are not refused as "node busy".
QUEUE_SHARE = 0.5


class ReservationsFull(Exception):
    """The reservation table is at `max_reservations`."""


@dataclass(slots=True)
class Reservation:
    """A claim of this process for one pod (see the module docstring for its stages)."""

    usage: PodUsage
    created: float
    stage: str = BINDING
    # The pod's request as filter parsed it: its bind needs no read of the pod.
    request: GpuRequest | None = None
    # When it was made, in `BindLocks.serial` (a pod reserved after a list began may be missing from it).
    serial: int = 0

    @property
    def queued(self) -> bool:
        """Decided or binding: a bind of this process still has to go through the node."""
        return self.stage != SETTLED


class BindLocks:
    """This process's reservations, and the rule of when another pod's bind-lock keeps a pod off a node."""

    def __init__(
        self,
        lock_ttl: float,
        lock_wait: float,
        reservation_ttl: float,
        decision_ttl: float = 30.0,
        max_reservations: int = 10_000,
        bind_wait: float = 5.0,
    ) -> None:
        self.lock_ttl = lock_ttl
        # > 0: binds wait up to this long for a hand-off about to finish, so such a node is no obstacle
        # to filter and prioritize (see `blocks`).
        self.lock_wait = lock_wait
        self.reservation_ttl = reservation_ttl
        self.decision_ttl = decision_ttl
        self.max_reservations = max_reservations
        self.bind_wait = bind_wait
        self.reservations: dict[str, Reservation] = {}
        # Node -> how many of its reservations are decided or binding (kept with `reservations`).
        self.queued: dict[str, int] = {}
        # Running estimate of one hand-off's time on a node, from binds that queued behind another (the
        # first measurement replaces the prior).
        self.handoff_seconds = HANDOFF_PRIOR
        self.handoffs_measured = 0
        # Counts the reservations made; each carries its number (`Reservation.serial`).
        self.serial = 0

    def _count(self, reservation: Reservation, delta: int) -> None:
        if not reservation.queued:
            return
        node = reservation.usage.node
        left = self.queued.get(node, 0) + delta
        if left > 0:
            self.queued[node] = left
        else:
            self.queued.pop(node, None)

    def _put(self, reservation: Reservation) -> None:
        old = self.reservations.get(reservation.usage.uid)
        if old is not None:
            self._count(old, -1)
        self.reservations[reservation.usage.uid] = reservation
        self._count(reservation, 1)

    def _pop(self, uid: str) -> Reservation | None:
        reservation = self.reservations.pop(uid, None)
        if reservation is not None:
            self._count(reservation, -1)
        return reservation

    def get(self, uid: str) -> Reservation | None:
        """The pod's reservation, if this process holds one."""
        return self.reservations.get(uid)

    def claim(self, uid: str) -> PodUsage | None:
        """The pod's reserved claim, if this process holds one."""
        reservation = self.reservations.get(uid)
        return reservation.usage if reservation is not None else None

    def reserve(
        self, usage: PodUsage, now: float, stage: str = BINDING, request: GpuRequest | None = None
    ) -> None:
        """Hold `usage` for its pod (replacing what the pod held); `ReservationsFull` at the cap."""
        if usage.uid not in self.reservations and len(self.reservations) >= self.max_reservations:
            raise ReservationsFull(
                f"{len(self.reservations)} reservations held, the most max_reservations allows; retry"
            )
        old = self.reservations.get(usage.uid)
        if request is None and old is not None:
            request = old.request
        self.serial += 1
        self._put(Reservation(usage, now, stage, request, self.serial))

    def begin(self, uid: str, now: float) -> None:
        """The pod's bind starts on its reservation: it no longer expires by time."""
        reservation = self.reservations.get(uid)
        if reservation is not None and reservation.stage == DECIDED:
            reservation.stage = BINDING
            reservation.created = now

    def release(self, uid: str) -> bool:
        """Drop the pod's reservation; whether there was one."""
        return self._pop(uid) is not None

    def settle(self, uid: str, bound: bool, now: float) -> bool:
        """The pod's bind succeeded: keep its reservation only until the watch shows it bound (`bound`:
        it does already). Whether the reservation was dropped."""
        reservation = self.reservations.get(uid)
        if reservation is None:
            return False
        if bound:
            self._pop(uid)
            return True
        self._count(reservation, -1)
        reservation.stage = SETTLED
        reservation.created = now
        return False

    def seen_bound(self, uid: str) -> bool:
        """The watch shows the pod bound: a settled or decided reservation gives way to its annotations (a
        decided one: someone else bound the pod). Whether one was dropped."""
        reservation = self.reservations.get(uid)
        if reservation is not None and reservation.stage != BINDING:
            self._pop(uid)
            return True
        return False

    def expired(self, now: float) -> list[str]:
        """Drop settled reservations the watch never confirmed within `reservation_ttl`, and decided ones
        whose bind never began within `decision_ttl`; their UIDs."""
        ttl = {SETTLED: self.reservation_ttl, DECIDED: self.decision_ttl}
        dropped = [
            uid
            for uid, reservation in self.reservations.items()
            if reservation.stage in ttl and now - reservation.created > ttl[reservation.stage]
        ]
        for uid in dropped:
            self._pop(uid)
        return dropped

    def absent(self, listed: set[str], before: int) -> list[str]:
        """A complete pod list that began after reservation number `before` holds the pods `listed` (UIDs):
        drop the decided and settled reservations made by then whose pod it lacks (deleted while the watch
        was down or behind: no DELETED event came), and return their UIDs. A binding one stays: its bind
        fails on the missing pod and releases it."""
        dropped = [
            uid
            for uid, reservation in self.reservations.items()
            if reservation.stage != BINDING and reservation.serial <= before and uid not in listed
        ]
        for uid in dropped:
            self._pop(uid)
        return dropped

    def note_handoff(self, seconds: float) -> None:
        """A bind that queued behind another on its node held its turn `seconds`: one hand-off's time."""
        weight = HANDOFF_ALPHA if self.handoffs_measured else 1.0
        self.handoffs_measured += 1
        self.handoff_seconds += weight * (seconds - self.handoff_seconds)

    def ahead(self, node: str, uid: str, lock_uid: str, lock_expires: float, now: float) -> int:
        """How many hand-offs on `node` a new bind of pod `uid` would wait for: this process's decided and
        binding pods there, and a live bind-lock of a pod that is not one of them."""
        count = self.queued.get(node, 0)
        own = self.reservations.get(uid)
        if own is not None and own.queued and own.usage.node == node:
            count -= 1
        if lock_uid and lock_uid != uid and lock_expires > now:
            holder = self.reservations.get(lock_uid)
            if holder is None or not holder.queued:
                count += 1
        return count

    def busy(self, ahead: int) -> bool:
        """Whether a bind behind `ahead` hand-offs would likely wait longer than its share of `bind_wait`
        (with `lock_wait` 0 binds never wait for a hand-off: any is too many)."""
        if ahead <= 0:
            return False
        if self.lock_wait <= 0:
            return True
        return ahead * self.handoff_seconds > self.bind_wait * QUEUE_SHARE

    def blocks(
        self, node: str, lock_uid: str, lock_expires: float, uid: str, now: float, holder: PodRecord | None
    ) -> bool:
        """Whether the node's bind-lock (held by `lock_uid`, whose pod is `holder` as last watched) keeps
        pod `uid` off the node now.

        A live lock of another pod blocks, unless binds wait for locks (`lock_wait` > 0) and this one is
        about to go: its holder is bound to the node (the device plugin releases the lock when the
        kubelet admits the pod), its bind started less than `lock_wait` ago (it is still running), or it
        is this process's own bind, running or queued. A lock left by a bind that died, or by a pod the
        kubelet never admits, blocks until it expires. Real schedulers requeue a pod that no node accepts
        for a minute or more and do not wake it when a lock goes away, so a short wait inside bind beats
        a refusal by far.
        """
        if not lock_uid or lock_expires <= now or lock_uid == uid:
            return False
        if self.lock_wait <= 0:
            return True
        if holder is not None and holder.node_name == node and not holder.terminal:
            return False
        own = self.reservations.get(lock_uid)
        if own is not None and own.stage == BINDING:
            return False
        taken = lock_expires - self.lock_ttl
        return now - taken >= self.lock_wait
