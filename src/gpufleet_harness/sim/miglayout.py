"""MIG layouts made on a sim root through the unmodified pynvml, as an operator's tool would make them.

Used by the tests and benches that need MIG devices before a consumer starts. The NVML calls run in a child
Python with the sim root's environment, so this process never loads the simulated library itself.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gpufleet_harness.sim import control, machine

# The compute-instance profile that fills a GPU instance of N compute slices
# (NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE ... _7_SLICE).
FILLING_CI_PROFILE = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}


class LayoutError(ValueError):
    """A layout the simulated machine cannot have: a GPU it lacks, or a MIG profile the GPU does not offer."""


def profile_ids(root: str | os.PathLike[str], gpu: int, names: list[str]) -> list[tuple[int, int]]:
    """(GPU-instance profile id, filling compute-instance profile) per name, from the GPU's own profile table
    in the sim root's machine.json; LayoutError naming the profiles the GPU offers for a name it lacks."""
    gpus = machine.load_machine(root)["gpus"]
    if not 0 <= gpu < len(gpus):
        raise LayoutError(f"GPU {gpu}: the simulated machine has GPUs 0-{len(gpus) - 1}")
    table = (gpus[gpu].get("mig") or {}).get("profiles") or []
    offered = {p["name"]: (p["id"], FILLING_CI_PROFILE[p["slices"]]) for p in table}
    for name in names:
        if name not in offered:
            what = f"offers {', '.join(offered)}" if offered else "has no MIG"
            raise LayoutError(f"GPU {gpu} ({gpus[gpu]['name']}) has no MIG profile {name!r}; it {what}")
    return [offered[name] for name in names]

# Step "enable": MIG mode on. Step "create": one GPU instance with a filling compute instance per profile,
# then each GPU's MIG devices as NVML lists them.
_SCRIPT = """
import json, sys
import pynvml as n
layout, step = json.loads(sys.argv[1]), sys.argv[2]
n.nvmlInit()
out = {}
for gpu, profiles in layout.items():
    h = n.nvmlDeviceGetHandleByIndex(int(gpu))
    if step == "enable":
        n.nvmlDeviceSetMigMode(h, 1)
        continue
    for gi_profile, ci_profile in profiles:
        n.nvmlGpuInstanceCreateComputeInstance(n.nvmlDeviceCreateGpuInstance(h, gi_profile), ci_profile)
    found = []
    for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        except n.NVMLError_NotFound:
            continue
        uuid = n.nvmlDeviceGetUUID(m)
        found.append({"uuid": uuid.decode() if isinstance(uuid, bytes) else uuid, "k": k,
                      "gi": n.nvmlDeviceGetGpuInstanceId(m), "ci": n.nvmlDeviceGetComputeInstanceId(m),
                      "mem": n.nvmlDeviceGetMemoryInfo(m).total})
    out[gpu] = found
print(json.dumps(out))
"""


def make_layout(
    root: str | os.PathLike[str], layout: dict[int, list[str]]
) -> dict[int, list[dict[str, Any]]]:
    """MIG on for the GPUs of `layout` (an A100 applies it at the GPU reset that follows), then one instance
    per profile listed (names as the GPU lists them, "1g.10gb" on an A100, "1g.18gb" on an H200); returns
    each GPU's MIG devices: uuid, k (handle index), gi, ci, mem (bytes). LayoutError, before anything is
    changed, for a profile the GPU does not offer."""
    spec = json.dumps({str(g): profile_ids(root, g, profiles) for g, profiles in layout.items()})
    env = {**os.environ, **machine.sim_env(Path(root))}

    def step(name: str) -> str:
        done = subprocess.run(
            [sys.executable, "-c", _SCRIPT, spec, name], env=env, capture_output=True, text=True, timeout=120
        )
        if done.returncode != 0:
            raise RuntimeError(f"MIG layout step {name} failed: {done.stderr.strip()[-2000:]}")
        return done.stdout

    step("enable")
    for gpu in layout:
        control.inject(str(root), ["gpu", str(gpu), "reset"])
    return {int(g): devices for g, devices in json.loads(step("create")).items()}
