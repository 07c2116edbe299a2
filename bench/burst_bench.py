"""A burst of GPU-memory pods through the real kube-scheduler and the extender, beside a burst of plain pods.

    .venv/bin/python bench/burst_bench.py [--pods 1000,2500] [--runs 1] [--modes baseline,extender]
        [--nodes 50] [--restart-extender-after BINDS] [--k8s DIR | --k8s-version VERSION]
        [--extender-src OLD/src] [--json FILE]

Issue 31's shape: per burst, one fresh etcd + kube-apiserver + kube-scheduler (no controller-manager, no
kubelets), ``--nodes`` simulated nodes (Node objects with the capacity, labels and ``gpufleet.io/gpus``
annotation the device plugin would publish, made Ready) of ``--gpus`` GPUs of ``--gpu-gib`` GiB, binpack,
and ``--pods`` pods created at once, each asking ``--ask`` GiB of one GPU (``gpufleet.io/gpu-mem``).

- ``baseline``: as many plain pods (no GPU, so no extender call) through the same kube-scheduler, with no
  extender configured: what the scheduler alone takes.
- ``extender``: ``gpufleet-extender serve`` as its own process (``--extender-src``: from an older checkout's
  ``src``, for before/after figures from one window), configured by ``gpufleet-extender scheduler-config``'s
  code. The kubelet and device plugin are played for each bound pod as the kubelet's ``Allocate`` would call
  the plugin: the plugin's own code (``MemoryHandoff`` over ``KubernetesPodResolver``: a watch of each
  node's pods, per Allocate a GET of the node, the ``allocated`` patch and the bind-lock's release), one pod
  at a time per node, as soon as the bench's watch shows the pod bound.
- ``--restart-extender-after BINDS`` (``extender`` bursts): once the bench's watch has seen BINDS pods bound,
  the extender is SIGKILLed (its whole session, as a crash) and started again at once with the same command
  and port; kube-scheduler keeps its configuration, so its calls fail while the extender is down and the
  pods are retried. Reported: binds seen and seconds since the first create at the kill, seconds from the
  kill until the new process is ready (``/readyz``, as the bench waits for the first) and until it has
  answered its first filter (its ``/metrics``). The restarted process logs to ``extender-restarted.log``
  beside ``extender.log``; bind failures and CPU count both processes, and the over-commit checks run
  through the whole burst (the bench's watch does not depend on the extender).

Issue 32's figure: ``--nodes 5000 --pods 1000 --restart-extender-after 500`` on Kubernetes 1.37. The nodes
are created ``--create-threads`` at a time (four API calls each); a node's kubelet stand-in starts with its
first pod.

Reported per burst: time from the first create to the last bind, binds per second, p50/p90 bind latency (pod
created -> watch shows it bound), creation time, bind rejections (kube-scheduler's "Failed to bind pod" log
lines, 1.20's and 1.37's alike: ``scheduler_rejections``; and the extender's own ``bind_failed`` events by
reason), filter errors, CPU seconds of kube-apiserver, etcd, kube-scheduler, the extender and this process
(the watch and the kubelet stand-in) from /proc, API server CPU per bind, nodes used (binpack: the fewest that
hold the pods is ``ceil(pods / (gpus * (gpu_gib // ask)))``), over-committed GPUs (checked on every watched
change and at the end, again from a list of the pods) and refused ``Allocate`` calls, and the time creating
the nodes took.
Figures, not assertions.

Kubernetes: the lab's cached build (``gpufleet lab build``; ``--k8s-version`` picks a cache entry,
``--k8s`` names an entry directory with ``bin/`` directly: another version's binaries, e.g. 1.37), started
through the harness (``gpufleet_harness.cluster``): etcd, kube-apiserver and kube-scheduler with the
configuration the harness writes for them, around the extender section ``gpufleet-extender
scheduler-config`` generates.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.client import CoreV1Api
from kubernetes.client.rest import ApiException
from prometheus_client.parser import text_string_to_metric_families

import gpufleet
from gpufleet.deviceplugin.gpumem.handoff import MemoryHandoff
from gpufleet.deviceplugin.gpumem.resolver import KubernetesPodResolver
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions
from gpufleet.deviceplugin.rm.errors import RequestError as PluginRefusal
from gpufleet.deviceplugin.rm.model import GpuInfo
from gpufleet.extender.kube import KubeCluster
from gpufleet.extender.schedconfig import SchedulerConfigOptions, scheduler_config
from gpufleet.handoff import (
    ALLOCATED_ANNOTATION,
    ASSIGNMENT_ANNOTATION,
    Assignment,
    parse_allocated,
)
from gpufleet_harness.cluster.cluster import ControlPlane, Scheduler, TestCluster, create_fake_node
from gpufleet_harness.cluster.k8s_build import K8sArtifacts, cached, ensure_k8s
from gpufleet_harness.cluster.process import ClusterError, Daemon, free_ports, wait_for

GPU_MEM = "gpufleet.io/gpu-mem"
NAMESPACE = "burst"
GIB = 1 << 30


# -- the simulated fleet ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Fleet:
    """``nodes`` memory-sharing nodes of ``gpus`` GPUs of ``gpu_gib`` GiB each (NVSwitch-connected)."""

    nodes: int
    gpus: int
    gpu_gib: int

    def names(self) -> list[str]:
        return [f"node-{i:03d}" for i in range(self.nodes)]

    def uuids(self, node: str) -> list[str]:
        return [f"GPU-{node}-{k}" for k in range(self.gpus)]

    def gpus_annotation(self, node: str) -> str:
        uuids = self.uuids(node)
        return json.dumps([
            {"index": k, "uuid": u, "model": "NVIDIA A100-SXM4-80GB", "memory_gib": self.gpu_gib, "cc": "8.0",
             "numa": k * 2 // self.gpus, "healthy": True, "nvlink": {p: 12 for p in uuids if p != u}}
            for k, u in enumerate(uuids)
        ])  # fmt: skip

    def gpu_infos(self, node: str) -> dict[str, GpuInfo]:
        """The device plugin's discovery view of the node's GPUs (what MemoryHandoff checks against)."""
        return {
            u: GpuInfo(index=k, uuid=u, minor=k, model="NVIDIA A100-SXM4-80GB", cc=(8, 0),
                       memory_bytes=self.gpu_gib * GIB, numa=k * 2 // self.gpus,
                       bus_id=f"0000:{k + 1:02x}:00.0")
            for k, u in enumerate(self.uuids(node))
        }  # fmt: skip

    def fits(self, ask: int) -> int:
        """How many pods of ``ask`` GiB the fleet holds."""
        return self.nodes * self.gpus * (self.gpu_gib // ask)

    def create(self, core: Any, threads: int) -> None:
        """Create the Node objects, ``threads`` at a time (each is four API calls: create, status, the
        not-ready taint's removal, a read)."""

        def one(name: str) -> None:
            create_fake_node(core, name, {GPU_MEM: self.gpus * self.gpu_gib},
                             labels={"gpufleet.io/gpu-sharing": "memory"},
                             annotations={"gpufleet.io/gpus": self.gpus_annotation(name)})  # fmt: skip

        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(one, self.names()))


