"""Garbage on the device plugin's gRPC surface (Allocate, GetPreferredAllocation, PreStartContainer), sent to
the plugin process running on the GPU simulator: every request gets a clear status, none costs more than the
budget, and the plugin keeps serving valid requests afterwards."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from budget import FUZZ_SLOW, worst_case
from dp_helpers import FakeKubelet, PluginProcess, materialize_sim, short_dir, wait_for
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.deviceplugin.api import pb, pb_grpc
from gpufleet.deviceplugin.plugin.server import MAX_CONTAINER_REQUESTS
from gpufleet.deviceplugin.rm.devices import ID_SEPARATOR

RPC_TIMEOUT_S = 30.0  # generous: a refusal takes milliseconds, the budget is checked on CPU time
REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION}
REPLICAS = 4
MODES = {
    "whole-gpus": [],
    "time-slicing": ["--sharing-mode", "time-slicing", f"--sharing-time-slicing-replicas={REPLICAS}"],
}


@dataclass
class Plugin:
    """The plugin process on a dgx-a100 sim root, its fake kubelet, and the device IDs it advertises."""

    proc: PluginProcess
    kubelet: FakeKubelet
    channel: grpc.Channel
    devices: list[str]
    base: str

    @property
    def stub(self) -> pb_grpc.DevicePluginStub:
        return pb_grpc.DevicePluginStub(self.channel)

    @property
    def pid(self) -> int:
        return self.proc.proc.pid

    def assert_serving(self) -> None:
        """The process is alive and a valid Allocate of the first device succeeds."""
        assert self.proc.proc.poll() is None, self.proc.output()[-2000:]
        resp = self.stub.Allocate(allocate([self.devices[0]]), timeout=RPC_TIMEOUT_S)
        assert len(resp.container_responses) == 1


def allocate(*containers: list[str]) -> pb.AllocateRequest:
    return pb.AllocateRequest(
        container_requests=[pb.ContainerAllocateRequest(devices_ids=ids) for ids in containers]
    )


def preferred(available: list[str], must: list[str], size: int) -> pb.PreferredAllocationRequest:
    return pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size
            )
        ]
    )


@pytest.fixture(scope="module", params=sorted(MODES))
def plugin(request: pytest.FixtureRequest, sim_lib: Path) -> Iterator[Plugin]:
    base = short_dir("fz")
    root, socket_dir = os.path.join(base, "root"), os.path.join(base, "sock")
    os.mkdir(socket_dir)
    env = materialize_sim("dgx-a100", root)
    kubelet = FakeKubelet(socket_dir).start()
    proc = PluginProcess(
        env, ["--socket-dir", socket_dir, "--health-probe-interval", "1", *MODES[request.param]]
    )
    try:
        wait_for(lambda: kubelet.requests or proc.proc.poll() is not None, "the plugin to register")
        assert kubelet.requests, f"the plugin exited: {proc.output()[-2000:]}"
        channel = grpc.insecure_channel(
            "unix://" + os.path.join(socket_dir, kubelet.requests[0].endpoint),
            options=[("grpc.max_send_message_length", 64 << 20)],
        )
        stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty(), timeout=RPC_TIMEOUT_S)
        devices = [d.ID for d in next(stream).devices]
        stream.cancel()
        with open(os.path.join(root, "machine.json")) as fh:
            gpus = len(json.load(fh)["gpus"])
        assert len(devices) == gpus * (REPLICAS if request.param == "time-slicing" else 1)
        yield Plugin(proc, kubelet, channel, devices, base)
        channel.close()
    finally:
        proc.stop()
        kubelet.stop()
        shutil.rmtree(base, ignore_errors=True)


# ----- strategies ---------------------------------------------------------------------------------------

GARBAGE_IDS = st.one_of(
    st.text(max_size=50),
    st.sampled_from(
        ["", ID_SEPARATOR, f"GPU-x{ID_SEPARATOR}0", f"{ID_SEPARATOR}{ID_SEPARATOR}", "GPU-" + "f" * 300]
    ),
)


def device_ids(devices: list[str]) -> st.SearchStrategy[str]:
    """A known device of the plugin, a known one mangled, or garbage."""
    known = st.sampled_from(devices)
    return st.one_of(known, known.map(lambda d: d + ID_SEPARATOR + "9"), known.map(str.upper), GARBAGE_IDS)


def valid_allocation(devices: list[str], ids: list[str]) -> bool:
    return bool(ids) and len(set(ids)) == len(ids) and set(ids) <= set(devices)


# ----- properties ---------------------------------------------------------------------------------------


@FUZZ_SLOW
@given(data=st.data())
def test_allocate_answers_every_request_with_a_clear_status(plugin: Plugin, data: st.DataObject) -> None:
    containers = data.draw(
        st.lists(st.lists(device_ids(plugin.devices), max_size=12), max_size=4), label="container requests"
    )
    try:
        resp = plugin.stub.Allocate(allocate(*containers), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        assert err.code() in REFUSALS, (err.code(), err.details())
        assert err.details(), "a refusal says why"
        assert not (containers and all(valid_allocation(plugin.devices, ids) for ids in containers))
    else:
        assert containers and all(valid_allocation(plugin.devices, ids) for ids in containers)
        assert len(resp.container_responses) == len(containers)


@FUZZ_SLOW
@given(data=st.data())
def test_preferred_allocation_answers_within_the_request_or_refuses(
    plugin: Plugin, data: st.DataObject
) -> None:
    available = data.draw(st.lists(device_ids(plugin.devices), max_size=40), label="available")
    must = data.draw(
        st.lists(st.sampled_from(available) if available else GARBAGE_IDS, max_size=4), label="must"
    )
    size = data.draw(st.one_of(st.integers(-3, 12), st.sampled_from([-(2**31), 2**31 - 1])), label="size")
    try:
        resp = plugin.stub.GetPreferredAllocation(preferred(available, must, size), timeout=RPC_TIMEOUT_S)
    except grpc.RpcError as err:
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert err.details()
    else:
        [answer] = resp.container_responses
        chosen = list(answer.deviceIDs)
        assert len(chosen) == size and len(set(chosen)) == size
        assert set(must) <= set(chosen) <= set(available)


@FUZZ_SLOW
@given(st.lists(GARBAGE_IDS, max_size=20))
def test_pre_start_container_accepts_anything_it_is_sent(plugin: Plugin, ids: list[str]) -> None:
    plugin.stub.PreStartContainer(pb.PreStartContainerRequest(devices_ids=ids), timeout=RPC_TIMEOUT_S)


def test_concurrent_garbage_on_many_connections_gets_statuses_and_the_plugin_keeps_serving(
    plugin: Plugin,
) -> None:
    socket = plugin.channel  # one extra channel per thread below: separate HTTP/2 connections
    assert socket is not None
    target = "unix://" + os.path.join(
        os.path.dirname(plugin.kubelet.path), plugin.kubelet.requests[0].endpoint
    )
    garbage = [
        allocate(),
        allocate([]),
        allocate(["GPU-nope"]),
        allocate([plugin.devices[0]] * 3),
        allocate(*[[plugin.devices[0]]] * (MAX_CONTAINER_REQUESTS + 1)),
        preferred(plugin.devices, [], -1),
        preferred(plugin.devices, [], 2**31 - 1),
        preferred(["x"] * 1000, ["y"], 1),
        preferred(plugin.devices, plugin.devices, 1),
    ]

    def hammer(worker: int) -> list[grpc.StatusCode]:
        with grpc.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = pb_grpc.DevicePluginStub(channel)
            codes = []
            for n in range(50):
                req = garbage[(worker + n) % len(garbage)]
                call = stub.Allocate if isinstance(req, pb.AllocateRequest) else stub.GetPreferredAllocation
                try:
                    call(req, timeout=RPC_TIMEOUT_S)
                    codes.append(grpc.StatusCode.OK)
                except grpc.RpcError as err:
                    codes.append(err.code())
            return codes

    with ThreadPoolExecutor(16) as pool:
        codes = [code for result in pool.map(hammer, range(16)) for code in result]
    assert len(codes) == 16 * 50
    assert set(codes) <= {grpc.StatusCode.INVALID_ARGUMENT}, set(codes)
    plugin.assert_serving()


# ----- worst cases --------------------------------------------------------------------------------------


def test_huge_requests_are_refused_within_budget_and_the_plugin_keeps_serving(plugin: Plugin) -> None:
    many = [f"GPU-{n:08d}" for n in range(80_000)]  # about 1 MB, under gRPC's 4 MiB message limit
    cases = {
        "allocate with 80000 unknown IDs": (plugin.stub.Allocate, allocate(many)),
        "allocate with 256 containers of 1000 IDs": (
            plugin.stub.Allocate,
            allocate(*[many[:1000]] * MAX_CONTAINER_REQUESTS),
        ),
        "preferred with 80000 available and must-include IDs": (
            plugin.stub.GetPreferredAllocation,
            preferred(many, many, len(many)),
        ),
        "preferred with the real devices and 80000 must-include IDs": (
            plugin.stub.GetPreferredAllocation,
            preferred(plugin.devices, many, 1),
        ),
        "pre-start with 80000 IDs": (
            plugin.stub.PreStartContainer,
            pb.PreStartContainerRequest(devices_ids=many),
        ),
    }
    for name, (call, request) in cases.items():
        result = worst_case((grpc.RpcError,), call, request, RPC_TIMEOUT_S, server_pid=plugin.pid)
        if isinstance(result, grpc.RpcError):
            assert result.code() is grpc.StatusCode.INVALID_ARGUMENT, (name, result.code(), result.details())
    plugin.assert_serving()


def test_message_over_grpc_size_limit_is_refused_and_the_plugin_keeps_serving(plugin: Plugin) -> None:
    huge = allocate(["x" * (5 << 20)])
    with pytest.raises(grpc.RpcError) as err:
        worst_case((), plugin.stub.Allocate, huge, RPC_TIMEOUT_S, server_pid=plugin.pid)
    assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    plugin.assert_serving()


# ----- regressions --------------------------------------------------------------------------------------


def test_preferred_allocation_with_a_huge_must_include_list_is_refused_without_stalling_the_plugin(
    plugin: Plugin,
) -> None:
    # Before the fix: 50000 IDs in both lists kept the event loop busy for minutes (a quadratic membership
    # check), so Allocate and ListAndWatch stalled with it.
    many = [f"GPU-{n}" for n in range(50_000)]
    with pytest.raises(grpc.RpcError) as err:
        worst_case(
            (),
            plugin.stub.GetPreferredAllocation,
            preferred(many, many, 50_000),
            RPC_TIMEOUT_S,
            server_pid=plugin.pid,
        )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "available device IDs" in (err.value.details() or "")
    plugin.assert_serving()


def test_preferred_allocation_with_more_must_include_than_size_is_refused_before_the_search(
    plugin: Plugin,
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        plugin.stub.GetPreferredAllocation(
            preferred(plugin.devices, plugin.devices[:3], 2), timeout=RPC_TIMEOUT_S
        )
    assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "exceed allocation size 2" in (err.value.details() or "")


def test_duplicate_ids_in_preferred_allocation_lists_count_once(plugin: Plugin) -> None:
    first = plugin.devices[0]
    resp = plugin.stub.GetPreferredAllocation(
        preferred([first] * 5 + plugin.devices[1:2] * 5, [first] * 3, 2), timeout=RPC_TIMEOUT_S
    )
    assert sorted(resp.container_responses[0].deviceIDs) == sorted([first, plugin.devices[1]])
