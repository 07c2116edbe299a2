#!/usr/bin/env python3
"""What a real GPU shows while a process holds it: the readings the simulator's workloads model but the
2026-11-28 recording did not capture. Read-only towards the GPU's settings; stdlib + pynvml + the driver's
libcuda.so.1 (no CUDA toolkit, no torch).

A CUDA context of our own allocates 1 GiB and memsets it in a loop for ~8 s; meanwhile this records:
nvidia-smi's summary (its process row: the simulator's layout was taken from a public paste of 580's), `-q`'s
and `-q -x`'s process sections, `dmon -s pucvmet`, and through NVML the process list (v1 and v3 with the
instance ids), nvmlSystemGetProcessName, the video clock, BAR1 in use, the JPG/OFA utilization and the memory
in use per context. Writes process-check.json and smi-*.txt into the folder given (default: .).

    python3 process_check.py OUTDIR
"""

import ctypes
import json
import os
import subprocess
import sys
import threading
import time

import pynvml as N

OUT = sys.argv[1] if len(sys.argv) > 1 else "."
os.makedirs(OUT, exist_ok=True)
done = threading.Event()


def work():
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(dev), 0) == 0
    assert cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev) == 0
    words = (1 << 30) // 4
    assert cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(words * 4)) == 0
    end = time.time() + 8
    while time.time() < end and not done.is_set():
        for k in range(20):
            cuda.cuMemsetD32_v2(ptr, ctypes.c_uint(k), ctypes.c_size_t(words))
        cuda.cuCtxSynchronize()
    cuda.cuMemFree_v2(ptr)
    cuda.cuCtxDestroy_v2(ctx)


def g(fn, *a):
    try:
        v = fn(*a)
    except N.NVMLError as e:
        return f"err:{e}"
    except Exception as e:  # a pynvml without the call
        return f"exc:{type(e).__name__}"
    return v.decode() if isinstance(v, bytes) else v


def smi(name, *argv):
    r = subprocess.run(["nvidia-smi", *argv], capture_output=True, text=True, timeout=60)
    with open(os.path.join(OUT, name), "w") as fh:
        fh.write(r.stdout + r.stderr + f"rc={r.returncode}\n")


N.nvmlInit()
h = N.nvmlDeviceGetHandleByIndex(0)
before = {"mem_used": N.nvmlDeviceGetMemoryInfo(h).used,
          "bar1_used": N.nvmlDeviceGetBAR1MemoryInfo(h).bar1Used,
          "video_mhz": g(N.nvmlDeviceGetClockInfo, h, 3)}
worker = threading.Thread(target=work)
worker.start()
time.sleep(3)


def listed(procs):
    if not isinstance(procs, list):
        return procs
    return [[p.pid, p.usedGpuMemory, getattr(p, "gpuInstanceId", None), getattr(p, "computeInstanceId", None)]
            for p in procs]


rows = listed(g(N.nvmlDeviceGetComputeRunningProcesses_v3, h)) or []
during = {
    "procs_v3": rows,
    "procs_v2": listed(g(N.nvmlDeviceGetComputeRunningProcesses_v2, h)),
    "names": {str(r[0]): g(N.nvmlSystemGetProcessName, r[0]) for r in rows if isinstance(rows, list)},
    "mem_used": N.nvmlDeviceGetMemoryInfo(h).used,
    "bar1_used": N.nvmlDeviceGetBAR1MemoryInfo(h).bar1Used,
    "util": str(g(N.nvmlDeviceGetUtilizationRates, h)),
    "clocks": {k: g(N.nvmlDeviceGetClockInfo, h, k) for k in range(4)},
    "reasons": g(N.nvmlDeviceGetCurrentClocksEventReasons, h), "power_mw": g(N.nvmlDeviceGetPowerUsage, h),
    "jpg": g(N.nvmlDeviceGetJpgUtilization, h), "ofa": g(N.nvmlDeviceGetOfaUtilization, h),
    "mps_procs": listed(g(N.nvmlDeviceGetMPSComputeRunningProcesses_v3, h)),
    "graphics_procs": listed(g(N.nvmlDeviceGetGraphicsRunningProcesses_v3, h)),
}
smi("smi-busy.txt")
smi("smi-q-busy.txt", "-q")
smi("smi-qx-busy.txt", "-q", "-x")
smi("dmon-busy.txt", "dmon", "-s", "pucvmet", "-c", "3")
done.set()
worker.join()
time.sleep(1)
after = {"procs_v3": listed(g(N.nvmlDeviceGetComputeRunningProcesses_v3, h)),
         "mem_used": N.nvmlDeviceGetMemoryInfo(h).used}
with open(os.path.join(OUT, "process-check.json"), "w") as fh:
    doc = {"pid": os.getpid(), "before": before, "during": during, "after": after}
    json.dump(doc, fh, indent=1, default=str)
print("written to", OUT)