def pod_body(i: int, ask: int) -> dict[str, Any]:
    limits = {GPU_MEM: str(ask)} if ask else {}
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": f"burst-{i:05d}"},
        "spec": {"automountServiceAccountToken": False, "terminationGracePeriodSeconds": 0,
                 "containers": [{"name": "c0", "image": "registry.example/gpu-job:v1",
                                 "resources": {"limits": limits}}]},
    }  # fmt: skip


# -- what the bench's watch records -------------------------------------------------------------------------


@dataclass
class PodSeen:
    name: str
    node: str | None = None
    assignment: Assignment | None = None
    allocated: tuple[str, ...] = ()
    version: str = ""


@dataclass
class Recorder:
    """A ClusterSink for the bench's own watch: when each pod is first seen bound, GiB per GPU of the bound
    pods' assignments (over-commit on every change), and which bound pods the kubelet stand-in must admit."""

    gpu_gib: int
    admit: Any = None  # callable(node, uid), set once the kubelet stand-in runs
    pods: dict[str, PodSeen] = field(default_factory=dict)
    bound_at: dict[str, float] = field(default_factory=dict)  # pod name -> monotonic time first seen bound
    used: dict[str, int] = field(default_factory=dict)  # GPU uuid -> GiB of bound pods' assignments
    overcommitted: set[str] = field(default_factory=set)
    unassigned: set[str] = field(default_factory=set)  # GPU-memory pods bound without an assignment
    lock: threading.Lock = field(default_factory=threading.Lock)
    listed: threading.Event = field(default_factory=threading.Event)
    restart_after: int = 0  # binds after which restart_due is set (0: never)
    restart_due: threading.Event = field(default_factory=threading.Event)

    def _shares(self, seen: PodSeen) -> dict[str, int]:
        if seen.node is None or seen.assignment is None or seen.assignment.node != seen.node:
            return {}
        return seen.assignment.shares()

    def _put(self, obj: Mapping[str, Any], now: float) -> None:
        meta = obj.get("metadata") or {}
        if meta.get("namespace") != NAMESPACE:
            return
        uid, name = str(meta.get("uid")), str(meta.get("name"))
        annotations = meta.get("annotations") or {}
        raw = annotations.get(ASSIGNMENT_ANNOTATION)
        seen = PodSeen(name, (obj.get("spec") or {}).get("nodeName") or None,
                       Assignment.from_json(raw) if raw else None,
                       parse_allocated(annotations.get(ALLOCATED_ANNOTATION)),
                       str(meta.get("resourceVersion") or ""))  # fmt: skip
        old = self.pods.get(uid)
        for uuid, gib in self._shares(old).items() if old else ():
            self.used[uuid] -= gib
        for uuid, gib in self._shares(seen).items():
            self.used[uuid] = self.used.get(uuid, 0) + gib
            if self.used[uuid] > self.gpu_gib:
                self.overcommitted.add(uuid)
        self.pods[uid] = seen
        if seen.node and name not in self.bound_at:
            self.bound_at[name] = now
            if self.restart_after and len(self.bound_at) >= self.restart_after:
                self.restart_due.set()
        wants_gpu = any(GPU_MEM in ((c.get("resources") or {}).get("limits") or {})
                        for c in (obj.get("spec") or {}).get("containers") or [])  # fmt: skip
        if seen.node and wants_gpu and seen.assignment is None:
            self.unassigned.add(name)
        pending = seen.assignment.pending(seen.allocated) if seen.assignment is not None else ()
        if seen.node and pending and self.admit is not None:
            self.admit(seen.node, uid)

    def _drop(self, uid: str) -> None:
        old = self.pods.pop(uid, None)
        for uuid, gib in self._shares(old).items() if old else ():
            self.used[uuid] -= gib

    # ClusterSink
    def replace_nodes(self, objs: Iterable[Mapping[str, Any]]) -> None:
        for _ in objs:
            pass

    def upsert_node(self, obj: Mapping[str, Any]) -> None:
        pass

    def delete_node(self, obj: Mapping[str, Any]) -> None:
        pass

    def replace_pods(self, objs: Iterable[Mapping[str, Any]]) -> None:
        now = time.monotonic()
        with self.lock:
            for obj in objs:
                self._put(obj, now)
        self.listed.set()

    def upsert_pod(self, obj: Mapping[str, Any]) -> None:
        now = time.monotonic()
        with self.lock:
            self._put(obj, now)

    def delete_pod(self, obj: Mapping[str, Any]) -> None:
        with self.lock:
            self._drop(str((obj.get("metadata") or {}).get("uid")))

    def set_watch_error(self, message: str | None) -> None:
        if message:
            print(f"  bench watch: {message}", file=sys.stderr)


