"""gpufleet's scheduler extender behind the real kube-scheduler of the lab, 1.37 (issue 5, "Tests"; the
opt-in 1.20 runs them too).

Everything runs for real except the GPUs and the kubelets:

* kube-apiserver and kube-scheduler from the lab, the scheduler configured with the extender section
  that ``gpufleet.extender.schedconfig`` generates (filter, prioritize, bind; ``nodeCacheCapable``;
  ``managedResources`` gpu-mem ignored by the scheduler, whole GPUs checked by it);
* ``gpufleet-extender serve`` as its own process, authenticated as a ServiceAccount holding exactly the
  ClusterRole of ``deploy/extender/rbac.yaml``, so a missing permission fails here;
* simulated GPU nodes: kubelet-less Nodes whose capacity, labels and ``gpufleet.io/gpus`` annotation are
  what the device plugin would publish;
* :class:`FakeKubelet` plays the kubelet's part for GPU-memory pods bound to those nodes: it calls the
  device plugin's own hand-off (:class:`~gpufleet.deviceplugin.gpumem.handoff.MemoryHandoff` over
  :class:`~gpufleet.deviceplugin.gpumem.resolver.KubernetesPodResolver`) once per container, with as many
  device IDs as the container requests, exactly as the kubelet's ``Allocate`` would. So every bind is
  also checked against the plugin's strict rules (lock holder, sizes, GPUs of the node), the lock is
  released as in production, and a refusal, which a real kubelet would turn into a failed pod, fails
  the test.

Checks read the API (pod annotations, ``spec.nodeName``, events) and the extender's ``/inspect`` and
``/metrics``; waits have generous deadlines and no test asserts a duration. Wall times are recorded in
the lab's timing summary.

What the real scheduler does that a unit test's retry loop does not: kube-scheduler 1.20 puts a pod that
no node accepted, whose extender call failed, or whose bind was refused, into its unschedulable queue and
retries it only when the queue is flushed (every 30 s, pods older than 60 s) or when a node's
labels/taints/allocatable/conditions change — never for an annotation (a bind-lock going away). A refusal
costs a pod 60-90 s. Hence the extender's ``lock_wait`` (binds wait for a hand-off about to finish instead
of refusing): with it a 40-pod burst settles in seconds; without it, not in ten minutes. Pods that failed
while the extender was down still wait for that flush after it is back; the kill test does not sit through
it: it changes a node label every 10 s while pods wait (``_wait_settled``'s ``nudge``). kube-scheduler 1.37
retries far sooner: the 40-pod burst settled in 8.7 s there against 90.8 s on 1.20 in the same hour.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException

from gpufleet.deviceplugin.gpumem.handoff import MemoryHandoff
from gpufleet.deviceplugin.gpumem.resolver import KubernetesPodResolver
from gpufleet.deviceplugin.plugin.allocate import VISIBLE_DEVICES_ENV, AllocateOptions
from gpufleet.deviceplugin.rm.errors import RequestError as PluginRefusal
from gpufleet.deviceplugin.rm.model import GpuInfo
from gpufleet.extender.schedconfig import SchedulerConfigOptions, scheduler_config
from gpufleet_harness.cluster.cluster import ControlPlane, Scheduler, TestCluster
from gpufleet_harness.cluster.node import PAUSE_IMAGE
from gpufleet_harness.cluster.process import ClusterError, Daemon, free_ports, wait_for

pytestmark = pytest.mark.cluster

GPU_MEM = "gpufleet.io/gpu-mem"
WHOLE_GPU = "nvidia.com/gpu"
GPUS_ANNOTATION = "gpufleet.io/gpus"
LOCK_ANNOTATION = "gpufleet.io/bind-lock"
ASSIGNMENT_ANNOTATION = "gpufleet.io/assignment"
ALLOCATED_ANNOTATION = "gpufleet.io/allocated"
SHARING_LABEL = "gpufleet.io/gpu-sharing"
PRODUCT_LABEL = "nvidia.com/gpu.product"
POOL_LABEL = "gpufleet.io/test-pool"
URL_PREFIX = "/gpufleet"
GIB = 1 << 30
DEADLINE = 180.0  # per wait; generous, the machine is shared with other heavy runs
SETTLE_DEADLINE = 600.0  # a burst; 1.20 retries unschedulable pods only every 60-90 s (module docstring)
RBAC_FILE = Path(__file__).resolve().parents[2] / "deploy" / "extender" / "rbac.yaml"


# -- simulated GPUs and nodes -------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """One simulated GPU as the device plugin publishes it."""

    uuid: str
    model: str
    memory_gib: int
    cc: str
    numa: int = 0
    nvlink: tuple[str, ...] = ()

    @property
    def cc_tuple(self) -> tuple[int, int]:
        major, minor = self.cc.split(".")
        return int(major), int(minor)

    def entry(self, index: int) -> dict[str, Any]:
        """This GPU's object in the node's ``gpufleet.io/gpus`` annotation (docs/handoff.md)."""
        return {"index": index, "uuid": self.uuid, "model": self.model, "memory_gib": self.memory_gib,
                "cc": self.cc, "numa": self.numa, "healthy": True,
                "nvlink": {peer: 12 for peer in self.nvlink}}  # fmt: skip


def gpu_group(
    prefix: str, count: int, model: str, memory_gib: int, cc: str, *, nvlink: bool = False,
    numa: Sequence[int] = (0,),
) -> list[GpuSpec]:  # fmt: skip
    """``count`` identical GPUs; ``nvlink`` links every pair (an NVSwitch machine); NUMA nodes round-robin."""
    ids = [f"GPU-{prefix}-{i:02d}" for i in range(count)]
    return [
        GpuSpec(uid, model, memory_gib, cc, numa[i % len(numa)],
                tuple(p for p in ids if p != uid) if nvlink else ())
        for i, uid in enumerate(ids)
    ]  # fmt: skip


@dataclass(frozen=True)
class NodeSpec:
    """A simulated GPU node: memory-sharing (``gpufleet.io/gpu-mem``) or whole-GPU (``nvidia.com/gpu``)."""

    name: str
    gpus: tuple[GpuSpec, ...]
    sharing: bool = True
    labels: Mapping[str, str] = field(default_factory=dict)

    def capacity(self) -> dict[str, int]:
        """What the device plugin advertises: one gpu-mem unit per GiB, or one device per GPU."""
        if self.sharing:
            return {GPU_MEM: sum(g.memory_gib for g in self.gpus)}
        return {WHOLE_GPU: len(self.gpus)}

    def annotations(self) -> dict[str, str]:
        return {GPUS_ANNOTATION: json.dumps([g.entry(i) for i, g in enumerate(self.gpus)])}

    def gpu(self, uuid: str) -> GpuSpec | None:
        return next((g for g in self.gpus if g.uuid == uuid), None)

    def gpu_infos(self) -> dict[str, GpuInfo]:
        """The device plugin's discovery view of these GPUs (what ``MemoryHandoff`` checks against)."""
        return {
            g.uuid: GpuInfo(index=i, uuid=g.uuid, minor=i, model=g.model, memory_bytes=g.memory_gib * GIB,
                            cc=g.cc_tuple, numa=g.numa, bus_id=f"0000:{i + 1:02x}:00.0")
            for i, g in enumerate(self.gpus)
        }  # fmt: skip


