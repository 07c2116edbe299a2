"""The DevicePlugin over real unix sockets against a fake kubelet, with a scripted device source."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import grpc
import pytest
from dp_helpers import (
    FakeKubelet,
    FakeSource,
    Watcher,
    make_config,
    make_inventory,
    plugin_channel,
    running_plugin,
    wait_for,
)

from gpufleet.deviceplugin.api import pb, pb_grpc
from gpufleet.deviceplugin.config import MountSpec
from gpufleet.deviceplugin.gpumem.resolver import InMemoryCluster
from gpufleet.deviceplugin.rm.model import HealthEvent, HealthEventKind
from gpufleet.logs import LOGGER

ENDPOINT = "gpufleet-nvidia.com-gpu.sock"


def stub(socket_dir: str, endpoint: str = ENDPOINT) -> pb_grpc.DevicePluginStub:
    return pb_grpc.DevicePluginStub(plugin_channel(socket_dir, endpoint))


def allocate(s: pb_grpc.DevicePluginStub, *containers: list[str]) -> pb.AllocateResponse:
    request = pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=c) for c in containers]
    )
    return s.Allocate(request, timeout=10)


def fake_host(root: str, gpus: int) -> str:
    for name in [f"nvidia{i}" for i in range(gpus)] + ["nvidiactl", "nvidia-uvm", "nvidia-uvm-tools"]:
        os.makedirs(os.path.join(root, "dev"), exist_ok=True)
        open(os.path.join(root, "dev", name), "w").close()
    return root


def test_registers_with_version_endpoint_resource_and_options(socket_dir: str, kubelet: FakeKubelet) -> None:
    with running_plugin(make_config(socket_dir), FakeSource()):
        [request] = wait_for(lambda: kubelet.requests, "registration")
    assert request.version == "v1beta1"
    assert request.endpoint == ENDPOINT
    assert request.resource_name == "nvidia.com/gpu"
    assert request.options.get_preferred_allocation_available
    assert not request.options.pre_start_required


def test_options_rpc_matches_registration(socket_dir: str, kubelet: FakeKubelet) -> None:
    with running_plugin(make_config(socket_dir), FakeSource()):
        options = stub(socket_dir).GetDevicePluginOptions(pb.Empty(), timeout=10)
    assert options.get_preferred_allocation_available and not options.pre_start_required


def test_list_and_watch_sends_full_list_then_update_on_xid(socket_dir: str, kubelet: FakeKubelet) -> None:
    source = FakeSource()
    uuids = [g.uuid for g in source.inv.gpus]
    with running_plugin(make_config(socket_dir), source):
        watcher = Watcher(plugin_channel(socket_dir, ENDPOINT))
        first = watcher.wait(lambda devs: len(devs) == 4, "the initial list")
        assert set(first) == set(uuids) and set(first.values()) == {"Healthy"}
        assert watcher.topology[uuids[3]] == [1]  # NUMA node in the topology hint
        source.events.put(HealthEvent(HealthEventKind.XID, uuids[2], 79))
        latest = watcher.wait(lambda devs: devs[uuids[2]] == "Unhealthy", "GPU 2 unhealthy")
        assert len(latest) == 4  # a full list, not a delta
        assert [h for u, h in latest.items() if u != uuids[2]] == ["Healthy"] * 3
        watcher.cancel()


def test_lost_gpu_comes_back_healthy_after_reset(socket_dir: str, kubelet: FakeKubelet) -> None:
    source = FakeSource()
    uuid = source.inv.gpus[1].uuid
    cfg = replace(make_config(socket_dir), health_probe_interval=0.05)
    with running_plugin(cfg, source):
        watcher = Watcher(plugin_channel(socket_dir, ENDPOINT))
        watcher.wait(lambda d: len(d) == 4, "the initial list")
        source.unusable[uuid] = "GPU is lost"
        watcher.wait(lambda d: d[uuid] == "Unhealthy", "lost GPU unhealthy")
        del source.unusable[uuid]
        watcher.wait(lambda d: d[uuid] == "Healthy", "GPU healthy again")
        watcher.cancel()


def test_allocate_returns_uuids_device_nodes_and_mounts(
    socket_dir: str, kubelet: FakeKubelet, tmp_path
) -> None:
    source = FakeSource()
    root = fake_host(str(tmp_path), 4)
    gpus = source.inv.gpus
    cfg = replace(
        make_config(socket_dir),
        host_root=root,
        allocate_driver_mounts=(MountSpec("/usr/lib/nvidia", "/usr/local/nvidia/lib", True),),
        allocate_cdi_enabled=True,
    )
    with running_plugin(cfg, source):
        resp = allocate(stub(socket_dir), [gpus[2].uuid, gpus[0].uuid], [gpus[1].uuid])
    first, second = resp.container_responses
    assert first.envs["NVIDIA_VISIBLE_DEVICES"] == f"{gpus[0].uuid},{gpus[2].uuid}"
    assert second.envs["NVIDIA_VISIBLE_DEVICES"] == gpus[1].uuid
    specs = {d.container_path: (d.host_path, d.permissions) for d in first.devices}
    assert specs == {
        "/dev/nvidia0": (f"{root}/dev/nvidia0", "rw"),
        "/dev/nvidia2": (f"{root}/dev/nvidia2", "rw"),
        "/dev/nvidiactl": (f"{root}/dev/nvidiactl", "rw"),
        "/dev/nvidia-uvm": (f"{root}/dev/nvidia-uvm", "rw"),
        "/dev/nvidia-uvm-tools": (f"{root}/dev/nvidia-uvm-tools", "rw"),
    }  # no nvidia-modeset: this host has none
    [mount] = first.mounts
    assert (mount.host_path, mount.container_path, mount.read_only) == (
        f"{root}/usr/lib/nvidia",
        "/usr/local/nvidia/lib",
        True,
    )
    assert [c.name for c in first.cdi_devices] == [
        f"nvidia.com/gpu={gpus[0].uuid}",
        f"nvidia.com/gpu={gpus[2].uuid}",
    ]


def test_allocate_with_index_strategy(socket_dir: str, kubelet: FakeKubelet) -> None:
    source = FakeSource()
    cfg = replace(
        make_config(socket_dir), allocate_device_id_strategy="index", allocate_pass_device_specs=False
    )
    with running_plugin(cfg, source):
        resp = allocate(stub(socket_dir), [source.inv.gpus[3].uuid, source.inv.gpus[1].uuid])
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == "1,3"
    assert not resp.container_responses[0].devices


def test_time_slicing_replicas_renamed_and_collapsed(socket_dir: str, kubelet: FakeKubelet) -> None:
    source = FakeSource(make_inventory(2))
    cfg = replace(
        make_config(socket_dir),
        sharing_mode="time-slicing",
        sharing_time_slicing_replicas=3,
        sharing_time_slicing_rename="nvidia.com/gpu.shared",
    )
    endpoint = "gpufleet-nvidia.com-gpu.shared.sock"
    u0 = source.inv.gpus[0].uuid
    with running_plugin(cfg, source):
        [request] = wait_for(lambda: kubelet.requests, "registration")
        assert request.resource_name == "nvidia.com/gpu.shared"
        watcher = Watcher(plugin_channel(socket_dir, endpoint))
        devices = watcher.wait(lambda d: len(d) == 6, "6 replicas")
        assert f"{u0}::2" in devices
        resp = allocate(stub(socket_dir, endpoint), [f"{u0}::0", f"{u0}::2"])
        watcher.cancel()
    assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == u0


@pytest.mark.parametrize(
    ("containers", "code", "message"),
    [
        ([["GPU-nope"]], grpc.StatusCode.INVALID_ARGUMENT, "unknown nvidia.com/gpu device(s): GPU-nope"),
        ([[]], grpc.StatusCode.INVALID_ARGUMENT, "no device IDs"),
        ([], grpc.StatusCode.INVALID_ARGUMENT, "no container requests"),
        ([["{0}", "{0}"]], grpc.StatusCode.INVALID_ARGUMENT, "duplicate device IDs"),
        (
            [["GPU-x"] * 5000],
            grpc.StatusCode.INVALID_ARGUMENT,
            "5000 device IDs requested but nvidia.com/gpu has only 4",
        ),
        ([["{0}"]] * 300, grpc.StatusCode.INVALID_ARGUMENT, "300 container requests is too many"),
        ([["{2}"]], grpc.StatusCode.FAILED_PRECONDITION, "unhealthy device(s)"),
    ],
    ids=[
        "unknown",
        "empty-container",
        "no-containers",
        "duplicate",
        "oversized",
        "too-many-containers",
        "unhealthy",
    ],
)
def test_bad_allocate_is_refused_clearly_and_the_plugin_keeps_answering(
    socket_dir: str, kubelet: FakeKubelet, containers: list[list[str]], code: grpc.StatusCode, message: str
) -> None:
    source = FakeSource()
    uuids = [g.uuid for g in source.inv.gpus]
    with running_plugin(make_config(socket_dir), source):
        s = stub(socket_dir)
        watcher = Watcher(plugin_channel(socket_dir, ENDPOINT))
        source.events.put(HealthEvent(HealthEventKind.XID, uuids[2], 48))
        watcher.wait(lambda d: d.get(uuids[2]) == "Unhealthy", "GPU 2 unhealthy")
        with pytest.raises(grpc.RpcError) as err:
            allocate(s, *[[d.format(*uuids) for d in c] for c in containers])
        assert err.value.code() == code
        assert message in err.value.details()
        # Still serving: a good request right after is answered.
        assert allocate(s, [uuids[0]]).container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == uuids[0]
        watcher.cancel()


class EventLog(logging.Handler):
    """Collects (event, fields) from the gpufleet logger."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, dict[str, Any]]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.events.append((record.getMessage(), dict(getattr(record, "fields", {}))))

    def named(self, *names: str) -> list[tuple[str, dict[str, Any]]]:
        return [e for e in self.events if e[0] in names]


