"""MIG strategies none, single and mixed, end to end on the GPU simulator: MIG layouts made through the
unmodified pynvml, the plugin process discovering them through its real NVML source, a fake kubelet."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import grpc
import pytest
from dp_helpers import (
    FakeKubelet,
    PluginProcess,
    Watcher,
    inject,
    make_inventory,
    materialize_sim,
    plugin_channel,
    short_dir,
    wait_for,
)

from gpufleet.deviceplugin import config as configuration
from gpufleet.deviceplugin.api import pb, pb_grpc
from gpufleet.deviceplugin.labels import gpus_annotation, node_labels
from gpufleet.deviceplugin.rm.model import GIB, MIB, MigDeviceInfo
from gpufleet_harness.sim import miglayout

FAST = ["--health-probe-interval", "0.1", "--nvml-retry-interval", "0.1"]
GPU_ENDPOINT = "gpufleet-nvidia.com-gpu.sock"
MIG_1G = "nvidia.com/mig-1g.10gb"
MIG_3G = "nvidia.com/mig-3g.40gb"


def endpoint(resource: str) -> str:
    return "gpufleet-" + resource.replace("/", "-") + ".sock"


# ----- making MIG layouts through pynvml --------------------------------------------------------------


def run_python(env: dict[str, str], code: str, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


@dataclass
class Node:
    """A materialized sim root with a MIG layout (no plugin running)."""

    root: str
    env: dict[str, str]
    uuids: list[str]  # GPU UUIDs by index
    migs: dict[int, list[dict[str, Any]]]  # GPU index -> its MIG devices as NVML lists them

    def mig_uuids(self, gpu: int) -> list[str]:
        return [m["uuid"] for m in self.migs.get(gpu, [])]


def make_node(fixture: str, layout: dict[int, list[str]]) -> Node:
    root = os.path.join(short_dir("mig"), "root")
    env = materialize_sim(fixture, root)
    migs = miglayout.make_layout(root, layout) if layout else {}
    with open(os.path.join(root, "machine.json")) as f:
        gpus = json.load(f)["gpus"]
    uuids = [g["uuid"] for g in sorted(gpus, key=lambda g: g["index"])]
    return Node(root, env, uuids, migs)


def drop_node(node: Node) -> None:
    shutil.rmtree(os.path.dirname(node.root), ignore_errors=True)


@dataclass
class Plugin:
    node: Node
    socket_dir: str
    kubelet: FakeKubelet
    proc: PluginProcess

    def resources(self) -> dict[str, str]:
        """resource name -> endpoint, as registered."""
        return {r.resource_name: r.endpoint for r in self.kubelet.requests}

    def devices(self, resource: str, count: int) -> dict[str, str]:
        watcher = Watcher(plugin_channel(self.socket_dir, endpoint(resource)))
        try:
            return watcher.wait(lambda d: len(d) == count, f"{count} {resource} devices")
        finally:
            watcher.cancel()

    def allocate(self, resource: str, ids: list[str]) -> pb.ContainerAllocateResponse:
        stub = pb_grpc.DevicePluginStub(plugin_channel(self.socket_dir, endpoint(resource)))
        req = pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=ids)])
        return stub.Allocate(req, timeout=10).container_responses[0]


def start_plugin(node: Node, *args: str, resources: int = 1) -> Plugin:
    socket_dir = short_dir("sock")
    kubelet = FakeKubelet(socket_dir).start()
    proc = PluginProcess(node.env, ["--socket-dir", socket_dir, *FAST, *args])
    plugin = Plugin(node, socket_dir, kubelet, proc)
    wait_for(lambda: len(kubelet.requests) >= resources, f"{resources} registrations")
    return plugin


def stop_plugin(plugin: Plugin) -> int:
    code = plugin.proc.stop()
    plugin.kubelet.stop()
    shutil.rmtree(plugin.socket_dir, ignore_errors=True)
    return code


# GPU 0: seven 1g.10gb; GPU 1: two 3g.40gb; GPUs 2-7 whole (MIG off).
MIXED_LAYOUT = {0: ["1g.10gb"] * 7, 1: ["3g.40gb"] * 2}


@pytest.fixture(scope="module")
def mixed_node(sim_library: str) -> Iterator[Node]:
    node = make_node("dgx-a100", MIXED_LAYOUT)
    yield node
    drop_node(node)


@pytest.fixture(scope="module")
def mixed(mixed_node: Node) -> Iterator[Plugin]:
    plugin = start_plugin(mixed_node, "--mig-strategy", "mixed", resources=3)
    yield plugin
    stop_plugin(plugin)


def test_the_layout_is_what_nvml_lists(mixed_node: Node) -> None:
    """The fixture itself: seven 1g.10gb on GPU 0, two 3g.40gb on GPU 1, with their profile's memory."""
    assert [len(mixed_node.migs[g]) for g in (0, 1)] == [7, 2]
    assert {m["mem"] for m in mixed_node.migs[0]} == {9728 * MIB}
    assert {m["mem"] for m in mixed_node.migs[1]} == {40192 * MIB}
    assert all(u.startswith("MIG-") for g in (0, 1) for u in mixed_node.mig_uuids(g))


