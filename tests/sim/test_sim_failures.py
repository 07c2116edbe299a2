"""Lifetime, failure injection and events, through the unmodified pynvml in child processes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.sim import control as simcontrol

Runner = Callable[..., Any]

Roots = Callable[[str], Path]  # fixture name → sim root


def test_init_shutdown_is_reference_counted(sim_root: Roots, nvml: Runner) -> None:
    r = nvml(sim_root("pcie-2x-t4"), """
        n.nvmlInit(); n.nvmlInit()
        n.nvmlShutdown()
        still = n.nvmlDeviceGetCount()             # one reference left
        n.nvmlShutdown()
        after = err(n.nvmlDeviceGetCount)          # none left
        extra = n.nvmlLib.nvmlShutdown()           # C level: shutdown below zero
        n.nvmlInit()                               # and back
        again = n.nvmlDeviceGetCount()
        h = n.nvmlDeviceGetHandleByIndex(1)
        n.nvmlShutdown(); n.nvmlInit()
        kept = n.nvmlDeviceGetIndex(h)             # handles survive a shutdown/init cycle
        out([still, after, extra, again, kept])
    """)
    assert r == [2, "NVMLError_Uninitialized", 1, 2, 1]


def test_calls_before_init_are_uninitialized(sim_root: Roots, nvml: Runner) -> None:
    r = nvml(sim_root("pcie-2x-t4"), """
        n._LoadNvmlLibrary()
        c = ctypes.c_uint()
        out([n.nvmlLib.nvmlDeviceGetCount_v2(byref(c)), n.nvmlSystemGetNVMLVersion()])
    """)
    assert r == [1, "12.535.261.03"]  # the NVML version needs no init, like the real library


def test_unversioned_entry_points_and_legacy_pci_struct(sim_root: Roots, nvml: Runner) -> None:
    r = nvml(sim_root("dgx-a100"), """
        lib = ctypes.CDLL("libnvidia-ml.so.1")
        rc = [lib.nvmlInit()]
        c = ctypes.c_uint(); rc.append(lib.nvmlDeviceGetCount(byref(c)))
        h = ctypes.c_void_p(); rc.append(lib.nvmlDeviceGetHandleByIndex(2, byref(h)))
        buf = (ctypes.c_ubyte * 72)(*([0xAB] * 72))
        rc.append(lib.nvmlDeviceGetPciInfo(h, buf))
        legacy = bytes(buf[:16]).split(b"\\0")[0].decode()
        untouched = all(b == 0xAB for b in buf[40:])   # v1 structs end before the 32-byte busId
        h2 = ctypes.c_void_p(); rc.append(lib.nvmlDeviceGetHandleByPciBusId(b"0000:47:00.0", byref(h2)))
        rc.append(lib.nvmlShutdown())
        out([rc, c.value, legacy, untouched, h.value == h2.value])
    """)
    assert r == [[0, 0, 0, 0, 0, 0], 8, "0000:47:00.0", True, True]


def test_pci_bus_id_lookup_forms(sim_root: Roots, nvml: Runner) -> None:
    r = nvml(sim_root("dgx-a100"), """
        n.nvmlInit()
        idx = lambda b: n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByPciBusId(b))
        out([idx("00000000:4E:00.0"), idx("0000:4e:00.0"), idx("00000000:4e:00.0"), idx("4E:00.0"),
             err(n.nvmlDeviceGetHandleByPciBusId, "0000:99:00.0"),
             err(n.nvmlDeviceGetHandleByPciBusId, "junk"),
             err(n.nvmlDeviceGetHandleByUUID, "GPU-00000000-0000-0000-0000-000000000000")])
    """)
    assert r == [3, 3, 3, 3, "NVMLError_NotFound", "NVMLError_InvalidArgument", "NVMLError_NotFound"]


def test_missing_machine_json_is_driver_not_loaded_with_one_message(tmp_path: Path, nvml: Runner,
                                                                   sim_root: Roots) -> None:
    root = sim_root("pcie-2x-t4")
    code = f"""
        import os
        os.environ["GPUFLEET_SIM_ROOT"] = {str(tmp_path / "nowhere")!r}
        out([err(n.nvmlInit), err(n.nvmlInit)])
    """
    r, proc = nvml(root, code, check=False)
    assert r == ["NVMLError_DriverNotLoaded"] * 2
    msgs = [ln for ln in proc.stderr.splitlines() if ln.startswith("gpufleet-sim:")]
    assert len(msgs) == 1 and "machine.json" in msgs[0]


def test_bad_machine_json_is_driver_not_loaded(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("pcie-2x-t4")
    (root / "machine.json").write_text('{"schema": 1, "gpus": [')
    r, proc = nvml(root, "out(err(n.nvmlInit))", check=False)
    assert r == "NVMLError_DriverNotLoaded"
    assert "gpufleet-sim:" in proc.stderr and "not valid JSON" in proc.stderr


def test_driver_unloaded(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("dgx-a100")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        control.inject({str(root)!r}, ["driver", "unloaded"])
        a = [err(n.nvmlDeviceGetName, h), err(n.nvmlDeviceGetCount)]
        n.nvmlShutdown()
        a.append(err(n.nvmlInit))
        control.inject({str(root)!r}, ["driver", "loaded"])
        a.append(err(n.nvmlInit))
        a.append(n.nvmlDeviceGetName(h))
        out(a)
    """)
    assert r == ["NVMLError_DriverNotLoaded", "NVMLError_DriverNotLoaded", "NVMLError_DriverNotLoaded", "ok",
                 "NVIDIA A100-SXM4-80GB"]
    host = root / "host"
    simcontrol.inject(root, ["driver", "unloaded"])
    assert not (host / "sys/module/nvidia").exists() and not (host / "proc/driver/nvidia").exists()
    assert not (host / "sys/bus/pci/devices/0000:07:00.0/driver").is_symlink()
    simcontrol.inject(root, ["driver", "loaded"])
    assert (host / "sys/module/nvidia/version").read_text() == "535.261.03\n"
    assert (host / "sys/bus/pci/devices/0000:07:00.0/driver").resolve().name == "nvidia"