def sharing_fleet(prefix: str) -> list[NodeSpec]:
    """Three memory-sharing nodes with different GPUs; ``mixed`` carries two V100 models."""
    return [
        NodeSpec(f"{prefix}-a100", tuple(gpu_group(f"{prefix}-a100", 8, "NVIDIA A100-SXM4-80GB", 80, "8.0",
                                                   nvlink=True, numa=(0, 0, 0, 0, 1, 1, 1, 1)))),
        NodeSpec(f"{prefix}-t4", tuple(gpu_group(f"{prefix}-t4", 2, "Tesla T4", 15, "7.5"))),
        NodeSpec(f"{prefix}-v100", (
            GpuSpec(f"GPU-{prefix}-v100-32", "Tesla V100-SXM2-32GB", 32, "7.0"),
            GpuSpec(f"GPU-{prefix}-v100-16", "Tesla V100-PCIE-16GB", 15, "7.0"),
        )),
    ]  # fmt: skip


# -- pods as the API returns them (plain JSON) --------------------------------------------------------------


def mem_containers(pod: Mapping[str, Any]) -> list[tuple[str, int]]:
    """(container, GiB) per container requesting GPU memory, init containers first (kubelet order)."""
    spec = pod.get("spec") or {}
    out = []
    for group in ("initContainers", "containers"):
        for container in spec.get(group) or []:
            limits = (container.get("resources") or {}).get("limits") or {}
            if GPU_MEM in limits:
                out.append((container["name"], int(limits[GPU_MEM])))
    return out


def whole_request(pod: Mapping[str, Any]) -> int:
    """Whole GPUs the pod's containers request."""
    containers = (pod.get("spec") or {}).get("containers") or []
    return sum(int(((c.get("resources") or {}).get("limits") or {}).get(WHOLE_GPU, 0)) for c in containers)