# -- the kubelet and device plugin, played -----------------------------------------------------------------


class Kubelets:
    """One admission thread per node that has a pod, as each node's kubelet admits its pods one at a time:
    each GPU-memory container of a bound pod gets the plugin's ``Allocate`` with as many device IDs as it
    asks GiB. A node's thread, plugin and pods watch start with its first pod (binpack fills few of 5,000)."""

    def __init__(self, core: Any, fleet: Fleet, recorder: Recorder) -> None:
        self.fleet = fleet
        self.recorder = recorder
        self.errors: list[str] = []
        self.allocated = 0
        self.allocate_s: list[float] = []  # wall time of each Allocate the plugin answered
        # The plugin's own resolver, one for all the nodes' plugins: a watch of each node's pods (as each
        # node's plugin holds one), the node's GET, the pod's and the node's patches.
        self.resolver = KubernetesPodResolver(core)
        self.options = AllocateOptions(pass_device_specs=False)
        self.nodes = set(fleet.names())
        self.queues: dict[str, queue.Queue[str | None]] = {}
        self.queued: set[str] = set()
        self._lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def stop(self) -> None:
        with self._lock:
            self.nodes.clear()  # no node starts now
        for q in self.queues.values():
            q.put(None)
        for thread in self.threads:
            thread.join(10)
        self.resolver.close()

    def admit(self, node: str, uid: str) -> None:
        """Called from the watch (under the recorder's lock) for a bound pod with containers to allocate."""
        with self._lock:
            if uid in self.queued or (node not in self.queues and node not in self.nodes):
                return
            self.queued.add(uid)
            if node not in self.queues:
                self.queues[node] = queue.Queue()
                self.threads.append(threading.Thread(target=self._run, args=(node,), daemon=True))
                self.threads[-1].start()
        self.queues[node].put(uid)

    def _run(self, node: str) -> None:
        infos = self.fleet.gpu_infos(node)
        handoff = MemoryHandoff(self.resolver, node, lambda: infos, dict, self.options)
        first_gpu = self.fleet.uuids(node)[0]
        while (uid := self.queues[node].get()) is not None:
            with self.recorder.lock:
                seen = self.recorder.pods.get(uid)
                todo = seen.assignment.pending(seen.allocated) if seen and seen.assignment else ()
            for container in todo:
                ids = [f"{first_gpu}::{k}" for k in range(container.gpu_mem_gib)]
                try:
                    started = time.monotonic()
                    handoff(ids)
                    self.allocate_s.append(time.monotonic() - started)
                    self.allocated += 1
                except PluginRefusal as exc:
                    self.errors.append(f"{seen.name if seen else uid}/{container.name}: {exc}")
                    break
                except Exception as exc:  # an API hiccup: the kubelet would retry the pod later
                    self.errors.append(f"{seen.name if seen else uid}/{container.name}: {exc!r}")
                    break