# ----- strategy none --------------------------------------------------------------------------------------


def test_none_advertises_mig_enabled_gpus_whole(mixed_node: Node) -> None:
    plugin = start_plugin(mixed_node)
    try:
        assert plugin.resources() == {"nvidia.com/gpu": GPU_ENDPOINT}
        assert set(plugin.devices("nvidia.com/gpu", 8)) == set(mixed_node.uuids)
        resp = plugin.allocate("nvidia.com/gpu", [mixed_node.uuids[0]])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == mixed_node.uuids[0]
        assert not any("nvidia-caps" in d.container_path for d in resp.devices)
    finally:
        stop_plugin(plugin)


# ----- strategy mixed ------------------------------------------------------------------------------------


def test_mixed_registers_one_resource_per_profile_and_whole_gpus(mixed: Plugin) -> None:
    assert mixed.resources() == {
        "nvidia.com/gpu": GPU_ENDPOINT,
        MIG_1G: endpoint(MIG_1G),
        MIG_3G: endpoint(MIG_3G),
    }
    node = mixed.node
    whole = mixed.devices("nvidia.com/gpu", 6)
    assert set(whole) == set(node.uuids[2:])  # MIG-enabled GPUs 0 and 1 are not whole GPUs any more
    assert set(mixed.devices(MIG_1G, 7)) == set(node.mig_uuids(0))
    assert set(mixed.devices(MIG_3G, 2)) == set(node.mig_uuids(1))


def test_mixed_devices_carry_the_parent_numa_node(mixed: Plugin) -> None:
    watcher = Watcher(plugin_channel(mixed.socket_dir, endpoint(MIG_3G)))
    try:
        watcher.wait(lambda d: len(d) == 2, "2 devices")
    finally:
        watcher.cancel()
    assert set(map(tuple, watcher.topology.values())) == {(0,)}  # GPU 1 sits on NUMA node 0


def cap_minor(gpu_minor: int, gi: int, ci: int | None = None) -> int:
    """The driver's fixed numbering of mig-minors (MIG user guide): 3 + 135 per GPU + 9 per GPU instance,
    its compute instances right after it."""
    base = 3 + 135 * gpu_minor + 9 * gi
    return base if ci is None else base + 1 + ci


def test_mixed_allocate_passes_mig_uuid_parent_and_capability_nodes(mixed: Plugin) -> None:
    node = mixed.node
    mig = node.migs[0][3]
    resp = mixed.allocate(MIG_1G, [mig["uuid"]])
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == mig["uuid"]
    host = os.path.join(node.root, "host")
    gi_cap = f"/dev/nvidia-caps/nvidia-cap{cap_minor(0, mig['gi'])}"
    ci_cap = f"/dev/nvidia-caps/nvidia-cap{cap_minor(0, mig['gi'], mig['ci'])}"
    specs = {d.container_path: d.host_path for d in resp.devices}
    assert specs == {
        "/dev/nvidia0": f"{host}/dev/nvidia0",
        "/dev/nvidiactl": f"{host}/dev/nvidiactl",
        "/dev/nvidia-uvm": f"{host}/dev/nvidia-uvm",
        "/dev/nvidia-uvm-tools": f"{host}/dev/nvidia-uvm-tools",
        "/dev/nvidia-modeset": f"{host}/dev/nvidia-modeset",
        gi_cap: host + gi_cap,
        ci_cap: host + ci_cap,
    }
    assert all(os.path.exists(p) for p in specs.values())
    # The table the plugin read names exactly these minors for this instance.
    with open(f"{host}/proc/driver/nvidia-caps/mig-minors") as f:
        table = dict(line.split() for line in f)
    assert table[f"gpu0/gi{mig['gi']}/access"] == gi_cap.rsplit("cap", 1)[1]
    assert table[f"gpu0/gi{mig['gi']}/ci{mig['ci']}/access"] == ci_cap.rsplit("cap", 1)[1]