@dataclass(frozen=True)
class PodState:
    """The parts of a pod the checks read."""

    name: str
    uid: str
    node: str | None
    annotations: Mapping[str, str]
    mem: tuple[tuple[str, int], ...]
    whole: int
    terminal: bool

    @classmethod
    def of(cls, obj: Mapping[str, Any]) -> PodState:
        meta = obj["metadata"]
        return cls(name=meta["name"], uid=meta["uid"], node=(obj.get("spec") or {}).get("nodeName"),
                   annotations=meta.get("annotations") or {}, mem=tuple(mem_containers(obj)),
                   whole=whole_request(obj),
                   terminal=(obj.get("status") or {}).get("phase") in ("Succeeded", "Failed"))  # fmt: skip

    @property
    def gib(self) -> int:
        return sum(g for _, g in self.mem)

    @property
    def assignment(self) -> dict[str, Any] | None:
        raw = self.annotations.get(ASSIGNMENT_ANNOTATION)
        return json.loads(raw) if raw else None

    def gpus(self) -> list[str]:
        """Every GPU uuid the assignment names, once per container."""
        doc = self.assignment or {"containers": []}
        return [uuid for c in doc["containers"] for uuid in c["gpus"]]

    def shares(self) -> dict[str, int]:
        """GiB per GPU uuid as the extender and the device plugin count them."""
        out: dict[str, int] = {}
        for container in (self.assignment or {"containers": []})["containers"]:
            each = -(-container["gpu_mem_gib"] // len(container["gpus"]))
            for uuid in container["gpus"]:
                out[uuid] = out.get(uuid, 0) + each
        return out


def api_json(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call a client method without its models: the API's JSON as plain dicts, as the extender sees it."""
    return json.loads(call(*args, _preload_content=False, **kwargs).data)


def list_pods(core: k8s.CoreV1Api, namespace: str) -> dict[str, PodState]:
    """Every pod of the namespace by name, from one (quorum) list."""
    items = api_json(core.list_namespaced_pod, namespace)["items"]
    return {p["metadata"]["name"]: PodState.of(p) for p in items}


def node_annotations(core: k8s.CoreV1Api, node: str) -> dict[str, str]:
    """The node's annotations."""
    return api_json(core.read_node, node)["metadata"].get("annotations") or {}  # type: ignore[no-any-return]


def failed_scheduling(core: k8s.CoreV1Api, namespace: str, pod: str) -> list[str]:
    """Messages of the pod's FailedScheduling events, oldest first."""
    selector = f"involvedObject.name={pod},reason=FailedScheduling"
    events = api_json(core.list_namespaced_event, namespace, field_selector=selector)["items"]
    events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [e.get("message") or "" for e in events]


# -- the extender process -----------------------------------------------------------------------------------


class ExtenderProcess:
    """``gpufleet-extender serve`` on a free loopback port; restartable on the same port after a SIGKILL."""

    def __init__(self, kubeconfig: Path, log_path: Path, settings: Mapping[str, str] | None = None) -> None:
        (self.port,) = free_ports(1)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + URL_PREFIX  # the scheduler's urlPrefix
        self.log_path = log_path
        flags = {"kubeconfig": str(kubeconfig), "listen-address": "127.0.0.1", "port": str(self.port),
                 "url-prefix": URL_PREFIX, **(settings or {})}  # fmt: skip
        self.argv = [_extender_command(), "serve", *(a for k, v in flags.items() for a in (f"--{k}", v))]
        self.daemon: Daemon | None = None

    def start(self) -> ExtenderProcess:
        """Start and wait until ``/readyz`` says the node and pod lists are in."""
        self.daemon = Daemon("gpufleet-extender", self.argv, self.log_path)
        wait_for("gpufleet-extender /readyz", lambda: self._status("/readyz") == 200, DEADLINE,
                 interval=0.2, alive=self.daemon.check)  # fmt: skip
        return self

    def kill(self) -> None:
        """SIGKILL the extender (its own process group: nothing else) and reap it."""
        assert self.daemon is not None
        os.killpg(self.daemon.pid, signal.SIGKILL)
        self.daemon.proc.wait(30)

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()

    def _status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.base + path, timeout=5) as response:
                return int(response.status)
        except urllib.error.HTTPError as err:
            return err.code
        except OSError:
            return 0

    def get(self, path: str) -> Any:
        """GET a JSON endpoint under the prefix (``/inspect``, ``/inspect/<node>``)."""
        with urllib.request.urlopen(self.url + path, timeout=30) as response:
            return json.loads(response.read())

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as {'name{labels}': value}."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as response:
            text = response.read().decode()
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the series of ``name`` that carry all ``labels``."""
        wanted = [f'{k}="{v}"' for k, v in labels.items()]
        return sum(
            value
            for key, value in self.metrics().items()
            if key.split("{", 1)[0] == name and all(w in key for w in wanted)
        )

    def log_tail(self, lines: int = 40) -> str:
        return self.daemon.tail(lines) if self.daemon else ""


def _extender_command() -> str:
    """The ``gpufleet-extender`` console script next to this interpreter."""
    script = Path(sys.executable).parent / "gpufleet-extender"
    if not script.exists():
        pytest.fail(f"{script} missing: install the package (pip install -e .)")
    return str(script)


# -- the kubelet's part, through the device plugin's own hand-off code --------------------------------------


class FakeKubelet:
    """For kubelet-less nodes: admits bound GPU-memory pods the way the kubelet + gpufleet plugin would.

    Every ``interval`` it lists the namespace's pods; for each pod bound to one of its nodes it calls the
    node's :class:`MemoryHandoff` once per GPU-memory container not yet allocated, in kubelet order, with
    as many device IDs as the container requests. The hand-off decides the pod from the node's bind-lock
    (it never learns which pod the kubelet meant), records ``gpufleet.io/allocated`` and releases the
    lock after the last container. The answer's ``NVIDIA_VISIBLE_DEVICES`` must name the GPUs the
    extender assigned to the container the kubelet was admitting; anything else is a ``mismatch``.
    A refusal is an ``error`` (a real kubelet would fail the pod with UnexpectedAdmissionError).
    """

    def __init__(self, api_client: k8s.ApiClient, namespace: str, nodes: Iterable[NodeSpec],
                 interval: float = 0.2) -> None:  # fmt: skip
        self.core = k8s.CoreV1Api(api_client)
        self.namespace = namespace
        self.interval = interval
        self.resolver = resolver = KubernetesPodResolver(self.core)  # one watch of each node's pods
        options = AllocateOptions(pass_device_specs=False)
        self.handoffs = {
            n.name: MemoryHandoff(resolver, n.name, _constant(n.gpu_infos()), dict, options)
            for n in nodes
            if n.sharing
        }
        self.first_gpu = {n.name: n.gpus[0].uuid for n in nodes}
        self.allocated: dict[tuple[str, str], list[str]] = {}  # (pod uid, container) -> GPUs answered
        self.errors: list[str] = []
        self.mismatches: list[str] = []
        self.hiccups: list[str] = []
        self._refused: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-kubelet", daemon=True)

    def start(self) -> FakeKubelet:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.resolver.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._admit_all()
            except ApiException as exc:  # an API hiccup: next round
                self.hiccups.append(f"{exc.status} {exc.reason}")
            except Exception as exc:  # a bug here must show, not kill the thread silently
                self.errors.append(f"fake kubelet crashed a round: {exc!r}")

    def _admit_all(self) -> None:
        pods = api_json(self.core.list_namespaced_pod, self.namespace)["items"]
        pods.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "", p["metadata"]["name"]))
        for obj in pods:
            pod = PodState.of(obj)
            if pod.node not in self.handoffs or pod.uid in self._refused or pod.terminal:
                continue
            if obj["metadata"].get("deletionTimestamp"):
                continue
            for container, gib in pod.mem:
                if (pod.uid, container) in self.allocated:
                    continue
                self._allocate(pod, container, gib)
                if pod.uid in self._refused:
                    break

    def _allocate(self, pod: PodState, container: str, gib: int) -> None:
        assert pod.node is not None
        # Which units of which GPU the kubelet picked carries no meaning (docs/handoff.md), only their count.
        device_ids = [f"{self.first_gpu[pod.node]}::{k}" for k in range(gib)]
        try:
            response = self.handoffs[pod.node](device_ids)
        except PluginRefusal as exc:
            self.errors.append(f"Allocate for {pod.name}/{container} refused: {exc}")
            self._refused.add(pod.uid)
            return
        answered = response.envs[VISIBLE_DEVICES_ENV].split(",")
        self.allocated[(pod.uid, container)] = answered
        assigned = next((c["gpus"] for c in (pod.assignment or {}).get("containers", [])
                         if c["name"] == container), None)  # fmt: skip
        if assigned != answered:
            self.mismatches.append(f"{pod.name}/{container}: assigned {assigned}, plugin answered {answered}")


def _constant(value: Mapping[str, GpuInfo]) -> Callable[[], Mapping[str, GpuInfo]]:
    """The device plugin's view of a node's GPUs, which never changes here."""
    return lambda: value


class OvercommitMonitor:
    """Samples the pods while a burst runs and records every GPU whose bound pods exceed its memory."""

    def __init__(self, core: k8s.CoreV1Api, namespace: str, nodes: Mapping[str, NodeSpec]) -> None:
        self.core, self.namespace, self.nodes = core, namespace, nodes
        self.samples = 0
        self.violations: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="overcommit-monitor", daemon=True)

    def start(self) -> OvercommitMonitor:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            with contextlib.suppress(ApiException, OSError):
                pods = list_pods(self.core, self.namespace)
                self.samples += 1
                self.violations.extend(overcommits(self.nodes, pods.values()))


# -- accounting checks -------------------------------------------------------------------------------------


def used_by_gpu(pods: Iterable[PodState]) -> dict[str, int]:
    """GiB per GPU uuid held by bound, live pods whose assignment names the node they are bound to."""
    used: dict[str, int] = {}
    for pod in pods:
        doc = pod.assignment
        if pod.node is None or pod.terminal or doc is None or doc["node"] != pod.node:
            continue
        for uuid, gib in pod.shares().items():
            used[uuid] = used.get(uuid, 0) + gib
    return used


def overcommits(nodes: Mapping[str, NodeSpec], pods: Iterable[PodState]) -> list[str]:
    """One message per GPU whose bound pods hold more GiB than it has."""
    used = used_by_gpu(pods)
    return [
        f"{node.name} {gpu.uuid}: {used[gpu.uuid]} GiB > {gpu.memory_gib} GiB"
        for node in nodes.values()
        for gpu in node.gpus
        if used.get(gpu.uuid, 0) > gpu.memory_gib
    ]


def free_by_gpu(nodes: Mapping[str, NodeSpec], pods: Iterable[PodState]) -> dict[str, int]:
    """Free GiB per GPU uuid of the memory-sharing nodes."""
    used = used_by_gpu(pods)
    return {g.uuid: g.memory_gib - used.get(g.uuid, 0) for n in nodes.values() if n.sharing for g in n.gpus}


def assert_placements_valid(nodes: Mapping[str, NodeSpec], pods: Mapping[str, PodState]) -> None:
    """Every bound GPU-memory pod carries an assignment for its node that matches its request and names
    GPUs of that node; no GPU is over-committed; no pod is bound twice or counted twice."""
    problems = []
    for pod in pods.values():
        if not pod.mem or pod.node is None:
            continue
        doc = pod.assignment
        if doc is None:
            problems.append(f"{pod.name} bound to {pod.node} without {ASSIGNMENT_ANNOTATION}")
            continue
        if doc["node"] != pod.node:
            problems.append(f"{pod.name} bound to {pod.node}, assignment names {doc['node']}")
        got = [(c["name"], c["gpu_mem_gib"]) for c in doc["containers"]]
        if got != list(pod.mem):
            problems.append(f"{pod.name}: assignment {got} != request {list(pod.mem)}")
        node = nodes.get(pod.node)
        for uuid in pod.gpus():
            if node is None or node.gpu(uuid) is None:
                problems.append(f"{pod.name}: GPU {uuid} is not on node {pod.node}")
    problems += overcommits(nodes, pods.values())
    assert not problems, "\n".join(problems)


# -- the harness --------------------------------------------------------------------------------------------


@dataclass
class GpuLab:
    """One test's simulated GPU nodes, extender process, kube-scheduler and fake kubelet."""

    core: k8s.CoreV1Api
    namespace: str
    scheduler_name: str
    nodes: dict[str, NodeSpec]
    extender: ExtenderProcess
    scheduler: Scheduler
    kubelet: FakeKubelet
    timings: dict[str, float]

    def create_pod(
        self,
        name: str,
        gib: int | Sequence[int] = 0,
        *,
        whole: int = 0,
        annotations: Mapping[str, str] | None = None,
        selector: Mapping[str, str] | None = None,
    ) -> None:
        """A pause pod for this test's scheduler and nodes; ``gib`` per container (a list: one each)."""
        sizes = [gib] if isinstance(gib, int) else list(gib)
        containers = []
        for i, size in enumerate(sizes):
            limits = {GPU_MEM: str(size)} if size else {}
            if whole and i == 0:
                limits[WHOLE_GPU] = str(whole)
            containers.append({"name": f"c{i}", "image": PAUSE_IMAGE, "imagePullPolicy": "Never",
                               "resources": {"limits": limits}})  # fmt: skip
        body = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "annotations": dict(annotations or {})},
            "spec": {"schedulerName": self.scheduler_name, "terminationGracePeriodSeconds": 0,
                     "nodeSelector": {POOL_LABEL: self.namespace, **(selector or {})},
                     "containers": containers},
        }  # fmt: skip
        self.core.create_namespaced_pod(self.namespace, body)  # type: ignore[arg-type]

    def pods(self) -> dict[str, PodState]:
        return list_pods(self.core, self.namespace)

    def wait_bound(self, names: Iterable[str], timeout: float = DEADLINE) -> dict[str, PodState]:
        """Wait until every named pod is bound; return all pods."""
        wanted = set(names)

        def all_bound() -> dict[str, PodState] | None:
            pods = self.pods()
            return pods if all(pods[n].node for n in wanted if n in pods) and wanted <= pods.keys() else None

        return self.wait(f"pods {sorted(wanted)} bound", all_bound, timeout)

    def wait_event(self, pod: str, needle: str, timeout: float = DEADLINE) -> str:
        """Wait for a FailedScheduling event of ``pod`` containing ``needle``; return its message."""

        def find() -> str | None:
            return next((m for m in failed_scheduling(self.core, self.namespace, pod) if needle in m), None)

        return self.wait(f"a FailedScheduling event of {pod} saying {needle!r}", find, timeout)  # type: ignore[no-any-return]

    def wait(self, what: str, probe: Callable[[], Any], timeout: float = DEADLINE) -> Any:
        """``wait_for`` with the extender's and scheduler's state in the failure message."""
        try:
            return wait_for(what, probe, timeout, interval=0.5, alive=self._alive)
        except ClusterError as err:
            raise AssertionError(f"{err}\n{self.diagnostics()}") from None

    def _alive(self) -> None:
        if self.extender.daemon is not None:
            self.extender.daemon.check()
        if self.scheduler.daemon is not None:
            self.scheduler.daemon.check()

    def diagnostics(self) -> str:
        """Pods, plugin stand-in findings and log tails, for failure messages."""
        lines = ["pods:"]
        for pod in sorted(self.pods().values(), key=lambda p: p.name):
            events = failed_scheduling(self.core, self.namespace, pod.name)
            lines.append(f"  {pod.name} gib={pod.gib} whole={pod.whole} node={pod.node} gpus={pod.gpus()} "
                         f"last-event={events[-1][:300] if events else None!r}")  # fmt: skip
        lines.append(f"fake kubelet errors={self.kubelet.errors} mismatches={self.kubelet.mismatches}")
        lines.append(f"extender log ({self.extender.log_path}):\n{self.extender.log_tail()}")
        if self.scheduler.daemon is not None:
            lines.append(f"scheduler log ({self.scheduler.log_path}):\n{self.scheduler.daemon.tail(30)}")
        return "\n".join(lines)

    def inspect_used(self) -> dict[str, int]:
        """The extender's ``/inspect`` GiB in use per GPU uuid of this test's nodes."""
        doc = self.extender.get("/inspect")
        return {gpu["uuid"]: gpu["used_gib"] for name in self.nodes for gpu in doc["nodes"][name]["gpus"]}

    def wait_inspect_matches_annotations(self) -> dict[str, PodState]:
        """Wait until ``/inspect`` equals the sum of the bound pods' assignments (the watch may lag)."""

        def matches() -> dict[str, PodState] | None:
            pods = self.pods()
            expected = used_by_gpu(pods.values())
            reported = self.inspect_used()
            same = all(reported[u] == expected.get(u, 0) for u in reported)
            return pods if same and set(expected) <= set(reported) else None

        return self.wait("/inspect equal to the pods' assignments", matches)

    def wait_handoffs_done(self) -> None:
        """Wait until every bound GPU-memory pod is allocated and no node of this test holds a bind-lock, in
        the API and in the extender's cache. Until then a node is in the middle of a hand-off, and
        prioritize ranks it last while another node fits (docs/extender.md): a pod created right after the
        previous one was bound could land elsewhere than on the state the previous ones left."""

        def done() -> bool:
            pods = self.pods().values()
            allocated = all(p.annotations.get(ALLOCATED_ANNOTATION) == ",".join(c for c, _ in p.mem)
                            for p in pods if p.node and p.mem)  # fmt: skip
            return (
                allocated
                and not any(LOCK_ANNOTATION in node_annotations(self.core, n) for n in self.nodes)
                and all(self.extender.get(f"/inspect/{n}")["bind_lock"] is None for n in self.nodes)
            )

        self.wait("every hand-off finished (pods allocated, bind-locks gone, also from the extender's cache)",
                  done)  # fmt: skip

    def assert_kubelet_clean(self) -> None:
        """No Allocate was refused and every answer named the assigned GPUs."""
        assert not self.kubelet.errors, self.kubelet.errors
        assert not self.kubelet.mismatches, self.kubelet.mismatches