# -- processes and their CPU --------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a process (and its reaped children) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class ExtenderProcess:
    def __init__(
        self, kubeconfig: Path, log_path: Path, src: str | None, settings: Mapping[str, str]
    ) -> None:
        (self.port,) = free_ports(1)
        self.base = f"http://127.0.0.1:{self.port}"
        self.url = self.base + "/gpufleet"
        self.env = dict(os.environ)
        if src:
            self.env["PYTHONPATH"] = str(Path(src).resolve())
        flags = {"kubeconfig": str(kubeconfig), "listen-address": "127.0.0.1", "port": str(self.port),
                 "url-prefix": "/gpufleet", "log-format": "json", **settings}  # fmt: skip
        self.argv = [sys.executable, "-m", "gpufleet.extender", "serve",
                     *(a for k, v in flags.items() for a in (f"--{k}", v))]  # fmt: skip
        self.log_paths = [log_path]  # one per process, the restarted one's too
        self.killed_cpu = 0.0  # CPU seconds of the processes killed so far
        self.daemon = Daemon("gpufleet-extender", self.argv, log_path, env=self.env)
        wait_for("extender /readyz", self._ready, 120, interval=0.1, alive=self.daemon.check)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/readyz", timeout=5) as response:
                return bool(response.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def _filters_answered(self) -> float:
        """The filter requests this process has answered 200 (its /metrics; 0 while it does not answer)."""
        try:
            with urllib.request.urlopen(self.base + "/metrics", timeout=5) as response:
                text = response.read().decode()
        except (urllib.error.URLError, OSError):
            return 0.0
        return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
                   if s.name == "gpufleet_extender_requests_total"
                   and s.labels.get("verb") == "filter" and s.labels.get("code") == "200")  # fmt: skip

    def cpu(self) -> float:
        """CPU seconds of every extender process of the burst so far."""
        return self.killed_cpu + cpu_seconds(self.daemon.pid)

    def restart(self, log_path: Path, done: threading.Event) -> tuple[float, float | None]:
        """SIGKILL the extender (its whole session, as a crash would end it) and start it again at once with
        the same command on the same port, logging to ``log_path``. Returns the seconds from the kill until
        the new process is ready (/readyz, as at the start) and until it has answered its first filter (None
        if the burst is ``done`` first).

        Call it from a thread that outlives the new process: the harness's daemons die with the thread
        that started them (PR_SET_PDEATHSIG)."""
        self.killed_cpu += cpu_seconds(self.daemon.pid)
        killed = time.monotonic()
        os.killpg(self.daemon.pid, signal.SIGKILL)
        self.daemon.proc.wait(10)
        self.log_paths.append(log_path)
        self.daemon = Daemon("gpufleet-extender", self.argv, log_path, env=self.env)
        wait_for("restarted extender /readyz", self._ready, 120, interval=0.05, alive=self.daemon.check)
        ready = time.monotonic() - killed
        while not self._filters_answered():
            self.daemon.check()
            if done.wait(0.05):
                return ready, None
        return ready, time.monotonic() - killed

    def bind_failures(self) -> dict[str, int]:
        """The extender's ``bind_failed`` events by reason, from the JSON logs of all its processes."""
        out: dict[str, int] = {}
        for log_path in self.log_paths:
            for line in log_path.read_text(errors="replace").splitlines():
                if '"bind_failed"' not in line:
                    continue
                with contextlib.suppress(ValueError):
                    doc = json.loads(line)
                    if doc.get("event") == "bind_failed":
                        out[doc.get("reason", "?")] = out.get(doc.get("reason", "?"), 0) + 1
        return out


