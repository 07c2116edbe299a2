"""NVML fidelity as a contract: the simulated H200 answers every getter as the real one did.

tests/sim/nvml_getter_probe.py (the getters of the 2026-11-28 recording, read-only) runs through the
unmodified pynvml against the `firecracker-vm-h200` fixture, and each entry is compared with
tests/realgpu/h200-580.159.04/nvml-probe.json: the same outcome (a value, which NVML error, or pynvml's own
failure), and the same value, except for the readings that move on a real GPU (power, temperature, clocks,
counters, memory in use), which must be plausible and consistent instead. The MIG placements, which the
recording's probe could not read (it called pynvml with the wrong arguments), are compared with
`nvidia-smi mig -lgipp` of the same recording.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.sim import machine as simmachine

RECORDING = Path(__file__).resolve().parents[1] / "realgpu" / "h200-580.159.04"
PROBE = Path(__file__).resolve().parent / "nvml_getter_probe.py"
FIXTURE = "firecracker-vm-h200"

Roots = Callable[[str], Path]
Entry = dict[str, Any]

# NVML_CLOCKS_EVENT_REASON_* bits an idle or busy GPU may show (GpuIdle 0x1 ... HwPowerBrake 0x80,
# DisplayClockSetting 0x100).
CLOCK_REASON_BITS = 0x1FF


def _load_recording() -> dict[str, Any]:
    return json.loads((RECORDING / "nvml-probe.json").read_text())


def run_probe(root: Path) -> dict[str, Any]:
    """The probe's JSON for a sim root (a child interpreter: pynvml loads the library once per process)."""
    env = {**os.environ, **simmachine.sim_env(root)}
    proc = subprocess.run([sys.executable, str(PROBE), "sim"], env=env, capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def outcome(entry: Any) -> tuple[str, Any] | None:
    """What a call came to: ("ok", None), ("err", NVML error name), ("exc", None), ("missing", None)."""
    if not isinstance(entry, dict):
        return None
    for kind in ("ok", "err", "exc", "missing"):
        if kind in entry:
            return kind, entry[kind] if kind == "err" else None
    return None


def _ok(d: dict[str, Any], key: str) -> Any:
    return d[key]["ok"]


# Readings that legitimately differ between two reads of the same GPU, each with the check that replaces
# equality: (simulated device entries, the key's value) -> a complaint or None.
def _power(d: dict[str, Any], v: Any) -> str | None:
    return None if 0 < v <= _ok(d, "nvmlDeviceGetEnforcedPowerLimit") else f"power {v} mW outside (0, limit]"


def _temperature(d: dict[str, Any], v: Any) -> str | None:
    return None if 20 <= v <= 90 else f"temperature {v} C"


def _energy(d: dict[str, Any], v: Any) -> str | None:
    again = d.get("nvmlDeviceGetTotalEnergyConsumption(again)", {}).get("ok")  # read 0.1 s later
    if again is None:  # a probe without the second read (the 2026-11-28 recording)
        return None if v > 0 else f"energy {v} mJ"
    return None if 0 < v < again else f"energy did not grow: {v} then {again} mJ (0.1 s apart)"


def _clock(k: int) -> Callable[[dict[str, Any], Any], str | None]:
    def check(d: dict[str, Any], v: Any) -> str | None:
        top = _ok(d, f"nvmlDeviceGetMaxClockInfo({k})")
        return None if 0 < v <= top else f"clock {k} at {v} MHz, above its maximum {top}"
    return check


def _reasons(d: dict[str, Any], v: Any) -> str | None:
    return None if v & ~CLOCK_REASON_BITS == 0 else f"unknown clock-event reason bits {v:#x}"


def _pcie(d: dict[str, Any], v: Any) -> str | None:
    # KB/s: at most the link's bandwidth (Mbps per lane, times lanes, / 8).
    top = _ok(d, "nvmlDeviceGetPcieSpeed") * _ok(d, "nvmlDeviceGetCurrPcieLinkWidth") * 1000 // 8
    return None if 0 <= v <= top else f"PCIe throughput {v} KB/s beyond the link's {top}"


def _utilization(d: dict[str, Any], v: Any) -> str | None:
    return None if 0 <= v["gpu"] <= 100 and 0 <= v["memory"] <= 100 else f"utilization {v}"


def _engine(d: dict[str, Any], v: Any) -> str | None:
    return None if 0 <= v[0] <= 100 and v[1] > 0 else f"engine utilization {v}"


def _memory_v1(d: dict[str, Any], v: Any) -> str | None:
    return None if v["free"] + v["used"] == v["total"] else f"free + used != total: {v}"


def _memory_v2(d: dict[str, Any], v: Any) -> str | None:
    ok = v["free"] + v["used"] + v["reserved"] == v["total"]
    return None if ok else f"free + used + reserved != total: {v}"


def _bar1(d: dict[str, Any], v: Any) -> str | None:
    return None if v["bar1Free"] + v["bar1Used"] == v["bar1Total"] else f"BAR1 free + used != total: {v}"


def _processes(d: dict[str, Any], v: Any) -> str | None:
    return None if isinstance(v, list) else f"process list {v!r}"


def _counter(d: dict[str, Any], v: Any) -> str | None:
    return None if isinstance(v, int) and v >= 0 else f"counter {v!r}"


MOVING: dict[str, Callable[[dict[str, Any], Any], str | None]] = {
    "nvmlDeviceGetPowerUsage": _power,
    "nvmlDeviceGetTemperature(GPU)": _temperature,
    "nvmlDeviceGetTotalEnergyConsumption": _energy,
    **{f"nvmlDeviceGetClockInfo({k})": _clock(k) for k in range(4)},
    "nvmlDeviceGetCurrentClocksThrottleReasons": _reasons,
    "nvmlDeviceGetCurrentClocksEventReasons": _reasons,
    "nvmlDeviceGetPcieThroughput(TX)": _pcie,
    "nvmlDeviceGetUtilizationRates": _utilization,
    "nvmlDeviceGetEncoderUtilization": _engine,
    "nvmlDeviceGetDecoderUtilization": _engine,
    "nvmlDeviceGetMemoryInfo": _memory_v1,
    "nvmlDeviceGetMemoryInfo(v2)": _memory_v2,
    "nvmlDeviceGetBAR1MemoryInfo": _bar1,
    "nvmlDeviceGetComputeRunningProcesses": _processes,
    "nvmlDeviceGetGraphicsRunningProcesses": _processes,
    "nvmlDeviceGetPcieReplayCounter": _counter,
}
# Parts of a moving reading that are still identity: compared exactly.
IDENTITY_PARTS = {
    "nvmlDeviceGetMemoryInfo": ("total",),
    "nvmlDeviceGetMemoryInfo(v2)": ("total", "reserved", "version"),
    "nvmlDeviceGetBAR1MemoryInfo": ("bar1Total",),
}
# Repr of a pointer in pynvml's event data: its address differs in every process.
POINTER = re.compile(r"<pynvml\.LP_struct_c_nvmlDevice_t object at 0x[0-9a-f]+>")


def compare_entry(path: str, real: Any, sim: Any, device: dict[str, Any], out: list[str]) -> None:
    """Append to `out` what differs between one recorded call and the simulator's."""
    want, got = outcome(real), outcome(sim)
    if want != got:
        out.append(f"{path}: recorded {want}, simulated {got}")
        return
    if want is None or want[0] != "ok":
        return
    key = path.rsplit("/", 1)[-1]
    if key in MOVING:
        complaint = MOVING[key](device, sim["ok"])
        if complaint:
            out.append(f"{path}: {complaint}")
        for part in IDENTITY_PARTS.get(key, ()):
            if real["ok"][part] != sim["ok"][part]:
                out.append(f"{path}.{part}: recorded {real['ok'][part]!r}, simulated {sim['ok'][part]!r}")
        return
    if real["ok"] != sim["ok"]:
        out.append(f"{path}: recorded {real['ok']!r}, simulated {sim['ok']!r}")


def compare(real: dict[str, Any], sim: dict[str, Any]) -> list[str]:
    """Every mismatch between the recording and the simulator's probe, one line each."""
    out: list[str] = []
    for name, entry in real["system"].items():
        compare_entry(f"system/{name}", entry, sim["system"].get(name), {}, out)
    for name in ("bad_uuid", "bad_index"):
        compare_entry(name, real[name], sim[name], {}, out)
    if len(real["devices"]) != len(sim["devices"]):
        out.append(f"devices: recorded {len(real['devices'])}, simulated {len(sim['devices'])}")
    for i, (rd, sd) in enumerate(zip(real["devices"], sim["devices"], strict=False)):
        for name, entry in rd.items():
            path = f"devices[{i}]/{name}"
            if name == "events":
                _compare_events(path, entry, sd.get(name), out)
            elif name == "nvlink":
                for link, states in entry.items():
                    got = sd[name].get(link, {})
                    for what, call in states.items():
                        compare_entry(f"{path}/{link}/{what}", call, got.get(what), sd, out)
            elif name == "mig_profiles":
                _compare_profiles(path, entry, sd.get(name) or {}, out)
            else:
                compare_entry(path, entry, sd.get(name), sd, out)
    return out


def _compare_events(path: str, real: dict[str, Any], sim: dict[str, Any] | None, out: list[str]) -> None:
    if sim is None or "supported" not in sim:
        out.append(f"{path}: simulated {sim}")
        return
    if real["supported"] != sim["supported"]:
        out.append(f"{path}/supported: recorded {real['supported']:#x}, simulated {sim['supported']:#x}")
    compare_entry(f"{path}/register", real["register"], sim["register"], {}, out)
    # One bounded wait: TIMEOUT, or an event of a registered type (the recording caught a clock change).
    wait = sim["wait_200ms"]
    if outcome(wait) == ("err", "NVML_ERROR_TIMEOUT"):
        return
    event = wait.get("ok")
    if not isinstance(event, dict) or not event["eventType"] & sim["supported"]:
        out.append(f"{path}/wait_200ms: neither TIMEOUT nor a registered event: {wait}")
    elif not POINTER.fullmatch(str(event["device"])):
        out.append(f"{path}/wait_200ms: event without a device handle: {event}")


def _compare_profiles(path: str, real: dict[str, Any], sim: dict[str, Any], out: list[str]) -> None:
    if sorted(real) != sorted(sim):
        out.append(f"{path}: profile indexes recorded {sorted(real)}, simulated {sorted(sim)}")
    for p, entry in real.items():
        if p not in sim:
            continue
        compare_entry(f"{path}/{p}", {k: v for k, v in entry.items() if k != "placements"},
                      {k: v for k, v in sim[p].items() if k != "placements"}, {}, out)
        recorded = entry.get("placements")
        if recorded is not None and outcome(recorded) != ("exc", None):  # a re-recording with real placements
            compare_entry(f"{path}/{p}/placements", recorded, sim[p].get("placements"), {}, out)


def lgipp_placements() -> dict[int, list[list[int]]]:
    """`nvidia-smi mig -lgipp` of the recording: profile id -> [[start, size], ...]."""
    found: dict[int, list[list[int]]] = {}
    for line in (RECORDING / "smi-mig-lgipp.txt").read_text().splitlines():
        m = re.fullmatch(r"GPU +\d+ Profile ID +(\d+) Placements? *: \{([\d,]+)\}:(\d+)", line)
        if m:
            found[int(m.group(1))] = [[int(s), int(m.group(3))] for s in m.group(2).split(",")]
    return found


@pytest.fixture(scope="module")
def probes(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], dict[str, Any]]:
    """(recorded probe, simulated probe) of the H200, one simulated run for the module."""
    from gpufleet_harness.sim import build as simbuild

    root = simmachine.materialize(FIXTURE, tmp_path_factory.mktemp("h200") / "root",
                                  library=simbuild.build_library())
    return _load_recording(), run_probe(root)