@contextmanager
def event_log() -> Iterator[EventLog]:
    handler, previous = EventLog(), LOGGER.level
    LOGGER.addHandler(handler)
    LOGGER.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        LOGGER.removeHandler(handler)
        LOGGER.setLevel(previous)


def test_allocations_are_logged_after_the_answer_and_before_a_refusal(
    socket_dir: str, kubelet: FakeKubelet
) -> None:
    source = FakeSource()
    uuids = [g.uuid for g in source.inv.gpus]
    with event_log() as log, running_plugin(make_config(socket_dir), source):
        s = stub(socket_dir)
        allocate(s, [uuids[1], uuids[0]], [uuids[2]])
        # Logged once the answer is sent, so possibly just after the client has it.
        wait_for(lambda: len(log.named("allocated")) == 2, "two allocated events")
        with pytest.raises(grpc.RpcError):
            allocate(s, [uuids[3]], ["GPU-nope"])
        wait_for(lambda: log.named("allocate_refused"), "the refusal")
    assert log.named("allocated", "allocate_refused") == [
        ("allocated", {"resource": "nvidia.com/gpu", "devices": f"{uuids[1]},{uuids[0]}", "count": 2}),
        ("allocated", {"resource": "nvidia.com/gpu", "devices": uuids[2], "count": 1}),
        # The first container of the refused request was answered before the second was refused.
        ("allocated", {"resource": "nvidia.com/gpu", "devices": uuids[3], "count": 1}),
        (
            "allocate_refused",
            {
                "resource": "nvidia.com/gpu",
                "code": "INVALID_ARGUMENT",
                "error": "container request 1: unknown nvidia.com/gpu device(s): GPU-nope",
            },
        ),
    ]


