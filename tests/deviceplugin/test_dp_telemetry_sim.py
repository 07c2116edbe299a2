"""GPU telemetry end to end on the simulator: the plugin process reading the simulated GPUs through the
unmodified pynvml, a fake kubelet PodResources server for pod labels, injected failures, and Debian's real
Prometheus scraping the plugin on a free loopback port."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from dp_helpers import (
    REPO,
    FakeKubelet,
    PluginProcess,
    inject,
    materialize_sim,
    plugin_channel,
    short_dir,
    wait_for,
)
from telemetry_helpers import FakePodResources, families, samples, scrape

from gpufleet.deviceplugin.api import pb, pb_grpc
from gpufleet_harness.cluster.process import free_ports
from gpufleet_harness.prometheus import Prometheus, ScrapeTarget
from gpufleet_harness.sim import workload

FAST = ["--health-probe-interval", "0.2", "--nvml-retry-interval", "0.2", "--telemetry-interval", "0.3"]
GPUS = 8
ENDPOINT = "gpufleet-nvidia.com-gpu.sock"
MEMORY_MIB = 81920  # dgx-a100's fixture: A100-SXM4-80GB


@dataclass
class Node:
    root: str
    env: dict[str, str]
    port: int
    uuids: list[str]
    kubelet: FakeKubelet
    pods: FakePodResources
    proc: PluginProcess
    sockets: str

    def metrics(self) -> str:
        return scrape(self.port)

    def allocate(self, *indexes: int) -> pb.ContainerAllocateResponse:
        req = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[self.uuids[i] for i in indexes])]
        )
        stub = pb_grpc.DevicePluginStub(plugin_channel(self.sockets, ENDPOINT))
        return stub.Allocate(req, timeout=10).container_responses[0]


@pytest.fixture(scope="module")
def node(sim_library: str) -> Iterator[Node]:
    base = short_dir("tel")
    root, sockets = os.path.join(base, "root"), os.path.join(base, "sock")
    os.mkdir(sockets)
    env = materialize_sim("dgx-a100", root)
    uuids = [g["uuid"] for g in sorted(json.loads(Path(root, "machine.json").read_text())["gpus"],
                                       key=lambda g: g["index"])]  # fmt: skip
    kubelet = FakeKubelet(sockets).start()
    pods = FakePodResources(os.path.join(sockets, "pod-resources.sock")).start()
    (port,) = free_ports(1)
    args = ["--socket-dir", sockets, "--http-port", str(port), "--http-address", "127.0.0.1",
            "--telemetry-pod-resources-socket", pods.socket_path, *FAST]  # fmt: skip
    proc = PluginProcess(env, args)
    node = Node(root, env, port, uuids, kubelet, pods, proc, sockets)
    try:
        wait_for(lambda: _gpus_up(node) == GPUS, "every GPU's series", 60)
        yield node
    finally:
        proc.stop()
        pods.stop()
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query in deploy/grafana/gpufleet-gpus.json."""
    doc = json.loads((REPO / "deploy" / "grafana" / "gpufleet-gpus.json").read_text())
    return [(p["title"], t["expr"]) for p in doc["panels"] for t in p.get("targets", [])]


def _gpus_up(node: Node) -> int:
    try:
        text = node.metrics()
    except OSError:
        return 0
    return sum(1 for s in samples(text, "gpufleet_gpu_up") if s.value == 1)


def _nvml_answers(env: dict[str, str], getter: str) -> bool:
    """Whether the simulator's NVML answers `getter` for GPU 0, asked directly through pynvml."""
    code = textwrap.dedent(f"""
        import pynvml
        pynvml.nvmlInit()
        try:
            pynvml.{getter}(pynvml.nvmlDeviceGetHandleByIndex(0))
            print("yes")
        except pynvml.NVMLError as exc:
            print("no", exc)
    """)
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    return done.stdout.startswith("yes")


