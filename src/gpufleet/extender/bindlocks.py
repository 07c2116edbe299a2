"""Bind-locks and reservations: what this process's binds hold, and which nodes' hand-offs keep a pod off.

A reservation is the binder's claim while its bind runs, authoritative over what the pod's annotations say
until the watch shows the pod bound; a settled one the watch never confirms expires after
`reservation_ttl` (`expired`, run by the sweep). A node's bind-lock (`gpufleet.io/bind-lock`, taken by
some replica's bind and released by the device plugin) keeps other pods off the node while it is live,
unless binds wait for hand-offs about to finish (`blocks`). Call everything with the state's lock held.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufleet.extender.ledger import PodUsage
from gpufleet.extender.watchcache import PodRecord


@dataclass(slots=True)
class Reservation:
    """A claim by this process's binder; authoritative until the bind settles and the watch catches up."""

    usage: PodUsage
    created: float
    in_flight: bool = True


class BindLocks:
    """This process's reservations, and the rule of when another pod's bind-lock keeps a pod off a node."""

    def __init__(self, lock_ttl: float, lock_wait: float, reservation_ttl: float) -> None:
        self.lock_ttl = lock_ttl
        # > 0: binds wait up to this long for a hand-off about to finish, so such a node is no obstacle
        # to filter and prioritize (see `blocks`).
        self.lock_wait = lock_wait
        self.reservation_ttl = reservation_ttl
        self.reservations: dict[str, Reservation] = {}

    def claim(self, uid: str) -> PodUsage | None:
        """The pod's reserved claim, if this process holds one."""
        reservation = self.reservations.get(uid)
        return reservation.usage if reservation is not None else None

    def reserve(self, usage: PodUsage, now: float) -> None:
        """Hold `usage` for its pod (replacing what the pod held)."""
        self.reservations[usage.uid] = Reservation(usage, now)

    def release(self, uid: str) -> bool:
        """Drop the pod's reservation; whether there was one."""
        return self.reservations.pop(uid, None) is not None

    def settle(self, uid: str, bound: bool) -> bool:
        """The pod's bind succeeded: keep its reservation only until the watch shows it bound (`bound`:
        it does already). Whether the reservation was dropped."""
        reservation = self.reservations.get(uid)
        if reservation is None:
            return False
        reservation.in_flight = False
        if bound:
            del self.reservations[uid]
            return True
        return False

    def seen_bound(self, uid: str) -> None:
        """The watch shows the pod bound: a settled reservation gives way to its annotations."""
        reservation = self.reservations.get(uid)
        if reservation is not None and not reservation.in_flight:
            del self.reservations[uid]

    def expired(self, now: float) -> list[str]:
        """Drop settled reservations the watch never confirmed within `reservation_ttl`; their UIDs."""
        dropped = [
            uid
            for uid, reservation in self.reservations.items()
            if not reservation.in_flight and now - reservation.created > self.reservation_ttl
        ]
        for uid in dropped:
            del self.reservations[uid]
        return dropped

    def blocks(
        self, node: str, lock_uid: str, lock_expires: float, uid: str, now: float, holder: PodRecord | None
    ) -> bool:
        """Whether the node's bind-lock (held by `lock_uid`, whose pod is `holder` as last watched) keeps
        pod `uid` off the node now.

        A live lock of another pod blocks, unless binds wait for locks (`lock_wait` > 0) and this one is
        about to go: its holder is bound to the node (the device plugin releases the lock when the
        kubelet admits the pod) or its bind started less than `lock_wait` ago (it is still running). A
        lock left by a bind that died, or by a pod the kubelet never admits, blocks until it expires.
        Real schedulers requeue a pod that no node accepts for a minute or more and do not wake it when
        a lock goes away, so a short wait inside bind beats a refusal by far.
        """
        if not lock_uid or lock_expires <= now or lock_uid == uid:
            return False
        if self.lock_wait <= 0:
            return True
        if holder is not None and holder.node_name == node and not holder.terminal:
            return False
        taken = lock_expires - self.lock_ttl
        return now - taken >= self.lock_wait