Probes = tuple[dict[str, Any], dict[str, Any]]


def test_every_recorded_getter_answers_as_the_real_h200(probes: Probes) -> None:
    real, sim = probes
    mismatches = compare(real, sim)
    assert not mismatches, "getters that differ from the real H200:\n" + "\n".join(mismatches)


def test_the_contract_covers_the_whole_recording(probes: Probes) -> None:
    """Every getter of the recording is in the simulated probe (none silently skipped), and the getters the
    issue found NOT_SUPPORTED on the simulator are among those the real GPU answered."""
    real, sim = probes
    assert set(real["system"]) <= set(sim["system"])
    assert set(real["devices"][0]) <= set(sim["devices"][0])
    answered = {k for k, v in real["devices"][0].items() if outcome(v) == ("ok", None)}
    newly = {"AccountingMode", "AddressingMode", "BAR1MemoryInfo", "BoardId", "BusType", "C2cModeInfoV",
             "ConfComputeMemSizeInfo", "CurrentClocksEventReasons", "DecoderUtilization",
             "EncoderUtilization", "GspFirmwareMode", "GspFirmwareVersion", "InforomConfigurationChecksum",
             "IrqNum", "MemoryBusWidth", "ModuleId", "NumFans", "NumGpuCores", "PcieLinkMaxSpeed",
             "PcieReplayCounter", "PcieSpeed", "PcieThroughput(TX)", "Pdi", "PlatformInfo", "PowerSource",
             "RemappedRows", "RepairStatus", "TotalEnergyConsumption"}
    assert {f"nvmlDeviceGet{n}" for n in newly} <= answered
    assert len(newly) == 28
    for name in ("nvmlGetExcludedDeviceCount", "nvmlSystemGetDriverBranch"):
        assert outcome(real["system"][name]) == outcome(sim["system"][name]) == ("ok", None)


