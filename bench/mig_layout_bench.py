"""Time to apply a MIG layout on 8 GPUs, and the no-op re-apply, on the GPU simulator.

    python bench/mig_layout_bench.py [--runs 3] [--layout all-1g.10gb] [--fixture dgx-a100]

Each run takes a fresh sim root (MIG off on every GPU) and runs the role nvidia_mig's boot applier
(roles/nvidia_mig/files/gpufleet_mig_apply.py beside the collection's mig_layout.py, as the role installs
them: the same code as the module gpufleet.nvidia.gpu_mig_layout, without Ansible's round trips) three
times: the layout applied (MIG mode on, a GPU reset per A100 through the simulator's nvidia-smi, the GPU and
compute instances created), the same layout again (nothing to do), then `all-disabled` (instances
destroyed, MIG off, a reset per A100). Wall time of each applier process, interpreter start included.

Figures, not assertions. What they leave out: a real driver's MIG mode change and GPU reset take seconds per
GPU on hardware; here they are file writes, so this measures gpufleet's own work around NVML.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gpufleet_harness.sim import build, machine

REPO = Path(__file__).resolve().parents[1]
APPLIER = REPO / "roles/nvidia_mig/files/gpufleet_mig_apply.py"
MIG_LAYOUT = REPO / "plugins/module_utils/mig_layout.py"
# mig-parted's format, as NVIDIA's default config names these layouts.
CONFIG = {
    "version": "v1",
    "mig-configs": {
        "all-disabled": [{"devices": "all", "mig-enabled": False}],
        "all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
        "all-balanced": [
            {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}}
        ],
    },
}


def _apply(work: Path, env: dict[str, str], layout: str) -> tuple[float, bool]:
    """(seconds, changed) of one applier run; raises with its output when it fails."""
    argv = [sys.executable, str(work / "gpufleet_mig_apply.py"), "--config", str(work / "config.json"),
            "--layout", layout]  # fmt: skip
    start = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300, check=False)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr)[-1500:]
        raise RuntimeError(f"{layout}: applier exited {proc.returncode}: {output}")
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    return seconds, bool(last.get("changed"))


def run_once(fixture: str, layout: str, library: Path) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="miglayout", dir="/tmp"))
    try:
        shutil.copy2(APPLIER, work / "gpufleet_mig_apply.py")
        shutil.copy2(MIG_LAYOUT, work / "mig_layout.py")
        (work / "config.json").write_text(json.dumps(CONFIG))  # JSON is YAML
        root = machine.materialize(fixture, work / "root", library=library)
        env = {**os.environ, **machine.sim_env(root)}
        env["PATH"] = f"{root / 'bin'}{os.pathsep}{env.get('PATH', '')}"  # the simulator's nvidia-smi resets
        apply_s, changed = _apply(work, env, layout)
        again_s, again_changed = _apply(work, env, layout)
        off_s, off_changed = _apply(work, env, "all-disabled")
        if not changed or again_changed or not off_changed:
            raise RuntimeError(f"changes: apply {changed}, again {again_changed}, disable {off_changed}")
        return {"apply": apply_s, "again": again_s, "disable": off_s}
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    layouts = sorted(set(CONFIG["mig-configs"]) - {"all-disabled"})
    parser.add_argument("--layout", default="all-1g.10gb", choices=layouts)
    parser.add_argument("--fixture", default="dgx-a100", help="a MIG-capable fixture (dgx-a100, hgx-h100)")
    args = parser.parse_args()
    library = build.build_library()
    runs = [run_once(args.fixture, args.layout, library) for _ in range(args.runs)]
    load = os.getloadavg()[0]
    print(f"{args.fixture}, layout {args.layout}, {args.runs} runs, load {load:.1f}: "
          "applier wall time (median, max)")
    for step in ("apply", "again", "disable"):
        values = [r[step] * 1000 for r in runs]
        print(f"  {step:<8} {statistics.median(values):8.0f} ms {max(values):8.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