def _service_account_kubeconfig(
    control_plane: ControlPlane, core: k8s.CoreV1Api, namespace: str, path: Path
) -> tuple[Path, Callable[[], None]]:
    """A ServiceAccount bound to the ClusterRole of ``deploy/extender/rbac.yaml``; its kubeconfig and undo."""
    docs = list(yaml.safe_load_all(RBAC_FILE.read_text()))
    rules = next(d for d in docs if d and d["kind"] == "ClusterRole")["rules"]
    name = f"gpufleet-extender-{namespace}"
    rbac = k8s.RbacAuthorizationV1Api(control_plane.api_client())
    account: Any = {"metadata": {"name": "gpufleet-extender"}}
    core.create_namespaced_service_account(namespace, account)
    role: Any = {"metadata": {"name": name}, "rules": rules}
    rbac.create_cluster_role(role)
    binding: Any = {
        "metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": "gpufleet-extender", "namespace": namespace}],
    }  # fmt: skip
    rbac.create_cluster_role_binding(binding)

    def undo() -> None:
        for delete in (rbac.delete_cluster_role_binding, rbac.delete_cluster_role):
            with contextlib.suppress(ApiException):
                delete(name)

    bearer = control_plane.service_account_token(namespace, "gpufleet-extender")
    config = {
        "apiVersion": "v1", "kind": "Config", "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": control_plane.url,
                                                 "certificate-authority": str(control_plane.ca_file)}}],
        "users": [{"name": "gpufleet-extender", "user": {"token": bearer}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "gpufleet-extender"}}],
    }  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path, undo


