"""The GPU series: dcgm-exporter's names, types and units, each tied to the NVML reading behind it.

Names and types follow dcgm-exporter's default counter set (etc/default-counters.csv, checked against its
main branch and release 4.5.3-4.8.2), plus the ECC counters it names but leaves commented out there and
DCGM's clock-event-reasons field. docs/metrics.md is this table in prose.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from gpufleet.gpu.telemetry import NVLINK_KEYS, NVLINK_STAMP

MIB = float(1 << 20)
NVLINK_RATE = "nvlink_dcgm_rate"
"""The key NvlinkRate adds to a reading: DCGM's DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL (not an NVML value)."""


@dataclass(frozen=True)
class Field:
    """One dcgm-exporter series and how to compute it from a reading (gpufleet.gpu.telemetry keys)."""

    name: str
    kind: str  # Prometheus type: "gauge" or "counter"
    help: str
    keys: tuple[str, ...]  # reading keys it needs; all of them must be present
    value: Callable[[Mapping[str, float]], float]
    default: bool = True  # in dcgm-exporter's default counter set (False: named there, commented out)


def _key(key: str, scale: float = 1.0) -> Callable[[Mapping[str, float]], float]:
    return lambda values: values[key] / scale if scale != 1.0 else values[key]


def _whole_mib(key: str) -> Callable[[Mapping[str, float]], float]:
    return lambda values: float(int(values[key]) >> 20)


def _one(name: str, kind: str, text: str, key: str, scale: float = 1.0, default: bool = True) -> Field:
    return Field(name, kind, text, (key,), _key(key, scale), default)


