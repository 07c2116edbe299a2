"""One reading of a GPU's counters (clocks, temperatures, power, energy, utilization, memory, errors), in
NVML's own units, for exporters: each counter a GPU, driver or library does not offer is left out and the
reason kept, never guessed.

    with nvml_session() as nv:
        reading = read_gpu(nv, 0)            # Reading(values={"power_mw": 79572, ...}, absent={...})
        free, used, reserved = read_mig_memory(nv, 0, slot=1)

Every NVML call behind a key is named in :data:`CALLS` (docs/metrics.md prints the same table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import (
    NvmlDriverLibraryMismatch,
    NvmlDriverNotLoaded,
    NvmlError,
    NvmlGpuLost,
    NvmlLibraryNotFound,
    NvmlUnavailable,
)
from .nvml import Nvml

# nvml.h field ids read through nvmlDeviceGetFieldValues (pynvml has them too, but older releases lack
# the NVLink throughput ones).
FI_MEMORY_TEMP = 82
FI_NVLINK_THROUGHPUT_DATA_TX = 138  # KiB sent since the driver loaded, payload only (what DCGM reads)
FI_NVLINK_THROUGHPUT_DATA_RX = 139
SCOPE_ALL_LINKS = 0xFFFFFFFF  # nvmlFieldValue_t.scopeId: the sum over every link
_FIELD_KEYS = {
    FI_MEMORY_TEMP: "memory_temp_c",
    FI_NVLINK_THROUGHPUT_DATA_TX: "nvlink_data_tx_kib",
    FI_NVLINK_THROUGHPUT_DATA_RX: "nvlink_data_rx_kib",
}
NVLINK_KEYS = ("nvlink_data_tx_kib", "nvlink_data_rx_kib")
NVLINK_STAMP = "nvlink_stamp_us"  # when NVML took them: the later nvmlFieldValue_t.timestamp, µs since 1970
# nvmlValueType_t -> the member of nvmlValue_t that holds the value
_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
_SUCCESS = 0
_NOT_SUPPORTED = 3
# Failures that concern the whole GPU or NVML itself, not one counter: the reading stops there.
_FATAL = (NvmlGpuLost, NvmlDriverNotLoaded, NvmlLibraryNotFound, NvmlUnavailable, NvmlDriverLibraryMismatch)

CALLS: dict[str, str] = {
    "fb_free_bytes": "nvmlDeviceGetMemoryInfo_v2 .free (nvmlDeviceGetMemoryInfo where v2 is missing)",
    "fb_used_bytes": "nvmlDeviceGetMemoryInfo_v2 .used (v1: .used, which then includes the reserved memory)",
    "fb_reserved_bytes": "nvmlDeviceGetMemoryInfo_v2 .reserved",
    "gpu_util_pct": "nvmlDeviceGetUtilizationRates .gpu",
    "mem_copy_util_pct": "nvmlDeviceGetUtilizationRates .memory",
    "enc_util_pct": "nvmlDeviceGetEncoderUtilization [0]",
    "dec_util_pct": "nvmlDeviceGetDecoderUtilization [0]",
    "sm_clock_mhz": "nvmlDeviceGetClockInfo(NVML_CLOCK_SM)",
    "mem_clock_mhz": "nvmlDeviceGetClockInfo(NVML_CLOCK_MEM)",
    "gpu_temp_c": "nvmlDeviceGetTemperature(NVML_TEMPERATURE_GPU)",
    "memory_temp_c": "nvmlDeviceGetFieldValues(NVML_FI_DEV_MEMORY_TEMP)",
    "power_mw": "nvmlDeviceGetPowerUsage",
    "energy_mj": "nvmlDeviceGetTotalEnergyConsumption",
    "pcie_replays": "nvmlDeviceGetPcieReplayCounter",
    "clock_event_reasons": "nvmlDeviceGetCurrentClocksEventReasons (ThrottleReasons before r535)",
    "remapped_rows_correctable": "nvmlDeviceGetRemappedRows [0]",
    "remapped_rows_uncorrectable": "nvmlDeviceGetRemappedRows [1]",
    "remap_pending": "nvmlDeviceGetRemappedRows [2]",
    "remap_failure": "nvmlDeviceGetRemappedRows [3]",
    "ecc_sbe_volatile": "nvmlDeviceGetTotalEccErrors(CORRECTED, VOLATILE_ECC), when nvmlDeviceGetEccMode: on",
    "ecc_dbe_volatile": "nvmlDeviceGetTotalEccErrors(UNCORRECTED, VOLATILE_ECC), when ECC is on",
    "ecc_sbe_aggregate": "nvmlDeviceGetTotalEccErrors(CORRECTED, AGGREGATE_ECC), when ECC is on",
    "ecc_dbe_aggregate": "nvmlDeviceGetTotalEccErrors(UNCORRECTED, AGGREGATE_ECC), when ECC is on",
    "nvlink_data_tx_kib": "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, scope all links)",
    "nvlink_data_rx_kib": "nvmlDeviceGetFieldValues(NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, scope all links)",
    NVLINK_STAMP: "the later .timestamp of those two nvmlFieldValue_t (µs since 1970)",
}
MIG_MEMORY_CALL = "nvmlDeviceGetMigDeviceHandleByIndex, then nvmlDeviceGetMemoryInfo_v2 of the MIG device"


@dataclass
class Reading:
    """What one pass over a GPU's counters got: values by key (NVML units), and why each missing key is."""

    values: dict[str, float] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)


