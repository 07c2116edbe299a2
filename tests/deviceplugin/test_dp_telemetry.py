"""GPU telemetry from scripted readings: dcgm-exporter's names, types and labels, what a lost or hung GPU's
series say, pod attribution in the series, and scrapes that never wait for NVML. /metrics is read with
prometheus_client's parser throughout."""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from dp_helpers import FakeSource, make_inventory, wait_for
from telemetry_helpers import FULL, ScriptedReader, events, families, reading, samples

from gpufleet.deviceplugin.metrics import HttpEndpoint, Metrics
from gpufleet.deviceplugin.rm.manager import HealthSettings, ResourceManager
from gpufleet.deviceplugin.rm.model import (
    GIB,
    HealthEvent,
    HealthEventKind,
    MigDeviceInfo,
    NodeInventory,
    SourceUnavailable,
)
from gpufleet.deviceplugin.telemetry.exporter import GpuSample, Settings, Telemetry
from gpufleet.deviceplugin.telemetry.fields import FIELDS, LEFT_OUT
from gpufleet.deviceplugin.telemetry.pods import Attribution, Holder, MemoryShare
from gpufleet.gpu import NvmlGpuLost

HOST = "node-a"
DRIVER = "535.261.03"

# dcgm-exporter's default counter set (etc/default-counters.csv, main branch and release 4.5.3-4.8.2):
# every field it enables, with its Prometheus type. Checked by hand against the published file.
DCGM_DEFAULTS = {
    "DCGM_FI_DEV_SM_CLOCK": "gauge",
    "DCGM_FI_DEV_MEM_CLOCK": "gauge",
    "DCGM_FI_DEV_MEMORY_TEMP": "gauge",
    "DCGM_FI_DEV_GPU_TEMP": "gauge",
    "DCGM_FI_DEV_POWER_USAGE": "gauge",
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION": "counter",
    "DCGM_FI_DEV_PCIE_REPLAY_COUNTER": "counter",
    "DCGM_FI_DEV_GPU_UTIL": "gauge",
    "DCGM_FI_DEV_MEM_COPY_UTIL": "gauge",
    "DCGM_FI_DEV_ENC_UTIL": "gauge",
    "DCGM_FI_DEV_DEC_UTIL": "gauge",
    "DCGM_FI_DEV_XID_ERRORS": "gauge",
    "DCGM_FI_DEV_FB_FREE": "gauge",
    "DCGM_FI_DEV_FB_USED": "gauge",
    "DCGM_FI_DEV_FB_RESERVED": "gauge",
    "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL": "counter",
    "DCGM_FI_DEV_VGPU_LICENSE_STATUS": "gauge",
    "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS": "counter",
    "DCGM_FI_DEV_ROW_REMAP_FAILURE": "gauge",
    "DCGM_FI_PROF_GR_ENGINE_ACTIVE": "gauge",
    "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": "gauge",
    "DCGM_FI_PROF_DRAM_ACTIVE": "gauge",
    "DCGM_FI_PROF_PCIE_TX_BYTES": "gauge",
    "DCGM_FI_PROF_PCIE_RX_BYTES": "gauge",
}
GPU_LABELS = {"gpu", "UUID", "pci_bus_id", "device", "modelName", "Hostname", "DCGM_FI_DRIVER_VERSION"}


def telemetry(
    inventory: NodeInventory,
    reader: ScriptedReader,
    attribution: Attribution | None = None,
    xids: dict[str, int] | None = None,
    watched: bool = True,
    **settings: float,
) -> Telemetry:
    inventory = replace(inventory, driver_version=DRIVER)

    def attribute(gpus: object, migs: object) -> Attribution:
        assert attribution is not None
        return attribution

    return Telemetry(
        lambda: inventory,
        reader,
        lambda: dict(xids or {}) if watched else None,
        attribute if attribution is not None else None,
        HOST,
        Settings(**settings),
    )