def scheduler_rejections(log_path: Path) -> tuple[int, int]:
    """kube-scheduler's log: bind rejections, and the other scheduling errors (extender filter errors).

    Every failed binding cycle logs "Failed to bind pod" at verbosity 1 (the harness runs the scheduler at
    2): 1.20 (scheduler.go ``finishBinding``, "Failed to bind pod: ns/name") and 1.37 (schedule_one.go
    ``finishBinding``, ``"Failed to bind pod" pod="ns/name"``). Each failure, of a bind or of a filter, also
    logs one "Error scheduling pod; retrying": 1.20 wraps a bind's error as "binding rejected: <error>", 1.37
    passes it through as it is (an extender's ``Error`` text, or the HTTP client's error for its bind URL),
    so on 1.37 only the "Failed to bind pod" lines tell binds from filters. Rejections: the larger of the two
    counts (1.20's wrapper is logged at any verbosity); other errors: the rest of the "Error scheduling pod"
    lines."""
    failed = wrapped = errors = 0
    for line in log_path.read_text(errors="replace").splitlines():
        lowered = line.lower()
        if "failed to bind pod" in lowered:
            failed += 1
        elif "error scheduling pod" in lowered:
            errors += 1
            if "binding rejected" in lowered:
                wrapped += 1
    rejected = max(failed, wrapped)
    return rejected, max(0, errors - rejected)


def api_version_for(artifacts: K8sArtifacts) -> str:
    """The KubeSchedulerConfiguration API the scheduler reads: v1beta1 up to 1.21 (1.20's), v1 from 1.25."""
    text = artifacts.git_version or artifacts.version
    digits = text.lstrip("v").split(".")
    try:
        minor = int(digits[1])
    except (IndexError, ValueError):
        return "v1"
    return "v1beta1" if int(digits[0]) == 1 and minor <= 21 else "v1"


# -- one burst -----------------------------------------------------------------------------------------------


@dataclass
class Result:
    mode: str
    pods: int
    expected: int
    bound: int = 0
    create_s: float = 0.0
    last_bind_s: float | None = None
    p50_s: float | None = None
    p90_s: float | None = None
    rejected: int = 0
    sched_errors: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    cpu: dict[str, float] = field(default_factory=dict)
    nodes_used: int = 0
    overcommitted: int = 0
    unassigned: int = 0
    plugin_refusals: list[str] = field(default_factory=list)
    allocate_ms: tuple[float, float] | None = None  # the plugin's Allocate, wall p50 / p90
    load: float = 0.0
    nodes_s: float = 0.0  # creating the Node objects
    # --restart-extender-after: binds seen and seconds since the first create at the kill, seconds from the
    # kill until the new process was ready and until it answered its first filter (None: it got none)
    restart: dict[str, float | None] = field(default_factory=dict)

    @property
    def binds_per_s(self) -> float | None:
        return self.bound / self.last_bind_s if self.last_bind_s else None