def _why(exc: NvmlError) -> str:
    text = str(exc)
    return text.rsplit(": ", 1)[-1] if ": " in text else text


class _Pass:
    """One reading in progress: each getter fills its keys or records why they are missing."""

    def __init__(self, nvml: Nvml, index: int) -> None:
        self.nvml, self.nv, self.what = nvml, nvml.nv, f"GPU {index}"
        self.handle = nvml.handle(index)
        self.reading = Reading()

    def get(self, keys: tuple[str, ...], fn: Callable[..., Any] | None, *args: Any) -> Any:
        """`fn(handle, *args)`; None (keys marked absent) where NVML does not offer it. Fatal errors raise."""
        if fn is None:
            self.absent(keys, "not in this pynvml")
            return None
        try:
            return self.nvml.call(self.what, fn, self.handle, *args)
        except _FATAL:
            raise
        except NvmlError as exc:
            self.absent(keys, _why(exc))
            return None

    def put(self, key: str, value: Any) -> None:
        self.reading.values[key] = float(value)

    def absent(self, keys: tuple[str, ...], why: str) -> None:
        for key in keys:
            self.reading.absent[key] = why


def _memory(p: _Pass) -> None:
    keys = ("fb_free_bytes", "fb_used_bytes", "fb_reserved_bytes")
    version = getattr(p.nv, "nvmlMemory_v2", None)
    info = p.get(keys, p.nv.nvmlDeviceGetMemoryInfo, version) if version else None
    if info is not None:
        p.put("fb_free_bytes", info.free)
        p.put("fb_used_bytes", info.used)
        p.put("fb_reserved_bytes", info.reserved)
        return
    info = p.get(keys, p.nv.nvmlDeviceGetMemoryInfo)
    if info is not None:
        p.reading.absent.pop("fb_free_bytes", None)
        p.reading.absent.pop("fb_used_bytes", None)
        p.put("fb_free_bytes", info.free)
        p.put("fb_used_bytes", info.used)


def _utilization(p: _Pass) -> None:
    rates = p.get(("gpu_util_pct", "mem_copy_util_pct"), p.nv.nvmlDeviceGetUtilizationRates)
    if rates is not None:
        p.put("gpu_util_pct", rates.gpu)
        p.put("mem_copy_util_pct", rates.memory)
    for key, name in (("enc_util_pct", "nvmlDeviceGetEncoderUtilization"),
                      ("dec_util_pct", "nvmlDeviceGetDecoderUtilization")):  # fmt: skip
        answer = p.get((key,), getattr(p.nv, name, None))
        if answer is not None:
            p.put(key, answer[0])  # [utilization %, sampling period in µs]


def _clocks_and_thermals(p: _Pass) -> None:
    nv = p.nv
    for key, clock in (("sm_clock_mhz", nv.NVML_CLOCK_SM), ("mem_clock_mhz", nv.NVML_CLOCK_MEM)):
        value = p.get((key,), nv.nvmlDeviceGetClockInfo, clock)
        if value is not None:
            p.put(key, value)
    value = p.get(("gpu_temp_c",), nv.nvmlDeviceGetTemperature, nv.NVML_TEMPERATURE_GPU)
    if value is not None:
        p.put("gpu_temp_c", value)
    # The same bitmask under its r535 name and its older one; a library may answer only one of them.
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        value = p.get(("clock_event_reasons",), getattr(nv, name, None))
        if value is not None:
            p.reading.absent.pop("clock_event_reasons", None)
            p.put("clock_event_reasons", value)
            break


