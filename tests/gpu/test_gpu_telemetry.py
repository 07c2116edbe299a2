"""gpufleet.gpu.telemetry on the simulator, through the unmodified pynvml in child processes: each counter
is read where NVML answers its getter and recorded as absent, with NVML's reason, where it does not."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from gpu_helpers import HEALTHY, run_in_sim

from gpufleet.gpu.telemetry import CALLS
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import miglayout

# key -> the pynvml getter a raw call checks it against (GPU 0, no arguments beyond the handle)
RAW = {
    "power_mw": "nvmlDeviceGetPowerUsage",
    "energy_mj": "nvmlDeviceGetTotalEnergyConsumption",
    "pcie_replays": "nvmlDeviceGetPcieReplayCounter",
    "remapped_rows_correctable": "nvmlDeviceGetRemappedRows",
    "gpu_util_pct": "nvmlDeviceGetUtilizationRates",
    "enc_util_pct": "nvmlDeviceGetEncoderUtilization",
}

CHILD = """
import json, pynvml
from gpufleet.gpu import nvml_session, NvmlGpuLost
from gpufleet.gpu.telemetry import read_gpu, read_mig_memory
out = {"readings": [], "raw": {}}
with nvml_session() as nv:
    for index in range(nv.count()):
        try:
            r = read_gpu(nv, index)
            out["readings"].append({"values": r.values, "absent": r.absent})
        except NvmlGpuLost as exc:
            out["readings"].append({"lost": str(exc)})
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    for key, getter in RAW.items():
        try:
            getattr(pynvml, getter)(handle)
            out["raw"][key] = True
        except pynvml.NVMLError:
            out["raw"][key] = False
    out["mig"] = [read_mig_memory(nv, index, slot) for index, slot in MIG]
print(json.dumps(out))
"""


def _read(root: Path, mig: list[tuple[int, int]] = ()) -> dict[str, Any]:  # type: ignore[assignment]
    code = f"RAW = {RAW!r}\nMIG = {list(mig)!r}\n" + textwrap.dedent(CHILD)
    proc = run_in_sim(root, ["-c", code])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("fixture", HEALTHY)
def test_each_counter_is_read_exactly_where_nvml_answers_its_getter(
    fixture: str, sim_root: Callable[[str], Path]
) -> None:
    root = sim_root(fixture)
    out = _read(root)
    machine = simmachine.load_machine(root)
    assert len(out["readings"]) == len(machine["gpus"])
    first = out["readings"][0]
    assert set(first["values"]) | set(first["absent"]) == set(CALLS), "every key is either read or absent"
    assert not set(first["values"]) & set(first["absent"])
    for key, answered in out["raw"].items():
        assert (key in first["values"]) == answered, (
            f"{fixture}: {key} read {key in first['values']}, NVML {answered}"
        )
        if not answered:
            assert first["absent"][key], f"{fixture}: {key} is absent without a reason"
    total = machine["gpus"][0]["memory"]["total"]
    values = first["values"]
    assert values["fb_free_bytes"] + values["fb_used_bytes"] + values.get("fb_reserved_bytes", 0) == total


def test_a_lost_gpu_raises_gpu_lost_and_the_others_read(fresh_root: Callable[[str], Path]) -> None:
    from gpufleet_harness.sim import control

    root = fresh_root("pcie-2x-t4")
    control.inject(root, ["gpu", "1", "lost"])
    out = _read(root)
    assert "values" in out["readings"][0]
    assert "lost" in out["readings"][1]


def test_mig_devices_memory_is_read_per_slot(fresh_root: Callable[[str], Path]) -> None:
    root = fresh_root("dgx-a100")
    migs = miglayout.make_layout(str(root), {0: ["1g.10gb", "3g.40gb"]})
    slots = [(0, m["k"]) for m in migs[0]]
    out = _read(root, slots)
    assert len(out["mig"]) == 2
    for (free, used, reserved), device in zip(out["mig"], migs[0], strict=True):
        assert free + used + (reserved or 0) == device["mem"], "a MIG device's memory adds up to its size"