FIELDS: tuple[Field, ...] = (
    _one("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock in MHz.", "sm_clock_mhz"),
    _one("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock in MHz.", "mem_clock_mhz"),
    _one("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature in degrees C.", "memory_temp_c"),
    _one("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature in degrees C.", "gpu_temp_c"),
    _one("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw in W.", "power_mw", 1000.0),
    _one(
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "counter",
        "Energy consumed since the driver was loaded, in mJ.",
        "energy_mj",
    ),
    _one("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "counter", "PCIe replays (retries) so far.", "pcie_replays"),
    _one("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization in percent.", "gpu_util_pct"),
    _one(
        "DCGM_FI_DEV_MEM_COPY_UTIL",
        "gauge",
        "Memory (copy engine) utilization in percent.",
        "mem_copy_util_pct",
    ),
    _one("DCGM_FI_DEV_ENC_UTIL", "gauge", "Video encoder utilization in percent.", "enc_util_pct"),
    _one("DCGM_FI_DEV_DEC_UTIL", "gauge", "Video decoder utilization in percent.", "dec_util_pct"),
    Field(
        "DCGM_FI_DEV_FB_FREE",
        "gauge",
        "Free framebuffer memory in MiB.",
        ("fb_free_bytes",),
        _whole_mib("fb_free_bytes"),
    ),
    Field(
        "DCGM_FI_DEV_FB_USED",
        "gauge",
        "Used framebuffer memory in MiB.",
        ("fb_used_bytes",),
        _whole_mib("fb_used_bytes"),
    ),
    Field(
        "DCGM_FI_DEV_FB_RESERVED",
        "gauge",
        "Framebuffer memory the driver reserves, in MiB.",
        ("fb_reserved_bytes",),
        _whole_mib("fb_reserved_bytes"),
    ),
    _one(
        "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL",
        "counter",
        "NVLink data sent plus received over all links per second since the last reading, in DCGM's MB/s "
        "(KiB/s / 1000); 0 on the first reading.",
        NVLINK_RATE,
    ),
    _one(
        "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Memory rows remapped after uncorrectable errors.",
        "remapped_rows_uncorrectable",
    ),
    _one(
        "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS",
        "counter",
        "Memory rows remapped after correctable errors.",
        "remapped_rows_correctable",
    ),
    _one("DCGM_FI_DEV_ROW_REMAP_FAILURE", "gauge", "1 when a row remapping has failed.", "remap_failure"),
    _one(
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL",
        "counter",
        "Single-bit ECC errors since the driver was loaded.",
        "ecc_sbe_volatile",
        default=False,
    ),
    _one(
        "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL",
        "counter",
        "Double-bit ECC errors since the driver was loaded.",
        "ecc_dbe_volatile",
        default=False,
    ),
    _one(
        "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "counter",
        "Single-bit ECC errors over the GPU's life.",
        "ecc_sbe_aggregate",
        default=False,
    ),
    _one(
        "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL",
        "counter",
        "Double-bit ECC errors over the GPU's life.",
        "ecc_dbe_aggregate",
        default=False,
    ),
    _one(
        "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
        "gauge",
        "Why the clocks are held back, NVML's bitmask (1 idle, 4 software power cap, 8 hardware slowdown).",
        "clock_event_reasons",
        default=False,
    ),
)

XID_FIELD = "DCGM_FI_DEV_XID_ERRORS"
XID_HELP = "The last XID error the GPU reported (0: none since the plugin started; absent: not watched)."
MIG_FIELDS = ("DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_RESERVED")
"""The fields a MIG device has series of its own for (NVML answers memory per MIG device only)."""

_PCIE_WHY = (
    "a profiling field: DCGM reads its profiling module (DCP) or, from Hopper on, NVML's GPM metrics "
    "(nvmlGpmMetricsGet PCIE_TX/RX_PER_SEC, two samples apart), not NVML's byte counters 197/198"
)
# dcgm-exporter's default counters gpufleet does not serve, and why (docs/metrics.md says the same).
LEFT_OUT: dict[str, str] = {
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "a profiling (DCP) field: DCGM's profiling module, not NVML",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "a profiling (DCP) field: DCGM's profiling module, not NVML",
    "DCGM_FI_PROF_DRAM_ACTIVE": "a profiling (DCP) field: DCGM's profiling module, not NVML",
    "DCGM_FI_PROF_PCIE_TX_BYTES": _PCIE_WHY,
    "DCGM_FI_PROF_PCIE_RX_BYTES": _PCIE_WHY,
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "licensing of vGPU guests; gpufleet runs bare metal and passthrough",
}

DRIVER_LABEL = "DCGM_FI_DRIVER_VERSION"
"""dcgm-exporter's one default label field: the driver version on every GPU series."""


class NvlinkRate:
    """DCGM's ``DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL`` (field 449, ``NVLINK_THROUGHPUT_TOTAL``) from NVML's
    cumulative data counters, computed as DCGM's cache manager does (DcgmCacheManager.cpp,
    ``ReadAndCacheNvLinkBandwidth``, DCGM 4.6.0):

    - the sum of ``NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX`` and ``_TX`` over all links, in KiB;
    - 0 on the first reading of a GPU, and whenever that sum is 0;
    - else (sum - the last reading's sum) / seconds between their NVML timestamps / 1000, truncated to an
      integer (DCGM's unit "MB/s": KiB/s divided by 1000); 0 when both readings share their timestamp.

    One departure: a sum smaller than the last one (the driver reloaded) gives 0 where DCGM would publish a
    negative rate. A reading served again (a hung GPU's) keeps its rate.
    """

    def __init__(self) -> None:
        self._last: dict[str, tuple[int, float, float, float]] = {}  # GPU -> (sum KiB, NVML's stamp, the
        # stamp used (µs since 1970), the rate served)

    def update(self, gpu: str, values: Mapping[str, float]) -> float | None:
        """The rate for GPU `gpu`'s reading `values`; None (and the history forgotten) when it lacks them."""
        if not all(k in values for k in (*NVLINK_KEYS, NVLINK_STAMP)):
            self._last.pop(gpu, None)
            return None
        total, nvml_stamp = sum(int(values[k]) for k in NVLINK_KEYS), values[NVLINK_STAMP]
        last = self._last.get(gpu)
        if last is not None and last[:2] == (total, nvml_stamp):
            return last[3]
        stamp = nvml_stamp or time.time() * 1e6  # DCGM: the time of its own read when NVML gave none
        rate = 0.0
        if last is not None and total != 0 and stamp != last[2] and total >= last[0]:
            rate = float(int((total - last[0]) / ((stamp - last[2]) / 1e6) / 1000.0))
        self._last[gpu] = (total, nvml_stamp, stamp, rate)
        return rate

    def forget(self, keep: set[str]) -> None:
        """Drop the history of GPUs not in `keep` (gone from the inventory)."""
        for gpu in set(self._last) - keep:
            del self._last[gpu]
