"""The per-GPU health state machine, including recovery."""

from __future__ import annotations

from gpufleet.deviceplugin.rm.health import DEFAULT_IGNORED_XIDS, HealthTracker
from gpufleet.deviceplugin.rm.model import HealthEvent, HealthEventKind, Probe

A, B = "GPU-a", "GPU-b"
OK = Probe(True)
LOST = Probe(False, "GPU is lost")


def xid(code: int, uuid: str | None = A) -> HealthEvent:
    return HealthEvent(HealthEventKind.XID, uuid, code)


def test_default_ignored_xids_are_the_application_ones() -> None:
    assert frozenset({13, 31, 43, 45, 68, 109}) == DEFAULT_IGNORED_XIDS


def test_ignored_xid_changes_nothing() -> None:
    t = HealthTracker([A, B])
    for code in DEFAULT_IGNORED_XIDS:
        assert t.on_event(xid(code)) == []
    assert t.get(A).healthy


def test_critical_xid_marks_only_that_gpu_unhealthy_with_the_reason() -> None:
    t = HealthTracker([A, B])
    [change] = t.on_event(xid(48))
    assert change.uuid == A and not change.after.healthy and "XID 48" in change.after.reason
    assert t.get(B).healthy


def test_ignored_xids_are_configurable() -> None:
    t = HealthTracker([A], ignored_xids={48})
    assert t.on_event(xid(48)) == []
    assert t.on_event(xid(13))
    assert not t.get(A).healthy


def test_double_bit_ecc_marks_unhealthy() -> None:
    t = HealthTracker([A])
    t.on_event(HealthEvent(HealthEventKind.ECC_DBE, A, 1))
    assert t.get(A).reason == "double-bit ECC error"


def test_event_without_uuid_applies_to_every_gpu() -> None:
    t = HealthTracker([A, B])
    assert len(t.on_event(xid(79, None))) == 2


def test_xid_is_not_cleared_by_a_gpu_that_keeps_answering() -> None:
    t = HealthTracker([A])
    t.on_event(xid(48))
    for _ in range(3):
        assert t.on_probe(A, OK) == []
    assert not t.get(A).healthy


def test_lost_gpu_recovers_when_nvml_serves_it_again() -> None:
    t = HealthTracker([A])
    t.on_probe(A, LOST)
    assert not t.get(A).healthy and "lost" in t.get(A).reason
    [change] = t.on_probe(A, OK)
    assert change.after.healthy and t.get(A).healthy


def test_xid_then_reset_cycle_recovers() -> None:
    t = HealthTracker([A])
    t.on_event(xid(79))
    t.on_probe(A, LOST)
    t.on_probe(A, OK)
    assert t.get(A).healthy


def test_xid_reported_while_lost_does_not_block_recovery() -> None:
    t = HealthTracker([A])
    t.on_probe(A, LOST)
    t.on_event(xid(79))  # the event log can deliver the XID after the probe saw the GPU gone
    t.on_probe(A, OK)
    assert t.get(A).healthy


def test_new_xid_after_recovery_needs_a_new_reset() -> None:
    t = HealthTracker([A])
    t.on_probe(A, LOST)
    t.on_probe(A, OK)
    t.on_event(xid(94))
    t.on_probe(A, OK)
    assert not t.get(A).healthy and "XID 94" in t.get(A).reason


def test_lost_event_counts_as_unreachable() -> None:
    t = HealthTracker([A])
    t.on_event(HealthEvent(HealthEventKind.LOST, A, 15, "GPU is lost"))
    t.on_probe(A, OK)
    assert t.get(A).healthy


def test_gpu_already_unreachable_is_not_announced_again() -> None:
    # Seen against the real kubelet: a lost GPU is reported by the probe and by NVML's lost event in
    # different words; each wording used to count as a new transition (and a new list to the kubelet).
    t = HealthTracker([A])
    t.on_event(xid(79))
    [change] = t.on_probe(A, LOST)
    assert change.after.reason == "GPU is lost" and change.after.unreachable_seen
    assert t.on_event(HealthEvent(HealthEventKind.LOST, A, 15, "GPU lost")) == []
    assert t.on_probe(A, Probe(False, "GPU 0: GPU is lost")) == []
    assert t.get(A).reason == "GPU is lost"
    [change] = t.on_probe(A, OK)
    assert change.after.healthy


def test_unknown_gpu_is_ignored() -> None:
    t = HealthTracker([A])
    assert t.on_event(xid(79, "GPU-other")) == []
    assert t.on_probe("GPU-other", LOST) == []
