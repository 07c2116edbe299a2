"""How each pair of GPUs is connected, in the vocabulary of `nvidia-smi topo -m`.

NV<n>: n NVLinks join the pair, directly or through the NVSwitch fabric (where every GPU pair on the
fabric can use all of a GPU's switch links, hence NV12 between any two GPUs of a DGX A100). Otherwise
the closest common PCIe ancestor, from NVML: PIX (one bridge), PXB (several bridges), PHB (a host bridge),
NODE (host bridges within a NUMA node), SYS (across NUMA nodes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .device import REMOTE_GPU, REMOTE_NVSWITCH, Gpu

# nvmlGpuTopologyLevel_t → label. INTERNAL (0) between two different GPUs means one board carries
# both (K80 style) behind its own bridge, which nvidia-smi shows as a single-bridge hop.
LEVEL_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
SELF = "X"
UNKNOWN = "N/A"


@dataclass
class Topology:
    """Connection matrix between GPUs; rows and columns follow `indices` (GPU indices)."""

    indices: list[int]
    matrix: list[list[str]]  # "X", "NV12", "PIX", ..., "N/A"
    nvlinks: list[list[int]]  # usable NVLinks between each pair, 0 when none

    def connection(self, a: int, b: int) -> str:
        """The label between GPU indices `a` and `b`."""
        return self.matrix[self.indices.index(a)][self.indices.index(b)]

    def nvlink_peers(self, index: int) -> dict[int, int]:
        """{peer GPU index: NVLinks} for GPU `index`, only peers reachable over NVLink."""
        row = self.nvlinks[self.indices.index(index)]
        # zip(strict=) would need Python 3.10; targets running this as module_utils may be older.
        return {self.indices[pos]: n for pos, n in enumerate(row) if n and self.indices[pos] != index}


def nvlink_counts(gpus: list[Gpu]) -> list[list[int]]:
    """Usable NVLinks between each pair of `gpus` (positions as in the list), from active links only."""
    size = len(gpus)
    position = {gpu.pci_bus_id: pos for pos, gpu in enumerate(gpus)}
    counts = [[0] * size for _row in range(size)]
    switch_links = [0] * size
    for i, gpu in enumerate(gpus):
        for link in gpu.active_nvlinks:
            if link.remote == REMOTE_NVSWITCH:
                switch_links[i] += 1
            elif link.remote == REMOTE_GPU and link.remote_bus_id in position:
                counts[i][position[link.remote_bus_id]] += 1
    for i in range(size):
        for j in range(size):
            # Through switches a pair gets the bandwidth of the less-connected GPU of the two.
            if i != j and not counts[i][j] and switch_links[i] and switch_links[j]:
                counts[i][j] = min(switch_links[i], switch_links[j])
    return counts


def build(gpus: list[Gpu], level: Callable[[int, int], int | None]) -> Topology:
    """The matrix for `gpus`; `level(a, b)` gives the nvmlGpuTopologyLevel_t of two GPU indices."""
    counts = nvlink_counts(gpus)
    size = len(gpus)
    matrix = [[SELF] * size for _row in range(size)]
    for i in range(size):
        for j in range(i + 1, size):
            if counts[i][j]:
                label = f"NV{counts[i][j]}"
            else:
                found = level(gpus[i].index, gpus[j].index)
                label = UNKNOWN if found is None else LEVEL_LABELS.get(found, UNKNOWN)
            # Common ancestors are symmetric; NVLink counts are too once both ends are up.
            matrix[i][j] = matrix[j][i] = label
    return Topology(indices=[gpu.index for gpu in gpus], matrix=matrix, nvlinks=counts)