def test_mig_placements_match_nvidia_smi_mig_lgipp(probes: Probes) -> None:
    _, sim = probes
    listed = lgipp_placements()
    assert len(listed) == 7
    profiles = sim["devices"][0]["mig_profiles"].values()
    got = {e["ok"]["id"]: e["placements"]["ok"] for e in profiles if "ok" in e}
    assert got == listed


def test_identity_values_are_the_recorded_gpus(probes: Probes) -> None:
    """The fields a consumer identifies the GPU by, spelled out (the comparison above covers them too)."""
    _, sim = probes
    d = sim["devices"][0]
    assert _ok(d, "nvmlDeviceGetUUID") == "GPU-3710040f-331e-b1cd-ae09-04a71f007081"
    assert _ok(d, "nvmlDeviceGetSerial") == "1654024075654"
    assert _ok(d, "nvmlDeviceGetPciInfo")["busId"] == "00000000:00:06.0"
    assert _ok(d, "nvmlDeviceGetPciInfo")["pciDeviceId"] == 0x233510DE
    assert _ok(d, "nvmlDeviceGetMemoryInfo(v2)")["total"] == 143771 << 20
    assert _ok(d, "nvmlDeviceGetBoardPartNumber") == "692-2G520-0282-000"
    assert _ok(d, "nvmlDeviceGetVirtualizationMode") == 1  # NVML_GPU_VIRTUALIZATION_MODE_PASSTHROUGH
    assert _ok(d, "nvmlDeviceGetPdi") == 0x5FD61A387AEC3B65
    assert sim["system"]["nvmlSystemGetNVMLVersion"]["ok"] == "13.580.159.04"


