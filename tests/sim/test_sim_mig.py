"""MIG in the simulator, through the unmodified pynvml in child processes: modes, profiles, placements,
GPU and compute instances, MIG device handles, persistence in the sim root, and the invalid requests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import smi as simsmi

Runner = Callable[..., Any]
Roots = Callable[[str], Path]

MIB = 1 << 20

# Child-process helpers: enable MIG on GPU 0 and read every GI profile.
HELPERS = """
def s(v):
    return v.decode() if isinstance(v, bytes) else v
def v(x):
    return getattr(x, "value", x)
def profiles(h):
    got = {}
    for p in range(20):
        try:
            i = n.nvmlDeviceGetGpuInstanceProfileInfo(h, p)
        except n.NVMLError as e:
            got[p] = type(e).__name__
            continue
        got[p] = [i.id, s(i.name), i.sliceCount, i.instanceCount, i.multiprocessorCount, i.memorySizeMB,
                  i.copyEngineCount, i.decoderCount]
    return got
def place(start, size):
    p = n.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return byref(p)  # pynvml passes the placement as given: a pointer, as the C API takes
def placements(h, pid):
    count = ctypes.c_uint(0)
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, None, byref(count))
    arr = (n.c_nvmlGpuInstancePlacement_t * count.value)()
    n.nvmlDeviceGetGpuInstancePossiblePlacements(h, pid, arr, byref(count))
    return [[p.start, p.size] for p in arr]
