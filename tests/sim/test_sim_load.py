"""The simulator's counters move: workloads (gpufleet sim inject ROOT load, the GPU burner) against the real
H200's recording under load (tests/realgpu/h200-580.159.04/load-series.jsonl, dmon.txt).

Every NVML reading runs through the unmodified pynvml in child processes; the sim clock is frozen and stepped
(`inject ROOT clock`), so a series is deterministic. The recorded series and the simulated one are reduced to
the same features (idle levels, plateau levels, ramp, reason bits, process list, cool-down) and compared with
tolerances: the shape, not the sample times.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import smi as simsmi
from gpufleet_harness.sim import workload

RECORDING = Path(__file__).resolve().parents[1] / "realgpu" / "h200-580.159.04"
Runner = Callable[..., Any]
Roots = Callable[[str], Path]
SW_POWER_CAP, GPU_IDLE = 0x4, 0x1
STEP = 0.55  # the recording's sampling interval (s)
BURN = [sys.executable, "-m", "gpufleet_harness.sim.burn"]

# A child that samples GPU 0 every STEP s of sim time, as load_series.sh sampled the real one: 6 samples
# idle, a workload of LOAD_S (pid 448, 1130 MiB, as recorded), then 12 samples after it.
SAMPLER = """
    from gpufleet_harness.sim import control, workload
    ROOT, T0, LOAD_S, PHASES = {root!r}, {t0!r}, {load_s!r}, {phases!r}
    control.inject(ROOT, ["clock", str(T0)])
    n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
    rows = []
    t = T0
    for phase, count in PHASES:
        for k in range(count):
            if phase == "load" and k == 0:
                workload.start(ROOT, 0, pid=448, memory_mib=1130, name="python3", seconds=LOAD_S)
            u = n.nvmlDeviceGetUtilizationRates(h); m = n.nvmlDeviceGetMemoryInfo(h)
            rows.append({{"t": round(t - T0, 2), "phase": phase, "gpu_util": u.gpu, "mem_util": u.memory,
                "fb_used_mib": m.used // 2**20, "power_mw": n.nvmlDeviceGetPowerUsage(h),
                "energy_mj": n.nvmlDeviceGetTotalEnergyConsumption(h),
                "temp_c": n.nvmlDeviceGetTemperature(h, 0),
                "sm_mhz": n.nvmlDeviceGetClockInfo(h, 1), "mem_mhz": n.nvmlDeviceGetClockInfo(h, 2),
                "pstate": n.nvmlDeviceGetPerformanceState(h),
                "clock_event_reasons": n.nvmlDeviceGetCurrentClocksEventReasons(h),
                "procs": [[p.pid, p.usedGpuMemory // 2**20]
                          for p in n.nvmlDeviceGetComputeRunningProcesses(h)]}})
            t = round(t + {step!r}, 3)
            control.inject(ROOT, ["clock", str(t)])
    out(rows)
"""


def simulated_series(nvml: Runner, root: Path, load_s: float = 20.0) -> list[dict[str, Any]]:
    phases = [["idle-before", 6], ["load", round(load_s / STEP) + 1], ["idle-after", 12]]
    return list(nvml(root, SAMPLER.format(root=str(root), t0=1000.0, load_s=load_s, phases=phases, step=STEP),
                     timeout=120))


def recorded_series() -> list[dict[str, Any]]:
    return [json.loads(line) for line in (RECORDING / "load-series.jsonl").read_text().splitlines() if line]


def features(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The shape of a series: where the work ran (utilization > 0), the levels before, during and after."""
    busy = [i for i, r in enumerate(rows) if r["gpu_util"] > 0]
    first, last = busy[0], busy[-1]
    idle = [r for r in rows[:first] if not r["procs"]][1:]  # the first sample may still be settling
    plateau = [r for r in rows[first:last + 1] if r["t"] >= rows[first]["t"] + 2.0]
    after = rows[last + 1:]
    idle_power = statistics.median(r["power_mw"] for r in idle)
    top = statistics.median(r["power_mw"] for r in plateau)
    ramp = next(r["t"] for r in rows[first:] if r["power_mw"] >= 0.95 * top) - rows[first]["t"]
    energy_rate = (plateau[-1]["energy_mj"] - plateau[0]["energy_mj"]) / (plateau[-1]["t"] - plateau[0]["t"])
    end = rows[last]["t"]
    back = next(r["t"] for r in after if abs(r["power_mw"] - idle_power) < 0.02 * idle_power) - end
    idle_temp = statistics.median(r["temp_c"] for r in idle)
    cool = next(r["t"] for r in after if r["temp_c"] - idle_temp <= 3) - rows[last]["t"]
    return {
        "idle_power_w": idle_power / 1000, "idle_sm": {r["sm_mhz"] for r in idle},
        "idle_reasons": {r["clock_event_reasons"] for r in idle}, "idle_fb": {r["fb_used_mib"] for r in idle},
        "util": statistics.median(r["gpu_util"] for r in plateau),
        "mem_util": statistics.median(r["mem_util"] for r in plateau),
        "power_w": top / 1000, "max_power_w": max(r["power_mw"] for r in rows) / 1000,
        "sm": statistics.median(r["sm_mhz"] for r in plateau),
        "reasons": {r["clock_event_reasons"] for r in plateau},
        "fb_added": statistics.median(r["fb_used_mib"] for r in plateau) - statistics.median(
            r["fb_used_mib"] for r in idle),
        "procs": {json.dumps(r["procs"]) for r in plateau},
        "temp_rise": statistics.median(r["temp_c"] for r in plateau) - idle_temp,
        "ramp_s": ramp, "energy_w": energy_rate / 1000,
        "energy_monotonic": all(b["energy_mj"] >= a["energy_mj"] for a, b in itertools.pairwise(rows)),
        "linger": any(r["sm_mhz"] > max(r0["sm_mhz"] for r0 in idle) and r["clock_event_reasons"] == 0
                      for r in after),
        "back_to_idle_s": back, "cooled_s": cool,
        "after": {(r["sm_mhz"], r["clock_event_reasons"], json.dumps(r["procs"])) for r in after[-3:]},
        "pstates": {r["pstate"] for r in rows}, "mem_mhz": {r["mem_mhz"] for r in rows},
    }


def test_a_load_moves_the_counters_in_the_shape_the_real_h200_recorded(fresh_root: Roots,
                                                                        nvml: Runner) -> None:
    root = fresh_root("firecracker-vm-h200")
    real, sim = features(recorded_series()), features(simulated_series(nvml, root))
    # idle: ~79.5 W at 345 MHz with only the GPU-idle reason, the driver's 615 MiB in use
    assert real["idle_sm"] == sim["idle_sm"] == {345}
    assert real["idle_reasons"] == sim["idle_reasons"] == {GPU_IDLE}
    assert sim["idle_power_w"] == pytest.approx(real["idle_power_w"], rel=0.01)
    assert real["idle_fb"] == sim["idle_fb"] == {615}
    # under the load: 100 % busy, 25 % memory, power at the 700 W cap's plateau, the SM clock held below its
    # 1980 MHz maximum by the cap with clock-event reason 4 (SW power cap) alone
    assert real["util"] == sim["util"] == 100 and real["mem_util"] == sim["mem_util"] == 25
    assert sim["power_w"] == pytest.approx(real["power_w"], rel=0.02)
    assert real["max_power_w"] <= 700 and sim["max_power_w"] <= 700
    assert sim["sm"] == pytest.approx(real["sm"], rel=0.05) and sim["sm"] < 1980
    assert real["reasons"] == sim["reasons"] == {SW_POWER_CAP}
    # the process and its memory: 1130 MiB of its own, 1138 MiB more in use on the GPU (its context)
    assert real["procs"] == sim["procs"] == {json.dumps([[448, 1130]])}
    assert real["fb_added"] == sim["fb_added"] == 1138
    # power ramps to the plateau within a second or so (NVML's one-second average), energy follows it
    assert 0.5 <= sim["ramp_s"] <= 1.65 and 0.5 <= real["ramp_s"] <= 1.65
    assert real["energy_monotonic"] and sim["energy_monotonic"]
    assert sim["energy_w"] == pytest.approx(sim["power_w"], rel=0.01)
    assert real["energy_w"] == pytest.approx(real["power_w"], rel=0.02)
    # the temperature rises ~20 C to a plateau and falls back within seconds
    assert sim["temp_rise"] == pytest.approx(real["temp_rise"], abs=3)
    assert sim["cooled_s"] <= 5.5 and real["cooled_s"] <= 5.5
    # after: clocks stay up (reason 0) for a moment, then idle clocks, idle power, no process
    assert real["linger"] and sim["linger"]
    assert sim["back_to_idle_s"] <= 5.5 and real["back_to_idle_s"] <= 5.5
    assert real["after"] == sim["after"] == {(345, GPU_IDLE, "[]")}
    assert real["pstates"] == sim["pstates"] == {0} and real["mem_mhz"] == sim["mem_mhz"] == {3201}


def test_partial_loads_add_up_and_only_a_full_gpu_meets_the_power_cap(fresh_root: Roots,
                                                                       nvml: Runner) -> None:
    root = fresh_root("firecracker-vm-h200")
    simcontrol.inject(root, ["clock", "500"])
    simcontrol.inject(root, ["load", "0", "util", "50", "pid", "10", "memory", "100", "encoder", "30"])
    simcontrol.inject(root, ["clock", "510"])
    code = """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        def read():
            u = n.nvmlDeviceGetUtilizationRates(h)
            return [u.gpu, u.memory, n.nvmlDeviceGetPowerUsage(h), n.nvmlDeviceGetClockInfo(h, 1),
                    n.nvmlDeviceGetClockInfo(h, 0), n.nvmlDeviceGetCurrentClocksEventReasons(h),
                    n.nvmlDeviceGetEncoderUtilization(h)[0], n.nvmlDeviceGetDecoderUtilization(h)[0]]
        out(read())
    """
    util, mem, power, sm, gfx, reasons, enc, dec = nvml(root, code)
    assert (util, mem, sm, gfx, reasons, enc, dec) == (50, 12, 1980, 1980, 0, 30, 0)
    assert 300_000 < power < 691_000  # above idle, under the cap: not capped, full clocks
    simcontrol.inject(root, ["load", "0", "util", "60", "pid", "11", "memory", "100"])
    simcontrol.inject(root, ["clock", "520"])
    util, _, power, sm, _, reasons, _, _ = nvml(root, code)
    assert util == 100 and reasons == SW_POWER_CAP and sm < 1980 and power <= 700_000


def test_processes_memory_and_names(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("firecracker-vm-h200")
    simcontrol.inject(root, ["clock", "100"])
    simcontrol.inject(root, ["load", "0", "pid", "4242", "memory", "2048", "name", "train.py"])
    simcontrol.inject(root, ["load", "0", "pid", "4343", "memory", "512", "util", "10"])
    r = nvml(root, """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        procs = lambda f: sorted([p.pid, p.usedGpuMemory >> 20] for p in f(h))
        v2 = n.nvmlDeviceGetMemoryInfo(h, version=n.nvmlMemory_v2)
        info = n.nvmlDeviceGetComputeRunningProcesses_v3(h)[0]
        # the size query of the C API: count 0 → INSUFFICIENT_SIZE (7) with the count
        c = ctypes.c_uint(0)
        rc = n.nvmlLib.nvmlDeviceGetComputeRunningProcesses_v3(h, byref(c), None)
        out([procs(n.nvmlDeviceGetComputeRunningProcesses),
             procs(n.nvmlDeviceGetComputeRunningProcesses_v2),
             procs(n.nvmlDeviceGetGraphicsRunningProcesses), procs(n.nvmlDeviceGetMPSComputeRunningProcesses),
             v2.used >> 20, v2.free + v2.used + v2.reserved == v2.total,
             [info.gpuInstanceId, info.computeInstanceId],
             n.nvmlSystemGetProcessName(4242), n.nvmlSystemGetProcessName(4343),
             err(n.nvmlSystemGetProcessName, 1),
             rc, c.value])
    """)
    want = [[4242, 2048], [4343, 512]]
    used_mib = ((2048 + 512) * 1024 + 2 * workload.CONTEXT_KIB) // 1024  # two processes, two contexts
    assert r == [want, want, [], [], used_mib, True, [0xFFFFFFFF, 0xFFFFFFFF],
                 "train.py", "burn", "NVMLError_NotFound", 7, 2]
    # a workload that does not fit is refused as cudaMalloc would be, naming what is free
    with pytest.raises(simcontrol.InjectError, match=r"GPU 0 has \d+ MiB free.*out of memory"):
        simcontrol.inject(root, ["load", "0", "memory", "200000"])
    assert "2 workloads stopped" in simcontrol.inject(root, ["idle", "0"])
    count = "n.nvmlInit(); out(len(n.nvmlDeviceGetComputeRunningProcesses(n.nvmlDeviceGetHandleByIndex(0))))"
    assert nvml(root, count) == 0


def test_every_fixture_stays_within_its_limits_under_load(fresh_root: Roots, nvml: Runner) -> None:
    """A full load on every GPU of the 8-GPU A100 box: power at most the limit, clocks at most their maxima,
    the power cap's reason, each GPU's own process; GPUs keep their own idle power."""
    root = fresh_root("dgx-a100")
    simcontrol.inject(root, ["clock", "100"])
    for gpu in range(8):
        simcontrol.inject(root, ["load", str(gpu), "pid", str(1000 + gpu), "memory", "4096"])
    simcontrol.inject(root, ["clock", "130"])
    rows = nvml(root, """
        n.nvmlInit()
        rows = []
        for i in range(n.nvmlDeviceGetCount()):
            h = n.nvmlDeviceGetHandleByIndex(i)
            rows.append([n.nvmlDeviceGetPowerUsage(h), n.nvmlDeviceGetEnforcedPowerLimit(h),
                         n.nvmlDeviceGetClockInfo(h, 1), n.nvmlDeviceGetMaxClockInfo(h, 1),
                         n.nvmlDeviceGetCurrentClocksEventReasons(h), n.nvmlDeviceGetTemperature(h, 0),
                         [p.pid for p in n.nvmlDeviceGetComputeRunningProcesses(h)]])
        out(rows)
    """)
    for gpu, (power, limit, sm, max_sm, reasons, temp, pids) in enumerate(rows):
        assert 0.95 * limit <= power <= limit and 0 < sm < max_sm and reasons == SW_POWER_CAP
        assert 40 <= temp < 90 and pids == [1000 + gpu]


def test_energy_never_goes_backwards_across_processes(fresh_root: Roots, tmp_path: Path) -> None:
    """Three processes read GPU 0's energy as fast as they can on the real clock while workloads start and
    stop; every reading taken after another one finished (by the host's monotonic clock, in any process)
    is at least as large."""
    root = fresh_root("firecracker-vm-h200")
    reader = (
        "import json, sys, time\nimport pynvml as n\nn.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)\n"
        "rows = []\nend = time.monotonic() + float(sys.argv[1])\n"
        "while time.monotonic() < end:\n"
        "    a = time.monotonic_ns(); e = n.nvmlDeviceGetTotalEnergyConsumption(h); b = time.monotonic_ns()\n"
        "    rows.append([a, b, e])\n"
        "print(json.dumps(rows))\n"
    )
    env = {**os.environ, **simmachine.sim_env(root)}
    procs = [subprocess.Popen([sys.executable, "-c", reader, "4"], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(3)]
    for _ in range(6):
        workload.start(root, 0, memory_mib=10)
        time.sleep(0.2)
        workload.stop(root, gpu=0)
        time.sleep(0.2)
    readings = []
    for p in procs:
        stdout, _ = p.communicate(timeout=60)
        assert p.returncode == 0
        readings += json.loads(stdout)
    assert len(readings) > 300
    readings.sort()
    floor = 0  # the largest energy among readings that finished before this one started
    finished = sorted(readings, key=lambda r: r[1])
    k = 0
    for start, _, energy in readings:
        while k < len(finished) and finished[k][1] < start:
            floor = max(floor, finished[k][2])
            k += 1
        assert energy >= floor, f"energy went back: {energy} mJ after {floor} mJ"
    assert readings[-1][2] > readings[0][2]


def test_folding_the_history_changes_no_reading(fresh_root: Roots, nvml: Runner) -> None:
    """Past FOLD_AFTER records a GPU idle for a minute has its records folded into one `settled` line; the
    library's readings at that instant are the same before and after, and equal workload.py's model."""
    root = fresh_root("firecracker-vm-h200")
    t = 1000.0
    simcontrol.inject(root, ["clock", str(t)])
    for k in range(workload.FOLD_AFTER + 1):
        simcontrol.inject(root, ["load", "0", "util", str(40 + 3 * k), "seconds", "2.5"])
        t += 4.0
        simcontrol.inject(root, ["clock", str(t)])
    t += 120
    simcontrol.inject(root, ["clock", str(t)])
    # energy, power, temperature; the fields of the time held by the cap, idle, and the PCIe bytes
    read = ("n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0); "
            "out([n.nvmlDeviceGetTotalEnergyConsumption(h), n.nvmlDeviceGetPowerUsage(h), "
            "n.nvmlDeviceGetTemperature(h, 0), "
            "[v.value.ullVal if v.valueType == 3 else v.value.uiVal "
            " for v in n.nvmlDeviceGetFieldValues(h, [74, 78, 80, 197, 198])]])")
    before = nvml(root, read)
    state = workload.read_state(root)
    machine = json.loads((root / "machine.json").read_text())
    params = workload.params_of(machine["gpus"][0])
    at = round(t * 1000)
    assert before[0] == workload.energy_mj(params, state, 0, at)
    counted = workload.counters_at(params, state, 0, at)
    assert not state.settled and len(state.loads) == workload.FOLD_AFTER + 1
    simcontrol.inject(root, ["load", "0", "seconds", "1"])  # a writer folds
    state = workload.read_state(root)
    assert list(state.settled) == [0] and len(state.loads) == 1
    assert nvml(root, read) == before
    assert before[0] == workload.energy_mj(params, state, 0, at)
    assert before[0] > params.idle_mw * t  # the folded workloads' energy is kept
    # the counters too, folded into a `counters` line: as the library counted them, kept by the fold
    assert state.settled[0].counters == counted == workload.counters_at(params, state, 0, at)
    assert counted.idle_ms < at and counted.capped_ms > 0 and counted.tx_bytes > params.pcie_tx_kbps * at
    h200_boot_tx = 1722550744  # the recorded H200's bytes before (native/fields.c)
    assert before[3][3] == (h200_boot_tx + counted.tx_bytes) % (1 << 32)
    assert before[3][1] == (counted.idle_ms - 12319) * 1_000_000  # low utilization after the driver's start


def test_xids_injected_under_load_reach_an_event_set(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("firecracker-vm-h200")
    simcontrol.inject(root, ["load", "0"])
    r = nvml(root, f"""
        import subprocess
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        s = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, s)
        from gpufleet_harness.sim import control
        control.inject({str(root)!r}, ["xid", "0", "48"])
        e = n.nvmlEventSetWait_v2(s, 5000)
        out([e.eventType, e.eventData, n.nvmlDeviceGetUtilizationRates(h).gpu])
    """)
    assert r == [0x8, 48, 100]


def test_mig_devices_carry_their_processes_and_utilization_is_not_supported(fresh_root: Roots,
                                                                           nvml: Runner) -> None:
    """The burner given a MIG device busies its parent GPU by the device's share of compute slices, with the
    process in that MIG device (its instance ids); a MIG-enabled GPU answers no utilization (nvml.h)."""
    from gpufleet_harness.sim.miglayout import make_layout

    root = fresh_root("dgx-a100")
    made = make_layout(root, {2: ["3g.40gb", "1g.10gb"]})
    big = max(made[2], key=lambda m: m["mem"])  # the 3g.40gb device
    simcontrol.inject(root, ["clock", "100"])
    burner = subprocess.Popen([*BURN, "--root", str(root), "--devices", big["uuid"], "--memory", "300"],
                              stdout=subprocess.PIPE, text=True)
    try:
        line = burner.stdout.readline()  # type: ignore[union-attr]
        simcontrol.inject(root, ["clock", "105"])  # within the burner's lease
        ks = [big["k"], *(m["k"] for m in made[2] if m is not big)]
        r = nvml(root, f"""
            KS = {ks!r}
            n.nvmlInit(); g = n.nvmlDeviceGetHandleByIndex(2)
            migs = [n.nvmlDeviceGetMigDeviceHandleByIndex(g, k) for k in KS]
            procs = lambda h: [[p.usedGpuMemory >> 20, p.gpuInstanceId, p.computeInstanceId]
                               for p in n.nvmlDeviceGetComputeRunningProcesses(h)]
            out([procs(g), [procs(m) for m in migs], [n.nvmlDeviceGetMemoryInfo(m).used >> 20 for m in migs],
                 [n.nvmlDeviceGetGpuInstanceId(migs[0]), n.nvmlDeviceGetComputeInstanceId(migs[0])],
                 err(n.nvmlDeviceGetUtilizationRates, g),
                 n.nvmlDeviceGetPowerUsage(g) > n.nvmlDeviceGetPowerUsage(n.nvmlDeviceGetHandleByIndex(3))])
        """)
    finally:
        burner.send_signal(signal.SIGTERM)
        burner.wait(timeout=30)
    assert burner.returncode == 0
    assert line.startswith(f"gpufleet-sim-burn: GPU 2 busy at {round(100 * 3 / 7)} %"), line  # 3 of 7 slices
    gi, ci = r[3]
    assert (gi, ci) == (big["gi"], big["ci"])
    assert r[0] == [[300, gi, ci]] and r[1] == [[[300, gi, ci]], []]
    assert r[2] == [(300 * 1024 + workload.CONTEXT_KIB) // 1024, 0]
    assert r[4] == "NVMLError_NotSupported"
    assert r[5] is True  # GPU 2 draws more than the idle GPU 3


def test_burner_keeps_its_gpus_busy_while_it_runs(fresh_root: Roots, nvml: Runner) -> None:
    """gpufleet-sim-burn with the NVIDIA_VISIBLE_DEVICES a pod gets: busy until SIGTERM, then idle again;
    its process is in the list with the memory it holds."""
    root = fresh_root("dgx-a100")
    uuids = [g["uuid"] for g in json.loads((root / "machine.json").read_text())["gpus"]]
    env = {**os.environ, **simmachine.sim_env(root), "NVIDIA_VISIBLE_DEVICES": f"{uuids[5]},1"}
    burner = subprocess.Popen([*BURN, "--memory", "2000"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        started = [burner.stdout.readline() for _ in range(2)]  # type: ignore[union-attr]
        assert [line.split()[2] for line in started] == ["5", "1"], started
        code = """
            n.nvmlInit()
            rows = []
            for i in (1, 5, 0):
                h = n.nvmlDeviceGetHandleByIndex(i)
                procs = n.nvmlDeviceGetComputeRunningProcesses(h)
                rows.append([n.nvmlDeviceGetUtilizationRates(h).gpu,
                             [[p.pid, p.usedGpuMemory >> 20] for p in procs]])
            out(rows)
        """
        assert nvml(root, code) == [[100, [[burner.pid, 2000]]], [100, [[burner.pid, 2000]]], [0, []]]
    finally:
        burner.send_signal(signal.SIGTERM)
        burner.wait(timeout=30)
    assert burner.returncode == 0
    simcontrol.inject(root, ["clock", str(workload.real_clock_ms() / 1000 + 1)])  # past the stop's grace
    assert nvml(root, code) == [[0, []], [0, []], [0, []]]


def test_a_memory_bound_burner_keeps_the_memory_busy_below_the_power_cap(fresh_root: Roots,
                                                                          nvml: Runner) -> None:
    """`--kind membound`, the recorded memset loop: GPU and memory 100 % busy, the power between idle and the
    cap, every clock at its maximum and no clock-event reason; the default (compute) meets the cap."""
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["clock", "50"])
    env = {**os.environ, "GPUFLEET_SIM_ROOT": str(root)}
    code = """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        u = n.nvmlDeviceGetUtilizationRates(h)
        out([u.gpu, u.memory, n.nvmlDeviceGetClockInfo(h, 1) == n.nvmlDeviceGetMaxClockInfo(h, 1),
             n.nvmlDeviceGetCurrentClocksEventReasons(h), n.nvmlDeviceGetPowerUsage(h),
             n.nvmlDeviceGetEnforcedPowerLimit(h)])
    """
    idle_mw = nvml(root, code)[4]
    burner = subprocess.run([*BURN, "--devices", "0", "--kind", "membound", "--seconds", "0.01"], env=env,
                            capture_output=True, text=True, timeout=60, check=True)
    assert burner.stdout.startswith("gpufleet-sim-burn: GPU 0 busy at 100 %"), burner.stdout
    assert [ld.kind for ld in workload.read_state(root).loads] == [workload.MEMBOUND]
    simcontrol.inject(root, ["load", "1", "kind", "membound", "seconds", "30"])
    simcontrol.inject(root, ["clock", "53"])
    gpu, memory, max_clock, reasons, power, limit = nvml(root, code.replace("Index(0)", "Index(1)"))
    assert (gpu, memory, max_clock, reasons) == (100, 100, True, 0)
    assert idle_mw < power < 0.98 * limit
    simcontrol.inject(root, ["load", "0", "kind", "compute", "seconds", "30"])
    simcontrol.inject(root, ["clock", "56"])
    assert nvml(root, code)[:4] == [100, 25, False, SW_POWER_CAP]


def test_state_lines_without_a_kind_are_compute_work(fresh_root: Roots, nvml: Runner) -> None:
    """A line of an older writer (no kind) or of a newer one (a kind this version does not know) is
    compute-bound work, for the library and for workload.py alike; membound is read as such."""
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["clock", "10"])
    (root / "workloads" / "state").write_text(
        "next 4\n"
        "load 1 0 5000 -1 100 25 0 0 7 100 -1 -1 old\n"
        "load 2 1 5000 -1 100 25 0 0 8 100 -1 -1 newer tensor\n"
        "load 3 1 5000 -1 0 0 0 0 9 100 -1 -1 mb membound\n")
    assert [ld.kind for ld in workload.read_state(root).loads] == [workload.COMPUTE, workload.COMPUTE,
                                                                     workload.MEMBOUND]
    reasons = nvml(root, "n.nvmlInit(); out([n.nvmlDeviceGetCurrentClocksEventReasons("
                         "n.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)])")
    assert reasons == [SW_POWER_CAP, SW_POWER_CAP]  # both GPUs run a full compute load: held by the cap


def test_a_killed_burner_frees_its_gpu_when_its_lease_runs_out(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["clock", "50"])
    env = {**os.environ, "GPUFLEET_SIM_ROOT": str(root), "NVIDIA_VISIBLE_DEVICES": "all"}
    burner = subprocess.Popen(BURN, env=env, stdout=subprocess.PIPE, text=True)
    assert burner.stdout.readline().startswith("gpufleet-sim-burn: GPU 0 busy")  # type: ignore[union-attr]
    burner.stdout.readline()  # type: ignore[union-attr]
    burner.kill()
    burner.wait(timeout=30)
    busy = ("n.nvmlInit(); "
            "out([n.nvmlDeviceGetUtilizationRates(n.nvmlDeviceGetHandleByIndex(i)).gpu for i in (0, 1)])")
    assert nvml(root, busy) == [100, 100]
    simcontrol.inject(root, ["clock", str(50 + workload.LINGER_MS / 1000 + 16)])  # lease 15 s
    assert nvml(root, busy) == [0, 0]


@pytest.mark.parametrize(("words", "message"), [
    (["load", "0", "util", "150"], "util must be 0-100 %, got 150"),
    (["load", "0", "speed", "3"], "unknown option 'speed'"),
    (["load", "0", "util"], "usage: load N"),
    (["load", "9"], "GPU 9 does not exist"),
    (["load", "0", "seconds", "0"], "seconds must be positive"),
    (["load", "0", "kind", "tensor"], "kind must be one of compute, membound, got 'tensor'"),
    (["idle"], "usage: idle N|all"),
    (["clock", "soon"], "seconds since boot, +seconds or real, got 'soon'"),
])
def test_bad_workload_injections_are_refused_naming_the_problem(fresh_root: Roots, words: list[str],
                                                                message: str) -> None:
    root = fresh_root("pcie-2x-t4")
    with pytest.raises(simcontrol.InjectError, match=re.escape(message)):
        simcontrol.inject(root, words)
    assert workload.read_state(root).loads == []


def test_the_frozen_clock_only_moves_forward(fresh_root: Roots) -> None:
    root = fresh_root("pcie-2x-t4")
    assert simcontrol.inject(root, ["clock", "100"]) == "clock 100 s"
    assert simcontrol.inject(root, ["clock", "+2.5"]) == "clock 102.5 s"
    backwards = "stands at 102.5 s and only moves forward, asked 50 s"
    with pytest.raises(simcontrol.InjectError, match=re.escape(backwards)):
        simcontrol.inject(root, ["clock", "50"])
    assert simcontrol.inject(root, ["clock", "real"]) == "clock real"
    assert simcontrol.read_control(root).clock_ms is None


def test_nvidia_smi_shows_the_load(fresh_root: Roots) -> None:
    """The summary's GPU cell and process table, and dmon in the recorded dmon's columns."""
    root = fresh_root("firecracker-vm-h200")
    simcontrol.inject(root, ["clock", "100"])
    simcontrol.inject(root, ["load", "0", "pid", "448", "memory", "1130", "name", "python3"])
    simcontrol.inject(root, ["clock", "110"])
    env = {**os.environ, **simmachine.sim_env(root)}
    smi = [sys.executable, "-m", "gpufleet_harness.sim.smi"]
    summary = subprocess.run(smi, env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    header = simsmi.PROCESS_HEADER[2]
    row = next(line for line in summary.splitlines() if line.startswith("|    0 ") and " C " in line)
    assert len(row) == len(header) == 91
    assert row.split() == ["|", "0", "N/A", "N/A", "448", "C", "python3", "1130MiB", "|"]
    # each value ends (or, for the name, starts) where its header does, as in nvidia-smi 580's table
    for word, head in (("448", "PID"), ("C", "Type"), ("1130MiB", "Memory")):
        end = header.index(head) + len(head)
        assert row.index(word) + len(word) in (end, end - 1), (word, head)
    assert row.index("python3") == header.index("Process name")
    # 1130 MiB and the context's 8.8 MiB: 1139 MiB in use, as the recorded dmon's fb shows
    assert "691W /  700W" in summary and "1139MiB / 143771MiB" in summary and "100%      Default" in summary
    dmon = subprocess.run([*smi, "dmon", "-s", "pucvmet", "-c", "2", "-d", "0"], env=env, capture_output=True,
                          text=True, timeout=60, check=True).stdout.splitlines()
    recorded = (RECORDING / "dmon.txt").read_text().splitlines()
    assert dmon[:2] == recorded[:2]
    assert [len(line) for line in dmon[2:]] == [len(recorded[2])] * 2
    values = dict(zip(recorded[0].split()[1:], dmon[2].split(), strict=True))
    assert (values["pwr"], values["sm"], values["mem"], values["pclk"], values["pviol"], values["fb"]) == (
        "691", "100", "25", "1485", "100", "1139")
