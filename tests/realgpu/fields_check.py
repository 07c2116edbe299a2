#!/usr/bin/env python3
"""What a real GPU answers through nvmlDeviceGetFieldValues, for the simulator's field values (its
native/fields.c answers a handful of fields and NOT_SUPPORTED for the rest, with value types and per-field
codes taken from nvml.h, not from a GPU). Read-only towards the GPU's settings; stdlib + pynvml + the
driver's libcuda.so.1 (no CUDA toolkit, no torch). About 25 s.

Records, into fields-check.json in the folder given (default: .):
- `idle`: every field id 1..319 at scope 0, each as [fieldId, scopeId, nvmlReturn, valueType, value]; the
  ids 0 and 5000; the NVLink throughput fields at scope 0xFFFFFFFF (all links) and 0; the power
  fields at scopes 0, 1 and 2; what the whole call answers for a count of 0;
- `series`: every 0.5 s for 3 s idle, ~12 s of a memset loop on 1 GiB (as process_check.py) and 6 s after:
  the memory temperature (field 82), the GPU temperature, power average/instant (fields 185/186) and
  nvmlDeviceGetPowerUsage, utilization, BAR1 and memory in use, so the simulator's memory-temperature lags
  can be checked against a memory-bound load sampled finer than dmon's 1 s.

    python3 fields_check.py OUTDIR

The idle part (`idle`) and one sample of the series (`sample`) are functions, so the simulator's contract
test (tests/sim/test_sim_fields_contract.py) asks the simulated H200 exactly what this asked the real one.
"""

import ctypes
import json
import os
import sys
import threading
import time

import pynvml as N

PROBE_TO = 320  # past NVML_FI_MAX of every header so far (310 in 13.x; pynvml 13.615.71 says 308)
MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
ALL_LINKS = 0xFFFFFFFF
start_load = threading.Event()
stop_load = threading.Event()


def fields(h, ids):
    """[[fieldId, scopeId, nvmlReturn, valueType, value or None]] for (id, scope) pairs, one call."""
    got = N.nvmlDeviceGetFieldValues(h, ids)
    rows = []
    for v in got:
        member = MEMBERS.get(v.valueType)
        value = getattr(v.value, member) if v.nvmlReturn == 0 and member else None
        rows.append([v.fieldId, v.scopeId, v.nvmlReturn, v.valueType, value])
    return rows


def whole_call(h, count):
    values = (N.c_nvmlFieldValue_t * 1)()
    values[0].fieldId = 82
    return N.nvmlLib.nvmlDeviceGetFieldValues(h, ctypes.c_int(count), values)


def idle(h):
    """Idle: every id at scope 0 in one call, unknown ids, NVLink and power scopes, counts 0 and 1."""
    return {
        "all": fields(h, [(i, 0) for i in range(1, PROBE_TO)]),
        "unknown": fields(h, [(0, 0), (5000, 0)]),
        "nvlink_throughput": fields(h, [(i, s) for i in (138, 139, 140, 141) for s in (ALL_LINKS, 0)]),
        "power_scopes": fields(h, [(i, s) for i in range(185, 193) for s in (0, 1, 2)]),
        "count_0": whole_call(h, 0),
        "count_1": whole_call(h, 1),
    }


def work():
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    start_load.wait()
    assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    words = (1 << 30) // 4
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(words * 4)) == 0
    while not stop_load.is_set():
        for k in range(20):
            cuda.cuMemsetD32_v2(ptr, ctypes.c_uint(k), ctypes.c_size_t(words))
        cuda.cuCtxSynchronize()
    cuda.cuMemFree_v2(ptr)
    cuda.cuCtxDestroy_v2(ctx)


def sample(h, phase, t):
    """One sample of the series, taken `t` seconds into it."""
    u = N.nvmlDeviceGetUtilizationRates(h)
    [mt, avg, inst] = fields(h, [(82, 0), (185, 0), (186, 0)])
    return {"t": round(t, 2), "phase": phase, "memory_temp": mt[2:],
            "gpu_temp": N.nvmlDeviceGetTemperature(h, 0), "power_avg_field": avg[2:],
            "power_instant_field": inst[2:],
            "power_usage_mw": N.nvmlDeviceGetPowerUsage(h), "util": [u.gpu, u.memory],
            "bar1_used": N.nvmlDeviceGetBAR1MemoryInfo(h).bar1Used,
            "mem_used": N.nvmlDeviceGetMemoryInfo(h).used}


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "."
    os.makedirs(out, exist_ok=True)
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    doc = {"driver": N.nvmlSystemGetDriverVersion(), "name": N.nvmlDeviceGetName(h)}
    doc["idle"] = idle(h)
    worker = threading.Thread(target=work)
    worker.start()
    series, t0 = [], time.monotonic()
    for _ in range(6):
        series.append(sample(h, "idle-before", time.monotonic() - t0))
        time.sleep(0.5)
    start_load.set()
    for _ in range(24):
        series.append(sample(h, "memset", time.monotonic() - t0))
        time.sleep(0.5)
    stop_load.set()
    worker.join()
    for _ in range(12):
        series.append(sample(h, "idle-after", time.monotonic() - t0))
        time.sleep(0.5)
    doc["series"] = series
    with open(os.path.join(out, "fields-check.json"), "w") as fh:
        json.dump(doc, fh, indent=1, default=str)
    answered = sum(1 for r in doc["idle"]["all"] if r[2] == 0)
    print(f"wrote {os.path.join(out, 'fields-check.json')}: {answered} of {PROBE_TO - 1} field ids answered "
          f"idle; memory temperature "
          f"{series[0]['memory_temp']} -> {max(r['memory_temp'][2] or 0 for r in series)} C")


if __name__ == "__main__":
    main()