def _known(extender: ExtenderProcess, node: str) -> bool:
    try:
        return bool(extender.get(f"/inspect/{node}").get("known"))
    except urllib.error.HTTPError:
        return False  # 404 until the watch delivers the node


@pytest.fixture
def gpu_lab(
    lab: TestCluster,
    control_plane: ControlPlane,
    scheduler_factory: Callable[..., Scheduler],
    fake_node: Callable[..., k8s.V1Node],
    core: k8s.CoreV1Api,
    namespace: str,
    tmp_path: Path,
    lab_timings: dict[str, float],
) -> Iterator[Callable[..., GpuLab]]:
    """``gpu_lab(nodes, **extender_settings)``: nodes, extender (as its ServiceAccount), scheduler and fake
    kubelet for this test; everything is stopped and deleted afterwards, also on failure."""
    cleanup = contextlib.ExitStack()

    def make(nodes: Sequence[NodeSpec], **settings: str) -> GpuLab:
        started = time.monotonic()
        by_name = {n.name: n for n in nodes}
        for node in nodes:
            labels = {POOL_LABEL: namespace, **node.labels}
            if node.sharing:
                labels[SHARING_LABEL] = "memory"
            fake_node(node.name, node.capacity(), labels=labels, annotations=node.annotations())
        kubeconfig, undo_rbac = _service_account_kubeconfig(control_plane, core, namespace,
                                                            tmp_path / "extender.kubeconfig")  # fmt: skip
        cleanup.callback(undo_rbac)
        extender = ExtenderProcess(kubeconfig, lab.logs / f"gpufleet-extender-{namespace}.log", settings)
        cleanup.callback(extender.stop)
        extender.start()
        for name in by_name:  # the scheduler sends node names only: the extender must know them first
            probe = functools.partial(_known, extender, name)
            wait_for(f"node {name} in the extender's cache", probe, DEADLINE, interval=0.2)
        scheduler_name = f"gpufleet-{namespace}"
        api_version = "v1beta1" if control_plane.legacy else "v1"  # what this kube-scheduler reads
        generated = scheduler_config(SchedulerConfigOptions(url=extender.url, api_version=api_version,
                                                            scheduler_name=scheduler_name))  # fmt: skip
        scheduler = scheduler_factory(generated, scheduler_name=scheduler_name)
        kubelet = FakeKubelet(control_plane.api_client(), namespace, nodes).start()
        cleanup.callback(kubelet.stop)
        # Bound pods on kubelet-less nodes never finish a graceful deletion: delete them at once.
        cleanup.callback(core.delete_collection_namespaced_pod, namespace, grace_period_seconds=0)
        lab_timings[f"extender lab up ({namespace})"] = time.monotonic() - started
        return GpuLab(core, namespace, scheduler_name, by_name, extender, scheduler, kubelet, lab_timings)

    try:
        yield make
    finally:
        cleanup.close()


# -- tests --------------------------------------------------------------------------------------------------


def test_gpu_memory_pods_land_on_gpus_that_fit(gpu_lab: Callable[..., GpuLab], namespace: str) -> None:
    """The real scheduler filters, prioritizes and binds through the extender: each pod gets a GPU with
    room for it."""
    lab = gpu_lab(sharing_fleet(namespace))
    started = time.monotonic()
    # 60 and 40 GiB fit only A100s, 20 also the V100-32GB, 14 any GPU; two containers get one GPU each.
    sizes = {"m60": 60, "m40": 40, "m20a": 20, "m20b": 20, "m14": 14, "m10": 10, "m8": 8, "m4": 4, "m2": 2}
    for name, gib in sizes.items():
        lab.create_pod(name, gib)
    lab.create_pod("two-containers", [6, 3])
    pods = lab.wait_bound([*sizes, "two-containers"])
    lab.timings["10 pods bound through the extender"] = time.monotonic() - started

    assert_placements_valid(lab.nodes, pods)
    for name, gib in sizes.items():
        pod = pods[name]
        (uuid,) = pod.gpus()
        gpu = lab.nodes[pod.node or ""].gpu(uuid)
        assert gpu is not None and gpu.memory_gib >= gib, f"{name} ({gib} GiB) on {gpu}"
    assert [c["name"] for c in pods["two-containers"].assignment["containers"]] == ["c0", "c1"]  # type: ignore[index]
    # The plugin stand-in allocated every container from the lock + assignment and released every lock.
    lab.wait(
        "every GPU-memory container allocated and every bind-lock released",
        lambda: (
            all(
                p.annotations.get(ALLOCATED_ANNOTATION) == ",".join(c for c, _ in p.mem)
                for p in lab.pods().values()
            )
            and not any(LOCK_ANNOTATION in node_annotations(lab.core, n) for n in lab.nodes)
        ),
    )
    lab.assert_kubelet_clean()
    assert len(lab.kubelet.allocated) == len(sizes) + 2
    lab.wait_inspect_matches_annotations()
    # Filter and bind were used. Filter answers a GPU-memory pod with the one node it chose, so the scheduler,
    # which calls prioritize only when more than one node passed the filters, never needed it here.
    for verb in ("filter", "bind"):
        calls = lab.extender.metric("gpufleet_extender_requests_total", verb=verb, code="200")
        assert calls > 0, f"the scheduler never called {verb}"
    assert lab.extender.metric("gpufleet_extender_requests_total", verb="prioritize") == 0
    assert lab.extender.metric("gpufleet_extender_binds_total", result="ok") >= len(sizes) + 1