def _power(p: _Pass) -> None:
    for key, name in (("power_mw", "nvmlDeviceGetPowerUsage"),
                      ("energy_mj", "nvmlDeviceGetTotalEnergyConsumption"),
                      ("pcie_replays", "nvmlDeviceGetPcieReplayCounter")):  # fmt: skip
        value = p.get((key,), getattr(p.nv, name, None))
        if value is not None:
            p.put(key, value)


def _errors(p: _Pass) -> None:
    keys = ("remapped_rows_correctable", "remapped_rows_uncorrectable", "remap_pending", "remap_failure")
    rows = p.get(keys, getattr(p.nv, "nvmlDeviceGetRemappedRows", None))
    if rows is not None:
        for key, value in zip(keys, rows, strict=True):
            p.put(key, value)
    nv = p.nv
    ecc_keys = ("ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate")
    mode = p.get(ecc_keys, nv.nvmlDeviceGetEccMode)
    if mode is None:
        return
    if int(mode[0]) != 1:
        p.absent(ecc_keys, "ECC disabled")
        return
    corrected, uncorrected = nv.NVML_MEMORY_ERROR_TYPE_CORRECTED, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED
    volatile, aggregate = nv.NVML_VOLATILE_ECC, nv.NVML_AGGREGATE_ECC
    for key, kind, counter in (("ecc_sbe_volatile", corrected, volatile),
                               ("ecc_dbe_volatile", uncorrected, volatile),
                               ("ecc_sbe_aggregate", corrected, aggregate),
                               ("ecc_dbe_aggregate", uncorrected, aggregate)):  # fmt: skip
        value = p.get((key,), nv.nvmlDeviceGetTotalEccErrors, kind, counter)
        if value is not None:
            p.put(key, value)


def _fields(p: _Pass) -> None:
    wanted = [
        (FI_MEMORY_TEMP, 0),
        (FI_NVLINK_THROUGHPUT_DATA_TX, SCOPE_ALL_LINKS),
        (FI_NVLINK_THROUGHPUT_DATA_RX, SCOPE_ALL_LINKS),
    ]
    keys = (*_FIELD_KEYS.values(), NVLINK_STAMP)
    answers = p.get(keys, getattr(p.nv, "nvmlDeviceGetFieldValues", None), wanted)
    if answers is None:
        return
    stamps = []
    for answer in answers:
        key = _FIELD_KEYS.get(int(answer.fieldId))
        if key is None:
            continue
        member = _VALUE_MEMBERS.get(int(answer.valueType))
        if int(answer.nvmlReturn) != _SUCCESS or member is None:
            code = int(answer.nvmlReturn)
            p.absent((key,), "Not Supported" if code == _NOT_SUPPORTED else f"NVML error {code}")
            continue
        p.put(key, getattr(answer.value, member))
        if key in NVLINK_KEYS:
            stamps.append(int(getattr(answer, "timestamp", 0) or 0))
    if all(k in p.reading.values for k in NVLINK_KEYS):
        p.put(NVLINK_STAMP, max(stamps))  # 0: NVML gave none (DCGM then takes the time of its read)
    else:
        p.absent((NVLINK_STAMP,), p.reading.absent.get(NVLINK_KEYS[0]) or p.reading.absent[NVLINK_KEYS[1]])


_GETTERS = (_memory, _utilization, _clocks_and_thermals, _power, _errors, _fields)


def read_gpu(nvml: Nvml, index: int) -> Reading:
    """Every counter of :data:`CALLS` GPU `index` answers now.

    Raises NvmlGpuLost when the GPU is gone, and the driver- or library-level NvmlErrors that mean NVML
    itself cannot answer; any other failure of one getter only marks its keys absent.
    """
    p = _Pass(nvml, index)
    for getter in _GETTERS:
        getter(p)
    return p.reading


def read_mig_memory(nvml: Nvml, index: int, slot: int) -> tuple[int, int, int | None]:
    """(free, used, reserved or None) bytes of the MIG device in slot `slot` of GPU `index`."""
    nv, what = nvml.nv, f"GPU {index} MIG device {slot}"
    mig = nvml.call(what, nv.nvmlDeviceGetMigDeviceHandleByIndex, nvml.handle(index), slot)
    version = getattr(nv, "nvmlMemory_v2", None)
    if version:
        try:
            info = nvml.call(what, nv.nvmlDeviceGetMemoryInfo, mig, version)
            return int(info.free), int(info.used), int(info.reserved)
        except _FATAL:
            raise
        except NvmlError:
            pass  # an NVML without the v2 call: v1 below
    info = nvml.call(what, nv.nvmlDeviceGetMemoryInfo, mig)
    return int(info.free), int(info.used), None
