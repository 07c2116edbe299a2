"""GPU series on the device plugin's /metrics: dcgm-exporter's names and labels, attributed to pods.

Every ``interval_s`` a round reads each GPU (watchdog.Sampler: a deadline per GPU), asks the kubelet who
holds what (pods.PodAttributor), and renders the text once. A scrape only copies that text and adds each
GPU's sample age: it never calls NVML, the kubelet or the API server, whatever it asks for.

What a GPU's series say:
- read in the last round: every value NVML offered, ``gpufleet_gpu_up`` 1;
- its read failed (lost, fallen off the bus, driver gone): no values at all, ``gpufleet_gpu_up`` 0;
- its read is hung: ``gpufleet_gpu_up`` 0, and the last values with their age
  (``gpufleet_gpu_sample_age_seconds``) until they are ``max_age_s`` old, then none.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from gpufleet.deviceplugin.rm.model import GpuInfo, MigDeviceInfo, NodeInventory
from gpufleet.deviceplugin.telemetry.collector import Ticker
from gpufleet.deviceplugin.telemetry.fields import (
    DRIVER_LABEL,
    FIELDS,
    MIG_FIELDS,
    NVLINK_RATE,
    XID_FIELD,
    XID_HELP,
    NvlinkRate,
)
from gpufleet.deviceplugin.telemetry.pods import NOBODY, Attribution, Holder
from gpufleet.deviceplugin.watchdog import Outcome, Sampler
from gpufleet.gpu.pci import nvml_bus_id
from gpufleet.gpu.telemetry import Reading
from gpufleet.logs import log_event
from gpufleet.metrics import Labels, series

OWN_HELP: dict[str, tuple[str, str]] = {
    "gpufleet_gpu_up": ("gauge", "1 when the last reading of the GPU succeeded and none is hung, else 0."),
    "gpufleet_gpu_sample_age_seconds": ("gauge", "Age of the reading the GPU's series come from."),
    "gpufleet_pod_gpu_memory_bytes": (
        "gauge",
        "GPU memory a container holds on the GPU by the extender's assignment (GPU-memory sharing).",
    ),
    "gpufleet_telemetry_round_seconds": ("gauge", "How long the last round over every GPU took."),
    "gpufleet_telemetry_pod_resources_up": (
        "gauge",
        "1 when the last round could ask the kubelet's PodResources API who holds which GPU.",
    ),
}


@dataclass(frozen=True)
class GpuSample:
    """One reading of a GPU, and of the memory of each of its MIG devices (by MIG UUID)."""

    reading: Reading
    mig_memory: Mapping[str, tuple[int, int, int | None]] = field(default_factory=dict)


@dataclass(frozen=True)
class Settings:
    interval_s: float = 10.0
    gpu_timeout_s: float = 2.0
    max_age_s: float = 0.0  # 0: three intervals

    @property
    def max_age(self) -> float:
        return self.max_age_s or 3 * self.interval_s


def nvml_reader(nvml: Callable[[], Any]) -> Callable[[GpuInfo], GpuSample]:
    """A GPU reader on the plugin's NVML session (`nvml()` returns gpufleet.gpu's Nvml)."""
    from gpufleet.gpu import NvmlError, NvmlGpuLost
    from gpufleet.gpu.telemetry import read_gpu, read_mig_memory

    def read(gpu: GpuInfo) -> GpuSample:
        nv = nvml()
        reading = read_gpu(nv, gpu.index)
        mig: dict[str, tuple[int, int, int | None]] = {}
        for device in gpu.mig_devices:
            try:
                mig[device.uuid] = read_mig_memory(nv, gpu.index, device.index)
            except NvmlGpuLost:
                raise
            except NvmlError:
                continue  # the layout changed since discovery: that MIG device has no series
        return GpuSample(reading, mig)

    return read


def hostname(node_name: str) -> str:
    """dcgm-exporter's Hostname label: the node's name where the plugin knows it, else the host name."""
    return node_name or socket.gethostname()


@dataclass
class _Served:
    """What one round decided to serve for a GPU."""

    gpu: GpuInfo
    up: bool
    sample: GpuSample | None
    taken: float
    derived: dict[str, float] = field(default_factory=dict)  # values computed across readings (rates)


class Telemetry:
    """The collection thread and the rendered series; `render()` is what a scrape returns."""

    def __init__(
        self,
        inventory: Callable[[], NodeInventory],
        read: Callable[[GpuInfo], GpuSample],
        xids: Callable[[], Mapping[str, int] | None],
        attribute: Callable[[Iterable[str], Iterable[str]], Attribution] | None,
        host: str,
        settings: Settings | None = None,
    ) -> None:
        self.inventory = inventory
        self.xids = xids
        self.attribute = attribute
        self.host = host
        self.settings = settings or Settings()
        self.sampler: Sampler[str, GpuSample] = Sampler(self._read, self.settings.gpu_timeout_s)
        self._read_gpu = read
        self._by_uuid: dict[str, GpuInfo] = {}
        self._lock = threading.Lock()
        self._body = ""  # the last round's series but the ages
        self._ages: list[tuple[Labels, float]] = []  # (labels, monotonic time taken) of GPUs with values
        self._down: set[str] = set()  # GPUs last reported down in the log
        self._nvlink = NvlinkRate()
        self._ticker = Ticker(self.tick, self.settings.interval_s, "gpufleet-telemetry")
        self.rounds = 0

    def start(self) -> None:
        """Collect every interval on a thread of its own (the first round at once)."""
        self._ticker.start()

    def stop(self) -> None:
        self._ticker.stop()

    def _read(self, uuid: str) -> GpuSample:
        return self._read_gpu(self._by_uuid[uuid])

    def tick(self) -> None:
        """One round: read every GPU, ask who holds them, render."""
        started = time.monotonic()
        inventory = self.inventory()
        self._by_uuid = {g.uuid: g for g in inventory.gpus}
        outcomes = self.sampler.round(list(self._by_uuid))
        served = [self._decide(gpu, outcomes.get(gpu.uuid)) for gpu in inventory.gpus]
        self._nvlink.forget({s.gpu.uuid for s in served if s.sample is not None})
        for s in served:
            if s.sample is not None:
                rate = self._nvlink.update(s.gpu.uuid, s.sample.reading.values)
                if rate is not None:
                    s.derived[NVLINK_RATE] = rate
        attribution = NOBODY
        if self.attribute is not None:
            migs = [m.uuid for g in inventory.gpus for m in g.mig_devices]
            attribution = self.attribute(list(self._by_uuid), migs)
        body, ages = render(
            served, attribution, self.xids(), inventory.driver_version, self.host,
            round_seconds=time.monotonic() - started, pod_resources=self.attribute is not None,
        )  # fmt: skip
        with self._lock:
            self._body, self._ages = body, ages
            self.rounds += 1

    def _decide(self, gpu: GpuInfo, outcome: Outcome[GpuSample] | None) -> _Served:
        now = time.monotonic()
        if outcome is None:
            return _Served(gpu, False, None, 0.0)
        up = outcome.sample is not None and not outcome.problem
        sample = outcome.sample if now - outcome.taken <= self.settings.max_age else None
        if not up and gpu.uuid not in self._down:
            self._down.add(gpu.uuid)
            log_event(
                "telemetry_gpu_down",
                level="warning",
                gpu=gpu.index,
                uuid=gpu.uuid,
                reason=outcome.problem or "no reading yet",
                serving="last values while not too old" if sample else "no values",
            )
        elif up and gpu.uuid in self._down:
            self._down.discard(gpu.uuid)
            log_event("telemetry_gpu_up", gpu=gpu.index, uuid=gpu.uuid)
        return _Served(gpu, up, sample, outcome.taken)

    def render(self) -> str:
        """The series of the last round, with each GPU's sample age as of now."""
        with self._lock:
            body, ages = self._body, self._ages
        if not ages:
            return body
        now = time.monotonic()
        name = "gpufleet_gpu_sample_age_seconds"
        kind, text = OWN_HELP[name]
        lines = [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines += [series(name, labels, round(now - taken, 3)) for labels, taken in ages]
        return body + "\n".join(lines) + "\n"


# ----- rendering ---------------------------------------------------------------------------------------


def gpu_labels(gpu: GpuInfo, host: str, driver: str) -> Labels:
    """dcgm-exporter's labels of a GPU's series (its `device` is named after the GPU's index, as there)."""
    return (
        ("gpu", str(gpu.index)),
        ("UUID", gpu.uuid),
        ("pci_bus_id", nvml_bus_id(gpu.bus_id) if gpu.bus_id else ""),
        ("device", f"nvidia{gpu.index}"),
        ("modelName", gpu.model),
        ("Hostname", host),
        (DRIVER_LABEL, driver),
    )


def _mig_labels(base: Labels, mig: MigDeviceInfo) -> Labels:
    return (*base, ("GPU_I_PROFILE", mig.profile), ("GPU_I_ID", str(mig.gi)))


def _holder_labels(holder: Holder) -> Labels:
    labels: Labels = (("pod", holder.pod), ("namespace", holder.namespace), ("container", holder.container))
    return (*labels, ("vgpu", holder.vgpu)) if holder.vgpu else labels


def _per_holder(labels: Labels, holders: tuple[Holder, ...]) -> list[Labels]:
    """One series per holder (dcgm-exporter's rule for shared GPUs), or the GPU's own when none."""
    return [(*labels, *_holder_labels(h)) for h in holders] or [labels]


def _family(name: str, kind: str, text: str, samples: list[str], out: list[str]) -> None:
    if samples:
        out += [f"# HELP {name} {text}", f"# TYPE {name} {kind}", *samples]


def render(
    served: list[_Served],
    attribution: Attribution,
    xids: Mapping[str, int] | None,
    driver: str,
    host: str,
    *,
    round_seconds: float,
    pod_resources: bool,
) -> tuple[str, list[tuple[Labels, float]]]:
    """(exposition text but the ages, [(labels, time taken)] of GPUs whose values are served)."""
    out: list[str] = []
    base = {s.gpu.uuid: gpu_labels(s.gpu, host, driver) for s in served}
    with_values = [s for s in served if s.sample is not None]
    values_of = {s.gpu.uuid: {**s.sample.reading.values, **s.derived} for s in with_values if s.sample}
    for f in FIELDS:
        samples = []
        for s in with_values:
            assert s.sample is not None
            values = values_of[s.gpu.uuid]
            if all(k in values for k in f.keys):
                value = f.value(values)
                samples += [
                    series(f.name, lab, value)
                    for lab in _per_holder(base[s.gpu.uuid], _holders(attribution, s.gpu))
                ]
            if f.name in MIG_FIELDS:
                samples += _mig_samples(f.name, s, base[s.gpu.uuid], attribution)
        _family(f.name, f.kind, f.help, samples, out)
    xid_samples = []
    for s in with_values if xids is not None else ():  # XIDs not watched: no claim of "none"
        code = xids.get(s.gpu.uuid, 0)
        for lab in _per_holder(base[s.gpu.uuid], _holders(attribution, s.gpu)):
            xid_samples.append(series(XID_FIELD, (*lab, ("err_code", str(code))), code))
    _family(XID_FIELD, "gauge", XID_HELP, xid_samples, out)
    own = OWN_HELP
    _family("gpufleet_gpu_up", *own["gpufleet_gpu_up"],
            [series("gpufleet_gpu_up", base[s.gpu.uuid], 1 if s.up else 0) for s in served], out)  # fmt: skip
    by_uuid = {s.gpu.uuid: s.gpu for s in served}
    memory = [
        series(
            "gpufleet_pod_gpu_memory_bytes", (*base[share.gpu], *_holder_labels(share.holder)), share.bytes
        )
        for share in attribution.memory
        if share.gpu in by_uuid
    ]
    _family("gpufleet_pod_gpu_memory_bytes", *own["gpufleet_pod_gpu_memory_bytes"], memory, out)
    took = series("gpufleet_telemetry_round_seconds", (("Hostname", host),), round(round_seconds, 6))
    _family("gpufleet_telemetry_round_seconds", *own["gpufleet_telemetry_round_seconds"], [took], out)
    if pod_resources:
        up = series("gpufleet_telemetry_pod_resources_up", (("Hostname", host),), 1 if attribution.ok else 0)
        _family("gpufleet_telemetry_pod_resources_up", *own["gpufleet_telemetry_pod_resources_up"], [up], out)
    ages = [(base[s.gpu.uuid], s.taken) for s in with_values]
    return ("\n".join(out) + "\n") if out else "", ages


def _holders(attribution: Attribution, gpu: GpuInfo) -> tuple[Holder, ...]:
    """Who holds the whole GPU: pods given it whole, a replica of it, or a memory share on it. A GPU in MIG
    mode is shared by its MIG devices' pods: its own series carry none of them."""
    return attribution.holders.get(gpu.uuid, ())


def _mig_samples(name: str, s: _Served, base: Labels, attribution: Attribution) -> list[str]:
    assert s.sample is not None
    index = MIG_FIELDS.index(name)  # free, used, reserved: the order of read_mig_memory's answer
    out = []
    for mig in s.gpu.mig_devices:
        memory = s.sample.mig_memory.get(mig.uuid)
        if memory is None or memory[index] is None:
            continue
        value = float(int(memory[index] or 0) >> 20)
        for lab in _per_holder(_mig_labels(base, mig), attribution.holders.get(mig.uuid, ())):
            out.append(series(name, lab, value))
    return out