def test_burst_never_overcommits_and_leftovers_stay_pending(
    gpu_lab: Callable[..., GpuLab], namespace: str
) -> None:
    """40 pods at once, more GiB than the fleet has: no GPU ever over-committed; what cannot fit stays
    Pending with the extender's reason in its FailedScheduling event."""
    lab = gpu_lab(sharing_fleet(namespace))
    sizes = [60] * 4 + [40] * 6 + [30] * 6 + [20] * 8 + [12] * 6 + [8] * 6 + [4] * 4  # 956 GiB > 717
    random.Random(5).shuffle(sizes)
    monitor = OvercommitMonitor(lab.core, lab.namespace, lab.nodes).start()
    started = time.monotonic()
    try:
        with ThreadPoolExecutor(8) as pool:  # the client's connection pool holds 10
            list(
                pool.map(lambda item: lab.create_pod(f"b{item[0]:02d}-{item[1]}", item[1]), enumerate(sizes))
            )
        lab.create_pod("absurd", 100)  # larger than any GPU of the cluster
        pods = _wait_settled(lab)
        lab.timings["burst of 40 settled"] = time.monotonic() - started
    finally:
        monitor.stop()
    assert monitor.samples > 0
    assert not monitor.violations, monitor.violations[:10]
    assert_placements_valid(lab.nodes, pods)
    bound = [p for p in pods.values() if p.node]
    pending = [p for p in pods.values() if not p.node]
    print(f"burst: {len(bound)} pods bound, {len(pending)} left Pending")
    assert bound, "nothing bound"
    assert pending, "the burst asks for more GiB than the fleet has; some pods must be left Pending"
    _assert_extender_reasons(lab, pending)
    lab.assert_kubelet_clean()
    lab.wait_inspect_matches_annotations()


NUDGE_LABEL = "gpufleet.io/test-nudge"
NUDGE_EVERY = 10.0  # seconds between two node label changes while pods wait (_wait_settled's nudge)


def _wait_settled(lab: GpuLab, nudge: bool = False) -> dict[str, PodState]:
    """Wait until every pod is bound or cannot fit any GPU as things stand (the scheduler has nothing
    left to do); return the pods.

    ``nudge``: while pods that would fit still wait, change a label of one lab node every NUDGE_EVERY
    seconds. kube-scheduler 1.20 answers a node label change by moving its unschedulable pods back to the
    active queue, so it retries now what it would retry at its next flush (60-90 s): for pods that failed
    while the extender was down, which otherwise cost the run two or three flushes of waiting."""
    nudged = [time.monotonic()]

    def settled() -> dict[str, PodState] | None:
        pods = lab.pods()
        room = max(free_by_gpu(lab.nodes, pods.values()).values())
        waiting = [p for p in pods.values() if not p.node and p.mem and max(g for _, g in p.mem) <= room]
        if waiting and nudge and time.monotonic() - nudged[0] >= NUDGE_EVERY:
            nudged[0] = time.monotonic()
            label = {NUDGE_LABEL: str(int(nudged[0]))}
            lab.core.patch_node(next(iter(lab.nodes)), {"metadata": {"labels": label}})
        return None if waiting else pods

    return lab.wait("every pod bound or unable to fit", settled, SETTLE_DEADLINE)  # type: ignore[no-any-return]


def _assert_extender_reasons(lab: GpuLab, pending: Sequence[PodState]) -> None:
    """Each pending pod's FailedScheduling events carry the extender's reason (not only "node busy")."""

    def reason(pod: PodState) -> str | None:
        for message in reversed(failed_scheduling(lab.core, lab.namespace, pod.name)):
            if pod.name == "absurd" and "the largest healthy GPU in the cluster has 80 GiB" in message:
                return message  # the extender's Error: the scheduler reports it as is
            if "nodes are available" in message and "not enough free GPU memory" in message:
                return message  # a FitError built from the extender's FailedNodes
        return None

    # A pod last refused at bind time or while a hand-off could not be waited for has another message;
    # its next attempt, when 1.20 flushes its unschedulable queue (60-90 s), names the shortfall.
    found = lab.wait("FailedScheduling events naming the extender's reason",
                     lambda: [reason(p) for p in pending] if all(reason(p) for p in pending) else None,
                     SETTLE_DEADLINE)  # fmt: skip
    absurd = next(m for p, m in zip(pending, found, strict=True) if p.name == "absurd")
    assert "asks 100 GiB on one GPU" in absurd


def test_extender_killed_mid_burst_loses_nothing(gpu_lab: Callable[..., GpuLab], namespace: str) -> None:
    """SIGKILL the extender while binds run (ideally while a node's lock is held for an unbound pod),
    restart it on the same port: the ledger is rebuilt from annotations and nothing is lost or doubled."""
    lab = gpu_lab(sharing_fleet(namespace), **{"lock-ttl": "15"})
    sizes = [40] * 10 + [30] * 6 + [20] * 10 + [12] * 6 + [8] * 4  # 908 GiB > 717
    random.Random(3).shuffle(sizes)
    monitor = OvercommitMonitor(lab.core, lab.namespace, lab.nodes).start()
    started = time.monotonic()
    try:
        for i, gib in enumerate(sizes):
            lab.create_pod(f"k{i:02d}-{gib}", gib)
        lab.wait("5 pods bound before the kill", lambda: sum(1 for p in lab.pods().values() if p.node) >= 5)
        caught = _kill_during_bind(lab)
        # A request the extender sent just before dying may still land: let it, then freeze the view.
        time.sleep(2)
        before = lab.pods()
        assert_placements_valid(lab.nodes, before)
        # With the extender gone nothing binds GPU pods; the scheduler only collects errors.
        time.sleep(3)
        assert {n: p.node for n, p in lab.pods().items()} == {n: p.node for n, p in before.items()}
        restarted = time.monotonic()
        lab.extender.start()
        lab.timings["extender restart to ready"] = time.monotonic() - restarted
        # Rebuilt from annotations: every pod bound before the kill is in /inspect on its GPUs at once.
        inspect = lab.extender.get("/inspect")
        for pod in (p for p in before.values() if p.node):
            for uuid, gib in pod.shares().items():
                held = [e for g in inspect["nodes"][pod.node]["gpus"] if g["uuid"] == uuid for e in g["pods"]
                        if e["uid"] == pod.uid]  # fmt: skip
                assert sum(e["gib"] for e in held) == gib, f"{pod.name} lost on {uuid}: {held}"
        pods = _wait_settled(lab, nudge=True)
        lab.timings["kill-and-restart burst settled"] = time.monotonic() - started
    finally:
        monitor.stop()
    assert not monitor.violations, monitor.violations[:10]
    assert_placements_valid(lab.nodes, pods)
    # Nothing bound before the kill moved or was re-assigned.
    before_bound = [p for p in before.values() if p.node]
    for pod in before_bound:
        assert (pods[pod.name].node, pods[pod.name].gpus()) == (pod.node, pod.gpus()), pod.name
    # No pod counted twice: /inspect lists each container once, on exactly its assigned GPUs.
    inspect_pods = lab.wait_inspect_matches_annotations()
    doc = lab.extender.get("/inspect")
    entries = [(e["uid"], e["container"], g["uuid"]) for n in lab.nodes for g in doc["nodes"][n]["gpus"]
               for e in g["pods"]]  # fmt: skip
    assert len(entries) == len(set(entries))
    expected = {(p.uid, c["name"], u) for p in inspect_pods.values() if p.node
                for c in p.assignment["containers"] for u in c["gpus"]}  # type: ignore[index]  # fmt: skip
    assert set(entries) == expected
    assert not [k for k in doc["unassigned_gpu_mem_pods"] if k.startswith(f"{namespace}/")]
    for pod in pods.values():  # bound with an assignment for its node, or Pending
        assert pod.node is None or (pod.assignment or {}).get("node") == pod.node, pod
    lab.assert_kubelet_clean()
    # The lock of the bind cut short is not released by anyone: it expires (lock-ttl 15 s) and stays
    # harmless; every other lock was released by the plugin stand-in.
    lab.wait("no live bind-lock left", lambda: not any(_live_lock(lab, n) for n in lab.nodes))
    if caught is not None:
        final = pods[caught]
        assert final.node is None or (final.assignment or {}).get("node") == final.node, final
    bound = sum(1 for p in pods.values() if p.node)
    print(
        f"kill: bind caught in flight: {caught}, {len(before_bound)} bound before the kill; at the end "
        f"{bound} bound, {len(pods) - bound} Pending"
    )