def burst(artifacts: K8sArtifacts, args: argparse.Namespace, mode: str, pods: int, base: Path) -> Result:
    fleet = Fleet(args.nodes, args.gpus, args.gpu_gib)
    ask = args.ask if mode == "extender" else 0
    expected = min(pods, fleet.fits(args.ask)) if ask else pods
    result = Result(mode, pods, expected)
    with TestCluster(artifacts, base) as lab:
        cp = lab.start_control_plane(controller_manager=False)
        core = cp.core_v1()
        core.api_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 32  # pools are made lazily
        core.create_namespace({"metadata": {"name": NAMESPACE}})
        core.create_namespaced_service_account(NAMESPACE, {"metadata": {"name": "default"}})
        nodes_started = time.monotonic()
        fleet.create(core, args.create_threads)
        result.nodes_s = time.monotonic() - nodes_started
        extender = None
        if mode == "extender":
            settings = dict(kv.split("=", 1) for kv in args.extender_setting)
            extender = ExtenderProcess(
                cp.kubeconfig(), lab.logs / "extender.log", args.extender_src, settings
            )
            opts = SchedulerConfigOptions(url=extender.url, api_version=api_version_for(artifacts))
            scheduler = lab.start_scheduler(scheduler_config(opts))
        else:
            scheduler = lab.start_scheduler(None)
        recorder = Recorder(args.gpu_gib, restart_after=args.restart_extender_after if extender else 0)
        watch_api = KubeCluster(cp.api_client(), timeout=30)
        plugin_client = cp.api_client()
        # 50 nodes' watches hold a connection each, and up to 50 hand-offs call at once.
        plugin_client.rest_client.pool_manager.connection_pool_kw["maxsize"] = 128
        kubelets = Kubelets(CoreV1Api(plugin_client), fleet, recorder)
        recorder.admit = kubelets.admit
        stop = threading.Event()
        watcher = threading.Thread(target=watch_api.watch, args=(recorder, stop), daemon=True)
        watcher.start()
        wait_for("the bench's watch", recorder.listed.is_set, 60)
        procs = _processes(cp, scheduler)

        def cpu_now() -> dict[str, float]:
            out = {name: cpu_seconds(pid) for name, pid in procs.items()}
            if extender is not None:
                out["extender"] = extender.cpu()
            return out

        cpu_before = cpu_now()
        created_at: dict[str, float] = {}
        result.load = os.getloadavg()[0]
        started = time.monotonic()
        done = threading.Event()  # the binds are over: stop waiting for the restart or its first filter
        restarted = threading.Event()  # the restart is over, or never came
        released = threading.Event()  # the restarted extender is stopped: the thread that started it may end

        def restart_extender() -> None:
            try:
                while not recorder.restart_due.wait(0.1):
                    if done.is_set():
                        return
                with recorder.lock:
                    binds = len(recorder.bound_at)
                result.restart = {"binds": binds, "at_s": time.monotonic() - started}
                log_path = lab.logs / "extender-restarted.log"
                ready_s, filter_s = extender.restart(log_path, done)  # type: ignore[union-attr]
                result.restart |= {"ready_s": ready_s, "first_filter_s": filter_s}
                print(f"  extender SIGKILLed at {binds} binds, {result.restart['at_s']:.1f} s; ready after "
                      f"{ready_s:.1f} s, first filter after {_s(filter_s)} s", file=sys.stderr)  # fmt: skip
            except ClusterError as exc:
                print(f"  extender restart failed: {exc}", file=sys.stderr)
            finally:
                restarted.set()
            released.wait()

        restarter = threading.Thread(target=restart_extender, daemon=True)
        if recorder.restart_after:
            restarter.start()

        def create(i: int) -> None:
            body = pod_body(i, ask)
            for attempt in range(10):
                try:
                    core.create_namespaced_pod(NAMESPACE, body, _preload_content=False)
                    break
                except ApiException as exc:
                    # An overloaded API server answers 500 ("resource quota evaluation timed out") or 429:
                    # a client retries; 409 after a retry means the earlier attempt landed.
                    if exc.status == 409 and attempt:
                        break
                    if exc.status not in (429, 500, 503, 504) or attempt == 9:
                        raise
                    time.sleep(0.5)
            created_at[body["metadata"]["name"]] = time.monotonic()

        with ThreadPoolExecutor(args.create_threads) as pool:
            list(pool.map(create, range(pods)))
        result.create_s = time.monotonic() - started
        last_progress, last_count = time.monotonic(), 0
        deadline = started + args.timeout
        while time.monotonic() < deadline:
            with recorder.lock:
                count = len(recorder.bound_at)
            if count >= expected:
                break
            if count != last_count:
                last_progress, last_count = time.monotonic(), count
            elif time.monotonic() - last_progress > args.stall:
                print(f"  no bind for {args.stall:.0f} s at {count}/{expected}; stopping", file=sys.stderr)
                break
            time.sleep(0.2)
        time.sleep(args.settle)  # in-flight hand-offs land; the extender's sweep and late events show
        done.set()
        if restarter.is_alive():
            restarted.wait(150)
        cpu_after = cpu_now()
        # The end state once more, from a list rather than the watch: every GPU's assignments summed again.
        final = Recorder(args.gpu_gib)
        listed = core.list_namespaced_pod(NAMESPACE, _preload_content=False)
        final.replace_pods(json.loads(listed.data)["items"])
        stop.set()
        kubelets.stop()
        watcher.join(10)
        with recorder.lock:
            bound = dict(recorder.bound_at)
            nodes_used = {p.node for p in recorder.pods.values() if p.node}
            result.overcommitted = len(recorder.overcommitted | final.overcommitted)
            result.unassigned = len(recorder.unassigned | final.unassigned)
        result.bound = len(bound)
        if bound:
            result.last_bind_s = max(bound.values()) - started
            latencies = sorted(t - created_at[n] for n, t in bound.items() if n in created_at)
            result.p50_s = statistics.median(latencies)
            result.p90_s = latencies[min(len(latencies) - 1, int(len(latencies) * 0.9))]
        result.nodes_used = len(nodes_used)
        result.cpu = {name: cpu_after[name] - cpu_before[name] for name in cpu_after}
        result.rejected, result.sched_errors = scheduler_rejections(scheduler.log_path)
        if extender is not None:
            result.reasons = extender.bind_failures()
            extender.daemon.stop()
        released.set()
        if restarter.is_alive():
            restarter.join(10)
        result.plugin_refusals = kubelets.errors
        if kubelets.allocate_s:
            walls = sorted(kubelets.allocate_s)
            result.allocate_ms = (1000 * statistics.median(walls), 1000 * walls[int(len(walls) * 0.9)])
        if args.keep_logs:
            target = Path(args.keep_logs) / f"{mode}-{pods}-{int(time.time())}"
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copytree(lab.logs, target)
    return result