def _field_answers(env: dict[str, str], field_id: int, scope: int = 0) -> int | None:
    """GPU 0's nvmlDeviceGetFieldValues answer for one field, asked directly: its value, None on an error."""
    code = textwrap.dedent(f"""
        import pynvml
        pynvml.nvmlInit()
        [v] = pynvml.nvmlDeviceGetFieldValues(pynvml.nvmlDeviceGetHandleByIndex(0), [({field_id}, {scope})])
        print(v.value.uiVal if v.nvmlReturn == 0 else "no")
    """)
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=60, check=True)  # fmt: skip
    answer = done.stdout.strip()
    return None if answer == "no" else int(answer)


def test_every_simulated_gpu_has_its_series(node: Node) -> None:
    text = node.metrics()
    every = ("FB_FREE", "FB_USED", "GPU_TEMP", "MEMORY_TEMP", "POWER_USAGE", "SM_CLOCK", "GPU_UTIL",
             "XID_ERRORS")
    for name in (f"DCGM_FI_DEV_{short}" for short in every):
        found = {s.labels["UUID"] for s in samples(text, name)}
        assert found == set(node.uuids), f"{name}: series for {len(found)} of {GPUS} GPUs"
    for gpu in range(GPUS):
        free, used, reserved = (samples(text, f"DCGM_FI_DEV_FB_{k}", gpu=str(gpu))[0].value
                                for k in ("FREE", "USED", "RESERVED"))  # fmt: skip
        assert free + used + reserved == MEMORY_MIB, f"GPU {gpu}: FB free + used + reserved != the fixture's"
        [temp] = samples(text, "DCGM_FI_DEV_GPU_TEMP", gpu=str(gpu))
        assert temp.labels["modelName"] == "NVIDIA A100-SXM4-80GB" and temp.labels["device"] == f"nvidia{gpu}"


