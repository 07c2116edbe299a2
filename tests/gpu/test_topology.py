"""The connection matrix from NVLink state and NVML topology levels, without NVML."""

from __future__ import annotations

from collections.abc import Callable

from gpufleet.gpu import Gpu, NvLink
from gpufleet.gpu.facts import fabric_symptoms
from gpufleet.gpu.topology import build


def _gpu(index: int, links: list[NvLink] | None = None) -> Gpu:
    bus_id = f"0000:{index + 1:02x}:00.0"
    return Gpu(index=index, pci_bus_id=bus_id, model="m", device_id=0, nvlinks=links or [])


def _to_gpu(peer: int, count: int, start: int = 0) -> list[NvLink]:
    return [NvLink(start + n, True, "gpu", f"0000:{peer + 1:02x}:00.0") for n in range(count)]


def _to_switch(count: int, active: bool = True) -> list[NvLink]:
    return [NvLink(n, active, "nvswitch", f"0000:c{n % 6 + 4:x}:00.0") for n in range(count)]


def _levels(table: dict[frozenset[int], int]) -> Callable[[int, int], int | None]:
    return lambda a, b: table.get(frozenset((a, b)))


def test_direct_nvlinks_count_per_pair_and_pcie_elsewhere() -> None:
    gpus = [_gpu(0, _to_gpu(1, 4)), _gpu(1, _to_gpu(0, 4)), _gpu(2)]
    topo = build(gpus, _levels({frozenset((0, 1)): 10, frozenset((0, 2)): 40, frozenset((1, 2)): 50}))
    assert topo.matrix == [["X", "NV4", "NODE"], ["NV4", "X", "SYS"], ["NODE", "SYS", "X"]]
    assert topo.nvlink_peers(0) == {1: 4}
    assert topo.nvlink_peers(2) == {}
    assert topo.connection(2, 1) == "SYS"


def test_every_pair_on_the_switch_fabric_gets_the_links_per_gpu() -> None:
    gpus = [_gpu(i, _to_switch(12)) for i in range(4)]
    topo = build(gpus, _levels({}))
    assert all(topo.matrix[i][j] == ("X" if i == j else "NV12") for i in range(4) for j in range(4))
    assert topo.nvlink_peers(3) == {0: 12, 1: 12, 2: 12}


def test_inactive_switch_links_fall_back_to_pcie_and_show_as_fabric_symptoms() -> None:
    gpus = [_gpu(0, _to_switch(12, active=False)), _gpu(1, _to_switch(12, active=False))]
    topo = build(gpus, _levels({frozenset((0, 1)): 20}))
    assert topo.matrix[0][1] == "PXB"
    assert fabric_symptoms(gpus, nvswitch_count=6) == [
        "GPU 0: 12 of 12 NVLinks to NVSwitches inactive",
        "GPU 1: 12 of 12 NVLinks to NVSwitches inactive",
    ]
    assert fabric_symptoms(gpus, nvswitch_count=0) == []


def test_unknown_level_shows_na_and_internal_between_two_gpus_is_one_bridge() -> None:
    topo = build([_gpu(0), _gpu(1), _gpu(2)], _levels({frozenset((0, 1)): 0, frozenset((1, 2)): 30}))
    assert topo.matrix[0][1] == "PIX"
    assert topo.matrix[1][2] == "PHB"
    assert topo.matrix[0][2] == "N/A"
