"""How each pair of GPUs is connected, in the vocabulary of `nvidia-smi topo -m`.

NV<n>: n NVLinks join the pair, directly or through the NVSwitch fabric (where every GPU pair on the
fabric can use all of a GPU's switch links, hence NV12 between any two GPUs of a DGX A100). Otherwise
the closest common PCIe ancestor, from NVML: PIX (one bridge), PXB (several bridges), PHB (a host bridge),
NODE (host bridges within a NUMA node), SYS (across NUMA nodes).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

from .device import REMOTE_GPU, REMOTE_NVSWITCH, Gpu

# nvmlGpuTopologyLevel_t → label. INTERNAL (0) between two different GPUs means one board carries
# both (K80 style) behind its own bridge, which nvidia-smi shows as a single-bridge hop.
LEVEL_LABELS = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
SELF = "X"
UNKNOWN = "N/A"
SMI_TIMEOUT_S = 60
# nvidia-smi underlines the matrix header with terminal escapes (seen in captures of R535-R580 output).
_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_GPU_LABEL = re.compile(r"^GPU(\d+)$")
_NVLINKS = re.compile(r"^NV(\d+)$")


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


def parse_matrix(text: str) -> Topology:
    """The GPU part of `nvidia-smi topo -m` output.

    The header names the columns (GPU0.. first, then NIC0.. and the affinity columns, which are ignored);
    each GPU row starts with its label. Cells hold no spaces, so tabs or runs of spaces both separate them.
    NVLink counts come from the NV<n> labels. Raises ValueError for output that is not such a matrix.
    """
    labels: list[int] | None = None
    rows: dict[int, list[str]] = {}
    for line in _ESCAPE.sub("", text).splitlines():
        words = line.split()
        if words[:1] == ["Legend:"]:
            break
        if labels is None:
            found = [_GPU_LABEL.match(word) for word in words]
            if any(found):
                labels = [int(m.group(1)) for m in found if m]
            continue
        head = _GPU_LABEL.match(words[0]) if words else None
        if head:
            rows[int(head.group(1))] = words[1 : 1 + len(labels)]
    if not labels:
        raise ValueError("no GPU column header (GPU0 ...) in the nvidia-smi topo -m output")
    matrix: list[list[str]] = []
    for pos, index in enumerate(labels):
        row = rows.get(index)
        if row is None or len(row) < len(labels):
            raise ValueError(f"GPU{index}'s row is missing or short in the nvidia-smi topo -m output")
        if row[pos] != SELF:
            raise ValueError(f"GPU{index}'s row does not say X for the GPU itself: {row}")
        matrix.append(row)
    nvlinks = [[int(m.group(1)) if (m := _NVLINKS.match(cell)) else 0 for cell in row] for row in matrix]
    return Topology(indices=labels, matrix=matrix, nvlinks=nvlinks)


def from_nvidia_smi() -> Topology:
    """The matrix `nvidia-smi topo -m` (from PATH) prints: for hosts whose Python lacks pynvml.

    Raises ValueError with the reason when nvidia-smi is missing, fails or prints no matrix.
    """
    smi = shutil.which("nvidia-smi")
    if smi is None:
        raise ValueError("nvidia-smi is not on PATH")
    try:
        run = subprocess.run(
            [smi, "topo", "-m"], capture_output=True, text=True, timeout=SMI_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"{smi} topo -m: {exc}") from exc
    if run.returncode != 0:
        said = (run.stdout + run.stderr).strip().splitlines()
        raise ValueError(f"{smi} topo -m exited {run.returncode}: {said[-1] if said else 'no output'}")
    return parse_matrix(run.stdout)
