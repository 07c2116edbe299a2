"""Preferred allocation on synthetic topologies: NVLink first, then PCIe switch, then NUMA; replicas and
memory units; the greedy search on large nodes; impossible requests."""

from __future__ import annotations

import pytest
from dp_helpers import make_inventory

from gpufleet.deviceplugin.rm.devices import ResourceKind, ResourceSpec, build_devices, device_ids
from gpufleet.deviceplugin.rm.preferred import PreferenceError, choose_gpus, preferred_allocation

GPU = ResourceSpec("nvidia.com/gpu", ResourceKind.GPU)


def idx(inv, uuids):  # type: ignore[no-untyped-def]
    order = [g.uuid for g in inv.gpus]
    return sorted(order.index(u) for u in uuids)


def test_nvlink_beats_pcie_switch_and_numa() -> None:
    # 0-1 share a switch, but 0-3 have four NVLinks between them.
    inv = make_inventory(4, nvlink_pairs=[(0, 3, 4)])
    u = [g.uuid for g in inv.gpus]
    assert idx(inv, choose_gpus(inv, u, [u[0]], 2)) == [0, 3]


def test_more_nvlinks_win() -> None:
    inv = make_inventory(4, nvlink_pairs=[(0, 1, 2), (2, 3, 6)])
    u = [g.uuid for g in inv.gpus]
    assert idx(inv, choose_gpus(inv, u, [], 2)) == [2, 3]


def test_pcie_switch_then_numa() -> None:
    inv = make_inventory(8)  # pairs (0,1),(2,3)... per switch; 0-3 NUMA 0, 4-7 NUMA 1
    u = [g.uuid for g in inv.gpus]
    assert idx(inv, choose_gpus(inv, [u[0], u[2], u[5], u[6]], [], 2)) == [0, 2]
    assert idx(inv, choose_gpus(inv, [u[0], u[4], u[5]], [], 2)) == [4, 5]


def test_greedy_search_on_a_large_node_stays_local() -> None:
    inv = make_inventory(40)  # NUMA 0 = GPUs 0-19, NUMA 1 = 20-39
    u = [g.uuid for g in inv.gpus]
    chosen = idx(inv, choose_gpus(inv, u[5:], [], 10))  # 35 choose 10: the greedy path
    assert len({i // 20 for i in chosen}) == 1  # one NUMA node
    assert all(i ^ 1 in chosen for i in chosen)  # whole switch pairs only
    assert 5 not in chosen  # the GPU whose partner is gone is not worth a pair


def test_replicas_spread_over_distinct_gpus_first() -> None:
    inv = make_inventory(4, nvlink_pairs=[(1, 2, 4)])
    spec = ResourceSpec("nvidia.com/gpu", ResourceKind.REPLICA, replicas=2)
    avail = [d for g in inv.gpus for d in device_ids(spec, g)]
    chosen = preferred_allocation(spec, inv, avail, [], 2)
    assert sorted(c.split("::")[0] for c in chosen) == [inv.gpus[1].uuid, inv.gpus[2].uuid]
    # More replicas than GPUs: every GPU once, then doubling up.
    chosen = preferred_allocation(spec, inv, avail, [], 6)
    assert len(set(chosen)) == 6 and len({c.split("::")[0] for c in chosen}) == 4


def test_replica_must_include_is_kept() -> None:
    inv = make_inventory(2)
    spec = ResourceSpec("nvidia.com/gpu", ResourceKind.REPLICA, replicas=3)
    avail = [d for g in inv.gpus for d in device_ids(spec, g)]
    chosen = preferred_allocation(spec, inv, avail, [f"{inv.gpus[1].uuid}::2"], 2)
    assert chosen[0] == f"{inv.gpus[1].uuid}::2" and chosen[1].startswith(inv.gpus[0].uuid)


def test_memory_units_come_from_as_few_gpus_as_possible() -> None:
    inv = make_inventory(2, memory_gib=4)
    spec = ResourceSpec("gpufleet.io/gpu-mem", ResourceKind.MEMORY)
    devices = build_devices(spec, inv, {})
    assert len(devices) == 8
    avail = [d.id for d in devices if not d.id.startswith(inv.gpus[0].uuid) or d.id.endswith("::0")]
    chosen = preferred_allocation(spec, inv, avail, [], 3)
    assert {c.split("::")[0] for c in chosen} == {inv.gpus[1].uuid}  # the emptier GPU, alone


@pytest.mark.parametrize(
    ("size", "must", "message"),
    [
        (0, [], "must be positive"),
        (5, [], "exceeds the 4 available"),
        (1, ["GPU-other"], "must-include devices are not available"),
        (1, ["{0}", "{1}"], "exceed allocation size 1"),
    ],
)
def test_impossible_requests(size: int, must: list[str], message: str) -> None:
    inv = make_inventory(4)
    u = [g.uuid for g in inv.gpus]
    with pytest.raises(PreferenceError, match=message):
        preferred_allocation(GPU, inv, u, [m.format(*u) for m in must], size)


def test_must_include_id_that_names_no_gpu_is_refused_not_dropped() -> None:
    """Found by tests/fuzz: a replica-style ID offered and required in whole-GPU mode was silently dropped,
    and the answer (the plain UUID) was neither the required device nor one the kubelet offered."""
    inv = make_inventory(2)
    odd = inv.gpus[0].uuid + "::9"
    with pytest.raises(PreferenceError, match="not GPUs of this node: " + odd):
        preferred_allocation(GPU, inv, [odd, inv.gpus[0].uuid], [odd], 1)


def test_unknown_available_ids_are_never_chosen() -> None:
    inv = make_inventory(2)
    u = [g.uuid for g in inv.gpus]
    assert preferred_allocation(GPU, inv, ["GPU-stale", *u], [], 2) == u
