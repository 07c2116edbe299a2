"""gpufleet's device plugin against the real kubelet of the lab, 1.37 (issue 4, "Tests").

The plugin runs as ``python -m gpufleet.deviceplugin`` inside the lab node's mount and PID namespaces
(``KubeletNode.spawn``), with its defaults: it finds ``kubelet.sock`` in ``/var/lib/kubelet/device-plugins``
exactly as on a real node. NVML is the GPU simulator of a fresh sim root per plugin, so failures can be
injected with ``gpufleet_harness.sim.control`` while the kubelet watches.

What these tests read: the Node's capacity/allocatable (what the kubelet reports), the pod's own view
(environment and ``/dev`` inside the container, printed by busybox) and the plugin's JSON log (its
``preferred``/``allocated`` answers, health transitions, registrations), plus the kubelet's log where
only the kubelet can tell (a registration it received).

Waits use generous deadlines and assert outcomes only, never durations.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpufleet_harness.cluster.cluster import ControlPlane
from gpufleet_harness.cluster.node import BUSYBOX_IMAGE, DEVICE_PLUGIN_DIR, KubeletNode
from gpufleet_harness.cluster.process import ClusterError, Daemon, wait_for
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

pytestmark = pytest.mark.cluster

GPU = "nvidia.com/gpu"
GPU_MEM = "gpufleet.io/gpu-mem"
DEADLINE = 120.0  # generous: the machine is shared with other heavy test runs
REPORT_DONE = "report-done"
LOCK_ANNOTATION = "gpufleet.io/bind-lock"
ASSIGNMENT_ANNOTATION = "gpufleet.io/assignment"
ALLOCATED_ANNOTATION = "gpufleet.io/allocated"
# `ls -l` of a character device in busybox: "crw-rw-rw-  1 root  root  195,   3 Nov 22 10:55 /dev/nvidia3"
_LS_CHARDEV = re.compile(r"^c\S*\s+\d+\s+\S+\s+\S+\s+(\d+),\s*(\d+)\s.*\s(/dev/\S+)$")


# -- the plugin process -------------------------------------------------------------------------------------


@dataclass
class PluginRun:
    """One ``python -m gpufleet.deviceplugin`` inside the lab node, on its own simulated machine."""

    node: KubeletNode
    fixture: str
    root: Path
    daemon: Daemon
    uuids: list[str]  # by GPU index
    minors: dict[str, int]  # uuid -> /dev/nvidiaN minor
    stopped: bool = False

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        """The plugin's JSON log events so far (``name``: only those events)."""
        found = []
        try:
            text = self.daemon.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return []
        for line in text.splitlines():
            try:
                doc = json.loads(line)
            except ValueError:
                continue  # e.g. a traceback; kept in the log for the reader
            if isinstance(doc, dict) and (name is None or doc.get("event") == name):
                found.append(doc)
        return found

    def wait_event(
        self,
        what: str,
        name: str,
        predicate: Callable[[dict[str, Any]], bool] = lambda e: True,
        *,
        skip: int = 0,
    ) -> dict[str, Any]:
        """The first ``name`` event after the first ``skip`` ones that satisfies ``predicate``."""

        def probe() -> dict[str, Any] | None:
            return next((e for e in self.events(name)[skip:] if predicate(e)), None)

        try:
            return wait_for(f"plugin log: {what}", probe, DEADLINE, interval=0.1, alive=self.check)
        except ClusterError as err:  # what both sides said, for a failure seen only under CI's load
            kubelet = self.node.kubelet.tail(40) if self.node.kubelet is not None else "(no kubelet)"
            raise ClusterError(
                f"{err}\n--- the plugin's log ({self.daemon.log_path}), last lines:\n{self.daemon.tail(40)}"
                f"\n--- the kubelet's log, last lines:\n{kubelet}"
            ) from None

    def check(self) -> None:
        """Raise with the log tail if the plugin died."""
        if not self.stopped:
            self.daemon.check()

    def inject(self, *words: str) -> None:
        """``gpufleet sim inject ROOT words...`` on this plugin's simulated machine."""
        simcontrol.inject(str(self.root), list(words))

    def indexes(self, uuids: str | list[str]) -> list[int]:
        """GPU indexes of comma-separated (or listed) UUIDs, sorted."""
        items = uuids.split(",") if isinstance(uuids, str) else uuids
        return sorted(self.uuids.index(u) for u in items if u)

    def stop(self) -> None:
        """SIGTERM the plugin (idempotent) and forget it in the node's spawned list."""
        if self.stopped:
            return
        self.stopped = True
        self.daemon.stop()
        if self.daemon in self.node.spawned:
            self.node.spawned.remove(self.daemon)


