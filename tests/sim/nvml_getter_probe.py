#!/usr/bin/env python3
"""Read-only NVML getter probe: the getters of the H200 recording
(tests/realgpu/h200-580.159.04/nvml-probe.json), each with its value or NVML error, as JSON in that
recording's format.

Self-contained (Python 3.8+, the standard library and pynvml / nvidia-ml-py), so the same file runs on a
host with a real GPU and against gpufleet's simulator:

    python3 nvml_getter_probe.py real > nvml-probe.json          # as root on the GPU host
    python3 nvml_getter_probe.py sim > probe.json                 # with `gpufleet sim env` exported

tests/sim/test_sim_h200_contract.py runs it against the simulated H200 and compares every entry with the
recording. It never changes anything: no setter, no reset, no MIG or persistence mode change, no clock or
power setting. The one event set it makes is freed again.

Differences from the probe that took the 2026-11-28 recording (tests/realgpu/nvml_probe.py), all additive
or corrections: the MIG placements are read with pynvml's real signature (the recording's call raised a
TypeError in pynvml), and GETTERS_ADDED lists getters the recording lacks.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import pynvml as N

SYSTEM_GETTERS = [
    "nvmlSystemGetDriverVersion", "nvmlSystemGetNVMLVersion", "nvmlSystemGetCudaDriverVersion",
    "nvmlSystemGetCudaDriverVersion_v2", "nvmlDeviceGetCount", "nvmlUnitGetCount",
    "nvmlGetExcludedDeviceCount", "nvmlSystemGetDriverBranch",
]
# One-argument device getters (the handle), in the recording's order.
DEVICE_GETTERS = [
    "nvmlDeviceGetName", "nvmlDeviceGetUUID", "nvmlDeviceGetSerial", "nvmlDeviceGetPciInfo",
    "nvmlDeviceGetPciInfo_v3", "nvmlDeviceGetMemoryInfo", "nvmlDeviceGetBAR1MemoryInfo",
    "nvmlDeviceGetMinorNumber", "nvmlDeviceGetIndex", "nvmlDeviceGetArchitecture",
    "nvmlDeviceGetCudaComputeCapability", "nvmlDeviceGetBrand", "nvmlDeviceGetPersistenceMode",
    "nvmlDeviceGetComputeMode", "nvmlDeviceGetMigMode", "nvmlDeviceGetMaxMigDeviceCount",
    "nvmlDeviceGetNumaNodeId", "nvmlDeviceGetPowerUsage",
    "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetPowerManagementLimit",
    "nvmlDeviceGetPowerManagementLimitConstraints", "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetCurrentClocksThrottleReasons", "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetEccMode", "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetSupportedEventTypes",
    "nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetVbiosVersion", "nvmlDeviceGetBoardPartNumber", "nvmlDeviceGetCurrPcieLinkGeneration",
    "nvmlDeviceGetCurrPcieLinkWidth", "nvmlDeviceGetMaxPcieLinkGeneration",
    "nvmlDeviceGetMaxPcieLinkWidth", "nvmlDeviceGetDisplayMode", "nvmlDeviceGetDisplayActive",
    "nvmlDeviceGetVirtualizationMode", "nvmlDeviceGetHostVgpuMode", "nvmlDeviceGetGspFirmwareMode",
    "nvmlDeviceGetGspFirmwareVersion", "nvmlDeviceGetMemoryBusWidth", "nvmlDeviceGetNumGpuCores",
    "nvmlDeviceGetBoardId", "nvmlDeviceGetMultiGpuBoard", "nvmlDeviceGetFanSpeed",
    "nvmlDeviceGetNumFans", "nvmlDeviceGetPerformanceState", "nvmlDeviceGetPowerState",
    "nvmlDeviceGetAccountingMode", "nvmlDeviceGetAutoBoostedClocksEnabled",
    "nvmlDeviceGetEncoderUtilization", "nvmlDeviceGetDecoderUtilization",
    "nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetPcieReplayCounter",
    "nvmlDeviceGetInforomImageVersion", "nvmlDeviceGetInforomConfigurationChecksum",
    "nvmlDeviceGetRetiredPagesPendingStatus", "nvmlDeviceGetAttributes",
    "nvmlDeviceGetAttributes_v2", "nvmlDeviceGetIrqNum", "nvmlDeviceGetBusType",
    "nvmlDeviceGetPcieLinkMaxSpeed", "nvmlDeviceGetPcieSpeed", "nvmlDeviceGetModuleId",
    "nvmlDeviceGetC2cModeInfoV", "nvmlDeviceIsMigDeviceHandle",
    "nvmlDeviceGetPdi",
    "nvmlDeviceGetAddressingMode", "nvmlDeviceGetRepairStatus", "nvmlDeviceGetPowerSource",
    "nvmlDeviceGetDramEncryptionMode", "nvmlDeviceGetHostname_v1",
    "nvmlDeviceGetConfComputeMemSizeInfo",
    # not in the 2026-11-28 recording (GETTERS_ADDED)
    "nvmlDeviceGetSupportedClocksEventReasons", "nvmlDeviceGetPowerManagementDefaultLimit",
]
# Entries of this probe that the 2026-11-28 recording does not have (compared once a re-recording has them).
GETTERS_ADDED = [
    "nvmlDeviceGetSupportedClocksEventReasons", "nvmlDeviceGetPowerManagementDefaultLimit",
    "nvmlDeviceGetInforomVersion(OEM)", "nvmlDeviceGetInforomVersion(ECC)",
    "nvmlDeviceGetInforomVersion(POWER)",
    "nvmlDeviceGetMaxCustomerBoostClock(0)", "nvmlDeviceGetPcieThroughput(RX)",
    "nvmlDeviceGetTotalEnergyConsumption(again)",
]
# Calls that take a caller-made structure: (pynvml structure, function, version constant or None).
STRUCT_GETTERS = [
    ("c_nvmlGpuFabricInfo_t", "nvmlDeviceGetGpuFabricInfo", None),
    ("c_nvmlGpuFabricInfo_v3_t", "nvmlDeviceGetGpuFabricInfoV", "nvmlGpuFabricInfo_v3"),
    ("c_nvmlPlatformInfo_v2_t", "nvmlDeviceGetPlatformInfo", "nvmlPlatformInfo_v2"),
]
GPU_INSTANCE_PROFILES = range(16)  # NVML_GPU_INSTANCE_PROFILE_* indexes probed
NVLINKS = range(20)


def err_name(e):
    code = getattr(e, "value", None)
    for k in dir(N):
        if k.startswith("NVML_ERROR_") and getattr(N, k) == code:
            return k
    return f"NVMLError({code})"


def conv(v, depth=0):
    """A pynvml answer as JSON: structures as objects of their fields, arrays as lists, bytes as text."""
    if depth > 4:
        return repr(v)[:200]
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    if isinstance(v, bytes):
        return v.decode(errors="replace")
    if isinstance(v, ctypes.Array):
        v = list(v)
    if isinstance(v, (list, tuple)):
        return [conv(x, depth + 1) for x in v][:64]
    if hasattr(v, "_fields_"):
        return {f[0]: conv(getattr(v, f[0]), depth + 1) for f in v._fields_}
    return repr(v)[:200]


def call(fn, *args):
    """{"ok": value} or {"err": NVML error name}, with the call's time in µs; {"missing"} when pynvml lacks
    the function, {"exc"} when pynvml itself fails (the library lacks the symbol, a binding's own error)."""
    t = time.perf_counter()
    try:
        v = fn(*args)
        return {"ok": conv(v), "us": round((time.perf_counter() - t) * 1e6, 1)}
    except N.NVMLError as e:
        return {"err": err_name(e), "us": round((time.perf_counter() - t) * 1e6, 1)}
    except AttributeError as e:
        return {"missing": str(e)[:120]}
    except Exception as e:
        return {"exc": f"{type(e).__name__}: {str(e)[:160]}"}


def g(name):
    fn = getattr(N, name, None)
    if fn is None:
        def absent(*_args):
            raise AttributeError(name)
        return absent
    return fn


def struct_call(struct_name, fn_name, version_name):
    """Calls that take a caller-made structure (pynvml passes it as given)."""
    def run(handle):
        st = getattr(N, struct_name)()
        if version_name:
            st.version = getattr(N, version_name)
        getattr(N, fn_name)(handle, ctypes.byref(st))
        return st
    return run


def placements(handle, profile_id):
    """nvmlDeviceGetGpuInstancePossiblePlacements_v2 as [[start, size], ...] (asks for the count first)."""
    count = ctypes.c_uint(0)
    N.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, None, ctypes.byref(count))
    array = (N.c_nvmlGpuInstancePlacement_t * max(count.value, 1))()
    N.nvmlDeviceGetGpuInstancePossiblePlacements(handle, profile_id, array, ctypes.byref(count))
    return [[array[k].start, array[k].size] for k in range(count.value)]