def _live_lock(lab: GpuLab, node: str) -> bool:
    lock = node_annotations(lab.core, node).get(LOCK_ANNOTATION)
    return lock is not None and float(lock.split()[2]) > time.time()


def _kill_during_bind(lab: GpuLab, patience: float = 30.0) -> str | None:
    """SIGKILL the extender, preferably while some node's bind-lock names a pod not bound yet (between
    the lock and the Binding); after ``patience`` seconds without such a moment, kill anyway. Returns
    the pod whose bind was caught in flight, if one was."""
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        nodes = api_json(lab.core.list_node, label_selector=f"{POOL_LABEL}={lab.namespace}")["items"]
        for node in nodes:
            lock = (node["metadata"].get("annotations") or {}).get(LOCK_ANNOTATION)
            if not lock:
                continue
            pod_name = lock.split()[1].split("/", 1)[1]
            pod = api_json(lab.core.read_namespaced_pod, pod_name, lab.namespace)
            if not pod["spec"].get("nodeName"):
                lab.extender.kill()
                return pod_name
        time.sleep(0.02)
    lab.extender.kill()
    return None


BURST_PODS = 48  # of 4 GiB: exactly what burst_fleet holds
MEMORY_REFUSALS = ("no_fit", "stale")  # the extender's bind_failed reasons for a lack of GPU memory


def burst_fleet(prefix: str) -> list[NodeSpec]:
    """Three memory-sharing nodes of four NVLinked 16 GiB GPUs: 192 GiB, 48 pods of 4 GiB."""
    return [NodeSpec(f"{prefix}-g{i}", tuple(gpu_group(f"{prefix}-g{i}", 4, "NVIDIA A2", 16, "8.6",
                                                       nvlink=True))) for i in range(3)]  # fmt: skip


def _create_burst(lab: GpuLab) -> list[str]:
    names = [f"burst-{i:02d}" for i in range(BURST_PODS)]
    with ThreadPoolExecutor(8) as pool:  # the client's connection pool holds 10
        list(pool.map(lambda name: lab.create_pod(name, 4), names))
    return names


def _bind_failures(lab: GpuLab) -> list[dict[str, Any]]:
    """Every ``bind_failed`` event of the extender's JSON log (all its runs: the log is appended to)."""
    events = []
    for line in lab.extender.log_path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict) and doc.get("event") == "bind_failed":
                events.append(doc)
    return events


def _assert_burst_placed(lab: GpuLab, monitor: OvercommitMonitor) -> None:
    """Every pod bound on GPUs the plugin stand-in allocated, none over-committed at any sample, no bind
    refused for a lack of memory, and the extender's view equal to the annotations."""
    pods = lab.pods()
    unbound = sorted(n for n, p in pods.items() if not p.node)
    assert not unbound, f"pods that fit left unbound: {unbound}\n{lab.diagnostics()}"
    assert monitor.samples > 0 and not monitor.violations, monitor.violations[:10]
    assert_placements_valid(lab.nodes, pods)
    assert sorted(used_by_gpu(pods.values()).values()) == [16] * 12  # exactly full
    refusals = [e for e in _bind_failures(lab) if e.get("reason") in MEMORY_REFUSALS]
    assert not refusals, refusals[:5]
    lab.wait_handoffs_done()
    lab.assert_kubelet_clean()
    lab.wait_inspect_matches_annotations()


def test_burst_that_fits_binds_every_pod_with_no_refusal_for_memory(
    gpu_lab: Callable[..., GpuLab], namespace: str
) -> None:
    """Issue 31: 48 pods created at once fill three nodes exactly. kube-scheduler filters each next pod while
    the binds before it still run; filter has already counted their placements, so every bind lands on
    GPUs that are free (no "not enough free GPU memory" at bind), and nothing is over-committed."""
    lab = gpu_lab(burst_fleet(namespace), **{"log-format": "json"})
    monitor = OvercommitMonitor(lab.core, lab.namespace, lab.nodes).start()
    started = time.monotonic()
    try:
        names = _create_burst(lab)
        lab.wait_bound(names, SETTLE_DEADLINE)
        lab.timings["burst of 48 that fits bound"] = time.monotonic() - started
    finally:
        monitor.stop()
    _assert_burst_placed(lab, monitor)
    assert lab.extender.metric("gpufleet_extender_binds_total", result="ok") >= BURST_PODS


def test_burst_that_fits_binds_every_pod_across_an_extender_restart(
    gpu_lab: Callable[..., GpuLab], namespace: str
) -> None:
    """The same burst with the extender SIGKILLed after a quarter of the pods are bound (during a bind if it
    can be caught) and restarted: the placements filter had decided and lost with the process are decided
    again, the ledger is rebuilt from the annotations, and still every pod is bound, none on GPUs that
    were taken, none refused for memory."""
    lab = gpu_lab(burst_fleet(namespace), **{"log-format": "json", "lock-ttl": "15"})
    monitor = OvercommitMonitor(lab.core, lab.namespace, lab.nodes).start()
    started = time.monotonic()
    try:
        _create_burst(lab)
        quarter = BURST_PODS // 4
        lab.wait(f"{quarter} pods bound", lambda: sum(1 for p in lab.pods().values() if p.node) >= quarter)
        _kill_during_bind(lab, patience=10.0)
        lab.extender.start()
        _wait_settled(lab, nudge=True)  # all fit: settled means every pod bound
        lab.timings["burst of 48 across an extender restart bound"] = time.monotonic() - started
    finally:
        monitor.stop()
    _assert_burst_placed(lab, monitor)