def test_library_missing_is_library_not_found(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["library", "missing"])
    assert not (root / "host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").exists()
    assert nvml(root, "out(err(n.nvmlInit))") == "NVMLError_LibraryNotFound"
    simcontrol.inject(root, ["library", "present"])
    assert nvml(root, "n.nvmlInit(); out(n.nvmlDeviceGetCount())") == 2


def test_gpu_lost_and_back(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("dgx-a100")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        h3, h2 = n.nvmlDeviceGetHandleByIndex(3), n.nvmlDeviceGetHandleByIndex(2)
        uuid = n.nvmlDeviceGetUUID(h3)
        control.inject({str(root)!r}, ["gpu", "3", "lost"])
        lost = [err(n.nvmlDeviceGetName, h3), err(n.nvmlDeviceGetMemoryInfo, h3),
                err(n.nvmlDeviceGetHandleByIndex, 3), err(n.nvmlDeviceGetHandleByUUID, uuid),
                err(n.nvmlDeviceGetTopologyCommonAncestor, h2, h3),
                err(n.nvmlDeviceGetUUID, h3),  # nvml.h lists GPU_IS_LOST for GetUUID
                n.nvmlDeviceGetCount(), n.nvmlDeviceGetName(h2)]
        control.inject({str(root)!r}, ["gpu", "3", "ok"])
        out([lost, n.nvmlDeviceGetIndex(n.nvmlDeviceGetHandleByIndex(3))])
    """)
    assert r == [["NVMLError_GpuIsLost"] * 6 + [8, "NVIDIA A100-SXM4-80GB"], 3]
    assert (root / "events").read_text() == "xid 3 79\n"


def test_a_hung_gpus_calls_block_until_released_while_everything_else_answers(fresh_root: Roots,
                                                                              nvml: Runner) -> None:
    """`gpu N hang`: a call on GPU 3's handle does not return (as a call into a wedged driver); the other
    GPUs, system calls and handle lookups answer meanwhile; `gpu 3 ok` releases it with its normal answer,
    and a GPU lost while its call hangs releases it with GPU_IS_LOST."""
    root = fresh_root("dgx-a100")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        h3, h2 = n.nvmlDeviceGetHandleByIndex(3), n.nvmlDeviceGetHandleByIndex(2)
        got = {{}}
        def call(key, f, *a):
            try:
                got[key] = f(*a)
            except n.NVMLError as e:
                got[key] = type(e).__name__
        def blocked(key, f, *a):
            t = threading.Thread(target=call, args=(key, f, *a), daemon=True)
            t.start()
            t.join(0.5)
            return t
        control.inject({str(root)!r}, ["gpu", "3", "hang"])
        t = blocked("name", n.nvmlDeviceGetName, h3)
        during = [t.is_alive(), "name" in got, n.nvmlDeviceGetName(h2), n.nvmlDeviceGetCount(),
                  err(n.nvmlDeviceGetHandleByIndex, 3)]
        control.inject({str(root)!r}, ["gpu", "5", "lost"])  # another rewrite of control keeps the hang
        control.inject({str(root)!r}, ["gpu", "5", "ok"])
        still = blocked("power", n.nvmlDeviceGetPowerUsage, h3).is_alive()
        control.inject({str(root)!r}, ["gpu", "3", "ok"])
        t.join(15)
        released = [t.is_alive(), got.get("name")]
        control.inject({str(root)!r}, ["gpu", "3", "hang"])
        t = blocked("memory", n.nvmlDeviceGetMemoryInfo, h3)
        alive = t.is_alive()
        control.inject({str(root)!r}, ["gpu", "3", "lost"])
        t.join(15)
        out([during, still, released, [alive, t.is_alive(), got.get("memory")]])
    """)
    assert r == [[True, False, "NVIDIA A100-SXM4-80GB", 8, "ok"], True,
                 [False, "NVIDIA A100-SXM4-80GB"], [True, False, "NVMLError_GpuIsLost"]]
    assert simcontrol.read_control(root).hung == {}  # `gpu 3 lost` ended the hang


