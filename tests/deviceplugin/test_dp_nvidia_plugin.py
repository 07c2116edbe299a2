"""NVIDIA's own k8s-device-plugin against the simulator, through the project's fake kubelet (issue 33:
"NVIDIA's plugin must start with --mig-strategy=single and mixed on the simulator").

Opt-in (tests/conftest.py OPT_IN): `-m nvdp` or `GPUFLEET_NVDP=1`, and `GPUFLEET_NVDP_BIN` naming the
plugin's binary, which is never committed: built outside the repository from NVIDIA/k8s-device-plugin's tag
(v0.20.0, the version run on the real H200: `go build ./cmd/nvidia-device-plugin`). Needs root: the plugin
runs in a private mount namespace (`unshare --mount`) where its fixed socket directory
/var/lib/kubelet/device-plugins is bind-mounted from the test's socket directory, and /proc/driver from the
sim root's `host/proc/driver` (the plugin reads `/proc/driver/nvidia-caps/mig-minors` at that path). Nothing
outside that namespace is mounted or changed.

Each case: a sim root of the fixture with its MIG layout (`gpufleet_harness.sim.miglayout`), the plugin with
`--mig-strategy=<strategy> --fail-on-init-error=true --device-discovery-strategy=nvml` and the sim root as
driver and device root, the FakeKubelet of dp_helpers taking its registrations; then, per resource,
ListAndWatch's first list (every device Healthy) and one Allocate (`NVIDIA_VISIBLE_DEVICES` = the device's
UUID). The resources and counts are those docs/simulator.md records for these runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from dp_helpers import FakeKubelet, short_dir

from gpufleet.deviceplugin.api import pb, pb_grpc
from gpufleet_harness.sim import machine, miglayout

pytestmark = [pytest.mark.nvdp, pytest.mark.root]

BINARY_VARIABLE = "GPUFLEET_NVDP_BIN"
REGISTER_WITHIN_S = 90  # a deadline for the plugin's registrations, not a measurement

# (fixture, MIG layout, strategy) -> the resources NVIDIA's plugin registers and their device counts.
CASES: dict[str, tuple[str, dict[int, list[str]], str, dict[str, int]]] = {
    "h200-single": ("firecracker-vm-h200", {}, "single", {"nvidia.com/gpu": 1}),
    "h200-mixed": ("firecracker-vm-h200", {}, "mixed", {"nvidia.com/gpu": 1}),
    "h200-mig-mixed": (
        "firecracker-vm-h200",
        {0: ["1g.18gb", "1g.18gb", "3g.71gb"]},
        "mixed",
        {"nvidia.com/mig-1g.18gb": 2, "nvidia.com/mig-3g.71gb": 1},
    ),
    "h200-mig-single": ("firecracker-vm-h200", {0: ["3g.71gb", "3g.71gb"]}, "single", {"nvidia.com/gpu": 2}),
    "dgx-a100-single": ("dgx-a100", {}, "single", {"nvidia.com/gpu": 8}),
    "dgx-a100-mig-mixed": (
        "dgx-a100",
        {0: ["1g.10gb", "3g.40gb"], 1: ["3g.40gb", "3g.40gb"]},
        "mixed",
        {"nvidia.com/gpu": 6, "nvidia.com/mig-1g.10gb": 1, "nvidia.com/mig-3g.40gb": 3},
    ),
    "dgx-a100-mig-single": (
        "dgx-a100",
        {gpu: ["3g.40gb", "3g.40gb"] for gpu in range(8)},
        "single",
        {"nvidia.com/gpu": 16},
    ),
    "hgx-h200-mig-single": (
        "hgx-h200",
        {gpu: ["7g.141gb"] for gpu in range(8)},
        "single",
        {"nvidia.com/gpu": 8},
    ),
    "hgx-h200-mig-mixed": (
        "hgx-h200",
        {2: ["3g.71gb", "2g.35gb", "2g.35gb"], 5: ["1g.18gb+me", "4g.71gb"]},
        "mixed",
        {
            "nvidia.com/gpu": 6,
            "nvidia.com/mig-1g.18gb.me": 1,
            "nvidia.com/mig-2g.35gb": 2,
            "nvidia.com/mig-3g.71gb": 1,
            "nvidia.com/mig-4g.71gb": 1,
        },
    ),
}


@pytest.fixture(scope="module")
def nvdp_binary() -> str:
    """The plugin's binary; fails (never skips) naming what is missing."""
    path = os.environ.get(BINARY_VARIABLE, "")
    if not path:
        pytest.fail(
            f"{BINARY_VARIABLE} is not set: it names NVIDIA's nvidia-device-plugin binary (k8s-device-plugin "
            "v0.20.0, `go build ./cmd/nvidia-device-plugin` from its tag, outside this repository)"
        )
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.fail(f"{BINARY_VARIABLE}={path}: no executable file there")
    if os.geteuid() != 0:
        pytest.fail("NVIDIA's plugin runs in a private mount namespace here (unshare --mount): needs root")
    if shutil.which("unshare") is None:
        pytest.fail("unshare (util-linux) is not on PATH: NVIDIA's plugin runs in a private mount namespace")
    return path


