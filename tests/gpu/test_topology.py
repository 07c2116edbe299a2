"""The connection matrix from NVLink state and NVML topology levels, without NVML."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from gpufleet.gpu import Gpu, NvLink
from gpufleet.gpu.cli import format_topology
from gpufleet.gpu.facts import fabric_symptoms
from gpufleet.gpu.topology import build, parse_matrix


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


# The layout of `nvidia-smi topo -m` from R535-R580 drivers as public captures show it (written here, not
# copied; the CPU lists are made up): a tab-led header, underlined with terminal escapes by some versions,
# GPU columns then NIC columns then "CPU Affinity", "NUMA Affinity" and "GPU NUMA ID" (an empty cell before
# its N/A); " X " on the diagonal; NIC rows; then the legends.
HGX_WITH_NICS = (
    "\t\x1b[4mGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV18\tNV18\tNV18\tPXB\tSYS\t0-47\t0\t\tN/A\n"
    "GPU1\tNV18\t X \tNV18\tNV18\tPXB\tSYS\t0-47\t0\t\tN/A\n"
    "GPU2\tNV18\tNV18\t X \tNV18\tSYS\tPXB\t48-95\t1\t\tN/A\n"
    "GPU3\tNV18\tNV18\tNV18\t X \tSYS\tPXB\t48-95\t1\t\tN/A\n"
    "NIC0\tPXB\tPXB\tSYS\tSYS\t X \tSYS\t\t\t\t\n"
    "NIC1\tSYS\tSYS\tPXB\tPXB\tSYS\t X \t\t\t\t\n"
    "\nLegend:\n\n  X    = Self\n  NV#  = Connection traversing a bonded set of # NVLinks\n"
    "\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n"
)
# Older drivers: no GPU NUMA ID column, no escapes; a pair joined by 4 direct NVLinks beside a PCIe-only GPU.
WORKSTATION = (
    "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tNV4\tNODE\t0-31,64-95\t0\n"
    "GPU1\tNV4\t X \tNODE\t0-31,64-95\t0\n"
    "GPU2\tNODE\tNODE\t X \t0-31,64-95\t0\n"
    "\nLegend:\n\n  X    = Self\n"
)


def test_parse_matrix_reads_gpu_columns_and_ignores_nics_affinity_and_escapes() -> None:
    topo = parse_matrix(HGX_WITH_NICS)
    assert topo.indices == [0, 1, 2, 3]
    assert all(topo.matrix[i][j] == ("X" if i == j else "NV18") for i in range(4) for j in range(4))
    assert topo.nvlink_peers(2) == {0: 18, 1: 18, 3: 18}


def test_parse_matrix_reads_direct_pairs_and_pcie_paths() -> None:
    topo = parse_matrix(WORKSTATION)
    assert topo.matrix == [["X", "NV4", "NODE"], ["NV4", "X", "NODE"], ["NODE", "NODE", "X"]]
    assert topo.nvlink_peers(0) == {1: 4} and topo.nvlink_peers(2) == {}
    # the same text laid out with spaces (as copied from a terminal) reads the same
    assert parse_matrix(WORKSTATION.replace("\t", "   ")).matrix == topo.matrix


def test_parse_matrix_reads_what_the_stand_in_nvidia_smi_prints() -> None:
    gpus = [_gpu(0, _to_gpu(1, 2)), _gpu(1, _to_gpu(0, 2)), _gpu(2)]
    built = build(gpus, _levels({frozenset((0, 2)): 50, frozenset((1, 2)): 20}))
    parsed = parse_matrix(format_topology(built, gpus))
    assert (parsed.indices, parsed.matrix, parsed.nvlinks) == (built.indices, built.matrix, built.nvlinks)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", "no GPU column"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-7\n", "GPU1's row is missing"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tNV2\tSYS\n", "does not say X"),
    ],
)
def test_parse_matrix_refuses_what_is_not_a_matrix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_matrix(text)