def test_a_series_exists_exactly_when_the_simulators_nvml_answers_its_getter(node: Node) -> None:
    text = node.metrics()
    for getter, name in (("nvmlDeviceGetTotalEnergyConsumption", "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"),
                         ("nvmlDeviceGetPcieReplayCounter", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER"),
                         ("nvmlDeviceGetPowerUsage", "DCGM_FI_DEV_POWER_USAGE"),
                         ("nvmlDeviceGetRemappedRows", "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS")):  # fmt: skip
        answers = _nvml_answers(node.env, getter)
        served = bool(samples(text, name, gpu="0"))
        assert served == answers, f"{name}: served {served}, but NVML answers {getter}: {answers}"
    # the field values: the A100's memory sensor answers (served, with its reading), and so do the NVLink
    # data counters of the DGX's 12 links (served as DCGM's rate: test_nvlink_bandwidth_is_dcgms_rate_…)
    memory_temp = _field_answers(node.env, 82)
    assert memory_temp is not None
    assert [s.value for s in samples(text, "DCGM_FI_DEV_MEMORY_TEMP", gpu="0")] == [memory_temp]
    assert _field_answers(node.env, 138, 0xFFFFFFFF) is not None
    assert len(samples(text, "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="0")) == 1


def test_nvlink_bandwidth_is_dcgms_rate_while_a_gpu_works_and_0_when_it_rests(node: Node) -> None:
    """DCGM's MB/s (Δ KiB / s / 1000) of the data the simulator's model moves: 1 GiB/s per link and direction
    while busy, so 2 x 1024 x 12 links = 24,576 on the DGX's A100; 0 at rest (never an ever-growing total)."""
    def bandwidth() -> float:
        [found] = samples(node.metrics(), "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", gpu="4")
        return float(found.value)

    assert bandwidth() == 0
    expected = 2 * 1024 * 12
    load = workload.start(node.root, 4, seconds=120.0)
    try:
        # within 1 %: the counters follow the sim clock in ms, the rate NVML's timestamps in µs
        wait_for(lambda: abs(bandwidth() - expected) <= expected / 100, f"about {expected} on GPU 4")
    finally:
        workload.stop(node.root, ids=[load.id])
    wait_for(lambda: bandwidth() == 0, "0 once GPU 4 rests (after its power's linger)", 30)


def test_a_pod_holding_a_gpu_labels_its_series(node: Node) -> None:
    node.pods.pods = [("team-a", "train-0", [("main", {"nvidia.com/gpu": [node.uuids[2]]})])]
    try:
        held = wait_for(lambda: samples(node.metrics(), "DCGM_FI_DEV_GPU_UTIL", pod="train-0"), "pod labels")
        assert [(s.labels["UUID"], s.labels["namespace"], s.labels["container"]) for s in held] == [
            (node.uuids[2], "team-a", "main")
        ]
        assert len(samples(node.metrics(), "DCGM_FI_DEV_GPU_UTIL")) == GPUS  # still one series per GPU
    finally:
        node.pods.pods = []


def test_a_lost_gpu_says_so_and_the_others_are_served_then_it_comes_back(node: Node) -> None:
    inject(node.root, "gpu", "3", "lost")
    try:
        wait_for(lambda: samples(node.metrics(), "gpufleet_gpu_up", gpu="3")[0].value == 0, "GPU 3 down")
        text = node.metrics()
        assert samples(text, "DCGM_FI_DEV_GPU_TEMP", gpu="3") == []
        assert samples(text, "DCGM_FI_DEV_FB_USED", gpu="3") == []
        assert len(samples(text, "DCGM_FI_DEV_GPU_TEMP")) == GPUS - 1
    finally:
        inject(node.root, "gpu", "3", "ok")
    wait_for(lambda: samples(node.metrics(), "DCGM_FI_DEV_GPU_TEMP", gpu="3"), "GPU 3's series back")
    assert "event=telemetry_gpu_down" in node.proc.output()


def _answered(node: Node, gpu: int) -> bool:
    """Whether the plugin logged that GPU `gpu`'s hung NVML call returned."""
    return f"event=telemetry_gpu_answered gpu={node.uuids[gpu]}" in node.proc.output()


def test_a_hung_gpu_holds_up_neither_the_scrape_nor_the_other_gpus_then_comes_back(node: Node) -> None:
    """The simulator's `gpu 2 hang`: every NVML call on GPU 2's handle blocks until released, as in a wedged
    driver. While it blocks, scrapes answer (within the scrape's 10 s timeout, the hang having no end),
    GPU 2's values go once too old (docs/metrics.md: three intervals) with gpufleet_gpu_up 0, and rounds
    go on for the other GPUs: a load started during the hang shows. Released, GPU 2 is read again."""
    assert not _answered(node, 2)
    inject(node.root, "gpu", "2", "hang")
    load = None
    try:
        wait_for(lambda: f"event=telemetry_gpu_hung gpu={node.uuids[2]}" in node.proc.output(),
                 "the round to give up on GPU 2's hung reading")  # fmt: skip
        wait_for(lambda: not samples(node.metrics(), "DCGM_FI_DEV_GPU_TEMP", gpu="2"), "GPU 2's values to go")
        text = node.metrics()
        assert [s.value for s in samples(text, "gpufleet_gpu_up", gpu="2")] == [0]
        assert samples(text, "gpufleet_gpu_sample_age_seconds", gpu="2") == []
        assert samples(text, "DCGM_FI_DEV_FB_USED", gpu="2") == []
        assert {s.labels["gpu"] for s in samples(text, "DCGM_FI_DEV_GPU_TEMP")} == {
            str(i) for i in range(GPUS) if i != 2
        }
        assert sum(s.value for s in samples(text, "gpufleet_gpu_up")) == GPUS - 1
        load = workload.start(node.root, 4, seconds=120.0)
        wait_for(lambda: [s.value for s in samples(node.metrics(), "DCGM_FI_DEV_GPU_UTIL", gpu="4")] == [100],
                 "GPU 4's load in a round while GPU 2 hangs")  # fmt: skip
        assert not _answered(node, 2), "the hang was not in force throughout"
    finally:
        if load is not None:
            workload.stop(node.root, ids=[load.id])
        inject(node.root, "gpu", "2", "ok")
    wait_for(lambda: _answered(node, 2), "GPU 2's hung call to return once released")
    wait_for(lambda: [s.value for s in samples(node.metrics(), "gpufleet_gpu_up", gpu="2")] == [1],
             "GPU 2 up")  # fmt: skip
    assert len(samples(node.metrics(), "DCGM_FI_DEV_GPU_TEMP", gpu="2")) == 1


def test_allocate_makes_no_nvml_call(node: Node) -> None:
    """With the whole simulated driver hung (every NVML call blocks, in this process too: its telemetry
    round gives up on a GPU), Allocate still answers: its path makes no NVML call (issue 35: none added)."""
    hung, answered = (node.proc.output().count(f"event=telemetry_gpu_{e}") for e in ("hung", "answered"))
    inject(node.root, "driver", "hang")
    try:
        wait_for(lambda: node.proc.output().count("event=telemetry_gpu_hung") > hung, "a read to hang")
        resp = node.allocate(7, 0)
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == f"{node.uuids[0]},{node.uuids[7]}"
        assert "/dev/nvidia7" in {d.container_path for d in resp.devices}
        assert node.proc.output().count("event=telemetry_gpu_answered") == answered, "the hang ended early"
    finally:
        inject(node.root, "driver", "loaded")
    wait_for(lambda: _gpus_up(node) == GPUS, "every GPU read again once the driver answers")


def test_an_xid_shows_in_xid_errors(node: Node) -> None:
    inject(node.root, "xid", "5", "43")  # an application XID: the GPU stays healthy
    wait_for(lambda: samples(node.metrics(), "DCGM_FI_DEV_XID_ERRORS", gpu="5")[0].value == 43, "XID 43")


def test_debians_prometheus_scrapes_every_gpu_and_the_pod_labels(node: Node, tmp_path: Path) -> None:
    shared = node.uuids[5]  # time-sliced: two pods hold a replica each, so GPU 5 has two series of each field
    node.pods.pods = [("team-b", "infer-0", [("app", {"nvidia.com/gpu": [node.uuids[6]]})]),
                      ("team-c", "slice-0", [("app", {"nvidia.com/gpu": [f"{shared}::0"]})]),
                      ("team-c", "slice-1", [("app", {"nvidia.com/gpu": [f"{shared}::1"]})])]  # fmt: skip
    target = ScrapeTarget(f"127.0.0.1:{node.port}", {"node": "sim-dgx"})
    try:
        with Prometheus(tmp_path / "prometheus", [target], interval_s=0.5) as prom:
            found = prom.wait_for('count(count by (UUID) (DCGM_FI_DEV_FB_USED{node="sim-dgx"})) == 8')
            assert found[0]["value"][1] == "8"
            [held] = prom.wait_for('DCGM_FI_DEV_GPU_UTIL{pod="infer-0",namespace="team-b"}')
            assert held["metric"]["UUID"] == node.uuids[6] and held["metric"]["container"] == "app"
            energy = prom.query("DCGM_FI_DEV_POWER_USAGE")
            assert {s["metric"]["gpu"] for s in energy} == {str(i) for i in range(GPUS)}
            # the counters' TYPE lines are dcgm-exporter's (no _total suffix), which Prometheus accepts
            meta = prom.api("metadata", metric="DCGM_FI_DEV_ECC_SBE_VOL_TOTAL")
            assert meta["DCGM_FI_DEV_ECC_SBE_VOL_TOTAL"][0]["type"] == "counter"
            prom.wait_for(f'count(DCGM_FI_DEV_POWER_USAGE{{UUID="{shared}"}}) == 2')
            # every query of the shipped Grafana dashboard is valid PromQL with answers here (GPU-memory
            # shares excepted: this node does not share GPU memory), and but for the per-pod panels shows
            # or counts each GPU once, the shared one too (its series repeat per holder)
            for title, expr in dashboard_queries():
                query = expr.replace("$node", ".*").replace("$gpu", ".*")
                found = prom.query(query)
                assert found or "gpufleet_pod_gpu_memory_bytes" in expr, f"panel {title!r}: {expr} is empty"
                if "by pod" in title:
                    continue
                if query.startswith(("sum(", "avg(")):  # a total or an average over the GPUs
                    [counted] = prom.query("count(" + query[4:])
                    assert counted["value"][1] == str(GPUS), f"panel {title!r} counts {counted} GPUs: {expr}"
                else:
                    gpus = [(s["metric"]["Hostname"], s["metric"]["gpu"]) for s in found]
                    assert sorted(gpus) == sorted(set(gpus)) and len(gpus) == GPUS, f"panel {title!r}: {gpus}"
    finally:
        node.pods.pods = []
    assert families(node.metrics())  # the plugin still serves after being scraped