def test_a_hang_for_seconds_ends_by_itself_and_a_driver_hang_blocks_every_call(fresh_root: Roots,
                                                                               nvml: Runner) -> None:
    root = fresh_root("pcie-2x-t4")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        h0 = n.nvmlDeviceGetHandleByIndex(0)
        done = {{}}
        def call(key, f, *a):
            done[key] = f(*a)
        def start(key, f, *a):
            t = threading.Thread(target=call, args=(key, f, *a), daemon=True)
            t.start()
            return t
        control.inject({str(root)!r}, ["gpu", "0", "hang", "3"])
        t = start("timed", n.nvmlDeviceGetUUID, h0)
        t.join(0.5)
        timed = [t.is_alive()]
        t.join(30)  # nobody releases it: the 3 s pass
        timed += [t.is_alive(), done.get("timed") == n.nvmlDeviceGetUUID(h0)]
        control.inject({str(root)!r}, ["driver", "hang"])
        ts = [start("count", n.nvmlDeviceGetCount), start("driver", n.nvmlSystemGetDriverVersion),
              start("temp", n.nvmlDeviceGetTemperature, h0, 0)]
        for t in ts: t.join(0.5)
        wedged = [t.is_alive() for t in ts]
        control.inject({str(root)!r}, ["driver", "loaded"])
        for t in ts: t.join(15)
        out([timed, wedged, [t.is_alive() for t in ts], sorted(done)])
    """)
    assert r == [[True, False, True], [True, True, True], [False, False, False],
                 ["count", "driver", "temp", "timed"]]


def test_fabricmanager_stopped_h100(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("hgx-h100")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(5)
        def fab():
            f = n.c_nvmlGpuFabricInfo_t(); n.nvmlDeviceGetGpuFabricInfo(h, byref(f))
            v = n.c_nvmlGpuFabricInfo_v3_t(); n.nvmlDeviceGetGpuFabricInfoV(h, byref(v))
            return [f.state, f.status, f.cliqueId, v.state, v.status, v.healthSummary,
                    n.nvmlDeviceGetNvLinkState(h, 0)]
        before = fab()
        control.inject({str(root)!r}, ["fabricmanager", "stopped"])
        stopped = fab()
        control.inject({str(root)!r}, ["fabricmanager", "running"])
        out([before, stopped, fab()])
    """)
    assert r[0] == r[2] == [3, 0, 32766, 3, 0, 1, 1]
    assert r[1] == [1, 27, 0, 1, 27, 0, 0]  # NOT_STARTED, NVML_ERROR_NOT_READY, links down