def test_model_and_capability_requests_land_on_the_right_gpus(
    gpu_lab: Callable[..., GpuLab], namespace: str
) -> None:
    """Model (annotation or nodeSelector), minimum compute capability and "most capable" choose the GPU,
    also inside a node with mixed cards; impossible wishes stay Pending with the extender's reason."""
    a100 = NodeSpec(f"{namespace}-a100", tuple(gpu_group(f"{namespace}-a100", 2, "NVIDIA A100-SXM4-80GB", 80,
                                                         "8.0")),
                    labels={PRODUCT_LABEL: "NVIDIA-A100-SXM4-80GB"})  # fmt: skip
    t4 = NodeSpec(
        f"{namespace}-t4",
        tuple(gpu_group(f"{namespace}-t4", 2, "Tesla T4", 15, "7.5")),
        labels={PRODUCT_LABEL: "Tesla-T4"},
    )
    # GPU feature discovery labels a mixed node with its first GPU's product.
    v100_uuid, a10_uuid = f"GPU-{namespace}-v100", f"GPU-{namespace}-a10"
    mixed = NodeSpec(f"{namespace}-mixed", (GpuSpec(v100_uuid, "Tesla V100-SXM2-32GB", 32, "7.0"),
                                            GpuSpec(a10_uuid, "NVIDIA A10", 22, "8.6")),
                     labels={PRODUCT_LABEL: "Tesla-V100-SXM2-32GB"})  # fmt: skip
    lab = gpu_lab([a100, t4, mixed])
    started = time.monotonic()

    def place(name: str, gib: int, **kwargs: Any) -> tuple[str | None, str]:
        lab.create_pod(name, gib, **kwargs)
        pod = lab.wait_bound([name])[name]
        # The next pod goes on the state this one leaves, not into its hand-off (see wait_handoffs_done).
        lab.wait_handoffs_done()
        (uuid,) = pod.gpus()
        return pod.node, uuid

    # nodeSelector on the product: per GPU too. Unconstrained binpack would take the A10 (22 - 20 = 2
    # left beats the V100's 12); the selector means the V100.
    assert place("sel-v100", 20, selector={PRODUCT_LABEL: "Tesla-V100-SXM2-32GB"}) == (mixed.name, v100_uuid)
    # The annotation: "A10" is a whole word, so never an A100; it exists only inside the mixed node.
    assert place("model-a10", 4, annotations={"gpufleet.io/gpu-model": "A10"}) == (mixed.name, a10_uuid)
    # cc >= 8.0: A100 or A10 only. Without it binpack would fill the V100 exactly (12 GiB left).
    node, uuid = place("cc80", 12, annotations={"gpufleet.io/gpu-min-cc": "8.0"})
    assert uuid in (a10_uuid, *(g.uuid for g in a100.gpus)), (node, uuid)
    # Most capable: the A10 (8.6) beats the A100 (8.0) on compute capability.
    assert place("best", 2, annotations={"gpufleet.io/gpu-prefer": "most-capable"}) == (mixed.name, a10_uuid)
    # Alternatives: the first model that exists.
    node, uuid = place("h100-or-a100", 30, annotations={"gpufleet.io/gpu-model": "H100, A100"})
    assert node == a100.name and a100.gpu(uuid) is not None
    # Capability and model together: T4 is 7.5.
    t4_wish = {"gpufleet.io/gpu-model": "T4", "gpufleet.io/gpu-min-cc": "7.5"}
    node, uuid = place("t4-cc75", 8, annotations=t4_wish)
    assert node == t4.name
    lab.timings["6 constrained pods placed one by one"] = time.monotonic() - started

    lab.create_pod("h100", 4, annotations={"gpufleet.io/gpu-model": "H100"})
    lab.create_pod("cc90", 4, annotations={"gpufleet.io/gpu-min-cc": "9.0"})
    lab.wait_event("h100", "no healthy GPU with model h100")
    lab.wait_event("cc90", "no healthy GPU with compute capability >= 9.0")
    pods = lab.pods()
    assert pods["h100"].node is None and pods["cc90"].node is None
    assert_placements_valid(lab.nodes, pods)
    lab.assert_kubelet_clean()
    lab.wait_inspect_matches_annotations()


def test_whole_gpu_pods_prefer_nvlink_and_respect_models(
    gpu_lab: Callable[..., GpuLab], namespace: str
) -> None:
    """``nvidia.com/gpu`` pods go through the extender too (it manages the resource, the scheduler still
    counts it): multi-GPU pods prefer the node whose free GPUs are NVLink-connected; a model wish passes
    only nodes where every GPU qualifies; the extender binds without lock or assignment."""
    mesh = NodeSpec(f"{namespace}-mesh", tuple(gpu_group(f"{namespace}-mesh", 4, "NVIDIA A100-SXM4-40GB", 40,
                                                         "8.0", nvlink=True)), sharing=False)  # fmt: skip
    pcie = NodeSpec(f"{namespace}-pcie", tuple(gpu_group(f"{namespace}-pcie", 4, "NVIDIA A100-PCIE-40GB", 40,
                                                         "8.0", numa=(0, 1))), sharing=False)  # fmt: skip
    mixed = NodeSpec(f"{namespace}-mixed",
                     (GpuSpec(f"GPU-{namespace}-mx-a100", "NVIDIA A100-PCIE-40GB", 40, "8.0"),
                      GpuSpec(f"GPU-{namespace}-mx-t4", "Tesla T4", 15, "7.5")),
                     sharing=False)  # fmt: skip
    lab = gpu_lab([mesh, pcie, mixed])
    started = time.monotonic()
    placed: dict[str, str | None] = {}
    # One at a time, each on the state the previous ones left.
    for name, count, wishes in (("w2-a", 2, {}), ("w2-b", 2, {"gpufleet.io/gpu-model": "A100"}),
                                ("w4", 4, {}), ("w1", 1, {})):  # fmt: skip
        lab.create_pod(name, whole=count, annotations=wishes)
        placed[name] = lab.wait_bound([name])[name].node
    lab.timings["4 whole-GPU pods placed one by one"] = time.monotonic() - started
    assert placed["w2-a"] == mesh.name, placed  # 2 GPUs: NVLink beats PCIe and the mixed node's pair
    assert placed["w2-b"] == mesh.name, placed  # binpack onto the mesh; the mixed node is not all A100
    assert placed["w4"] == pcie.name, placed  # the mesh is full (the scheduler counts nvidia.com/gpu)
    assert placed["w1"] == mixed.name, placed  # the only GPUs left

    # An A100 is free on the mixed node, but the kubelet, not the extender, picks whole GPUs there.
    lab.create_pod("w1-a100", whole=1, annotations={"gpufleet.io/gpu-model": "A100"})
    message = lab.wait_event("w1-a100", "lack model a100")
    assert "the kubelet may pick any" in message, message
    pods = lab.pods()
    assert pods["w1-a100"].node is None
    for pod in pods.values():  # whole-GPU pods: bound by the extender, no hand-off annotations
        assert ASSIGNMENT_ANNOTATION not in pod.annotations and ALLOCATED_ANNOTATION not in pod.annotations
    for node in lab.nodes:
        assert LOCK_ANNOTATION not in node_annotations(lab.core, node)
    doc = lab.extender.get("/inspect")
    held = {n: doc["nodes"][n]["whole_gpus_held"] for n in lab.nodes}
    assert held == {n: sum(p.whole for p in pods.values() if p.node == n) for n in lab.nodes}
    assert lab.extender.metric("gpufleet_extender_binds_total", result="ok") >= 4
