"""nvmlDeviceGetFieldValues of the simulator: each field with its own return code, the memory temperature
following the load, and the project's exporter (gpufleet.gpu.telemetry) reading the simulated H200 as it
read a real one (tests/realgpu/h200-580.159.04-host2/: metrics-idle.txt, log.txt; the memory temperatures of
h200-580.159.04/dmon.txt and h200-580.159.04-host3-process/dmon-busy.txt).

Field ids are nvml.h's (13.x header): 82 MEMORY_TEMP, 83 TOTAL_ENERGY_CONSUMPTION, 4 ECC_DBE_VOL_TOTAL, 94
PCIE_REPLAY_COUNTER, 138/139 NVLINK_THROUGHPUT_DATA_TX/RX, 140/141 NVLINK_THROUGHPUT_RAW_TX/RX, 142
REMAPPED_COR, 185 POWER_AVERAGE, 186 POWER_INSTANT, 187 POWER_MIN_LIMIT, 190 POWER_CURRENT_LIMIT, 191
ENERGY; 310 is NVML_FI_MAX.
"""

from __future__ import annotations

import ast
import re
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from gpufleet_harness.sim import control as simcontrol

REALGPU = Path(__file__).resolve().parents[1] / "realgpu"
HOST2 = REALGPU / "h200-580.159.04-host2"
Runner = Callable[..., Any]
Roots = Callable[[str], Path]
SUCCESS, INVALID_ARGUMENT, NOT_SUPPORTED, GPU_IS_LOST = 0, 2, 3, 15
UINT, ULL = 1, 3  # nvmlValueType_t
MTEMP_HOSTS_C = 4  # the recorded H200s idle at 34-38 C, and ran one memset loop at 50-51 and 54-55 C
ALL_LINKS = 0xFFFFFFFF

# A child's view of GPU `gpu`'s fields: [fieldId, nvmlReturn, valueType, value] each.
FIELDS = """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex({gpu})
        members = {{1: "uiVal", 3: "ullVal"}}
        def fields(ids):
            got = n.nvmlDeviceGetFieldValues(h, ids)
            return [[v.fieldId, v.nvmlReturn, v.valueType,
                     getattr(v.value, members[v.valueType]) if v.nvmlReturn == 0 else None] for v in got]
"""  # indented as the scenarios appended to it


def _metric(path: Path, name: str) -> float:
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{path.name} has no {name}")