def _plain(obj: Any) -> Any:
    """A client model as the API's JSON (camelCase dicts)."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def node_resource(core: k8s.CoreV1Api, node: str, resource: str) -> tuple[str | None, str | None]:
    """(capacity, allocatable) of ``resource`` as the kubelet last reported them on the Node."""
    status = _plain(core.read_node(node)).get("status", {})
    return status.get("capacity", {}).get(resource), status.get("allocatable", {}).get(resource)


def wait_node_resource(
    core: k8s.CoreV1Api, node: str, resource: str, capacity: str, allocatable: str, alive: Callable[[], None]
) -> None:
    """Wait until the Node shows exactly this capacity and allocatable of ``resource``."""
    wanted = (capacity, allocatable)
    seen: list[tuple[str | None, str | None]] = []

    def probe() -> bool:
        seen.append(node_resource(core, node, resource))
        return seen[-1] == wanted

    try:
        wait_for(f"{resource} capacity/allocatable {wanted} on {node}", probe, DEADLINE, interval=0.25,
                 alive=alive)  # fmt: skip
    except ClusterError as err:
        raise AssertionError(f"{err}; last seen {seen[-1] if seen else None}") from None


@pytest.fixture
def start_plugin(
    kubelet_node: KubeletNode, core: k8s.CoreV1Api, sim_lib: Path, tmp_path: Path
) -> Iterator[Callable[..., PluginRun]]:
    """``start_plugin(fixture, *flags)``: the device plugin inside the node on a fresh sim root.

    Every plugin started here is stopped when the test ends, whatever happened.
    """
    runs: list[PluginRun] = []

    def start(fixture: str = "dgx-a100", *flags: str) -> PluginRun:
        root = simmachine.materialize(fixture, tmp_path / f"sim-{len(runs)}", library=sim_lib)
        machine = json.loads((root / "machine.json").read_text())
        gpus = sorted(machine["gpus"], key=lambda g: g["index"])
        env = {**os.environ, **simmachine.sim_env(root), "PYTHONUNBUFFERED": "1"}
        argv = [
            sys.executable, "-m", "gpufleet.deviceplugin", "--log-format", "json",
            # the probe is what sees a lost GPU come back; keep it short so the test does not idle
            "--health-probe-interval", "0.2", "--labels-enabled", "false", *flags,
        ]  # fmt: skip
        name = f"dp-{fixture}-{secrets.token_hex(3)}"
        daemon = kubelet_node.spawn(name, argv, env=env)
        run = PluginRun(
            kubelet_node, fixture, root, daemon, [g["uuid"] for g in gpus],
            {g["uuid"]: int(g["minor"]) for g in gpus},
        )  # fmt: skip
        runs.append(run)
        return run

    yield start
    for run in reversed(runs):
        run.stop()


# -- pods ---------------------------------------------------------------------------------------------------

# Prints what the container sees (GPU, control and MIG capability nodes), then stays up (a running pod keeps
# its devices allocated).
_REPORT = (
    'echo "visible=$NVIDIA_VISIBLE_DEVICES"; ls -l /dev/nvidia* /dev/nvidia-caps/* 2>&1; '
    f"echo {REPORT_DONE}; exec sleep 3600"
)


@dataclass
class PodView:
    """What a pod's container printed about itself."""

    name: str
    visible: list[str]
    char_devices: dict[str, tuple[int, int]] = field(default_factory=dict)  # path -> (major, minor)