def test_every_default_counter_nvml_can_give_is_served_under_dcgm_exporters_name_and_type() -> None:
    t = telemetry(make_inventory(2), ScriptedReader())
    t.tick()
    found = families(t.render())
    for name, kind in DCGM_DEFAULTS.items():
        if name in LEFT_OUT:
            assert name not in found, f"{name} is said to be left out but is served"
            continue
        assert name in found, f"dcgm-exporter's default {name} is missing"
        assert found[name].type == kind, f"{name} is a {found[name].type}, dcgm-exporter says {kind}"
        assert len(found[name].samples) == 2, f"{name} should have one series per GPU"
    assert {f.name for f in FIELDS} <= set(found)


def test_series_carry_dcgm_exporters_labels_and_units() -> None:
    inventory = make_inventory(2)
    t = telemetry(inventory, ScriptedReader())
    t.tick()
    text = t.render()
    gpu = inventory.gpus[1]
    [power] = samples(text, "DCGM_FI_DEV_POWER_USAGE", gpu="1")
    assert power.labels == {
        "gpu": "1",
        "UUID": gpu.uuid,
        "pci_bus_id": "00000000:02:00.0",  # NVML's spelling, as dcgm-exporter prints it
        "device": "nvidia1",
        "modelName": gpu.model,
        "Hostname": HOST,
        "DCGM_FI_DRIVER_VERSION": DRIVER,
    }
    assert power.value == pytest.approx(692.41)  # mW -> W
    assert samples(text, "DCGM_FI_DEV_FB_USED", gpu="1")[0].value == 1138  # bytes -> whole MiB
    assert samples(text, "DCGM_FI_DEV_FB_RESERVED", gpu="1")[0].value == 615
    assert samples(text, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="1")[0].value == 0  # DCGM: first reading
    assert samples(text, "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", gpu="1")[0].value == FULL["energy_mj"]
    assert samples(text, "DCGM_FI_DEV_CLOCKS_EVENT_REASONS", gpu="1")[0].value == 4
    assert samples(text, "gpufleet_gpu_up", gpu="1")[0].value == 1
    assert samples(text, "gpufleet_gpu_sample_age_seconds", gpu="1")[0].value >= 0