# -- the comparison itself must be able to fail ----------------------------------------------------------


def test_compare_reports_a_changed_outcome_value_and_implausible_reading() -> None:
    real = _load_recording()
    sim = json.loads(json.dumps(real))
    assert compare(real, sim) == []
    d = sim["devices"][0]
    d["nvmlDeviceGetBoardId"] = {"err": "NVML_ERROR_NOT_SUPPORTED"}
    d["nvmlDeviceGetUUID"] = {"ok": "GPU-00000000-0000-0000-0000-000000000000"}
    d["nvmlDeviceGetClockInfo(1)"] = {"ok": 5000}
    d["nvmlDeviceGetTotalEnergyConsumption(again)"] = {"ok": 1}
    d["mig_profiles"]["9"]["ok"]["multiprocessorCount"] = 27
    sim["system"]["nvmlSystemGetDriverBranch"] = {"err": "NVML_ERROR_NOT_SUPPORTED"}
    found = compare(real, sim)
    assert len(found) == 6, found
    assert any("nvmlDeviceGetBoardId: recorded ('ok', None), simulated ('err'" in m for m in found)
    assert any("above its maximum 1980" in m for m in found)
    assert any("energy did not grow" in m for m in found)


def test_the_wait_may_time_out_or_deliver_a_registered_event() -> None:
    real = _load_recording()
    sim = json.loads(json.dumps(real))
    sim["devices"][0]["events"]["wait_200ms"] = {"err": "NVML_ERROR_TIMEOUT"}
    assert compare(real, sim) == []
    sim["devices"][0]["events"]["wait_200ms"] = {"err": "NVML_ERROR_UNKNOWN"}
    assert compare(real, sim) == ["devices[0]/events/wait_200ms: neither TIMEOUT nor a registered event: "
                                  "{'err': 'NVML_ERROR_UNKNOWN'}"]