def _processes(cp: ControlPlane, scheduler: Scheduler) -> dict[str, int]:
    """The processes whose CPU the burst reports, but the extender's (ExtenderProcess.cpu: it may be two)."""
    pids = {d.name: d.pid for d in cp.daemons}
    return {
        "kube-apiserver": pids["kube-apiserver"],
        "etcd": pids["etcd"],
        "kube-scheduler": scheduler.daemon.pid,  # type: ignore[union-attr]
        "bench (watch + kubelets)": os.getpid(),
    }


# -- report ---------------------------------------------------------------------------------------------


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def report(results: list[Result], label: str) -> str:
    columns = ["burst", "mode", "bound / expected", "pods created in", "last bind after", "binds/s",
               "p50 / p90 bind latency", "binds rejected (scheduler log)", "extender bind failures by reason",
               "apiserver / etcd / scheduler / extender / bench CPU s", "apiserver CPU ms per bind",
               "nodes used", "over-committed GPUs"]  # fmt: skip
    lines = [f"### {label}", "", "| " + " | ".join(columns) + " |", "|---" * len(columns) + "|"]
    for r in results:
        cpu = r.cpu
        per_bind = 1000 * cpu.get("kube-apiserver", 0.0) / r.bound if r.bound else None
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(r.reasons.items())) or "-"
        cpus = " / ".join(_s(cpu.get(k)) for k in ("kube-apiserver", "etcd", "kube-scheduler", "extender",
                                                    "bench (watch + kubelets)"))  # fmt: skip
        lines.append(
            f"| {r.pods} | {r.mode} | {r.bound} / {r.expected} | {r.create_s:.1f} s | "
            f"{_s(r.last_bind_s)} s | {_s(r.binds_per_s)} | {_s(r.p50_s)} / {_s(r.p90_s)} s | "
            f"{r.rejected} | {reasons} | {cpus} | {_s(per_bind)} | {r.nodes_used} | {r.overcommitted} |"
        )

    def allocates(r: Result) -> str:
        if r.allocate_ms is None:
            return ""
        return f" (Allocate p50 / p90 {r.allocate_ms[0]:.0f} / {r.allocate_ms[1]:.0f} ms)"

    def restart(r: Result) -> str:
        if not r.restart:
            return ""
        got = r.restart
        killed = f"; extender SIGKILLed at {got['binds']:.0f} binds, {_s(got['at_s'])} s into the burst"
        if "ready_s" not in got:
            return f"{killed}, restart failed"
        return (f"{killed}, ready {_s(got['ready_s'])} s later, first filter answered "
                f"{_s(got['first_filter_s'])} s later")  # fmt: skip

    notes = [f"{r.mode} {r.pods}: {len(r.plugin_refusals)} Allocate refusals{allocates(r)}, {r.unassigned} "
             f"bound without assignment, {r.sched_errors} other scheduling errors, load {r.load:.1f} at "
             f"start, nodes created in {r.nodes_s:.1f} s{restart(r)}" for r in results]  # fmt: skip
    return "\n".join([*lines, "", *notes])