def test_a_counter_nvml_does_not_offer_leaves_its_series_out_and_only_it() -> None:
    reader = ScriptedReader()
    reader.answers[0] = reading(energy_mj=None, enc_util_pct=None, memory_temp_c=None)
    t = telemetry(make_inventory(2), reader)
    t.tick()
    text = t.render()
    for name in ("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", "DCGM_FI_DEV_ENC_UTIL", "DCGM_FI_DEV_MEMORY_TEMP"):
        assert samples(text, name, gpu="0") == [], f"{name} has a series although NVML did not answer it"
        assert len(samples(text, name, gpu="1")) == 1
    assert len(samples(text, "DCGM_FI_DEV_POWER_USAGE", gpu="0")) == 1
    # NVLink bandwidth needs both directions
    reader.answers[0] = reading(nvlink_data_rx_kib=None)
    t.tick()
    assert samples(t.render(), "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="0") == []


def test_nvlink_bandwidth_is_dcgms_rate_of_the_data_counters_not_their_total() -> None:
    """DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL as DCGM 4.6.0 computes it (DcgmCacheManager.cpp,
    ReadAndCacheNvLinkBandwidth): Δ(data tx + rx KiB) / Δs of NVML's timestamps / 1000, truncated; 0 on
    a GPU's first reading; a total that grows for ever would read as a bandwidth that does too."""
    reader = ScriptedReader()
    t = telemetry(make_inventory(2), reader)
    stamp = FULL["nvlink_stamp_us"]

    def bandwidth(gpu: str = "0") -> float:
        [found] = samples(t.render(), "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu=gpu)
        return float(found.value)

    def answer(tx: float, rx: float, at: float) -> None:
        reader.answers[0] = reading(nvlink_data_tx_kib=tx, nvlink_data_rx_kib=rx, nvlink_stamp_us=at)

    answer(5_000_000, 3_000_000, stamp)
    t.tick()
    assert bandwidth() == 0  # the first reading: nothing to compare with
    # 25,000,000 KiB sent and 24,999,999 received over 2 s: 24,999,999.5 KiB/s, DCGM's 24,999 "MB/s"
    answer(30_000_000, 27_999_999, stamp + 2_000_000)
    t.tick()
    assert bandwidth() == 24_999
    answer(30_000_000, 27_999_999, stamp + 12_000_000)  # nothing moved for 10 s
    t.tick()
    assert bandwidth() == 0
    answer(30_000_000 + 1500, 27_999_999, stamp + 12_500_000)  # 3,000 KiB/s: 3 "MB/s"
    t.tick()
    assert bandwidth() == 3
    # the driver reloaded (counters back near 0): 0, not DCGM's negative rate, and counting resumes
    answer(1000, 1000, stamp + 13_500_000)
    t.tick()
    assert bandwidth() == 0
    answer(1000 + 4_000_000, 1000, stamp + 14_500_000)
    t.tick()
    assert bandwidth() == 4000
    # a GPU whose readings lack the counters has no series, and starts afresh when they come back
    reader.answers[0] = reading(nvlink_data_tx_kib=None)
    t.tick()
    assert samples(t.render(), "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="0") == []
    answer(9_000_000, 1000, stamp + 20_000_000)
    t.tick()
    assert bandwidth() == 0
    assert bandwidth("1") == 0  # GPU 1 read the same counters each round: nothing moved


def test_a_hung_gpus_nvlink_bandwidth_keeps_the_rate_of_its_last_reading() -> None:
    reader = ScriptedReader()
    t = telemetry(make_inventory(1), reader, gpu_timeout_s=0.2, interval_s=60)
    stamp = FULL["nvlink_stamp_us"]
    reader.answers[0] = reading(nvlink_data_tx_kib=0, nvlink_data_rx_kib=1000, nvlink_stamp_us=stamp)
    t.tick()
    reader.answers[0] = reading(nvlink_data_tx_kib=0,
                                nvlink_data_rx_kib=1_001_000, nvlink_stamp_us=stamp + 1e6)
    t.tick()
    release = threading.Event()
    reader.answers[0] = lambda gpu: release.wait(10) and reading()
    try:
        t.tick()  # abandoned after 0.2 s: the last reading is served again
        text = t.render()
        assert samples(text, "gpufleet_gpu_up", gpu="0")[0].value == 0
        assert samples(text, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="0")[0].value == 1000
    finally:
        release.set()


def test_xid_errors_is_the_gpus_last_xid_with_its_code() -> None:
    inventory = make_inventory(2)
    t = telemetry(inventory, ScriptedReader(), xids={inventory.gpus[1].uuid: 79})
    t.tick()
    text = t.render()
    assert samples(text, "DCGM_FI_DEV_XID_ERRORS", gpu="0")[0].value == 0
    [xid] = samples(text, "DCGM_FI_DEV_XID_ERRORS", gpu="1")
    assert xid.value == 79 and xid.labels["err_code"] == "79"


def test_xid_errors_is_left_out_while_nothing_watches_for_xids(caplog: pytest.LogCaptureFixture) -> None:
    """With health checks off, or NVML's event set unavailable, nobody hears an XID: serving 0 ("none since
    the plugin started") would be a claim nobody can make."""
    t = telemetry(make_inventory(2), ScriptedReader(), watched=False)
    t.tick()
    text = t.render()
    assert samples(text, "DCGM_FI_DEV_XID_ERRORS") == []
    assert len(samples(text, "DCGM_FI_DEV_GPU_TEMP")) == 2  # the rest is served

    def manager(source: FakeSource, enabled: bool) -> ResourceManager:
        rm = ResourceManager(source, [], HealthSettings(enabled=enabled, probe_interval_s=0.05))
        rm.start()
        return rm

    off = manager(FakeSource(), enabled=False)
    try:
        assert off.last_xids() is None
    finally:
        off.stop()
    source = FakeSource()
    on = manager(source, enabled=True)
    try:
        wait_for(lambda: on.last_xids() == {}, "the event set open: no XID yet")
        source.events.put(HealthEvent(HealthEventKind.XID, source.inv.gpus[0].uuid, 43))
        wait_for(lambda: on.last_xids() == {source.inv.gpus[0].uuid: 43}, "XID 43")
    finally:
        on.stop()
    caplog.set_level(logging.INFO, logger="gpufleet")

    def no_events(uuids: object) -> None:
        raise SourceUnavailable("events not supported")

    broken = FakeSource()
    broken.open_events = no_events  # type: ignore[method-assign,assignment]
    unwatched = manager(broken, enabled=True)
    try:
        wait_for(lambda: events(caplog, "health_events_unavailable"), "the event set refused")
        assert unwatched.last_xids() is None
    finally:
        unwatched.stop()


def test_a_lost_gpu_serves_no_values_and_says_so_while_the_others_are_served(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpufleet")
    reader = ScriptedReader()
    t = telemetry(make_inventory(3), reader)
    t.tick()
    assert len(samples(t.render(), "DCGM_FI_DEV_GPU_TEMP", gpu="1")) == 1
    reader.answers[1] = NvmlGpuLost("GPU 1: GPU is lost", 15)
    t.tick()
    text = t.render()
    for f in FIELDS:
        assert samples(text, f.name, gpu="1") == [], f"lost GPU 1 still has {f.name}"
    assert samples(text, "DCGM_FI_DEV_XID_ERRORS", gpu="1") == []
    assert samples(text, "gpufleet_gpu_sample_age_seconds", gpu="1") == []
    assert samples(text, "gpufleet_gpu_up", gpu="1")[0].value == 0
    for other in ("0", "2"):
        assert len(samples(text, "DCGM_FI_DEV_GPU_TEMP", gpu=other)) == 1
        assert samples(text, "gpufleet_gpu_up", gpu=other)[0].value == 1
    [down] = events(caplog, "telemetry_gpu_down")
    assert "GPU is lost" in down.fields["reason"] and down.fields["gpu"] == 1
    t.tick()  # still lost: no second log line
    assert len(events(caplog, "telemetry_gpu_down")) == 1
    del reader.answers[1]
    t.tick()
    assert samples(t.render(), "gpufleet_gpu_up", gpu="1")[0].value == 1
    assert len(events(caplog, "telemetry_gpu_up")) == 1


def test_a_hung_nvml_call_holds_up_neither_the_round_nor_the_scrape_nor_the_other_gpus(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="gpufleet")
    release = threading.Event()
    reader = ScriptedReader()
    t = telemetry(make_inventory(3), reader, gpu_timeout_s=0.2, max_age_s=1.0)
    t.tick()  # every GPU read once

    def hang(gpu: object) -> object:
        release.wait(60)
        return reading(gpu_temp_c=99)

    reader.answers[1] = hang
    rounds = [_tick_in_thread(t) for _ in range(3)]  # each round finishes although GPU 1 never answers
    text = t.render()
    assert samples(text, "gpufleet_gpu_up", gpu="1")[0].value == 0
    # the last values, with their age, until they are max_age old
    assert samples(text, "DCGM_FI_DEV_GPU_TEMP", gpu="1")[0].value == FULL["gpu_temp_c"]
    assert len(samples(text, "gpufleet_gpu_sample_age_seconds", gpu="1")) == 1
    for other in ("0", "2"):
        assert samples(text, "gpufleet_gpu_up", gpu=other)[0].value == 1
    # the hung call holds one thread, not one per round
    readers = [th for th in threading.enumerate() if th.name == "gpufleet-telemetry-read"]
    assert len(readers) == 1, f"{len(readers)} reader threads after {len(rounds)} rounds with one hung GPU"
    assert len(events(caplog, "telemetry_gpu_hung")) == 1
    time.sleep(1.1)  # past max_age
    _tick_in_thread(t)
    text = t.render()
    assert samples(text, "DCGM_FI_DEV_GPU_TEMP", gpu="1") == [], "values older than max_age are served"
    assert samples(text, "gpufleet_gpu_sample_age_seconds", gpu="1") == []
    assert len(samples(text, "DCGM_FI_DEV_GPU_TEMP", gpu="2")) == 1
    release.set()
    wait_for(lambda: events(caplog, "telemetry_gpu_answered"), "the hung read to return")
    del reader.answers[1]
    _tick_in_thread(t)
    text = t.render()
    assert samples(text, "gpufleet_gpu_up", gpu="1")[0].value == 1
    assert samples(text, "DCGM_FI_DEV_GPU_TEMP", gpu="1")[0].value == FULL["gpu_temp_c"]


def _tick_in_thread(t: Telemetry) -> None:
    """One round, failing the test if it does not end (it must not wait for a hung GPU)."""
    done = threading.Event()
    worker = threading.Thread(target=lambda: (t.tick(), done.set()), daemon=True)
    worker.start()
    assert done.wait(30), "a round waited for a hung GPU"


def test_scrapes_read_the_last_round_and_never_nvml() -> None:
    reader = ScriptedReader()
    t = telemetry(make_inventory(4), reader)
    t.tick()
    calls = reader.calls
    for _ in range(20):
        families(t.render())
    assert reader.calls == calls


def test_pods_label_the_series_of_what_they_hold() -> None:
    inventory = make_inventory(4)
    u = [g.uuid for g in inventory.gpus]
    mig = MigDeviceInfo(f"MIG-{u[3][4:]}", u[3], 1, 3, 0, "3g.40gb", 40 * GIB)
    inventory = replace(
        inventory,
        gpus=(*inventory.gpus[:3], replace(inventory.gpus[3], mig_enabled=True, mig_devices=(mig,))),
    )
    whole = Holder("team-a", "train-0", "main")
    r0, r1 = Holder("team-b", "infer-0", "app", vgpu="0"), Holder("team-b", "infer-1", "app", vgpu="1")
    shared = Holder("team-c", "mem-0", "c0")
    on_mig = Holder("team-d", "mig-0", "m")
    attribution = Attribution(
        {u[0]: (whole,), u[1]: (r0, r1), u[2]: (shared,), mig.uuid: (on_mig,)},
        (MemoryShare(shared, u[2], 4 * GIB),),
    )
    reader = ScriptedReader()
    reader.answers[3] = GpuSample(reading(), {mig.uuid: (30 * GIB, 10 * GIB, 0)})
    t = telemetry(inventory, reader, attribution)
    t.tick()
    text = t.render()
    [s] = samples(text, "DCGM_FI_DEV_GPU_UTIL", gpu="0")
    assert (s.labels["pod"], s.labels["namespace"], s.labels["container"]) == ("train-0", "team-a", "main")
    assert "vgpu" not in s.labels
    # a time-sliced GPU: one series per replica's pod, as dcgm-exporter does for shared GPUs
    sliced = samples(text, "DCGM_FI_DEV_GPU_UTIL", gpu="1")
    assert sorted((x.labels["pod"], x.labels["vgpu"]) for x in sliced) == [("infer-0", "0"), ("infer-1", "1")]
    # a GPU-memory share: the pod on the DCGM series, and its share in gpufleet's own
    [m] = samples(text, "DCGM_FI_DEV_GPU_UTIL", gpu="2")
    assert m.labels["pod"] == "mem-0"
    [share] = samples(text, "gpufleet_pod_gpu_memory_bytes", UUID=u[2])
    assert share.value == 4 * GIB and share.labels["pod"] == "mem-0" and share.labels["namespace"] == "team-c"
    # a MIG device: its memory series with GPU_I_PROFILE / GPU_I_ID and its pod; the GPU's own have none
    mig_used = [x for x in samples(text, "DCGM_FI_DEV_FB_USED", gpu="3") if "GPU_I_ID" in x.labels]
    assert len(mig_used) == 1
    assert mig_used[0].labels["GPU_I_PROFILE"] == "3g.40gb" and mig_used[0].labels["GPU_I_ID"] == "3"
    assert mig_used[0].labels["pod"] == "mig-0" and mig_used[0].value == 10 * 1024
    whole_gpu = samples(text, "DCGM_FI_DEV_GPU_UTIL", gpu="3")
    assert len(whole_gpu) == 1 and "pod" not in whole_gpu[0].labels
    assert set(whole_gpu[0].labels) == GPU_LABELS


def test_without_the_kubelet_series_have_no_pod_labels_and_say_why() -> None:
    t = telemetry(make_inventory(2), ScriptedReader(), Attribution({}, (), ok=False))
    t.tick()
    text = t.render()
    assert all("pod" not in s.labels for s in samples(text, "DCGM_FI_DEV_GPU_UTIL"))
    assert samples(text, "gpufleet_telemetry_pod_resources_up")[0].value == 0


def test_the_http_endpoint_costs_the_same_whatever_a_request_carries() -> None:
    t = telemetry(make_inventory(2), ScriptedReader())
    t.tick()
    http = HttpEndpoint("127.0.0.1", 0, Metrics(), lambda: (True, "ok"), t.render)
    http.start()
    try:
        plain = _raw(http.port, b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
        assert plain.startswith(b"HTTP/1.0 200") and b"DCGM_FI_DEV_GPU_TEMP{" in plain
        # a query string is ignored
        assert _raw(http.port, b"GET /metrics?match[]=" + b"x" * 4000 + b" HTTP/1.1\r\n\r\n").startswith(
            b"HTTP/1.0 200"
        )
        # a request line over http.server's 64 KiB limit is refused without being served
        assert _raw(http.port, b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 414")
        # a body announced as 10 GB is never read: the answer comes at once, the connection is closed
        huge = b"GET /metrics HTTP/1.1\r\nContent-Length: 10000000000\r\n\r\n" + b"x" * 1000
        assert _raw(http.port, huge).startswith(b"HTTP/1.0 200")
        # a client that sends nothing keeps nobody else waiting
        idle = socket.create_connection(("127.0.0.1", http.port))
        try:
            assert _raw(http.port, b"GET /metrics HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.0 200")
        finally:
            idle.close()
    finally:
        http.stop()


def test_trickling_or_crowding_clients_hold_few_threads_and_not_for_long() -> None:
    """Clients that send their headers a byte at a time (each byte well inside the per-read timeout) are cut
    off at the header deadline; beyond the connection cap a connection is closed unanswered; a scrape is
    served again once the tricklers are gone. (Before: one thread per connection, for ever.)"""
    http = HttpEndpoint("127.0.0.1", 0, Metrics(), lambda: (True, "ok"), lambda: "",
                        header_deadline_s=2.0, max_connections=3)  # fmt: skip
    http.start()
    cut: list[str] = []

    def trickle(conn: socket.socket) -> None:
        try:
            conn.sendall(b"GET /metrics HTTP/1.0\r\nX-Slow: ")
            for _ in range(600):  # 60 s at most
                conn.sendall(b"a")
                time.sleep(0.1)
                conn.settimeout(0.001)
                with contextlib.suppress(TimeoutError):
                    if conn.recv(1) == b"":
                        cut.append("closed")
                        return
                conn.settimeout(None)
        except OSError as exc:
            cut.append(type(exc).__name__)
        finally:
            conn.close()

    try:
        slow = [socket.create_connection(("127.0.0.1", http.port)) for _ in range(3)]
        threads = [threading.Thread(target=trickle, args=(c,), daemon=True) for c in slow]
        for thread in threads:
            thread.start()
        wait_for(lambda: _raw(http.port, b"GET /metrics HTTP/1.0\r\n\r\n") == b"",
                 "a fourth connection closed unanswered")  # fmt: skip
        for thread in threads:
            thread.join(30)
        assert len(cut) == 3, f"tricklers still served after the header deadline: {cut}"
        assert wait_for(lambda: _raw(http.port, b"GET /healthz HTTP/1.0\r\n\r\n"), "served again").startswith(
            b"HTTP/1.0 200")
    finally:
        http.stop()


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(request)
        chunks = []
        try:
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        except ConnectionResetError:
            pass  # the server closed with request bytes unread (the body it never reads): what came, counts
    return b"".join(chunks)


def test_the_benchs_help_says_what_it_measures_in_whole_sentences() -> None:
    """`bench/telemetry_bench.py --help` (docs/metrics.md, Cost) printed its docstring's first line, cut
    mid-sentence; it prints the whole docstring, usage and method."""
    bench = Path(__file__).resolve().parents[2] / "bench" / "telemetry_bench.py"
    done = subprocess.run([sys.executable, str(bench), "--help"], capture_output=True, text=True, timeout=60,
                          check=True)  # fmt: skip
    text = " ".join(done.stdout.split())
    assert "CPU per collection round, and Allocate latency with telemetry off and on." in text, done.stdout
    assert "--runs 3" in text and "Figures, not assertions." in text