def parse_report(name: str, log: str) -> PodView:
    """The container's ``NVIDIA_VISIBLE_DEVICES`` and its ``/dev/nvidia*`` character devices."""
    visible: list[str] = []
    devices: dict[str, tuple[int, int]] = {}
    for line in log.splitlines():
        if line.startswith("visible="):
            visible = [u for u in line.removeprefix("visible=").split(",") if u]
        elif match := _LS_CHARDEV.match(line.strip()):
            devices[match.group(3)] = (int(match.group(1)), int(match.group(2)))
    return PodView(name, visible, devices)


@pytest.fixture
def gpu_pods(core: k8s.CoreV1Api, namespace: str) -> Iterator[Callable[..., k8s.V1Pod]]:
    """``gpu_pods(name, limits, node_name=..., scheduler_name=..., annotations=...)`` -> created pod.

    Pods are deleted when the test ends, and the test waits until the API no longer has them: the kubelet
    frees their devices only once they are gone, and the next test counts on every GPU being free.
    """
    created: list[str] = []

    def make(
        name: str,
        limits: Mapping[str, str],
        *,
        node_name: str | None = None,
        scheduler_name: str | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> k8s.V1Pod:
        container = k8s.V1Container(
            name="c", image=BUSYBOX_IMAGE, image_pull_policy="Never", command=["/bin/sh", "-c", _REPORT],
            resources=k8s.V1ResourceRequirements(limits=dict(limits)),
        )  # fmt: skip
        pod = k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name=name, annotations=dict(annotations) if annotations else None),
            spec=k8s.V1PodSpec(
                containers=[container], node_name=node_name, scheduler_name=scheduler_name,
                termination_grace_period_seconds=0, restart_policy="Never",
            ),
        )  # fmt: skip
        created.append(name)
        return core.create_namespaced_pod(namespace, pod)

    yield make
    for name in created:
        try:
            core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
        except ApiException as err:
            if err.status != 404:
                raise

    def gone() -> bool:
        names = {p["metadata"]["name"] for p in _plain(core.list_namespaced_pod(namespace))["items"]}
        return not names & set(created)

    wait_for(f"pods {created} deleted", gone, DEADLINE, interval=0.25)


def wait_running_report(core: k8s.CoreV1Api, namespace: str, name: str) -> PodView:
    """Wait until the pod runs and has printed its report; fail at once if the kubelet rejected it."""

    def probe() -> bool:
        status = _plain(core.read_namespaced_pod(name, namespace)).get("status", {})
        phase = status.get("phase")
        if phase in ("Failed", "Succeeded"):
            # e.g. UnexpectedAdmissionError when Allocate failed
            raise AssertionError(f"pod {name} {phase}: {status.get('reason')}: {status.get('message')}")
        return phase == "Running"

    wait_for(f"pod {namespace}/{name} Running", probe, DEADLINE, interval=0.25)

    def report() -> str | None:
        log: str = core.read_namespaced_pod_log(name, namespace)
        return log if REPORT_DONE in log else None

    return parse_report(name, wait_for(f"pod {name}'s report", report, DEADLINE, interval=0.25))


def kubelet_log_since(node: KubeletNode, offset: int) -> str:
    """The kubelet's log written after byte ``offset`` (the file is appended across restarts)."""
    assert node.kubelet is not None
    with node.kubelet.log_path.open("rb") as handle:
        handle.seek(offset)
        return handle.read().decode(errors="replace")


def kubelet_got_registration(text: str, resource: str) -> bool:
    """The kubelet logged a plugin's registration request for ``resource``: 1.20's printf line
    (``... with resource name "R"``) or a current kubelet's structured one (``... with resource"
    resourceName="R"``)."""
    said = r'Got registration request from device plugin with resource(?: name "{0}"|" resourceName="{0}")'
    return re.search(said.format(re.escape(resource)), text) is not None