def test_unhealthy_error_names_gpu_and_reason(socket_dir: str, kubelet: FakeKubelet) -> None:
    source = FakeSource()
    uuid = source.inv.gpus[1].uuid
    with running_plugin(make_config(socket_dir), source):
        watcher = Watcher(plugin_channel(socket_dir, ENDPOINT))
        source.events.put(HealthEvent(HealthEventKind.ECC_DBE, uuid, 2))
        watcher.wait(lambda d: d.get(uuid) == "Unhealthy", "GPU 1 unhealthy")
        with pytest.raises(grpc.RpcError) as err:
            allocate(stub(socket_dir), [uuid])
        watcher.cancel()
    assert f"GPU 1 ({uuid}): double-bit ECC error" in err.value.details()


def test_a_client_that_never_reads_does_not_stall_other_watchers_or_allocate(
    socket_dir: str, kubelet: FakeKubelet
) -> None:
    # GPU-memory devices make each list ~20 KB, so a few unread updates fill the stuck client's HTTP/2
    # window and the server's writes to it block for good.
    source = FakeSource(make_inventory(4, memory_gib=80))
    cfg = replace(make_config(socket_dir), sharing_mode="memory", node_name="n1")
    endpoint = "gpufleet-gpufleet.io-gpu-mem.sock"
    uuids = [g.uuid for g in source.inv.gpus]
    with running_plugin(cfg, source, resolver=InMemoryCluster()):
        channel = plugin_channel(socket_dir, endpoint)
        stuck = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())  # never iterated
        others = [Watcher(plugin_channel(socket_dir, endpoint)) for _ in range(20)]
        for n in range(60):
            # A lost GPU found usable by the immediate probe recovers at once: two list updates each.
            source.events.put(HealthEvent(HealthEventKind.LOST, uuids[n % 4], 15))
        # The final state, two GPUs unhealthy together, is reached only after every update above.
        source.events.put(HealthEvent(HealthEventKind.XID, uuids[1], 48))
        source.events.put(HealthEvent(HealthEventKind.XID, uuids[2], 48))
        for w in others:
            w.wait(
                lambda d: d.get(f"{uuids[1]}::0") == "Unhealthy" and d.get(f"{uuids[2]}::79") == "Unhealthy",
                "the final list",
            )
        options = pb_grpc.DevicePluginStub(channel).GetDevicePluginOptions(pb.Empty(), timeout=10)
        assert options.get_preferred_allocation_available
        for w in others:
            w.cancel()
        stuck.cancel()


