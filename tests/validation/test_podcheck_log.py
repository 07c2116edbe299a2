"""What a validation pod printed, read back: its GPUs, device nodes and the GPU part of ``nvidia-smi topo -m``
(gpu_facts' reader: terminal escapes and NIC columns of current drivers do not hide a pair)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "validation"))

from podcheck import PodRun

UUID_A, UUID_B = "GPU-1b2c3d4e-0000-4000-8000-000000000001", "GPU-1b2c3d4e-0000-4000-8000-000000000002"
LOG = (
    "== gpus\n"
    f"GPU 2: NVIDIA A100-SXM4-80GB (UUID: {UUID_A})\n"
    f"GPU 5: NVIDIA A100-SXM4-80GB (UUID: {UUID_B})\n"
    "== rc 0\n== devices\nnvidia2\nnvidia5\n"
    "== topo\n"
    "\t\x1b[4mGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
    "GPU0\t X \tNV12\tPXB\t0-31\t0\t\tN/A\n"
    "GPU1\tNV12\t X \tSYS\t32-63\t1\t\tN/A\n"
    "NIC0\tPXB\tSYS\t X \t\t\t\t\n\nLegend:\n\n  X    = Self\n"
    "== end\n"
)


def _run(log: str) -> PodRun:
    return PodRun(name="pair", node="dgx-a100", phase="Succeeded", pod={}, log=log).parse()


def test_gpus_devices_and_the_pair_link_are_read() -> None:
    run = _run(LOG)
    assert [(index, uuid) for index, _model, uuid in run.gpus] == [(2, UUID_A), (5, UUID_B)]
    assert run.devices == ["nvidia2", "nvidia5"]
    assert run.topology == {"GPU0": {"GPU0": "X", "GPU1": "NV12"}, "GPU1": {"GPU0": "NV12", "GPU1": "X"}}


def test_an_unreadable_matrix_leaves_no_topology_to_claim_a_link() -> None:
    run = _run(LOG.replace("GPU1\tNV12\t X ", "GPU1\tNV12\tSYS"))
    assert run.topology == {} and len(run.gpus) == 2