def kubelet_log_size(node: KubeletNode) -> int:
    """Current size of the kubelet's log file."""
    assert node.kubelet is not None
    return node.kubelet.log_path.stat().st_size


def registered(plugin: PluginRun, core: k8s.CoreV1Api, gpus: int) -> None:
    """Wait until the plugin says it registered and the Node shows ``gpus`` GPUs, all allocatable."""
    plugin.wait_event("registered with the kubelet", "registered", lambda e: e.get("resource") == GPU)
    wait_node_resource(core, plugin.node.name, GPU, str(gpus), str(gpus), plugin.check)


# -- 1. registration ----------------------------------------------------------------------------------------


def test_registers_with_real_kubelet_and_node_shows_eight_gpus(
    core: k8s.CoreV1Api, kubelet_node: KubeletNode, start_plugin: Callable[..., PluginRun]
) -> None:
    log_offset = kubelet_log_size(kubelet_node)
    plugin = start_plugin("dgx-a100")
    registered(plugin, core, 8)
    event = plugin.events("registered")[0]
    # the default socket directory is the kubelet's compile-time one, seen inside the node
    assert event["kubelet"] == f"{DEVICE_PLUGIN_DIR}/kubelet.sock"
    assert event["endpoint"] == "gpufleet-nvidia.com-gpu.sock"
    assert (kubelet_node.device_plugin_dir / "gpufleet-nvidia.com-gpu.sock").is_socket()
    kubelet_said = kubelet_log_since(kubelet_node, log_offset)
    assert kubelet_got_registration(kubelet_said, GPU), kubelet_said[-2000:]

    # Clean shutdown: the socket goes, and the kubelet sees the plugin gone (devices unhealthy: allocatable
    # 0, capacity kept for the kubelet's grace period).
    plugin.stop()
    socket = kubelet_node.device_plugin_dir / "gpufleet-nvidia.com-gpu.sock"
    wait_for("the plugin's socket removed", lambda: not socket.exists(), DEADLINE)
    assert plugin.events("stopped")
    wait_node_resource(core, kubelet_node.name, GPU, "8", "0", lambda: None)


# -- 2. health ----------------------------------------------------------------------------------------------


def test_xid_lowers_allocatable_and_reset_restores_it(
    core: k8s.CoreV1Api, kubelet_node: KubeletNode, start_plugin: Callable[..., PluginRun]
) -> None:
    plugin = start_plugin("dgx-a100")
    registered(plugin, core, 8)

    plugin.inject("xid", "3", "79")
    plugin.wait_event("GPU 3 unhealthy after XID 79", "gpu_health_changed",
                      lambda e: e.get("gpu") == 3 and e.get("healthy") is False)  # fmt: skip
    wait_node_resource(core, kubelet_node.name, GPU, "8", "7", plugin.check)

    # A reset: the GPU drops off (the plugin must see that), then answers again with its UUID.
    plugin.inject("gpu", "3", "lost")
    plugin.wait_event("the probe to see GPU 3 lost", "gpu_health_changed",
                      lambda e: e.get("gpu") == 3 and "lost" in str(e.get("reason", "")))  # fmt: skip
    # still unhealthy while lost
    assert node_resource(core, kubelet_node.name, GPU) == ("8", "7")
    plugin.inject("gpu", "3", "ok")
    plugin.wait_event("GPU 3 healthy again", "gpu_health_changed",
                      lambda e: e.get("gpu") == 3 and e.get("healthy") is True)  # fmt: skip
    wait_node_resource(core, kubelet_node.name, GPU, "8", "8", plugin.check)


# -- 3. kubelet restart -------------------------------------------------------------------------------------