def test_each_field_answers_with_its_own_return_code(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("firecracker-vm-h200")
    simcontrol.inject(root, ["clock", "100"])
    simcontrol.inject(root, ["ecc-dbe", "0", "2"])
    r = nvml(root, FIELDS.format(gpu=0) + """
        import time
        before = int(time.time() * 1e6)
        got = n.nvmlDeviceGetFieldValues(h, [82])
        stamp = got[0].timestamp
        out([fields([82, 83, 191, 4, 94, 142, 185, 186, 187, 190, (140, 0xFFFFFFFF), (141, 0xFFFFFFFF),
                     (186, 1), 200, 0, 310, 5000]),
             n.nvmlDeviceGetTotalEnergyConsumption(h), n.nvmlDeviceGetPowerUsage(h),
             before <= stamp <= int(time.time() * 1e6)])
    """)
    got, energy, power, stamped = r
    # return codes and value types as the real H200 answered (tests/sim/test_sim_fields_contract.py checks
    # every id)
    assert got == [
        [82, SUCCESS, UINT, 36],  # the memory's sensor, idle: as the exporter read it on a real H200
        # nvml.h: both are the getter's; the driver types the energy an unsigned int in a short call
        [83, SUCCESS, ULL, energy], [191, SUCCESS, UINT, energy],
        [4, SUCCESS, ULL, 2],  # volatile double-bit ECC errors: the injected ones
        [94, SUCCESS, UINT, 0], [142, SUCCESS, ULL, 0],
        [185, SUCCESS, UINT, power], [186, SUCCESS, UINT, power],  # idle: the average is the instant
        [187, SUCCESS, UINT, 200_000], [190, SUCCESS, UINT, 700_000],
        # no NVLink in the VM: NOT_SUPPORTED, as the real H200 answered the exporter
        [140, NOT_SUPPORTED, ULL, None], [141, NOT_SUPPORTED, ULL, None],
        [186, NOT_SUPPORTED, UINT, None],  # scope 1, the module (a Grace CPU's and the GPU's): not on x86
        [200, NOT_SUPPORTED, UINT, None],  # NVLink power threshold: no NVLink
        # ids the 580 driver does not know, though the 13.x header names 310 (NVML_FI_MAX)
        [0, INVALID_ARGUMENT, 0, None], [310, INVALID_ARGUMENT, 0, None], [5000, INVALID_ARGUMENT, 0, None],
    ]
    assert stamped  # µs since 1970, taken by the call


def test_what_other_gpus_answer_follows_nvml_h(fresh_root: Roots, nvml: Runner) -> None:
    """GDDR boards have no memory sensor; GA100 has no one-second power average (nvml.h: "Ampere (except
    GA100) or newer"); a call without values is refused (INVALID_ARGUMENT)."""
    code = FIELDS.format(gpu=0) + """
        c = n.nvmlLib.nvmlDeviceGetFieldValues
        out([[f[:2] for f in fields([82, 185, 186, 83])], c(h, 0, byref((n.c_nvmlFieldValue_t * 1)())),
             c(h, 1, None)])
    """
    refused = [INVALID_ARGUMENT, INVALID_ARGUMENT]
    assert nvml(fresh_root("pcie-2x-t4"), code) == [  # Turing, GDDR6
        [[82, NOT_SUPPORTED], [185, NOT_SUPPORTED], [186, SUCCESS], [83, SUCCESS]], *refused]
    assert nvml(fresh_root("node-40-gpus"), code) == [  # L4: Ada, GDDR6
        [[82, NOT_SUPPORTED], [185, SUCCESS], [186, SUCCESS], [83, SUCCESS]], *refused]
    assert nvml(fresh_root("dgx-a100"), code) == [  # GA100, HBM2e
        [[82, SUCCESS], [185, NOT_SUPPORTED], [186, SUCCESS], [83, SUCCESS]], *refused]


def test_a_lost_gpu_fails_the_whole_call(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("firecracker-vm-h200")
    code = """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        {inject}
        out(err(n.nvmlDeviceGetFieldValues, h, [82, 83]))
    """
    inject = f"from gpufleet_harness.sim import control; control.inject({str(root)!r}, ['gpu', '0', 'lost'])"
    assert nvml(root, code.format(inject="")) == "ok"
    assert nvml(root, code.format(inject=inject)) == "NVMLError_GpuIsLost"


def _memory_temperatures(nvml: Runner, root: Path, kind: str, seconds: float, at: list[float]) -> list[int]:
    """The memory temperature (field 82) `at` seconds after a `kind` workload of `seconds` started."""
    return list(nvml(root, FIELDS.format(gpu=0) + f"""
        from gpufleet_harness.sim import control, workload
        ROOT = {str(root)!r}
        control.inject(ROOT, ["clock", "100"])
        workload.start(ROOT, 0, kind={kind!r}, seconds={seconds!r})
        temps = []
        for t in {at!r}:
            control.inject(ROOT, ["clock", str(100 + t)])
            temps.append(fields([82])[0][3])
        out(temps)
    """))


def _recorded_mtemp(path: Path) -> list[int]:
    lines = [line.split() for line in path.read_text().splitlines() if line.strip() and line[0] != "#"]
    lines = [words for words in lines if words[0].isdigit() and len(words) == 22]
    return [int(words[3]) for words in lines]


def test_the_memory_temperature_follows_the_load_as_recorded(fresh_root: Roots, nvml: Runner) -> None:
    # matrix products (100 % GPU, 25 % memory, at the cap) for 19 s, as the first host's dmon (1 s samples)
    real = _recorded_mtemp(REALGPU / "h200-580.159.04" / "dmon.txt")
    idle = statistics.median(real[:8])
    rise = [t - idle for t in real[9:]]  # 1 s after the start: +6 C, ... +12 C at 19 s; then 41/39/38/37 C
    at = [float(k) for k in range(1, 20)] + [19.0 + k for k in range(1, 5)]
    sim = [t - 36 for t in _memory_temperatures(nvml, fresh_root("firecracker-vm-h200"), "compute", 19.0, at)]
    assert len(rise) == len(sim) == 23
    assert all(abs(s - r) <= 2 for s, r in zip(sim, rise, strict=True)), (sim, rise)
    # the second host: 36 C idle, 48 C 12 s into the same kind of load (its exporter's readings)
    assert _metric(HOST2 / "metrics-idle.txt", "DCGM_FI_DEV_MEMORY_TEMP") == 36
    assert abs(36 + sim[11] - _metric(HOST2 / "metrics-load.txt", "DCGM_FI_DEV_MEMORY_TEMP")) <= 1
    # a memset loop (100 % memory) heats the memory more: 54-55 C 4-6 s in on the fourth host, which the
    # simulator follows (test_sim_fields_contract.py), 50-51 C on the third (its dmon): the hosts differ by
    # up to MTEMP_HOSTS_C
    busy = _recorded_mtemp(REALGPU / "h200-580.159.04-host3-process" / "dmon-busy.txt")
    root = fresh_root("firecracker-vm-h200")
    membound = _memory_temperatures(nvml, root, "membound", 30.0, [4.0, 5.0, 6.0])
    assert busy == [50, 51, 51]
    assert all(r <= s <= r + MTEMP_HOSTS_C for s, r in zip(membound, busy, strict=True)), membound


def _recorded_absent(log: str) -> dict[str, str]:
    found = re.findall(r"absent keys: (\{.*\})", log)
    assert found, "log.txt has no 'absent keys' line"
    return dict(ast.literal_eval(found[0]))


def test_the_exporter_reads_the_simulated_h200_as_it_read_a_real_one(fresh_root: Roots, nvml: Runner) -> None:
    """gpufleet.gpu.telemetry.read_gpu on the simulated H200 misses exactly the counters it missed on the
    real H200 (NVLink throughput: Not Supported) and reads the memory temperature the real one read idle."""
    root = fresh_root("firecracker-vm-h200")
    reading = nvml(root, """
        from gpufleet.gpu import nvml_session
        from gpufleet.gpu.telemetry import read_gpu
        with nvml_session() as nv:
            r = read_gpu(nv, 0)
        out([r.values, r.absent])
    """)
    values, absent = reading
    # the recording's exporter read the raw NVLink counters (140/141); it reads the data ones (138/139) now,
    # which the same H200 answered Not Supported too (h200-580.159.04-host4-fields/fields-check.json)
    assert _recorded_absent((HOST2 / "log.txt").read_text()) == {
        "nvlink_raw_tx_kib": "Not Supported", "nvlink_raw_rx_kib": "Not Supported"}
    assert absent == {"nvlink_data_tx_kib": "Not Supported", "nvlink_data_rx_kib": "Not Supported",
                      "nvlink_stamp_us": "Not Supported"}
    assert values["memory_temp_c"] == _metric(HOST2 / "metrics-idle.txt", "DCGM_FI_DEV_MEMORY_TEMP") == 36


def test_other_gpus_keep_their_answers_in_the_drivers_value_types(fresh_root: Roots, nvml: Runner) -> None:
    """Fixtures without a recorded field table answer the fields they answered before, in the value types
    the 580 driver gave them on the H200 (NVML, not the GPU, types a field; not recorded on 535)."""
    code = FIELDS.format(gpu=0) + """
        out([f[:3] for f in fields([1, 142, 191, 140, 75, 300, 310])])
    """
    assert nvml(fresh_root("dgx-a100"), code) == [
        [1, SUCCESS, ULL], [142, SUCCESS, ULL], [191, SUCCESS, UINT],
        [140, SUCCESS, ULL],  # NVLink raw TX: the DGX's 12 links (test_nvlink_counters_count_the_data_…)
        [75, NOT_SUPPORTED, ULL],  # a perf-policy counter: the H200's table answers it, this one does not
        [300, NOT_SUPPORTED, 0], [310, INVALID_ARGUMENT, 0]]  # ids known to the 535 driver: not recorded


def test_nvlink_counters_count_the_data_a_busy_gpu_moves(fresh_root: Roots, nvml: Runner) -> None:
    """Fields 138-141 (NVLink data TX/RX, raw TX/RX, KiB since boot) on GPUs with NVLinks: the simulator's
    model (fields.c: 1 GiB/s per link and direction while busy, raw = data + 1/8) at a frozen clock;
    NOT_SUPPORTED without NVLink (the recorded VM: test_each_field_answers_with_its_own_return_code)."""
    for fixture, links in (("dgx-a100", 12), ("hgx-h200", 18)):
        root = fresh_root(fixture)
        idle, busy = nvml(root, FIELDS.format(gpu=0) + f"""
        from gpufleet_harness.sim import control, workload
        ROOT = {str(root)!r}
        control.inject(ROOT, ["clock", "100"])
        idle = fields([(138, ALL), (139, ALL)])
        workload.start(ROOT, 0, seconds=60.0)
        control.inject(ROOT, ["clock", "105"])
        busy = fields([(138, ALL), (139, ALL), (140, ALL), (141, ALL), (138, 0)])
        busy += [f[:2] for f in fields([(138, {links})])]
        out([[f[3] for f in idle], busy])
    """.replace("ALL", str(ALL_LINKS)))
        data = 5000 * 1024 * links  # 5 s busy, every link
        assert idle == [0, 0], fixture
        assert busy == [
            [138, SUCCESS, ULL, data], [139, SUCCESS, ULL, data],
            [140, SUCCESS, ULL, data * 9 // 8], [141, SUCCESS, ULL, data * 9 // 8],
            [138, SUCCESS, ULL, 5000 * 1024],  # scope 0: link 0 alone
            [138, INVALID_ARGUMENT],  # a link the GPU does not have
        ], fixture


def test_a_long_call_leaves_the_power_limits_untouched(fresh_root: Roots, nvml: Runner) -> None:
    """The recorded H200 wrote its power limits in a call of 24 values and left them untouched (SUCCESS, no
    type, no value, no timestamp) in its call of 319; the simulator draws the line after 64 (not recorded
    where it is: tests/realgpu/fields_batch_check.py asks)."""
    code = """
        n.nvmlInit(); h = n.nvmlDeviceGetHandleByIndex(0)
        def call(count):
            got = n.nvmlDeviceGetFieldValues(h, [187, 190, 191] + [82] * (count - 3))
            return [[v.fieldId, v.nvmlReturn, v.valueType, v.value.ullVal if v.valueType == 3 else
                     v.value.uiVal, v.timestamp > 0] for v in got[:3]]
        out([call(64), call(65)])
    """
    short, long = nvml(fresh_root("firecracker-vm-h200"), code)
    energy = short[2][3]
    assert short == [[187, SUCCESS, UINT, 200_000, True], [190, SUCCESS, UINT, 700_000, True],
                     [191, SUCCESS, UINT, energy, True]]
    assert long[:2] == [[187, SUCCESS, 0, 0, False], [190, SUCCESS, 0, 0, False]]
    assert long[2][:3] == [191, SUCCESS, ULL] and long[2][3] >= energy
    # the rule is the recorded model's: other fixtures answer every call alike
    short, long = nvml(fresh_root("dgx-a100"), code)
    assert [row[:2] + row[3:] for row in short[:2]] == [row[:2] + row[3:] for row in long[:2]]


# Fields 74/78/80 (perf-policy time, ns), 83/191 (energy), 185/186 (power), 197/198 (PCIe bytes), 185 at
# scope 2 (the memory's power) and the getters they follow, at each instant of a frozen clock.
READINGS = """
        import time
        from gpufleet_harness.sim import control, workload
        ROOT = {root!r}
        def read(at):
            control.inject(ROOT, ["clock", str(at)])
            f = {{v.fieldId * 10 + v.scopeId: (v.value.ullVal if v.valueType == 3 else v.value.uiVal)
                 for v in n.nvmlDeviceGetFieldValues(h, [74, 78, 80, 83, 185, 186, 191, 197, 198, (185, 2)])}}
            return {{"f": f, "energy": n.nvmlDeviceGetTotalEnergyConsumption(h),
                    "power": n.nvmlDeviceGetPowerUsage(h), "tx": n.nvmlDeviceGetPcieThroughput(h, 0),
                    "rx": n.nvmlDeviceGetPcieThroughput(h, 1)}}
"""


def test_the_moving_fields_follow_their_getters_under_load(fresh_root: Roots, nvml: Runner) -> None:
    root = fresh_root("firecracker-vm-h200")
    got = nvml(root, FIELDS.format(gpu=0) + READINGS.format(root=str(root)) + """
        a = read(100.0)
        workload.start(ROOT, 0, util=100, seconds=10)  # matrix products: the cap holds the clocks
        b, c = read(105.0), read(120.0)
        control.inject(ROOT, ["clock", "200"])
        workload.start(ROOT, 0, kind=workload.MEMBOUND, seconds=10)
        d = read(203.0)
        out([a, b, c, d])
    """)
    a, b, c, d = got
    s = 1_000_000_000  # ns
    for r in got:  # the getters' values at the same instant
        assert r["f"]["830"] == r["f"]["1910"] == r["energy"]
        assert r["f"]["1850"] == r["power"]
    assert b["f"]["1860"] == 691_600  # instantaneous: at the cap plateau 5 s in
    # perf policy: capped 5 s by b, 10 s by c; low utilization only while idle (c: 7.5 s after the linger)
    assert [b["f"][k] - a["f"][k] for k in ("740", "780", "800")] == [5 * s, 0, 5 * s]
    assert [c["f"][k] - b["f"][k] for k in ("740", "780", "800")] == [5 * s, 7_500_000_000, 5 * s]
    assert [d["f"][k] - c["f"][k] for k in ("740", "800")] == [0, 0]  # memory-bound work: below the cap
    # PCIe bytes: the throughput (KB/s) times the milliseconds, wrapping as an unsigned int
    assert (b["f"]["1970"] - a["f"]["1970"]) % (1 << 32) == b["tx"] * 5000
    assert (b["f"]["1980"] - a["f"]["1980"]) % (1 << 32) == b["rx"] * 5000
    # the memory's power: idle 41.18 W as the fixture's -q; a memset loop 119.03 W (the third host's -q)
    assert a["f"]["1852"] == 41_180 and d["f"]["1852"] == 119_030
    assert 41_180 < b["f"]["1852"] < 119_030  # matrix products keep the memory a quarter busy