def test_fabric_info_v_checks_the_version(sim_root: Roots, nvml: Runner) -> None:
    r = nvml(sim_root("hgx-h100"), """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        v2 = n.c_nvmlGpuFabricInfo_v2_t(); n.nvmlDeviceGetGpuFabricInfoV(h, byref(v2))
        bad = n.c_nvmlGpuFabricInfo_v2_t(); bad.version = 7
        out([v2.state, v2.cliqueId, err(n.nvmlDeviceGetGpuFabricInfoV, h, byref(bad))])
    """)
    assert r == [3, 32766, "NVMLError_ArgumentVersionMismatch"]


def test_fabricmanager_stopped_a100_links_inactive(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("dgx-a100")
    simcontrol.inject(root, ["fabricmanager", "stopped"])
    r = nvml(root, """
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(0)
        out([[n.nvmlDeviceGetNvLinkState(h, l) for l in range(12)],
             n.nvmlDeviceGetP2PStatus(h, n.nvmlDeviceGetHandleByIndex(7), n.NVML_P2P_CAPS_INDEX_NVLINK)])
    """)
    assert r == [[0] * 12, 5]  # links down; P2P over NVLink: NVML_P2P_STATUS_NOT_SUPPORTED


def test_kernel_module_mismatch(tmp_path: Path, sim_lib: Path, nvml: Runner) -> None:
    from gpufleet_harness.sim import machine

    fx = tmp_path / "mismatch.yaml"
    text = (machine.FIXTURE_DIR / "pcie-2x-t4.yaml").read_text()
    fx.write_text(text.replace("host:\n", "host:\n  kernel_module_version: 535.216.03\n", 1))
    root = machine.materialize(fx, tmp_path / "root", library=sim_lib)
    assert "535.216.03" in (root / "host/proc/driver/nvidia/version").read_text()
    assert nvml(root, "out(err(n.nvmlInit))") == "NVMLError_LibRmVersionMismatch"


def test_nouveau_host_without_nvidia_driver(tmp_path: Path, sim_lib: Path, nvml: Runner) -> None:
    from gpufleet_harness.sim import machine

    fx = tmp_path / "nouveau.yaml"
    text = (machine.FIXTURE_DIR / "pcie-2x-t4.yaml").read_text()
    fx.write_text(text.replace("host:\n", "host:\n  nouveau_loaded: true\n  driver_loaded: false\n", 1))
    root = machine.materialize(fx, tmp_path / "root", library=sim_lib)
    host = root / "host"
    assert (host / "sys/module/nouveau").is_dir() and not (host / "sys/module/nvidia").exists()
    assert not (host / "sys/bus/pci/devices/0000:41:00.0/driver").exists()
    assert (root / "control").read_text() == "driver unloaded\n"
    assert nvml(root, "out(err(n.nvmlInit))") == "NVMLError_DriverNotLoaded"


# ---------------------------------------------------------------------------------------------- events

def test_xid_reaches_only_the_registered_gpu(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("dgx-a100")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        s3, s2 = n.nvmlEventSetCreate(), n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(3), n.nvmlEventTypeXidCriticalError, s3)
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(2), n.nvmlEventTypeXidCriticalError, s2)
        control.inject({str(root)!r}, ["xid", "3", "79"])
        d = n.nvmlEventSetWait(s3, 5000)
        t = time.monotonic()
        other = err(n.nvmlEventSetWait, s2, 300)
        waited = time.monotonic() - t
        again = err(n.nvmlEventSetWait, s3, 50)   # one event, delivered once
        n.nvmlEventSetFree(s3); n.nvmlEventSetFree(s2)
        out([n.nvmlDeviceGetIndex(d.device), d.eventType, d.eventData, d.gpuInstanceId, other, waited, again])
    """)
    assert r[:5] == [3, 8, 79, 0xFFFFFFFF, "NVMLError_Timeout"]
    assert 0.25 <= r[5] < 2.0
    assert r[6] == "NVMLError_Timeout"


def test_events_before_set_creation_are_not_delivered(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("pcie-2x-t4")
    simcontrol.inject(root, ["xid", "1", "13"])
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        s = n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(1), n.nvmlEventTypeXidCriticalError, s)
        before = err(n.nvmlEventSetWait, s, 100)
        control.inject({str(root)!r}, ["xid", "1", "31"])
        out([before, n.nvmlEventSetWait(s, 2000).eventData])
    """)
    assert r == ["NVMLError_Timeout", 31]


