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

# nvmlDeviceCreateGpuInstance profile ids on an A100-80GB and the compute-instance profile filling each
# (NVML's NVML_GPU_INSTANCE_PROFILE_* and NVML_COMPUTE_INSTANCE_PROFILE_* numbering).
PROFILES = {"1g.10gb": (19, 0), "3g.40gb": (9, 2)}

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
    per profile listed; returns each GPU's MIG devices: uuid, k (handle index), gi, ci, mem (bytes)."""
    spec = json.dumps({str(g): [PROFILES[p] for p in profiles] for g, profiles in layout.items()})
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