def test_kubelet_restart_leads_to_reregistration(
    core: k8s.CoreV1Api,
    kubelet_node: KubeletNode,
    namespace: str,
    start_plugin: Callable[..., PluginRun],
    gpu_pods: Callable[..., k8s.V1Pod],
) -> None:
    plugin = start_plugin("dgx-a100")
    registered(plugin, core, 8)
    registrations = len(plugin.events("registered"))
    log_offset = kubelet_log_size(kubelet_node)

    kubelet_node.restart_kubelet(DEADLINE)

    # The new kubelet wiped the directory and bound a new kubelet.sock; the plugin (not restarted)
    # noticed, re-served and registered again, and the new kubelet accepted it.
    plugin.wait_event("the kubelet restart noticed", "kubelet_restarted")
    plugin.wait_event("registered again", "registered", skip=registrations)

    def new_kubelet_got_it() -> str | None:
        text = kubelet_log_since(kubelet_node, log_offset)
        return text if kubelet_got_registration(text, GPU) else None

    kubelet_said = wait_for("the new kubelet to receive the registration", new_kubelet_got_it,
                            DEADLINE, interval=0.2)  # fmt: skip
    assert "Starting Device Plugin manager" in kubelet_said
    assert (kubelet_node.device_plugin_dir / "gpufleet-nvidia.com-gpu.sock").is_socket()
    assert plugin.daemon.running(), "the plugin was not meant to restart"
    wait_node_resource(core, kubelet_node.name, GPU, "8", "8", plugin.check)
    # The Node may never have shown the dip (re-registration can beat the first status update), so
    # prove the new kubelet uses the new endpoint: it admits a GPU pod through the plugin's Allocate.
    gpu_pods("after-restart", {GPU: "1"}, node_name=kubelet_node.name)
    view = wait_running_report(core, namespace, "after-restart")
    allocated = plugin.wait_event("Allocate from the new kubelet", "allocated")
    assert view.visible == [allocated["devices"]] and view.visible[0] in plugin.uuids


# -- 4. a pod with one GPU ----------------------------------------------------------------------------------


def test_pod_with_one_gpu_sees_exactly_that_gpu_and_its_device_nodes(
    core: k8s.CoreV1Api,
    kubelet_node: KubeletNode,
    namespace: str,
    start_plugin: Callable[..., PluginRun],
    gpu_pods: Callable[..., k8s.V1Pod],
) -> None:
    plugin = start_plugin("dgx-a100")
    registered(plugin, core, 8)
    gpu_pods("one-gpu", {GPU: "1"}, node_name=kubelet_node.name)
    view = wait_running_report(core, namespace, "one-gpu")

    assert len(view.visible) == 1, view
    uuid = view.visible[0]
    assert uuid in plugin.uuids
    allocated = plugin.wait_event("Allocate answered", "allocated")
    assert allocated["devices"] == uuid and allocated["count"] == 1
    # containerd (CRI) mapped the device specs: the container has the GPU's own node and the control nodes
    # (the simulator's are real character devices with NVIDIA's numbers), and no other GPU's node.
    minor = plugin.minors[uuid]
    assert view.char_devices.get(f"/dev/nvidia{minor}") == (195, minor), view
    assert view.char_devices.get("/dev/nvidiactl") == (195, 255), view
    assert view.char_devices.get("/dev/nvidia-uvm") == (510, 0), view
    assert view.char_devices.get("/dev/nvidia-uvm-tools") == (510, 1), view
    assert view.char_devices.get("/dev/nvidia-modeset") == (195, 254), view
    gpu_nodes = sorted(p for p in view.char_devices if re.fullmatch(r"/dev/nvidia\d+", p))
    assert gpu_nodes == [f"/dev/nvidia{minor}"]