@pytest.fixture
def plugin_sockets() -> Iterator[str]:
    path = short_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _start(binary: str, root: Path, sockets: str, strategy: str, log: Path) -> subprocess.Popen[bytes]:
    host = root / "host"
    script = (
        "set -e; mount -t tmpfs tmpfs /var/lib; mkdir -p /var/lib/kubelet/device-plugins; "
        f'mount --bind "{sockets}" /var/lib/kubelet/device-plugins; '
        f'mount --bind "{host}/proc/driver" /proc/driver; '
        f'exec "{binary}" --mig-strategy={strategy} --fail-on-init-error=true '
        f'--device-discovery-strategy=nvml --driver-root="{host}" --dev-root="{host}" '
        "--kubelet-socket=/var/lib/kubelet/device-plugins/kubelet.sock"
    )
    with log.open("wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env=machine.sim_env(root),
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _resource(sockets: str, request: pb.RegisterRequest) -> tuple[list[tuple[str, str]], str]:
    """(ID, health) of every device of ListAndWatch's first list, and the NVIDIA_VISIBLE_DEVICES of an
    Allocate of the first device."""
    with grpc.insecure_channel("unix://" + os.path.join(sockets, request.endpoint)) as channel:
        stub = pb_grpc.DevicePluginStub(channel)
        first = next(stub.ListAndWatch(pb.Empty(), timeout=30))
        devices = [(d.ID, d.health) for d in first.devices]
        ask = pb.ContainerAllocateRequest(devices_ids=[devices[0][0]])
        answer = stub.Allocate(pb.AllocateRequest(container_requests=[ask]), timeout=30)
        return devices, dict(answer.container_responses[0].envs).get("NVIDIA_VISIBLE_DEVICES", "")


@pytest.mark.parametrize("case", list(CASES))
def test_nvidias_plugin_serves_the_simulator(
    case: str, nvdp_binary: str, sim_lib: Path, tmp_path: Path, plugin_sockets: str
) -> None:
    fixture, layout, strategy, want = CASES[case]
    root = machine.materialize(fixture, tmp_path / "root", library=sim_lib)
    if layout:
        miglayout.make_layout(root, layout)
    kubelet = FakeKubelet(plugin_sockets).start()
    log = tmp_path / "nvidia-device-plugin.log"
    plugin = _start(nvdp_binary, root, plugin_sockets, strategy, log)
    try:
        deadline = time.monotonic() + REGISTER_WITHIN_S
        while plugin.poll() is None and time.monotonic() < deadline:
            if {r.resource_name for r in kubelet.requests} >= set(want):
                break
            time.sleep(0.2)
        registered = {r.resource_name: r for r in kubelet.requests}
        tail = log.read_text(errors="replace")[-1500:]
        assert plugin.poll() is None, f"NVIDIA's plugin exited with {plugin.returncode}:\n{tail}"
        assert sorted(registered) == sorted(want), f"registered {sorted(registered)}:\n{tail}"
        served = {}
        for name, request in sorted(registered.items()):
            devices, visible = _resource(plugin_sockets, request)
            assert {health for _, health in devices} == {"Healthy"}, (name, devices)
            prefix = "MIG-" if "mig-" in name or (strategy == "single" and layout) else "GPU-"
            assert visible == devices[0][0] and visible.startswith(prefix), (name, visible, devices[0])
            served[name] = len(devices)
        assert served == want
    finally:
        if plugin.poll() is None:
            plugin.terminate()
            try:
                plugin.wait(10)
            except subprocess.TimeoutExpired:
                plugin.kill()
                plugin.wait()
        kubelet.stop()
