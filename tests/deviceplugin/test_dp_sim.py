"""End to end on the GPU simulator: the plugin process with unmodified pynvml and gpufleet.gpu discovery,
a fake kubelet, failures injected with `gpufleet sim inject`."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
from dp_helpers import (
    FakeKubelet,
    PluginProcess,
    Watcher,
    inject,
    materialize_sim,
    plugin_channel,
    short_dir,
    wait_for,
)

from gpufleet.deviceplugin.api import pb, pb_grpc

ENDPOINT = "gpufleet-nvidia.com-gpu.sock"
FAST = ["--health-probe-interval", "0.1", "--nvml-retry-interval", "0.1"]


@dataclass
class Sim:
    root: str
    socket_dir: str
    kubelet: FakeKubelet
    proc: PluginProcess
    uuids: list[str]  # by GPU index

    def stub(self) -> pb_grpc.DevicePluginStub:
        return pb_grpc.DevicePluginStub(plugin_channel(self.socket_dir, ENDPOINT))

    def preferred(self, available: list[int], size: int, must: list[int] = ()) -> list[int]:  # type: ignore[assignment]
        req = pb.PreferredAllocationRequest(
            container_requests=[
                pb.ContainerPreferredAllocationRequest(
                    available_deviceIDs=[self.uuids[i] for i in available],
                    must_include_deviceIDs=[self.uuids[i] for i in must],
                    allocation_size=size,
                )
            ]
        )
        ids = self.stub().GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs
        return sorted(self.uuids.index(u) for u in ids)

    def allocate(self, *indexes: int) -> pb.ContainerAllocateResponse:
        req = pb.AllocateRequest(
            container_requests=[pb.ContainerAllocateRequest(devices_ids=[self.uuids[i] for i in indexes])]
        )
        return self.stub().Allocate(req, timeout=10).container_responses[0]


def start_sim(
    fixture: str,
    before: list[list[str]] = (),  # type: ignore[assignment]
    args: list[str] = (),  # type: ignore[assignment]
    env: dict[str, str] | None = None,
) -> Sim:
    base = short_dir("sim")
    root, socket_dir = os.path.join(base, "root"), os.path.join(base, "sock")
    os.mkdir(socket_dir)
    env = {**materialize_sim(fixture, root), **(env or {})}
    for words in before:
        inject(root, *words)
    with open(os.path.join(root, "machine.json")) as f:
        machine = json.load(f)
    uuids = [g["uuid"] for g in sorted(machine["gpus"], key=lambda g: g["index"])]
    kubelet = FakeKubelet(socket_dir).start()
    proc = PluginProcess(env, ["--socket-dir", socket_dir, *FAST, *args])
    return Sim(root, socket_dir, kubelet, proc, uuids)


def stop_sim(sim: Sim) -> int:
    code = sim.proc.stop()
    sim.kubelet.stop()
    shutil.rmtree(os.path.dirname(sim.root), ignore_errors=True)
    return code


@pytest.fixture(scope="module")
def dgx(sim_library: str) -> Iterator[Sim]:
    sim = start_sim("dgx-a100")
    wait_for(lambda: sim.kubelet.requests, "registration")
    yield sim
    stop_sim(sim)


@pytest.fixture(scope="module")
def t4(sim_library: str) -> Iterator[Sim]:
    sim = start_sim("pcie-2x-t4")
    wait_for(lambda: sim.kubelet.requests, "registration")
    yield sim
    stop_sim(sim)


def test_plugin_runs_from_the_base_install(sim_library: str, base_install_env: dict[str, str]) -> None:
    """No ansible, testinfra, pyVmomi or harness importable (tests/packaging): it registers, lists and
    allocates as ever."""
    sim = start_sim("pcie-2x-t4", env=base_install_env)
    try:
        wait_for(lambda: sim.kubelet.requests, "registration")
        watcher = Watcher(plugin_channel(sim.socket_dir, ENDPOINT))
        devices = watcher.wait(lambda d: len(d) == 2, "2 GPUs")
        watcher.cancel()
        assert set(devices.values()) == {"Healthy"}
        assert sim.allocate(1).envs["NVIDIA_VISIBLE_DEVICES"] == sim.uuids[1]
    finally:
        stop_sim(sim)
    assert "base install" not in sim.proc.output()


def index_health(sim: Sim, devices: dict[str, str]) -> list[str]:
    return [devices[u][0] for u in sim.uuids]  # "H"/"U" per GPU index


# ----- dgx-a100 ------------------------------------------------------------------------------------------


def test_dgx_registers_and_lists_eight_healthy_gpus_with_numa(dgx: Sim) -> None:
    request = dgx.kubelet.requests[0]
    assert (request.version, request.endpoint, request.resource_name) == (
        "v1beta1",
        ENDPOINT,
        "nvidia.com/gpu",
    )
    watcher = Watcher(plugin_channel(dgx.socket_dir, ENDPOINT))
    devices = watcher.wait(lambda d: len(d) == 8, "8 GPUs")
    watcher.cancel()
    assert set(devices) == set(dgx.uuids) and set(devices.values()) == {"Healthy"}
    assert [watcher.topology[u] for u in dgx.uuids] == [[0]] * 4 + [[1]] * 4


def test_dgx_allocate_points_at_the_simulated_device_nodes(dgx: Sim) -> None:
    resp = dgx.allocate(6, 1)
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == f"{dgx.uuids[1]},{dgx.uuids[6]}"
    host = os.path.join(dgx.root, "host")
    specs = {d.container_path: d.host_path for d in resp.devices}
    assert specs == {
        "/dev/nvidia1": f"{host}/dev/nvidia1",
        "/dev/nvidia6": f"{host}/dev/nvidia6",
        "/dev/nvidiactl": f"{host}/dev/nvidiactl",
        "/dev/nvidia-uvm": f"{host}/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools": f"{host}/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset": f"{host}/dev/nvidia-modeset",
    }
    assert all(os.path.exists(p) for p in specs.values())


@pytest.mark.parametrize(
    ("available", "must", "size", "expected", "why"),
    [
        (range(8), [], 2, [0, 1], "all NV12; 0-1 share a PCIe switch (PXB/PIX pair)"),
        ([0, 2, 3, 4, 5], [], 2, [4, 5], "2-3 and 4-5 are switch pairs; 4-5 leaves 0,2,3 together on NUMA 0"),
        ([0, 2, 3, 4, 6], [], 2, [2, 3], "the only intact switch pair"),
        ([0, 2, 3], [], 1, [0], "a lone GPU whose partner is gone, keeping 2-3 whole"),
        ([0, 2, 3, 4, 5, 6, 7], [0], 2, [0, 2], "partner of 0 taken: same NUMA node (NODE) beats SYS"),
        (range(8), [], 4, [0, 1, 2, 3], "one NUMA node"),
        ([0, 1, 4, 5, 6, 7], [], 4, [4, 5, 6, 7], "the complete NUMA node 1"),
        (range(8), [5], 2, [4, 5], "must-include 5 goes with its switch partner 4"),
        (range(8), [], 8, list(range(8)), "everything"),
    ],
)
def test_dgx_preferred_allocation_picks_what_topo_m_suggests(
    dgx: Sim, available: list[int], must: list[int], size: int, expected: list[int], why: str
) -> None:
    assert dgx.preferred(list(available), size, must) == expected, why


def test_dgx_preferred_refuses_impossible_sizes(dgx: Sim) -> None:
    with pytest.raises(grpc.RpcError) as err:
        dgx.preferred([0, 1], 3)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "exceeds the 2 available devices" in err.value.details()
    assert dgx.preferred([0, 1], 1) == [0]  # still answering


def test_dgx_xid_health_lost_gpu_and_recovery(dgx: Sim) -> None:
    watcher = Watcher(plugin_channel(dgx.socket_dir, ENDPOINT))
    watcher.wait(lambda d: len(d) == 8 and set(d.values()) == {"Healthy"}, "all healthy")
    # An ignored XID, then a critical one: events are handled in order, so when GPU 5 turns unhealthy
    # the ignored XID on GPU 3 has already been skipped.
    inject(dgx.root, "xid", "3", "13")
    inject(dgx.root, "xid", "5", "48")
    latest = watcher.wait(lambda d: d[dgx.uuids[5]] == "Unhealthy", "GPU 5 unhealthy after XID 48")
    assert index_health(dgx, latest) == list("HHHHHUHH")

    with pytest.raises(grpc.RpcError) as err:
        dgx.allocate(5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "GPU 5" in err.value.details() and "XID 48" in err.value.details()

    inject(dgx.root, "gpu", "3", "lost")
    watcher.wait(lambda d: d[dgx.uuids[3]] == "Unhealthy", "lost GPU 3 unhealthy")
    # The reset may only happen once the plugin has seen the GPU gone (a real reset takes seconds).
    wait_for(
        lambda: any("gpu=3" in line and "GPU is lost" in line for line in dgx.proc.output().splitlines()),
        "the probe to see GPU 3 lost",
    )
    inject(dgx.root, "gpu", "3", "ok")
    latest = watcher.wait(lambda d: d[dgx.uuids[3]] == "Healthy", "GPU 3 healthy after the reset")
    # Probes that brought GPU 3 back also probed GPU 5, which never went away: its XID stands.
    assert index_health(dgx, latest) == list("HHHHHUHH")
    assert dgx.allocate(3).envs["NVIDIA_VISIBLE_DEVICES"] == dgx.uuids[3]

    # GPU 5 recovers only through a reset cycle of its own.
    inject(dgx.root, "gpu", "5", "lost")
    wait_for(
        lambda: any("gpu=5" in line and "GPU is lost" in line for line in dgx.proc.output().splitlines()),
        "the probe to see GPU 5 lost",
    )
    inject(dgx.root, "gpu", "5", "ok")
    watcher.wait(lambda d: set(d.values()) == {"Healthy"}, "GPU 5 healthy after its reset")
    # A GPU that came back is watched for events again.
    inject(dgx.root, "xid", "3", "94")
    latest = watcher.wait(lambda d: d[dgx.uuids[3]] == "Unhealthy", "XID on the recovered GPU 3")
    assert index_health(dgx, latest) == list("HHHUHHHH")
    watcher.cancel()


def lines_with(sim: Sim, *words: str) -> list[str]:
    return [line for line in sim.proc.output().splitlines() if all(w in line for w in words)]


def test_a_hung_gpu_goes_unhealthy_while_the_others_health_goes_on_then_recovers(sim_library: str) -> None:
    # GPU 2's NVML calls block (`gpu 2 hang`: a wedged driver call that never returns). Before the
    # per-probe deadline the health thread waited in GPU 2's probe: an XID on GPU 5 went unreported until
    # GPU 2 was released, and GPU 2 itself stayed Healthy.
    sim = start_sim("dgx-a100", args=["--health-probe-timeout", "1"])
    try:
        wait_for(lambda: sim.kubelet.requests, "registration")
        watcher = Watcher(plugin_channel(sim.socket_dir, ENDPOINT))
        watcher.wait(lambda d: len(d) == 8 and set(d.values()) == {"Healthy"}, "all healthy")
        u = sim.uuids
        inject(sim.root, "gpu", "2", "hang")
        inject(sim.root, "xid", "5", "48")
        latest = watcher.wait(
            lambda d: d[u[2]] == "Unhealthy" and d[u[5]] == "Unhealthy",
            "hung GPU 2 and GPU 5 (XID 48) unhealthy while GPU 2 hangs",
        )
        assert index_health(sim, latest) == list("HHUHHUHH")
        assert lines_with(sim, "event=health_gpu_hung", f"gpu={u[2]}", "deadline_s=1.0")
        (changed,) = lines_with(sim, "event=gpu_health_changed", "gpu=2 ")
        assert "healthy=false" in changed and 'reason="NVML call has not returned for' in changed
        with pytest.raises(grpc.RpcError) as err:
            sim.allocate(2)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "GPU 2" in err.value.details() and "NVML call has not returned" in err.value.details()

        # Still hung: the other GPUs' probes go on. GPU 3 is lost and comes back, and the event set the
        # recovery opens anew (without GPU 2, whose registration would hang) reports an XID on GPU 3.
        inject(sim.root, "gpu", "3", "lost")
        wait_for(lambda: lines_with(sim, "gpu=3 ", "GPU is lost"), "the probe to see GPU 3 lost")
        inject(sim.root, "gpu", "3", "ok")
        watcher.wait(lambda d: d[u[3]] == "Healthy", "GPU 3 healthy after its reset, GPU 2 still hung")
        inject(sim.root, "xid", "3", "94")
        latest = watcher.wait(lambda d: d[u[3]] == "Unhealthy", "XID 94 on GPU 3 while GPU 2 hangs")
        assert index_health(sim, latest) == list("HHUUHUHH")
        assert not lines_with(sim, "event=health_gpu_answered"), "GPU 2's hang ended early"

        # Released: the abandoned call returns, the next probe finds GPU 2 answering, and it recovers
        # (it had been unreachable, as after a reset); it is watched for events again.
        inject(sim.root, "gpu", "2", "ok")
        latest = watcher.wait(lambda d: d[u[2]] == "Healthy", "GPU 2 healthy once it answers again")
        assert index_health(sim, latest) == list("HHHUHUHH")
        assert lines_with(sim, "event=health_gpu_answered", f"gpu={u[2]}")
        inject(sim.root, "xid", "2", "48")
        watcher.wait(lambda d: d[u[2]] == "Unhealthy", "XID 48 on the recovered GPU 2")
        watcher.cancel()
    finally:
        inject(sim.root, "gpu", "2", "ok")
        assert stop_sim(sim) == 0


# ----- pcie-2x-t4 ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "must", "size", "expected"),
    [([0, 1], [], 1, [0]), ([0, 1], [1], 1, [1]), ([0, 1], [], 2, [0, 1]), ([1], [], 1, [1])],
)
def test_t4_preferred_allocation(
    t4: Sim, available: list[int], must: list[int], size: int, expected: list[int]
) -> None:
    # topo -m shows NODE between the two cards: no NVLink, no shared switch; the answer is the plain one.
    assert t4.preferred(available, size, must) == expected


def test_t4_gpu_memory_units_are_whole_gib(sim_library: str) -> None:
    sim = start_sim(
        "pcie-2x-t4",
        args=["--sharing-mode", "memory", "--node-name", "n1", "--kubernetes-kubeconfig", "/nonexistent"],
    )
    try:
        code = sim.proc.proc.wait(60)
    finally:
        stop_sim(sim)
    # Without API access the hand-off cannot work: refuse to start rather than advertise memory.
    assert code == 1
    assert "startup_failed" in sim.proc.output()


# ----- NVML unavailable at start ------------------------------------------------------------------------


def test_driver_unloaded_at_start_advertises_zero_then_gpus(sim_library: str) -> None:
    sim = start_sim("pcie-2x-t4", before=[["driver", "unloaded"]])
    try:
        wait_for(lambda: sim.kubelet.requests, "registration with zero devices")
        watcher = Watcher(plugin_channel(sim.socket_dir, ENDPOINT))
        wait_for(lambda: watcher.lists and watcher.lists[0] == {}, "an empty first list")
        assert "nvml_unavailable" in sim.proc.output()
        inject(sim.root, "driver", "loaded")
        watcher.wait(
            lambda d: len(d) == 2 and set(d.values()) == {"Healthy"}, "both T4s once the driver loads"
        )
        watcher.cancel()
    finally:
        assert stop_sim(sim) == 0


def test_library_missing_fails_fast_when_configured(sim_library: str) -> None:
    sim = start_sim("pcie-2x-t4", before=[["library", "missing"]], args=["--nvml-on-init-failure", "fail"])
    try:
        code = sim.proc.proc.wait(60)
    finally:
        stop_sim(sim)
    assert code == 1
    line = next(ln for ln in sim.proc.output().splitlines() if "event=nvml_unavailable" in ln)
    assert "level=error" in line and "exiting" in line


def test_sigterm_removes_the_socket(sim_library: str) -> None:
    sim = start_sim("pcie-2x-t4")
    path = os.path.join(sim.socket_dir, ENDPOINT)
    try:
        wait_for(lambda: sim.kubelet.requests, "registration")
        assert os.path.exists(path)
    finally:
        code = sim.proc.stop()
        sim.kubelet.stop()
    assert code == 0 and not os.path.exists(path)
    shutil.rmtree(os.path.dirname(sim.root), ignore_errors=True)


def test_node40_preferred_takes_one_pcie_switch_then_one_numa_node(sim_library: str) -> None:
    sim = start_sim("node-40-gpus")
    try:
        wait_for(lambda: sim.kubelet.requests, "registration")
        assert sim.preferred(list(range(40)), 5) == [0, 1, 2, 3, 4]  # PIX: one switch
        assert sim.preferred(list(range(40)), 10) == list(range(10))  # one NUMA node, both switches whole
        assert sim.preferred(list(range(3, 40)), 5) == [5, 6, 7, 8, 9]  # the first intact switch
    finally:
        assert stop_sim(sim) == 0


def test_kubelet_restart_reregisters_and_serves_the_new_kubelet(sim_library: str) -> None:
    sim = start_sim("pcie-2x-t4")
    try:
        wait_for(lambda: sim.kubelet.requests, "registration")
        sim.kubelet.restart()  # wipe the directory, bind a new kubelet.sock
        wait_for(lambda: len(sim.kubelet.requests) >= 2, "re-registration")
        watcher = Watcher(plugin_channel(sim.socket_dir, ENDPOINT))
        watcher.wait(lambda d: len(d) == 2, "the list from the re-served socket")
        watcher.cancel()
        assert "event=kubelet_restarted" in sim.proc.output()
    finally:
        assert stop_sim(sim) == 0