# -- 5. GetPreferredAllocation ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "gpus", "size", "expected"),
    [
        # NVLink everywhere (NV12); 0-1 then 2-3 share a PCIe switch: a person reading topo -m picks those.
        ("dgx-a100", 8, 2, [[0, 1], [2, 3]]),
        # NODE between the two T4s: the plain answer, lowest index first.
        ("pcie-2x-t4", 2, 1, [[0], [1]]),
    ],
)
def test_kubelet_uses_the_preferred_allocation(
    core: k8s.CoreV1Api,
    kubelet_node: KubeletNode,
    namespace: str,
    start_plugin: Callable[..., PluginRun],
    gpu_pods: Callable[..., k8s.V1Pod],
    fixture: str,
    gpus: int,
    size: int,
    expected: list[list[int]],
) -> None:
    plugin = start_plugin(fixture)
    registered(plugin, core, gpus)
    for n, want in enumerate(expected):
        name = f"pref-{n}"
        gpu_pods(name, {GPU: str(size)}, node_name=kubelet_node.name)
        view = wait_running_report(core, namespace, name)
        # The kubelet asked (only the kubelet talks to the plugin's socket) ...
        asked = plugin.wait_event(f"GetPreferredAllocation for {name}", "preferred", skip=n)
        assert asked["size"] == size and asked["available"] == gpus - n * size, asked
        # ... the plugin answered the topology-aware set ...
        assert plugin.indexes(asked["devices"]) == want, asked
        # ... and the kubelet allocated exactly that set, which is what the container sees.
        allocated = plugin.wait_event(f"Allocate for {name}", "allocated", skip=n)
        assert plugin.indexes(allocated["devices"]) == want, allocated
        assert plugin.indexes(view.visible) == want, view
        gpu_nodes = sorted(p for p in view.char_devices if re.fullmatch(r"/dev/nvidia\d+", p))
        assert gpu_nodes == sorted(f"/dev/nvidia{plugin.minors[plugin.uuids[i]]}" for i in want)


# -- 6. GPU memory and the extender hand-off ----------------------------------------------------------------


@pytest.fixture
def memory_node(core: k8s.CoreV1Api, kubelet_node: KubeletNode) -> Iterator[KubeletNode]:
    """The lab node labelled for GPU-memory sharing (docs/handoff.md); gpufleet labels, annotations
    and the bind-lock are removed again afterwards."""
    core.patch_node(kubelet_node.name, {"metadata": {"labels": {"gpufleet.io/gpu-sharing": "memory"}}})
    yield kubelet_node
    node = _plain(core.read_node(kubelet_node.name))["metadata"]
    labels = {
        k: None
        for k in node.get("labels", {})
        if k.startswith("gpufleet.io/") and k != "gpufleet.io/lab-node"
    }
    annotations = {k: None for k in node.get("annotations", {}) if k.startswith("gpufleet.io/")}
    core.patch_node(kubelet_node.name, {"metadata": {"labels": labels, "annotations": annotations}})


def bind_as_the_extender(
    core: k8s.CoreV1Api,
    gpu_pods: Callable[..., k8s.V1Pod],
    namespace: str,
    node: str,
    name: str,
    gib: int,
    target: str,
) -> str:
    """What the extender does at bind (docs/handoff.md), for a GPU-memory pod ``name`` of ``gib`` GiB on GPU
    ``target``: a pod nobody schedules, the node's lock taken with the Node's resourceVersion as
    precondition, the assignment on the pod, then the Binding. Returns the pod's UID."""
    uid: str = _plain(gpu_pods(name, {GPU_MEM: str(gib)}, scheduler_name="nobody"))["metadata"]["uid"]
    rv = _plain(core.read_node(node))["metadata"]["resourceVersion"]
    lock = f"{uid} {namespace}/{name} {int(time.time()) + 120}"
    core.patch_node(node, {"metadata": {"resourceVersion": rv, "annotations": {LOCK_ANNOTATION: lock}}})
    assignment = {"node": node, "containers": [{"name": "c", "gpu_mem_gib": gib, "gpus": [target]}],
                  "ts": time.time()}  # fmt: skip
    core.patch_namespaced_pod(name, namespace, {"metadata": {"annotations": {
        ASSIGNMENT_ANNOTATION: json.dumps(assignment)}}})  # fmt: skip
    binding = k8s.V1Binding(
        metadata=k8s.V1ObjectMeta(name=name),
        target=k8s.V1ObjectReference(api_version="v1", kind="Node", name=node),
    )
    reply: Any = core.create_namespaced_pod_binding(name, namespace, binding, _preload_content=False)
    assert reply.status == 201
    return uid


