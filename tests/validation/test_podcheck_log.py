"""What a validation pod printed, read back: its GPUs, device nodes and the GPU part of ``nvidia-smi topo -m``
(gpu_facts' reader: terminal escapes and NIC columns of current drivers do not hide a pair), and a MIG
pod's MIG devices and their memory."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from gpufleet_harness.sim.machine import sim_env
from gpufleet_harness.sim.miglayout import make_layout

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


def test_a_mig_pods_device_and_memory_are_read_from_the_stand_in_smi(
    fresh_root: Callable[[str], Path],
) -> None:
    """The stand-in nvidia-smi given a MIG UUID (the lab image passes the container's NVIDIA_VISIBLE_DEVICES
    as -i): `-L` shows the parent GPU with that MIG device only, the summary's MIG table its memory; the
    pod reader finds both."""
    root = fresh_root("dgx-a100")
    made = make_layout(root, {6: ["1g.10gb", "1g.10gb", "3g.40gb"]})[6]
    one = next(d["uuid"] for d in made if d["mem"] == 9728 << 20)  # a 1g.10gb
    env = {**os.environ, **sim_env(root)}

    def smi(*argv: str) -> str:
        argv = (sys.executable, "-m", "gpufleet_harness.sim.smi", *argv)
        return subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=60).stdout

    listing, summary = smi("-i", one, "-L"), smi("-i", one)
    log = f"== gpus\n{listing}== rc 0\n== devices\nnvidia6\n== topo\n== summary\n{summary}== end\n"
    run = _run(log)
    assert [(index, uuid.startswith("GPU-")) for index, _model, uuid in run.gpus] == [(6, True)]
    assert run.mig_devices == [("1g.10gb", one)]
    assert run.mig_memory == [(0, 9728)]  # MiB of a 1g.10gb on an A100-80GB, as NVML reports it
    # Two MIG devices of one GPU: one GPU line, both devices; the whole machine lists every MIG device.
    pair = ",".join(made[k]["uuid"] for k in (0, 2))
    both = _run(f"== gpus\n{smi('-i', pair, '-L')}== end\n")
    assert sorted(p for p, _ in both.mig_devices) == ["1g.10gb", "3g.40gb"] and len(both.gpus) == 1
    assert len(_run(f"== summary\n{smi()}== end\n").mig_memory) == 3
    # A MIG UUID the driver does not know selects nothing, as an unknown GPU id does.
    unknown = "MIG-00000000-0000-4000-8000-000000000000"
    argv = (sys.executable, "-m", "gpufleet_harness.sim.smi", "-i", unknown, "-L")
    gone = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert (gone.returncode, gone.stdout) == (6, "No devices were found\n")


def test_mig_lines_of_other_drivers_are_read() -> None:
    """Older drivers name MIG devices MIG-GPU-<uuid>/<gi>/<ci>; the MIG table's first row per device has
    the memory, its second (BAR1) none."""
    log = (
        "== gpus\nGPU 0: A100-SXM4-40GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-e2c8a3e64000)\n"
        "  MIG 1g.5gb Device 0: (UUID: MIG-GPU-5d5ba0d6-d33d-2b2c-524d-e2c8a3e64000/7/0)\n== rc 0\n"
        "== summary\n|  0    7   0   0  |      3MiB /  4864MiB | 14      0 |  1   0    0    0    0 |\n"
        "|                  |      0MiB /  8191MiB |           |                       |\n== end\n"
    )
    run = _run(log)
    assert run.mig_devices == [("1g.5gb", "MIG-GPU-5d5ba0d6-d33d-2b2c-524d-e2c8a3e64000/7/0")]
    assert run.mig_memory == [(3, 4864)]