def gis(h, pid):
    arr = (n.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint(0)
    n.nvmlDeviceGetGpuInstances(h, pid, arr, byref(count))
    return [n.nvmlGpuInstanceGetInfo(arr[k]) for k in range(count.value)]
def mig_devices(h):
    out_ = []
    for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
        try:
            m = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
        except n.NVMLError_NotFound:
            continue
        parent = n.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(m)
        out_.append({"k": k, "uuid": s(n.nvmlDeviceGetUUID(m)), "name": s(n.nvmlDeviceGetName(m)),
                     "is_mig": v(n.nvmlDeviceIsMigDeviceHandle(m)),
                     "parent": n.nvmlDeviceGetIndex(parent), "gi": n.nvmlDeviceGetGpuInstanceId(m),
                     "ci": n.nvmlDeviceGetComputeInstanceId(m), "mem": n.nvmlDeviceGetMemoryInfo(m).total})
    return out_
n.nvmlInit()
"""


def mig(nvml: Runner, root: Path, code: str) -> Any:
    """Run a scenario with HELPERS defined and NVML initialized."""
    return nvml(root, HELPERS + textwrap.dedent(code))


def _enable_a100(root: Path, nvml: Runner, gpu: int = 0) -> None:
    r = mig(nvml, root, f"out(n.nvmlDeviceSetMigMode(n.nvmlDeviceGetHandleByIndex({gpu}), 1))")
    assert r == 19  # activationStatus NVML_ERROR_IN_USE: pending until a GPU reset
    simcontrol.inject(root, ["gpu", str(gpu), "reset"])


def test_a100_mig_mode_is_pending_until_a_gpu_reset(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("dgx-a100")
    r = mig(nvml, root, """
        h = n.nvmlDeviceGetHandleByIndex(0)
        before = list(n.nvmlDeviceGetMigMode(h))
        status = n.nvmlDeviceSetMigMode(h, n.NVML_DEVICE_MIG_ENABLE)
        after = list(n.nvmlDeviceGetMigMode(h))
        gi = err(n.nvmlDeviceCreateGpuInstance, h, 19)     # MIG not enabled yet
        bad = err(n.nvmlDeviceSetMigMode, h, 2)
        out([before, status, after, gi, bad])
    """)
    assert r == [[0, 0], 19, [0, 1], "NVMLError_NotSupported", "NVMLError_InvalidArgument"]
    # The driver keeps the pending mode: a new process sees it, and the other GPUs are untouched.
    assert mig(nvml, root, """
        out([list(n.nvmlDeviceGetMigMode(n.nvmlDeviceGetHandleByIndex(i))) for i in (0, 1)])
    """) == [[0, 1], [0, 0]]
    assert simcontrol.inject(root, ["gpu", "0", "reset"]) == "gpu 0 reset"
    assert mig(nvml, root, """
        out([list(n.nvmlDeviceGetMigMode(n.nvmlDeviceGetHandleByIndex(i))) for i in (0, 1)])
    """) == [[1, 1], [0, 0]]
    assert "mode 0 1 1" in (root / "mig").read_text()


def test_h100_mig_mode_applies_without_reset(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("hgx-h100")
    r = mig(nvml, root, """
        h = n.nvmlDeviceGetHandleByIndex(3)
        status = n.nvmlDeviceSetMigMode(h, 1)
        mode = list(n.nvmlDeviceGetMigMode(h))
        made = [n.nvmlDeviceCreateGpuInstance(h, 19) for _ in range(7)]
        eighth = err(n.nvmlDeviceCreateGpuInstance, h, 19)
        starts = sorted(n.nvmlGpuInstanceGetInfo(g).placement.start for g in made)
        ids = sorted(n.nvmlGpuInstanceGetInfo(g).id for g in made)
        off = n.nvmlDeviceSetMigMode(h, 0)                   # disabling drops the instances
        out([status, mode, eighth, starts, ids, off, list(n.nvmlDeviceGetMigMode(h)),
             profiles(n.nvmlDeviceGetHandleByIndex(0))[4]])
    """)
    assert r[:7] == [0, [1, 1], "NVMLError_InsufficientResources", [0, 1, 2, 3, 4, 5, 6],
                     list(range(7, 14)), 0, [0, 0]]
    # GPU 0 still has MIG off, and lists its profiles all the same (as the real H200 does)
    assert r[7] == [0, "MIG 7g.80gb", 7, 1, 132, 81152, 8, 7]


def test_h100_profiles(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("hgx-h100")
    r = mig(nvml, root, """
        h = n.nvmlDeviceGetHandleByIndex(0)
        n.nvmlDeviceSetMigMode(h, 1)
        out(profiles(h))
    """)
    table = {p: v for p, v in r.items() if isinstance(v, list)}
    assert {v[1]: (v[0], v[2], v[3], v[4], v[5]) for v in table.values()} == {
        "MIG 1g.10gb": (19, 1, 7, 16, 9984), "MIG 1g.10gb+me": (20, 1, 1, 16, 9984),
        "MIG 1g.20gb": (15, 1, 4, 26, 20096), "MIG 2g.20gb": (14, 2, 3, 32, 20096),
        "MIG 3g.40gb": (9, 3, 2, 60, 40448), "MIG 4g.40gb": (5, 4, 1, 64, 40448),
        "MIG 7g.80gb": (0, 7, 1, 132, 81152)}


def test_a100_profiles_and_placements(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("dgx-a100")
    _enable_a100(root, nvml)
    r = mig(nvml, root, """
        h = n.nvmlDeviceGetHandleByIndex(0)
        v1 = n.nvmlDeviceGetGpuInstanceProfileInfo(h, 2, version=1)
        out({"profiles": profiles(h), "v1": [v1.id, v1.sliceCount, v1.memorySizeMB],
             "placements": {pid: placements(h, pid) for pid in (19, 20, 15, 14, 9, 5, 0)},
             "bad_placement_profile": err(placements, h, 7),
             "other_gpu_placements": placements(n.nvmlDeviceGetHandleByIndex(1), 9)})
    """)
    p = r["profiles"]
    # NVML_GPU_INSTANCE_PROFILE_* index → [id, name, compute slices, instances, SMs, MiB, CEs, decoders]
    assert p["0"] == [19, "MIG 1g.10gb", 1, 7, 14, 9728, 1, 0]
    assert p["7"] == [20, "MIG 1g.10gb+me", 1, 1, 14, 9728, 1, 1]
    assert p["9"] == [15, "MIG 1g.20gb", 1, 4, 14, 19968, 1, 1]
    assert p["1"] == [14, "MIG 2g.20gb", 2, 3, 28, 19968, 2, 1]
    assert p["2"] == [9, "MIG 3g.40gb", 3, 2, 42, 40192, 3, 2]
    assert p["3"] == [5, "MIG 4g.40gb", 4, 1, 56, 40192, 4, 2]
    assert p["4"] == [0, "MIG 7g.80gb", 7, 1, 98, 80640, 7, 5]
    # Profiles the A100 does not have, and indexes past NVML's profile count (enumeration stops there).
    missing = {k for k, v in p.items() if v == "NVMLError_NotSupported"}
    assert missing == {"5", "6", "8", *map(str, range(10, 18))}
    assert p["18"] == p["19"] == "NVMLError_InvalidArgument"
    assert r["v1"] == [9, 3, 40192]
    assert r["placements"] == {
        "19": [[k, 1] for k in range(7)], "20": [[k, 1] for k in range(7)],
        "15": [[0, 2], [2, 2], [4, 2], [6, 2]], "14": [[0, 2], [2, 2], [4, 2]],
        "9": [[0, 4], [4, 4]], "5": [[0, 4]], "0": [[0, 8]]}
    assert r["bad_placement_profile"] == "NVMLError_NotSupported"
    assert r["other_gpu_placements"] == [[0, 4], [4, 4]]  # listed whether MIG is on or not (nvml.h)


def test_a100_instances_devices_and_invalid_requests(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("dgx-a100")
    _enable_a100(root, nvml)
    r = mig(nvml, root, """
        h = n.nvmlDeviceGetHandleByIndex(0)
        res = {}
        g3 = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 9, place(4, 4))      # 3g.40gb, slices 4-7
        g2 = n.nvmlDeviceCreateGpuInstance(h, 14)                               # 2g.20gb, top-most free
        g1 = n.nvmlDeviceCreateGpuInstanceWithPlacement(h, 19, place(0, 1))     # 1g.10gb at 0
        res["gi"] = [[i.id, i.profileId, i.placement.start, i.placement.size]
                     for i in map(n.nvmlGpuInstanceGetInfo, (g3, g2, g1))]
        res["invalid"] = [
            err(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 19, place(4, 1)),  # overlaps the 3g
            err(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 15, place(1, 2)),  # not a 1g.20gb placement
            err(n.nvmlDeviceCreateGpuInstanceWithPlacement, h, 19, place(1, 2)),  # wrong size
            err(n.nvmlDeviceCreateGpuInstance, h, 99),                            # no such profile
            err(n.nvmlDeviceCreateGpuInstance, h, 5),                             # 4g: 3+2+1+4 > 7 slices
            err(n.nvmlDeviceCreateGpuInstance, h, 0),                             # 7g: no room
            err(n.nvmlDeviceGetGpuInstanceById, h, 12),
        ]
        g1b = n.nvmlDeviceCreateGpuInstance(h, 19)                              # 1g at 1: seven slices used
        res["full"] = [err(n.nvmlDeviceCreateGpuInstance, h, 19),
                       n.nvmlDeviceGetGpuInstanceRemainingCapacity(h, 19)]
        res["list"] = [[i.id for i in gis(h, pid)] for pid in (9, 14, 19, 5)]
        res["by_id"] = n.nvmlGpuInstanceGetInfo(n.nvmlDeviceGetGpuInstanceById(h, 2)).profileId
        # compute instances
        ci3 = n.nvmlGpuInstanceCreateComputeInstance(g3, 2)                    # 3c: the whole 3g
        ci_a = n.nvmlGpuInstanceCreateComputeInstance(g2, 0)                   # 1c.2g.20gb
        ci_b = n.nvmlGpuInstanceCreateComputeInstance(g2, 0)
        ci1 = n.nvmlGpuInstanceCreateComputeInstance(g1, 0)
        cinfo = n.nvmlGpuInstanceGetComputeInstanceProfileInfo(g3, 0, 0)
        res["ci_profile"] = [cinfo.id, cinfo.sliceCount, cinfo.instanceCount, cinfo.multiprocessorCount,
                             s(cinfo.name)]
        res["ci_invalid"] = [
            err(n.nvmlGpuInstanceCreateComputeInstance, g2, 0),                 # 2g already split in two 1c
            err(n.nvmlGpuInstanceCreateComputeInstance, g2, 4),                 # 7c in a 2g
            err(n.nvmlGpuInstanceCreateComputeInstance, g2, 42),
            err(n.nvmlGpuInstanceGetComputeInstanceProfileInfo, g1, 1, 0),      # 2c in a 1g
            err(n.nvmlGpuInstanceGetComputeInstanceById, g2, 5),
            err(n.nvmlGpuInstanceDestroy, g2),                                  # has compute instances
        ]
        info = n.nvmlComputeInstanceGetInfo(ci_b)
        res["ci_info"] = [info.id, info.profileId, info.placement.start, info.placement.size,
                          n.nvmlDeviceGetIndex(info.device)]
        arr = (n.c_nvmlComputeInstance_t * 8)()
        count = ctypes.c_uint(0)
        n.nvmlGpuInstanceGetComputeInstances(g2, 0, arr, byref(count))
        res["ci_list"] = count.value
        res["devices"] = mig_devices(h)
        res["full_gpu"] = [v(n.nvmlDeviceIsMigDeviceHandle(h)), err(n.nvmlDeviceGetGpuInstanceId, h),
                           err(n.nvmlDeviceGetMigDeviceHandleByIndex, h, 5)]
        # tear down: a destroyed compute instance's MIG handle is gone
        m0 = n.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
        n.nvmlComputeInstanceDestroy(ci_a); n.nvmlComputeInstanceDestroy(ci_b)
        n.nvmlGpuInstanceDestroy(g2)
        res["after"] = [len(mig_devices(h)), [i.id for i in gis(h, 14)], err(n.nvmlGpuInstanceGetInfo, g2)]
        res["kept"] = s(n.nvmlDeviceGetUUID(m0))
        del g1b, ci3, ci1
        out(res)
    """)
    assert r["gi"] == [[2, 9, 4, 4], [4, 14, 2, 2], [7, 19, 0, 1]]
    assert r["invalid"] == ["NVMLError_InsufficientResources", "NVMLError_InvalidArgument",
                            "NVMLError_InvalidArgument", "NVMLError_InvalidArgument",
                            "NVMLError_InsufficientResources", "NVMLError_InsufficientResources",
                            "NVMLError_NotFound"]
    assert r["full"] == ["NVMLError_InsufficientResources", 0]
    assert r["list"] == [[2], [4], [7, 8], []]
    assert r["by_id"] == 9
    assert r["ci_profile"] == [0, 1, 3, 14, "MIG 1c.3g.40gb"]
    assert r["ci_invalid"] == ["NVMLError_InsufficientResources", "NVMLError_NotSupported",
                               "NVMLError_InvalidArgument", "NVMLError_NotSupported", "NVMLError_NotFound",
                               "NVMLError_InUse"]
    assert r["ci_info"] == [1, 0, 1, 1, 0]
    assert r["ci_list"] == 2
    devices = r["devices"]
    # ordered by GPU-instance placement: 1g at 0, then the 2g (two 1c), then the 3g
    assert [(d["gi"], d["ci"]) for d in devices] == [(7, 0), (4, 0), (4, 1), (2, 0)]
    assert [d["k"] for d in devices] == [0, 1, 2, 3]
    assert [d["name"] for d in devices] == ["NVIDIA A100-SXM4-80GB MIG " + p
                                            for p in ("1g.10gb", "1c.2g.20gb", "1c.2g.20gb", "3g.40gb")]
    assert [d["mem"] for d in devices] == [9728 * MIB, 19968 * MIB, 19968 * MIB, 40192 * MIB]
    assert all(d["is_mig"] == 1 and d["parent"] == 0 for d in devices)
    uuid_re = r"MIG-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}"
    assert all(re.fullmatch(uuid_re, d["uuid"]) for d in devices)
    assert len({d["uuid"] for d in devices}) == 4
    assert r["full_gpu"][1:] == ["NVMLError_NotSupported", "NVMLError_NotFound"]
    assert r["after"] == [2, [], "NVMLError_InvalidArgument"]
    assert r["kept"] == devices[0]["uuid"]  # the 1g device survives the 2g's teardown

    # The state is the driver's, not the process's: a new process sees the same instances and UUIDs.
    again = mig(nvml, root, """
        found = mig_devices(n.nvmlDeviceGetHandleByIndex(0))
        by_uuid = n.nvmlDeviceGetHandleByUUID(found[1]["uuid"])
        out([found, s(n.nvmlDeviceGetUUID(by_uuid)), n.nvmlDeviceGetComputeInstanceId(by_uuid),
             n.nvmlDeviceGetGpuInstanceId(by_uuid)])
    """)
    assert [d["uuid"] for d in again[0]] == [devices[0]["uuid"], devices[3]["uuid"]]
    assert again[1:] == [devices[3]["uuid"], 0, 2]  # GetHandleByUUID resolves MIG UUIDs
    text = (root / "mig").read_text()
    assert "gi 0 2 9 4" in text and "ci 0 7 0 0 0" in text
    # nvidia-smi -L lists them under their GPU.
    env = simmachine.sim_env(root)
    listing = _smi(env, ["-L"])
    lines = listing.splitlines()
    assert lines[0].startswith("GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-")
    assert lines[1] == f"  MIG 1g.10gb     Device  0: (UUID: {devices[0]['uuid']})"
    assert lines[2] == f"  MIG 3g.40gb     Device  1: (UUID: {devices[3]['uuid']})"
    assert lines[3].startswith("GPU 1: ")
    # A GPU reset drops the instances; MIG stays on.
    simcontrol.inject(root, ["gpu", "0", "reset"])
    assert mig(nvml, root, """
        h = n.nvmlDeviceGetHandleByIndex(0)
        out([list(n.nvmlDeviceGetMigMode(h)), mig_devices(h), [i.id for i in gis(h, 19)]])
    """) == [[1, 1], [], []]


def _smi(env: dict[str, str], argv: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "gpufleet_harness.sim.smi", *argv],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout


def test_smi_mig_line_format() -> None:
    gpu = type("G", (), {"index": 0, "model": "NVIDIA A100-SXM4-80GB", "uuid": "GPU-x", "lost": False})()
    migs = [simsmi.MigRow("1g.10gb", "MIG-a"), simsmi.MigRow("1c.3g.40gb", "MIG-b")]
    row = simsmi.Row(gpu=gpu, mig_devices=migs)  # type: ignore[arg-type]
    assert simsmi.list_gpus([row]).splitlines() == [
        "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-x)",
        "  MIG 1g.10gb     Device  0: (UUID: MIG-a)",
        "  MIG 1c.3g.40gb  Device  1: (UUID: MIG-b)",
    ]


@pytest.mark.parametrize("fixture", ["pcie-2x-t4", "esxi-vm-2x-v100"])
def test_mig_on_gpus_without_mig_is_not_supported(fixture: str, sim_root: Roots, nvml: Runner) -> None:
    r = mig(nvml, sim_root(fixture), """
        h = n.nvmlDeviceGetHandleByIndex(0)
        out([err(n.nvmlDeviceGetMigMode, h), err(n.nvmlDeviceSetMigMode, h, 1),
             err(n.nvmlDeviceGetGpuInstanceProfileInfo, h, 0), err(n.nvmlDeviceCreateGpuInstance, h, 19),
             err(placements, h, 19), v(n.nvmlDeviceGetMaxMigDeviceCount(h)),
             err(n.nvmlDeviceGetMigDeviceHandleByIndex, h, 0), v(n.nvmlDeviceIsMigDeviceHandle(h))])
    """)
    assert r[:5] + r[6:7] == ["NVMLError_NotSupported"] * 6
    assert r[5] == 0  # GetMaxMigDeviceCount: nvml.h says zero where MIG is not supported
    assert r[7] == 0


def test_reset_injection_is_checked(fresh_root: Roots) -> None:
    root = fresh_root("pcie-2x-t4")
    with pytest.raises(simcontrol.InjectError, match=re.escape("usage: gpu N lost|ok|reset")):
        simcontrol.inject(root, ["gpu", "0", "rest"])
    assert simcontrol.inject(root, ["gpu", "1", "reset"]) == "gpu 1 reset"
    assert (root / "mig").read_text().splitlines()[1:] == []  # no MIG GPU, nothing to record


def test_xid_in_a_mig_device_carries_its_instance_ids(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("hgx-h100")
    r = mig(nvml, root, f"""
        from gpufleet_harness.sim import control
        h = n.nvmlDeviceGetHandleByIndex(2)
        n.nvmlDeviceSetMigMode(h, 1)
        gi = n.nvmlDeviceCreateGpuInstance(h, 9)                    # 3g.40gb
        ci = n.nvmlGpuInstanceCreateComputeInstance(gi, 2)
        gi_id, ci_id = n.nvmlGpuInstanceGetInfo(gi).id, n.nvmlComputeInstanceGetInfo(ci).id
        es = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, es)
        control.inject({str(root)!r}, ["xid", "2", "43", str(gi_id), str(ci_id)])
        control.inject({str(root)!r}, ["xid", "2", "79"])
        a, b = n.nvmlEventSetWait(es, 5000), n.nvmlEventSetWait(es, 5000)
        out([gi_id, ci_id,
             [a.eventData, a.gpuInstanceId, a.computeInstanceId, n.nvmlDeviceGetIndex(a.device)],
             [b.eventData, b.gpuInstanceId, b.computeInstanceId]])
    """)
    gi_id, ci_id = r[0], r[1]
    assert r[2] == [43, gi_id, ci_id, 2]  # reported on the parent GPU with the instance ids
    assert r[3] == [79, 0xFFFFFFFF, 0xFFFFFFFF]
    with pytest.raises(simcontrol.InjectError, match="no compute instance 5"):
        simcontrol.inject(root, ["xid", "2", "43", str(gi_id), "5"])
    with pytest.raises(simcontrol.InjectError, match=re.escape("usage: xid N CODE [GI CI]")):
        simcontrol.inject(root, ["xid", "2", "43", str(gi_id)])