def probe_device(h):
    d = {}
    for name in DEVICE_GETTERS:
        d[name] = call(g(name), h)
    d["nvmlDeviceGetTemperature(GPU)"] = call(g("nvmlDeviceGetTemperature"), h, 0)
    d["nvmlDeviceGetMemoryInfo(v2)"] = call(lambda x: N.nvmlDeviceGetMemoryInfo(x, version=N.nvmlMemory_v2),
                                            h)
    for sname, fname, ver in STRUCT_GETTERS:
        d[fname] = call(struct_call(sname, fname, ver), h)
    d["nvmlDeviceGetCpuAffinity(4)"] = call(g("nvmlDeviceGetCpuAffinity"), h, 4)
    d["nvmlDeviceGetMemoryAffinity(4,0)"] = call(g("nvmlDeviceGetMemoryAffinity"), h, 4, 0)
    for clk in (0, 1, 2, 3):  # graphics, SM, memory, video
        d[f"nvmlDeviceGetClockInfo({clk})"] = call(g("nvmlDeviceGetClockInfo"), h, clk)
        d[f"nvmlDeviceGetMaxClockInfo({clk})"] = call(g("nvmlDeviceGetMaxClockInfo"), h, clk)
    for et in (0, 1):  # NVML_MEMORY_ERROR_TYPE_CORRECTED / UNCORRECTED, volatile / aggregate counters
        for ct in (0, 1):
            d[f"nvmlDeviceGetTotalEccErrors({et},{ct})"] = call(g("nvmlDeviceGetTotalEccErrors"), h, et, ct)
    d["nvmlDeviceGetRetiredPages(DBE)"] = call(g("nvmlDeviceGetRetiredPages"), h, 1)
    d["nvmlDeviceGetPcieThroughput(TX)"] = call(g("nvmlDeviceGetPcieThroughput"), h, 0)
    # GETTERS_ADDED
    d["nvmlDeviceGetPcieThroughput(RX)"] = call(g("nvmlDeviceGetPcieThroughput"), h, 1)
    for label, obj in (("OEM", 0), ("ECC", 1), ("POWER", 2)):
        d[f"nvmlDeviceGetInforomVersion({label})"] = call(g("nvmlDeviceGetInforomVersion"), h, obj)
    d["nvmlDeviceGetMaxCustomerBoostClock(0)"] = call(g("nvmlDeviceGetMaxCustomerBoostClock"), h, 0)
    time.sleep(0.1)
    d["nvmlDeviceGetTotalEnergyConsumption(again)"] = call(g("nvmlDeviceGetTotalEnergyConsumption"), h)
    links = {}
    for link in NVLINKS:
        st = call(g("nvmlDeviceGetNvLinkState"), h, link)
        links[link] = {"state": st}
        if "ok" in st:
            links[link]["version"] = call(g("nvmlDeviceGetNvLinkVersion"), h, link)
            links[link]["remote_pci"] = call(g("nvmlDeviceGetNvLinkRemotePciInfo"), h, link)
            links[link]["remote_type"] = call(g("nvmlDeviceGetNvLinkRemoteDeviceType"), h, link)
            links[link]["cap_p2p"] = call(g("nvmlDeviceGetNvLinkCapability"), h, link, 0)
        if "err" in st and st["err"] in ("NVML_ERROR_INVALID_ARGUMENT", "NVML_ERROR_NOT_SUPPORTED"):
            break
    d["nvlink"] = links
    # MIG: profiles and placements are readable with MIG off; the mode is never changed here.
    profs = {}
    for p in GPU_INSTANCE_PROFILES:
        r = call(g("nvmlDeviceGetGpuInstanceProfileInfo"), h, p)
        if "ok" in r or r.get("err") != "NVML_ERROR_INVALID_ARGUMENT":
            profs[p] = r
        if "ok" in r:
            profs[p]["placements"] = call(placements, h, r["ok"]["id"])
    d["mig_profiles"] = profs
    d["mig_device_0"] = call(g("nvmlDeviceGetMigDeviceHandleByIndex"), h, 0)
    # Events: a set, registered for what is supported, one bounded wait (TIMEOUT, or an event that came).
    try:
        es = N.nvmlEventSetCreate()
        sup = N.nvmlDeviceGetSupportedEventTypes(h)
        reg = call(N.nvmlDeviceRegisterEvents, h, sup, es)
        wait = call(N.nvmlEventSetWait, es, 200)
        d["events"] = {"supported": sup, "register": reg, "wait_200ms": wait}
        N.nvmlEventSetFree(es)
    except N.NVMLError as e:
        d["events"] = {"err": err_name(e)}
    d["byuuid"] = call(lambda u: N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(u)), N.nvmlDeviceGetUUID(h))
    pci = N.nvmlDeviceGetPciInfo(h)
    bus = pci.busId.decode() if isinstance(pci.busId, bytes) else pci.busId
    d["bypci"] = call(lambda b: N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(b)), bus)
    return d


def main(argv):
    out = {"argv": argv, "pynvml": getattr(N, "__version__", None)}
    t = time.perf_counter()
    N.nvmlInit()
    out["init_ms"] = round((time.perf_counter() - t) * 1e3, 2)
    out["system"] = {name: call(g(name)) for name in SYSTEM_GETTERS}
    out["devices"] = [probe_device(N.nvmlDeviceGetHandleByIndex(i)) for i in range(N.nvmlDeviceGetCount())]
    # error paths a plugin relies on
    out["bad_uuid"] = call(N.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000")
    out["bad_index"] = call(N.nvmlDeviceGetHandleByIndex, 64)
    N.nvmlShutdown()
    print(json.dumps(out, indent=1, sort_keys=True, default=repr))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