def test_event_types_filter_and_ecc_counts(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("hgx-h100")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        h = n.nvmlDeviceGetHandleByIndex(6)
        xid_only, ecc_only = n.nvmlEventSetCreate(), n.nvmlEventSetCreate()
        n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeXidCriticalError, xid_only)
        n.nvmlDeviceRegisterEvents(h, n.nvmlEventTypeDoubleBitEccError, ecc_only)
        control.inject({str(root)!r}, ["ecc-dbe", "6", "2"])
        control.inject({str(root)!r}, ["xid", "6", "48"])
        e = n.nvmlEventSetWait(ecc_only, 2000)
        x = n.nvmlEventSetWait(xid_only, 2000)
        total = n.nvmlDeviceGetTotalEccErrors(h, n.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, n.NVML_VOLATILE_ECC)
        bad = err(n.nvmlDeviceRegisterEvents, h, 1 << 40, xid_only)
        out([e.eventType, e.eventData, x.eventType, x.eventData, total, bad])
    """)
    assert r == [2, 0, 8, 48, 2, "NVMLError_NotSupported"]


def test_concurrent_waiters_and_injector(fresh_root: Roots, nvml: Runner) -> None:
    """Two threads block on their own event sets while a third injects; other calls keep working."""
    root = fresh_root("dgx-a100")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        results = {{}}
        ready = threading.Barrier(3)
        def waiter(gpu):
            s = n.nvmlEventSetCreate()
            n.nvmlDeviceRegisterEvents(n.nvmlDeviceGetHandleByIndex(gpu), n.nvmlEventTypeXidCriticalError, s)
            ready.wait()
            d = n.nvmlEventSetWait(s, 10000)
            results[gpu] = [n.nvmlDeviceGetIndex(d.device), d.eventData]
        def injector():
            ready.wait()
            time.sleep(0.2)
            control.inject({str(root)!r}, ["xid", "5", "94"])
            control.inject({str(root)!r}, ["xid", "1", "43"])
        threads = [threading.Thread(target=waiter, args=(g,)) for g in (1, 5)]
        threads.append(threading.Thread(target=injector))
        for t in threads: t.start()
        time.sleep(0.1)
        # the waits must not block other calls
        busy = [n.nvmlDeviceGetName(n.nvmlDeviceGetHandleByIndex(i)) for i in range(8)]
        for t in threads: t.join(15)
        out([results.get(1), results.get(5), len(busy)])
    """)
    assert r == [[1, 43], [5, 94], 8]


def test_many_threads_query_while_control_changes(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("node-40-gpus")
    r = nvml(root, f"""
        from gpufleet_harness.sim import control
        n.nvmlInit()
        errors, calls = [], [0]
        stop = threading.Event()
        def worker():
            while not stop.is_set():
                for i in range(40):
                    try:
                        h = n.nvmlDeviceGetHandleByIndex(i)
                        n.nvmlDeviceGetMemoryInfo(h); n.nvmlDeviceGetUUID(h)
                    except n.NVMLError_GpuIsLost:
                        pass
                    except Exception as e:
                        errors.append(repr(e))
                    calls[0] += 1
        ts = [threading.Thread(target=worker) for _ in range(4)]
        for t in ts: t.start()
        for k in range(10):
            control.inject({str(root)!r}, ["gpu", str(k), "lost"])
            control.inject({str(root)!r}, ["gpu", str(k), "ok"])
        stop.set()
        for t in ts: t.join(10)
        out([errors, calls[0] > 0])
    """)
    assert r == [[], True]


@pytest.mark.parametrize("words", [
    [], ["driver"], ["driver", "maybe"], ["gpu", "8", "lost"], ["gpu", "x", "lost"], ["gpu", "1", "sad"],
    ["xid", "1"], ["xid", "1", "-4"], ["ecc-dbe", "99", "1"], ["fabricmanager", "stopped"], ["reboot"],
    ["gpu", "1", "hang", "soon"], ["gpu", "1", "hang", "0"], ["gpu", "1", "lost", "5"], ["gpu", "2", "hang"],
    ["driver", "hang", "-1"],
])
def test_inject_rejects_bad_input(words: list[str], sim_root: Roots) -> None:
    root = sim_root("pcie-2x-t4")  # every one of these fails before touching the root
    with pytest.raises(simcontrol.InjectError):
        simcontrol.inject(root, words)