def test_mixed_allocate_of_two_3g_devices_and_whole_gpus(mixed: Plugin) -> None:
    node = mixed.node
    resp = mixed.allocate(MIG_3G, node.mig_uuids(1))
    assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(node.mig_uuids(1))
    paths = [d.container_path for d in resp.devices]
    assert paths.count("/dev/nvidia1") == 1  # one parent, listed once
    assert len([p for p in paths if p.startswith("/dev/nvidia-caps/")]) == 4  # gi + ci for each
    whole = mixed.allocate("nvidia.com/gpu", [node.uuids[5]])
    assert whole.envs["NVIDIA_VISIBLE_DEVICES"] == node.uuids[5]


@pytest.mark.parametrize(
    ("resource", "ids", "why"),
    [
        (MIG_1G, lambda n: [n.uuids[0]], "a whole GPU is not a 1g.10gb device"),
        (MIG_1G, lambda n: [n.mig_uuids(1)[0]], "a 3g.40gb device is not a 1g.10gb device"),
        ("nvidia.com/gpu", lambda n: [n.uuids[0]], "GPU 0 is in MIG mode: not advertised whole"),
        (MIG_3G, lambda n: [n.mig_uuids(1)[0]] * 2, "duplicates"),
    ],
)
def test_mixed_allocate_refuses_devices_of_another_resource(
    mixed: Plugin, resource: str, ids: Any, why: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        mixed.allocate(resource, ids(mixed.node))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, why


def test_mixed_preferred_allocation_keeps_must_include_first(mixed: Plugin) -> None:
    migs = mixed.node.mig_uuids(0)
    stub = pb_grpc.DevicePluginStub(plugin_channel(mixed.socket_dir, endpoint(MIG_1G)))
    req = pb.PreferredAllocationRequest(
        container_requests=[
            pb.ContainerPreferredAllocationRequest(
                available_deviceIDs=migs, must_include_deviceIDs=[migs[5]], allocation_size=2
            )
        ]
    )
    got = list(stub.GetPreferredAllocation(req, timeout=10).container_responses[0].deviceIDs)
    assert got == [migs[5], migs[0]]


def test_mixed_allocate_with_index_strategy_names_gpu_and_mig_index(mixed_node: Node) -> None:
    plugin = start_plugin(
        mixed_node, "--mig-strategy", "mixed", "--allocate-device-id-strategy", "index", resources=3
    )
    try:
        migs = mixed_node.migs[1]
        resp = plugin.allocate(MIG_3G, [m["uuid"] for m in migs])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == ",".join(f"1:{m['k']}" for m in migs)
    finally:
        stop_plugin(plugin)


# ----- health ----------------------------------------------------------------------------------------------


def test_an_xid_on_a_mig_device_marks_only_that_device(mixed_node: Node) -> None:
    plugin = start_plugin(mixed_node, "--mig-strategy", "mixed", resources=3)
    try:
        node = mixed_node
        one_g = Watcher(plugin_channel(plugin.socket_dir, endpoint(MIG_1G)))
        three_g = Watcher(plugin_channel(plugin.socket_dir, endpoint(MIG_3G)))
        whole = Watcher(plugin_channel(plugin.socket_dir, GPU_ENDPOINT))
        one_g.wait(lambda d: len(d) == 7 and set(d.values()) == {"Healthy"}, "1g.10gb healthy")
        three_g.wait(lambda d: len(d) == 2 and set(d.values()) == {"Healthy"}, "3g.40gb healthy")
        target = node.migs[0][2]
        inject(node.root, "xid", "0", "48", str(target["gi"]), str(target["ci"]))
        latest = one_g.wait(lambda d: d[target["uuid"]] == "Unhealthy", "the MIG device unhealthy")
        assert [latest[u][0] for u in node.mig_uuids(0)] == list("HHUHHHH")

        with pytest.raises(grpc.RpcError) as err:
            plugin.allocate(MIG_1G, [target["uuid"]])
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "XID 48" in err.value.details() and f"gi {target['gi']}" in err.value.details()
        assert plugin.allocate(MIG_1G, [node.mig_uuids(0)[0]]).envs["NVIDIA_VISIBLE_DEVICES"]

        # A whole-GPU XID on GPU 1: both of its MIG devices go; GPU 0's healthy ones stay.
        inject(node.root, "xid", "1", "48")
        three_g.wait(lambda d: set(d.values()) == {"Unhealthy"}, "both 3g.40gb unhealthy")
        assert [one_g.latest[u][0] for u in node.mig_uuids(0)] == list("HHUHHHH")
        assert set(whole.latest.values()) == {"Healthy"} and len(whole.latest) == 6
        for w in (one_g, three_g, whole):
            w.cancel()
    finally:
        stop_plugin(plugin)


# ----- strategy single -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def uniform_node(sim_library: str) -> Iterator[Node]:
    node = make_node("dgx-a100", {g: ["1g.10gb"] * 7 for g in range(8)})
    yield node
    drop_node(node)


def test_single_advertises_every_mig_device_as_the_gpu_resource(uniform_node: Node) -> None:
    plugin = start_plugin(uniform_node, "--mig-strategy", "single")
    try:
        node = uniform_node
        assert plugin.resources() == {"nvidia.com/gpu": GPU_ENDPOINT}
        every = [u for g in range(8) for u in node.mig_uuids(g)]
        assert len(every) == 56
        assert set(plugin.devices("nvidia.com/gpu", 56)) == set(every)
        mig = node.migs[6][0]
        resp = plugin.allocate("nvidia.com/gpu", [mig["uuid"]])
        assert resp.envs["NVIDIA_VISIBLE_DEVICES"] == mig["uuid"]
        paths = {d.container_path for d in resp.devices}
        assert "/dev/nvidia6" in paths
        assert f"/dev/nvidia-caps/nvidia-cap{cap_minor(6, mig['gi'], mig['ci'])}" in paths
    finally:
        stop_plugin(plugin)


def run_to_exit(node: Node, *args: str) -> tuple[int, str]:
    socket_dir = short_dir("sock")
    kubelet = FakeKubelet(socket_dir).start()
    proc = PluginProcess(node.env, ["--socket-dir", socket_dir, *FAST, *args])
    try:
        code = proc.proc.wait(30)
    finally:
        proc.stop()
        kubelet.stop()
        shutil.rmtree(socket_dir, ignore_errors=True)
    assert not kubelet.requests  # nothing was registered before it gave up
    return code, proc.output()


def test_single_refuses_a_node_with_mig_disabled_on_some_gpus(mixed_node: Node) -> None:
    code, output = run_to_exit(mixed_node, "--mig-strategy", "single")
    assert code == 1
    assert "every GPU must have MIG enabled" in output and "2, 3, 4, 5, 6, 7" in output


def test_single_refuses_two_profiles(sim_library: str) -> None:
    node = make_node("hgx-h100", {g: ["3g.40gb" if g == 4 else "1g.10gb"] for g in range(8)})
    try:
        code, output = run_to_exit(node, "--mig-strategy", "single")
    finally:
        drop_node(node)
    assert code == 1
    assert "one profile, found 1g.10gb, 3g.40gb" in output


@pytest.mark.parametrize("strategy", ["single", "mixed"])
def test_a_mig_enabled_gpu_without_mig_devices_is_refused(sim_library: str, strategy: str) -> None:
    node = make_node("hgx-h100", {g: [] if g == 2 else ["1g.10gb"] for g in range(8)})
    try:
        code, output = run_to_exit(node, "--mig-strategy", strategy)
    finally:
        drop_node(node)
    assert code == 1
    assert f"mig.strategy {strategy}: GPU(s) 2 have MIG enabled but no MIG devices" in output


def test_single_without_mig_enabled_gpus_falls_back_to_whole_gpus(sim_library: str) -> None:
    node = make_node("pcie-2x-t4", {})
    plugin = start_plugin(node, "--mig-strategy", "single")
    try:
        assert set(plugin.devices("nvidia.com/gpu", 2)) == set(node.uuids)
        assert "mig_strategy_fallback" in plugin.proc.output()
    finally:
        stop_plugin(plugin)
        drop_node(node)


# ----- configuration ---------------------------------------------------------------------------------------


def test_mig_strategy_from_file_env_and_flag() -> None:
    assert configuration.build(environ={}).mig_strategy == "none"
    assert configuration.build(environ={}, file_values={"mig.strategy": "mixed"}).mig_strategy == "mixed"
    env = {"GPUFLEET_DP_MIG_STRATEGY": "single"}
    assert configuration.build(environ=env, file_values={"mig.strategy": "mixed"}).mig_strategy == "single"
    assert configuration.parse(["--mig-strategy", "mixed"], environ=env).mig_strategy == "mixed"
    with pytest.raises(
        configuration.ConfigError, match="--mig-strategy: expected one of none, single, mixed"
    ):
        configuration.parse(["--mig-strategy", "all"], environ={})


@pytest.mark.parametrize("sharing", ["time-slicing", "memory"])
@pytest.mark.parametrize("strategy", ["single", "mixed"])
def test_mig_strategies_refuse_sharing(strategy: str, sharing: str) -> None:
    with pytest.raises(configuration.ConfigError) as err:
        configuration.build(
            environ={"NODE_NAME": "n"}, file_values={"mig.strategy": strategy, "sharing.mode": sharing}
        )
    assert f"mig.strategy: {strategy} cannot be combined with sharing.mode {sharing}" in str(err.value)


def test_named_configurations_may_set_the_mig_strategy(tmp_path: Any) -> None:
    path = tmp_path / "dp.yaml"
    path.write_text(
        "version: v1\n"
        "configs:\n"
        "  default: whole\n"
        "  named:\n"
        "    whole: {}\n"
        "    a100-mixed: {mig: {strategy: mixed}}\n"
    )
    cfg = configuration.build(environ={}, file_values=configuration.load_file(path))
    assert cfg.mig_strategy == "none"
    assert cfg.select("a100-mixed").mig_strategy == "mixed"
    path.write_text(
        "version: v1\n"
        "configs:\n"
        "  default: x\n"
        "  named:\n"
        "    x: {mig: {strategy: mixed}, sharing: {mode: time-slicing}}\n"
    )
    with pytest.raises(configuration.ConfigError) as err:
        configuration.build(environ={}, file_values=configuration.load_file(path))
    assert "configs.named.x: mig.strategy: mixed cannot be combined with sharing.mode time-slicing" in str(
        err.value
    )


def test_mixed_resource_names_follow_the_resource_domain() -> None:
    inv = make_inventory(2, 80)
    mig = MigDeviceInfo("MIG-a", inv.gpus[0].uuid, 0, 7, 0, "1g.10gb", 9728 * MIB)
    gpu0 = replace(inv.gpus[0], mig_enabled=True, mig_devices=(mig,))
    inv = replace(inv, gpus=(gpu0, inv.gpus[1]))
    cfg = configuration.build(
        environ={}, file_values={"mig.strategy": "mixed", "resource_name": "example.com/gpu"}
    )
    assert [(r.name, r.kind.value) for r in cfg.resources(inv)] == [
        ("example.com/gpu", "gpu"),
        ("example.com/mig-1g.10gb", "mig"),
    ]
    # A profile with media extensions: `+` is not allowed in a resource name; NVIDIA's plugin says `.me`.
    me = MigDeviceInfo("MIG-b", inv.gpus[0].uuid, 1, 8, 0, "1g.10gb+me", 9728 * MIB)
    gpu0 = replace(gpu0, mig_devices=(mig, me))
    specs = cfg.resources(replace(inv, gpus=(gpu0, inv.gpus[1])))
    assert [(r.name, r.mig_profile) for r in specs][1:] == [
        ("example.com/mig-1g.10gb", "1g.10gb"),
        ("example.com/mig-1g.10gb.me", "1g.10gb+me"),
    ]
    # Strategy none never looks at MIG, whatever the inventory holds.
    assert [r.name for r in configuration.build(environ={}).resources(inv)] == ["nvidia.com/gpu"]


# ----- labels ----------------------------------------------------------------------------------------------

LABELS_SCRIPT = """
import json, sys
from gpufleet.deviceplugin.rm.nvml_source import NvmlDeviceSource
from gpufleet.deviceplugin.gfd import gfd_labels
from gpufleet.deviceplugin.labels import node_labels
source = NvmlDeviceSource(sys.argv[1])
inv = source.inventory()
both = lambda s: {**node_labels(inv, "gpufleet.io", s), **gfd_labels(inv, s)}
print(json.dumps({s: both(s) for s in ("none", "single", "mixed")}))
source.close()
"""


def discovered_labels(node: Node) -> dict[str, dict[str, str]]:
    return json.loads(run_python(node.env, LABELS_SCRIPT, os.path.join(node.root, "host")))


def test_labels_mixed_as_gpu_feature_discovery_writes_them(mixed_node: Node) -> None:
    labels = discovered_labels(mixed_node)
    mixed, none = labels["mixed"], labels["none"]
    assert not any(k.startswith(("nvidia.com/mig.strategy", "nvidia.com/mig-")) for k in none)
    assert none["nvidia.com/mig.capable"] == "true"
    assert mixed["nvidia.com/mig.strategy"] == mixed["gpufleet.io/mig.strategy"] == "mixed"
    assert mixed["nvidia.com/gpu.count"] == "8"  # whole GPUs, MIG-enabled ones included, as without MIG
    assert mixed["nvidia.com/gpu.product"] == "NVIDIA-A100-SXM4-80GB"
    assert (mixed["nvidia.com/gpu.replicas"], mixed["nvidia.com/gpu.sharing-strategy"]) == ("1", "none")
    # GFD's per-profile labels; the attributes beyond memory only where the simulator answers
    # nvmlDeviceGetAttributes for MIG devices (memory comes from their memory info otherwise).
    core = ("count", "memory", "product", "replicas", "sharing-strategy")
    mig = {k: v for k, v in mixed.items() if k.startswith("nvidia.com/mig-") and k.rsplit(".", 1)[-1] in core}
    assert mig == {
        "nvidia.com/mig-1g.10gb.count": "7",
        "nvidia.com/mig-1g.10gb.memory": "9728",
        "nvidia.com/mig-1g.10gb.product": "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb",
        "nvidia.com/mig-1g.10gb.replicas": "1",
        "nvidia.com/mig-1g.10gb.sharing-strategy": "none",
        "nvidia.com/mig-3g.40gb.count": "2",
        "nvidia.com/mig-3g.40gb.memory": "40192",
        "nvidia.com/mig-3g.40gb.product": "NVIDIA-A100-SXM4-80GB-MIG-3g.40gb",
        "nvidia.com/mig-3g.40gb.replicas": "1",
        "nvidia.com/mig-3g.40gb.sharing-strategy": "none",
    }
    ours = {k.removeprefix("gpufleet.io/"): v for k, v in mixed.items() if k.startswith("gpufleet.io/mig-")}
    assert ours == {k.removeprefix("nvidia.com/"): v for k, v in mig.items() if k.endswith(core[:3])}


def test_labels_single_describe_the_mig_devices(uniform_node: Node) -> None:
    single = discovered_labels(uniform_node)["single"]
    for domain in ("nvidia.com", "gpufleet.io"):
        assert single[f"{domain}/mig.strategy"] == "single"
        assert single[f"{domain}/gpu.count"] == "56"
        assert single[f"{domain}/gpu.product"] == "NVIDIA-A100-SXM4-80GB-MIG-1g.10gb"
        assert single[f"{domain}/gpu.memory"] == "9728"
    assert not any(k.startswith(("nvidia.com/mig-", "gpufleet.io/mig-")) for k in single)
    assert single["nvidia.com/gpu.family"] == "ampere"  # the whole GPUs' architecture labels stay


def test_labels_single_fallback_keeps_whole_gpu_labels() -> None:
    inv = make_inventory(2, 16)
    labels = node_labels(inv, "gpufleet.io", "single")
    assert labels["gpufleet.io/mig.strategy"] == "single"
    assert labels["gpufleet.io/gpu.count"] == "2"
    assert labels["gpufleet.io/gpu.memory"] == str(16 * GIB // MIB)
    assert not any("mig" in k for k in node_labels(inv, "gpufleet.io", "none"))


def test_the_gpus_annotation_marks_the_gpus_in_mig_mode() -> None:
    """The extender reads it: a GPU in MIG mode takes neither whole-GPU nor GPU-memory pods."""
    inv = make_inventory(2, 80)
    inv = replace(inv, gpus=(replace(inv.gpus[0], mig_enabled=True), inv.gpus[1]))
    entries = json.loads(gpus_annotation(inv, {}))
    assert [e.get("mig", False) for e in entries] == [True, False]