# ----- a second real H200 (tests/realgpu/h200-580.159.04-host2, read through the same probe) ----------------

HOST2 = RECORDING.parent / "h200-580.159.04-host2"
# What differs from one H200 to the next: the GPU's identity and where its board sits.
HOST_IDENTITY = ("nvmlDeviceGetUUID", "nvmlDeviceGetSerial", "nvmlDeviceGetPdi",
                 "nvmlDeviceGetBoardPartNumber", "nvmlDeviceGetModuleId",
                 "nvmlDeviceGetPlatformInfo")  # fmt: skip


def test_a_second_real_h200_answers_every_getter_as_the_first() -> None:
    """The contract is the model's and driver's, not one board's: every getter of the first recording has
    the same outcome on a second H200 host; only identity values and moving readings differ."""
    first, second = _load_recording(), json.loads((HOST2 / "nvml-probe.json").read_text())
    d1, d2 = first["devices"][0], second["devices"][0]
    getters = [k for k in d1 if k.startswith("nvml")]
    assert len(getters) > 90
    changed = {k: (outcome(d1[k]), outcome(d2.get(k))) for k in getters}
    assert {k: pair for k, pair in changed.items() if pair[0] != pair[1]} == {}
    steady = [k for k in getters if k not in MOVING]
    differ = sorted(k for k in steady if _meaning(d1[k].get("ok")) != _meaning(d2[k].get("ok")))
    assert set(differ) <= set(HOST_IDENTITY), differ


def _meaning(value: Any) -> Any:
    """A value as NVML meant it: the two hosts' pynvml builds size the fabric info's clusterUuid array
    differently (16 and 64 bytes), both all zeros there."""
    if isinstance(value, dict) and "clusterUuid" in value:
        return {**value, "clusterUuid": any(value["clusterUuid"])}
    return value


def test_mig_placements_match_what_nvml_answered_on_a_real_h200(probes: Probes) -> None:
    """nvmlDeviceGetGpuInstancePossiblePlacements with MIG off, read on the second host with pynvml's real
    signature, equals the simulator's answer for every profile (the first recording only had `mig -lgipp`)."""
    _, sim = probes
    real = json.loads((HOST2 / "nvml-probe.json").read_text())["devices"][0]["mig_profiles"]
    simulated = sim["devices"][0]["mig_profiles"]
    assert sorted(real, key=int) == sorted(simulated, key=int)
    with_placements = 0
    for pid, entry in real.items():
        assert outcome(entry) == outcome(simulated[pid]), pid
        if "placements" in entry:
            with_placements += 1
            assert entry["placements"]["ok"] == simulated[pid]["placements"]["ok"], entry["ok"]["name"]
    assert with_placements == 7  # the seven H200 profiles