def test_gpu_memory_pod_gets_the_gpu_the_extender_assigned(
    core: k8s.CoreV1Api,
    control_plane: ControlPlane,
    memory_node: KubeletNode,
    namespace: str,
    start_plugin: Callable[..., PluginRun],
    gpu_pods: Callable[..., k8s.V1Pod],
) -> None:
    node = memory_node.name
    plugin = start_plugin(
        "dgx-a100", "--sharing-mode", "memory", "--node-name", node, "--labels-enabled", "true",
        "--kubernetes-kubeconfig", str(control_plane.kubeconfig()),
    )  # fmt: skip
    plugin.wait_event("registered gpu-mem", "registered", lambda e: e.get("resource") == GPU_MEM)
    wait_node_resource(core, node, GPU_MEM, "640", "640", plugin.check)  # 8 x floor(80 GiB)

    # The plugin's NodePublisher, against the real API server: labels and the gpus annotation.
    def published() -> dict[str, Any] | None:
        meta = _plain(core.read_node(node))["metadata"]
        return meta if "gpufleet.io/gpus" in meta.get("annotations", {}) else None

    meta = wait_for("the gpufleet.io/gpus annotation", published, DEADLINE, interval=0.25, alive=plugin.check)
    gpus_doc = json.loads(meta["annotations"]["gpufleet.io/gpus"])
    assert [g["uuid"] for g in gpus_doc] == plugin.uuids
    assert meta["labels"]["gpufleet.io/gpu.count"] == "8"
    # ... and labels under the same domain that are not the plugin's stay (it used to delete them all,
    # the sharing switch included, on its first publish)
    assert meta["labels"]["gpufleet.io/gpu-sharing"] == "memory"
    assert meta["labels"]["gpufleet.io/lab-node"] == "true"

    target = plugin.uuids[5]  # not what the kubelet's own pick (GPU 0's units) would suggest
    uid = bind_as_the_extender(core, gpu_pods, namespace, node, "mem", 4, target)

    view = wait_running_report(core, namespace, "mem")
    assert view.visible == [target], view
    minor = plugin.minors[target]
    gpu_nodes = sorted(p for p in view.char_devices if re.fullmatch(r"/dev/nvidia\d+", p))
    assert gpu_nodes == [f"/dev/nvidia{minor}"]
    handoff = plugin.wait_event("the hand-off", "gpu_memory_allocated")
    assert (handoff["pod"], handoff["uid"], handoff["container"]) == (f"{namespace}/mem", uid, "c")
    assert (handoff["gib"], handoff["gpus"], handoff["lock_released"]) == (4, target, True)
    # The kubelet picked 4 units (from the GPU GetPreferredAllocation named); they only count GiB.
    units = plugin.wait_event("Allocate of 4 GiB units", "allocated", lambda e: e.get("resource") == GPU_MEM)
    assert units["count"] == 4
    # The plugin recorded the container and released the node's lock.
    pod_meta = _plain(core.read_namespaced_pod("mem", namespace))["metadata"]
    assert pod_meta.get("annotations", {}).get(ALLOCATED_ANNOTATION) == "c"

    def lock_released() -> bool:
        return LOCK_ANNOTATION not in _plain(core.read_node(node))["metadata"].get("annotations", {})

    wait_for("the bind-lock released", lock_released, DEADLINE)


# -- 6. named configurations, picked by a node label (issue 16) --------------------------------------------

CONFIG_LABEL = "nvidia.com/device-plugin.config"
NAMED_CONFIGS = """\
version: v1
configs:
  default: training
  named:
    training: {}
    inference:
      sharing: {mode: time-slicing, time_slicing: {replicas: 4}}
"""


