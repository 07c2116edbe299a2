"""Health events through NVML event sets on the simulator: XIDs, double-bit ECC, lost GPUs, timeouts.

Each scenario runs in a child process (pynvml loads the library once per process); the child injects
after creating its monitor, because an event set only delivers what happens after it exists.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_helpers import run_in_sim

from gpufleet_harness.sim import machine as simmachine

PRELUDE = """
import json, os, time
from gpufleet.gpu import HealthMonitor, discover, nvml_session
from gpufleet_harness.sim import control
root = os.environ["GPUFLEET_SIM_ROOT"]
out = {}
def first(monitor, timeout=5.0):
    event = next(iter(monitor.events(timeout=timeout)), None)
    return None if event is None else [*event, event.critical]
"""


def _scenario(root: Path, code: str) -> dict[str, Any]:
    proc = run_in_sim(root, ["-c", PRELUDE + textwrap.dedent(code) + "\nprint(json.dumps(out))\n"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def test_xid_ecc_and_lost_gpu_arrive_as_health_events(fresh_root: Callable[[str], Path]) -> None:
    root = fresh_root("dgx-a100")
    uuids = [g["uuid"] for g in simmachine.load_machine(root)["gpus"]]
    out = _scenario(
        root,
        """
        with nvml_session() as nv, HealthMonitor(nv, wait_slice=0.5) as monitor:
            start = time.monotonic()
            out["quiet"] = list(monitor.events(timeout=0.3))
            out["quiet_seconds"] = time.monotonic() - start
            control.inject(root, ["xid", "2", "48"])
            out["xid"] = first(monitor)
            control.inject(root, ["ecc-dbe", "1", "2"])
            out["ecc"] = first(monitor)
            control.inject(root, ["xid", "0", "13"])
            out["app_xid"] = first(monitor)
            control.inject(root, ["gpu", "5", "lost"])
            out["lost"] = [list(e) for e in monitor.events(timeout=1.0)]
            control.inject(root, ["xid", "6", "31"])
            out["after_lost"] = first(monitor)
        """,
    )
    assert out["quiet"] == [] and 0.25 <= out["quiet_seconds"] < 2
    assert out["xid"] == [uuids[2], "xid", 48, True]
    assert out["ecc"][:2] == [uuids[1], "double-bit-ecc"] and out["ecc"][3] is True
    assert out["app_xid"] == [uuids[0], "xid", 13, False]  # application error: GPU stays healthy
    # Losing a GPU raises XID 79 (fallen off the bus); the monitor confirms and reports it lost once.
    assert out["lost"] == [[uuids[5], "xid", 79], [uuids[5], "gpu-lost", 15]]
    assert out["after_lost"] == [uuids[6], "xid", 31, False]  # the other GPUs are still watched


def test_gpu_already_lost_at_start_is_reported_first(fresh_root: Callable[[str], Path]) -> None:
    root = fresh_root("pcie-2x-t4")
    uuid1 = simmachine.load_machine(root)["gpus"][1]["uuid"]
    out = _scenario(
        root,
        f"""
        gpus = discover().gpus
        control.inject(root, ["gpu", "1", "lost"])
        with nvml_session() as nv, HealthMonitor(nv, gpus, wait_slice=0.2) as monitor:
            out["events"] = [list(e) for e in monitor.events(timeout=0.5)]
            control.inject(root, ["xid", "0", "79"])
            out["gpu0"] = first(monitor, timeout=2)
            out["gpu0_still_there"] = [list(e) for e in monitor.events(timeout=0.3)]
        out["uuid1"] = {uuid1!r}
        """,
    )
    assert out["events"] == [[uuid1, "gpu-lost", 15]]
    # XID 79 on a GPU that still answers is reported, but the GPU is not declared lost.
    assert out["gpu0"][1:3] == ["xid", 79]
    assert out["gpu0_still_there"] == []