def artifacts_from(args: argparse.Namespace) -> K8sArtifacts:
    if args.k8s:
        root = Path(args.k8s).resolve()
        found = cached(root.name, root.parent.parent) if (root / "manifest.json").exists() else None
        return found or K8sArtifacts(root.name, root)
    return ensure_k8s(args.k8s_version, build=False)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", default="1000,2500", help="burst sizes, comma-separated")
    parser.add_argument("--runs", type=int, default=1, help="runs of each burst size and mode")
    parser.add_argument("--modes", default="baseline,extender")
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu-gib", type=int, default=80)
    parser.add_argument("--ask", type=int, default=16, help="GiB of one GPU each pod asks")
    parser.add_argument("--k8s", help="a Kubernetes cache entry directory (with bin/)")
    parser.add_argument("--k8s-version", help="the cache entry's version (default: newest complete)")
    parser.add_argument("--extender-src", help="run the extender from this src/ (an older checkout)")
    parser.add_argument("--extender-setting", action="append", default=[], metavar="FLAG=VALUE",
                        help="a flag for `gpufleet-extender serve`, e.g. lock-wait=3")  # fmt: skip
    parser.add_argument("--create-threads", type=int, default=16, help="threads creating nodes and pods")
    parser.add_argument("--restart-extender-after", type=int, default=0, metavar="BINDS",
                        help="SIGKILL and restart the extender once the watch has seen this many pods bound "
                             "(extender bursts; 0: never)")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a burst may take")
    parser.add_argument(
        "--stall", type=float, default=240.0, help="stop after this many seconds without a bind"
    )
    parser.add_argument("--settle", type=float, default=3.0, help="seconds to wait after the last bind")
    parser.add_argument("--label", default="", help="a title for the table (e.g. before/after)")
    parser.add_argument("--json", help="append the results as JSON lines to this file")
    parser.add_argument("--keep-logs", help="copy each burst's logs into this directory")
    args = parser.parse_args()
    if args.restart_extender_after < 0:
        parser.error(f"--restart-extender-after {args.restart_extender_after}: expected a number of binds, "
                     "0 or more (0: never)")  # fmt: skip
    artifacts = artifacts_from(args)
    src = args.extender_src or str(Path(gpufleet.__file__).resolve().parents[1])
    label = args.label or f"Kubernetes {artifacts.git_version or artifacts.version}, extender from {src}"
    print(f"{label}: {args.nodes} nodes x {args.gpus} GPUs x {args.gpu_gib} GiB, pods ask {args.ask} GiB",
          file=sys.stderr)  # fmt: skip
    results = []
    base = Path(tempfile.mkdtemp(prefix="gpufleet-burst-"))
    for _ in range(args.runs):
        for pods in (int(p) for p in args.pods.split(",")):
            for mode in args.modes.split(","):
                print(f"  {mode} {pods} ...", file=sys.stderr)
                result = burst(artifacts, args, mode, pods, base)
                results.append(result)
                print(report([result], label).splitlines()[4], file=sys.stderr)
                if args.json:
                    with open(args.json, "a") as out:
                        out.write(json.dumps({"label": label, **result.__dict__}) + "\n")
    print(report(results, label))
    return 0


if __name__ == "__main__":
    sys.exit(main())