@pytest.fixture
def labelled_node(core: k8s.CoreV1Api, kubelet_node: KubeletNode) -> Iterator[KubeletNode]:
    """The lab node; its configuration label and the gpufleet labels are removed again afterwards."""
    yield kubelet_node
    meta = _plain(core.read_node(kubelet_node.name))["metadata"]
    ours = [k for k in meta.get("labels", {}) if k.startswith("gpufleet.io/") and k != "gpufleet.io/lab-node"]
    labels = dict.fromkeys([*ours, CONFIG_LABEL])
    annotations = {k: None for k in meta.get("annotations", {}) if k.startswith("gpufleet.io/")}
    core.patch_node(kubelet_node.name, {"metadata": {"labels": labels, "annotations": annotations}})


def test_node_label_switches_the_named_configuration_and_running_pods_stay(
    core: k8s.CoreV1Api,
    control_plane: ControlPlane,
    labelled_node: KubeletNode,
    namespace: str,
    start_plugin: Callable[..., PluginRun],
    gpu_pods: Callable[..., k8s.V1Pod],
    tmp_path: Path,
) -> None:
    """One configuration file, two named configurations: the node's label picks one, the plugin follows a
    change live (a watch on its Node), the kubelet re-reads the resource, and a pod started before the
    switch keeps running with its GPU. An unknown name is refused with a Warning event on the node."""
    node = labelled_node.name
    config = tmp_path / "named.yaml"
    config.write_text(NAMED_CONFIGS)
    plugin = start_plugin(
        "dgx-a100", "--config", str(config), "--node-name", node, "--labels-enabled", "true",
        "--kubernetes-kubeconfig", str(control_plane.kubeconfig()),
    )  # fmt: skip
    registered(plugin, core, 8)  # no label on the node: the default, whole GPUs

    def published(config: str, mode: str) -> None:
        def probe() -> bool:
            labels = _plain(core.read_node(node))["metadata"].get("labels", {})
            found = labels.get("gpufleet.io/device-plugin.config"), labels.get("gpufleet.io/gpu-sharing")
            return found == (config, mode)

        wait_for(f"labels of configuration {config} ({mode})", probe, DEADLINE, alive=plugin.check)

    published("training", "none")
    gpu_pods("before", {GPU: "1"}, node_name=node)
    before = wait_running_report(core, namespace, "before")
    assert len(before.visible) == 1

    core.patch_node(node, {"metadata": {"labels": {CONFIG_LABEL: "inference"}}})
    plugin.wait_event("the switch", "node_config_applied", lambda e: e.get("config") == "inference")
    wait_node_resource(core, node, GPU, "32", "32", plugin.check)  # 8 GPUs x 4 replicas
    published("inference", "time-slicing")
    # the pod admitted under the old configuration runs on, never restarted
    status = _plain(core.read_namespaced_pod("before", namespace))["status"]
    assert status["phase"] == "Running" and status["containerStatuses"][0]["restartCount"] == 0
    # and the new devices are allocatable: two pods on one GPU's replicas
    gpu_pods("after", {GPU: "1"}, node_name=node)
    assert len(wait_running_report(core, namespace, "after").visible) == 1

    core.patch_node(node, {"metadata": {"labels": {CONFIG_LABEL: "inferense"}}})
    plugin.wait_event("the refusal", "node_config_unknown", lambda e: e.get("label") == "inferense")

    def refusal() -> dict[str, Any] | None:
        selector = f"involvedObject.kind=Node,involvedObject.name={node}"
        items = _plain(core.list_namespaced_event("default", field_selector=selector))["items"]
        return next((e for e in items if e.get("reason") == "DevicePluginConfigUnknown"), None)

    event = wait_for("the refusal's event on the node", refusal, DEADLINE, alive=plugin.check)
    assert event["type"] == "Warning" and "known: inference, training" in event["message"], event
    assert node_resource(core, node, GPU) == ("32", "32")  # the last good configuration stays

    core.patch_node(node, {"metadata": {"labels": {CONFIG_LABEL: None}}})  # label gone: the default again
    plugin.wait_event("the switch back", "node_config_applied", lambda e: e.get("config") == "training")
    wait_node_resource(core, node, GPU, "8", "8", plugin.check)