def test_kubelet_restart_leads_to_reserve_and_reregistration(socket_dir: str, kubelet: FakeKubelet) -> None:
    source = FakeSource()
    with running_plugin(make_config(socket_dir), source):
        wait_for(lambda: len(kubelet.requests) == 1, "first registration")
        kubelet.restart()  # wipes the directory, our socket included, then binds a new kubelet.sock
        wait_for(lambda: len(kubelet.requests) >= 2, "re-registration")
        # Re-served: the socket exists again and answers.
        resp = allocate(stub(socket_dir), [source.inv.gpus[0].uuid])
        assert resp.container_responses[0].envs["NVIDIA_VISIBLE_DEVICES"] == source.inv.gpus[0].uuid
    assert kubelet.requests[-1].endpoint == ENDPOINT


def test_plugin_started_before_kubelet_registers_when_it_appears(socket_dir: str) -> None:
    source = FakeSource()
    kubelet = FakeKubelet(socket_dir)
    with running_plugin(make_config(socket_dir), source):
        wait_for(lambda: os.path.exists(os.path.join(socket_dir, ENDPOINT)), "the plugin socket")
        kubelet.start()
        try:
            wait_for(lambda: kubelet.requests, "registration once kubelet.sock appears")
        finally:
            kubelet.stop()


def test_registration_refused_is_retried(socket_dir: str) -> None:
    kubelet = FakeKubelet(socket_dir, refuse="resource name taken").start()
    try:
        with running_plugin(make_config(socket_dir), FakeSource()):
            wait_for(lambda: len(kubelet.requests) >= 2, "a retried registration")
    finally:
        kubelet.stop()


def test_clean_shutdown_removes_the_socket(socket_dir: str, kubelet: FakeKubelet) -> None:
    path = os.path.join(socket_dir, ENDPOINT)
    with running_plugin(make_config(socket_dir), FakeSource()):
        wait_for(lambda: os.path.exists(path), "the plugin socket")
    assert not os.path.exists(path)
    assert os.path.exists(kubelet.path)  # the kubelet's socket is not ours to remove


def test_nvml_unavailable_at_start_advertises_zero_then_devices(
    socket_dir: str, kubelet: FakeKubelet
) -> None:
    source = FakeSource(unavailable="NVML: driver not loaded")
    cfg = replace(make_config(socket_dir), nvml_retry_interval=0.05)
    with running_plugin(cfg, source) as app:
        wait_for(lambda: kubelet.requests, "registration with zero devices")
        watcher = Watcher(plugin_channel(socket_dir, ENDPOINT))
        wait_for(lambda: watcher.lists and watcher.lists[0] == {}, "an empty first list")
        _, why = app.app.healthz()
        assert "GPUs not discovered: NVML: driver not loaded" in why
        with pytest.raises(grpc.RpcError) as err:
            allocate(stub(socket_dir), ["GPU-x"])
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        source.unavailable = ""
        watcher.wait(lambda d: len(d) == 4, "devices once NVML answers")
        watcher.cancel()


def test_nvml_unavailable_at_start_fails_fast_when_configured(socket_dir: str) -> None:
    from gpufleet.deviceplugin.rm.model import SourceUnavailable

    cfg = replace(make_config(socket_dir), nvml_on_init_failure="fail")
    with (
        pytest.raises(SourceUnavailable, match="library not found"),
        running_plugin(cfg, FakeSource(unavailable="library not found")),
    ):
        pass


def test_healthz_and_metrics_over_http(socket_dir: str, kubelet: FakeKubelet) -> None:
    import socket
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = FakeSource()
    cfg = replace(make_config(socket_dir), http_port=port, http_address="127.0.0.1")
    with running_plugin(cfg, source):
        wait_for(lambda: kubelet.requests, "registration")
        health = wait_for(lambda: _get(urllib.request, port, "/healthz"), "healthz 200")
        assert health == "ok\n"
        allocate(stub(socket_dir), [source.inv.gpus[0].uuid])
        with pytest.raises(grpc.RpcError):
            allocate(stub(socket_dir), ["GPU-nope"])
        metrics = _get(urllib.request, port, "/metrics")
    assert 'gpufleet_dp_allocate_total{code="OK",resource="nvidia.com/gpu"} 1' in metrics
    assert 'gpufleet_dp_allocate_total{code="INVALID_ARGUMENT",resource="nvidia.com/gpu"} 1' in metrics
    assert 'gpufleet_dp_registrations_total{resource="nvidia.com/gpu",result="ok"} 1' in metrics
    assert "# TYPE gpufleet_dp_allocate_seconds histogram" in metrics


def _get(request_module, port: int, path: str) -> str:  # type: ignore[no-untyped-def]
    try:
        direct = request_module.build_opener(request_module.ProxyHandler({}))
        with direct.open(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.read().decode()
    except OSError:
        return ""


def test_gc_is_frozen_once_the_plugin_serves(monkeypatch: pytest.MonkeyPatch) -> None:
    import asyncio
    import gc

    from gpufleet.deviceplugin import app as app_module

    calls: list[str] = []

    def collect(*args: Any) -> int:
        calls.append("collect")
        return 0

    monkeypatch.setattr(gc, "collect", collect)
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))

    class Starting:
        def __init__(self) -> None:
            self.ready = asyncio.Event()

    async def scenario() -> None:
        app = Starting()
        task = asyncio.create_task(app_module.freeze_after_start(app))  # type: ignore[arg-type]
        await asyncio.sleep(0.01)
        assert calls == []  # still starting: nothing frozen yet
        app.ready.set()
        await task

    asyncio.run(scenario())
    assert calls == ["collect", "freeze"]
