"""The scheduler extender as kube-scheduler meets it: a process of its own, over HTTP, at N nodes.

    .venv/bin/python bench/extender_http_bench.py [--nodes 5000] [--used 0.1] [--rounds 500] [--system-pods N]
        [--api-server stand-in|kube] [--extender-src OLD/src]

An API server stand-in (gpufleet_harness.fakeapi over the in-memory cluster) serves N nodes x 8 GPUs
(80 GiB, NVSwitch-connected) as a real API server returns them (labels, capacity, conditions, addresses,
node info, images, managed fields), with a fraction ``--used`` of the GPUs partly used by GPU-memory pods
(and ``--system-pods`` DaemonSet-like pods per node that touch no GPU, which the extender must read and
drop). The extender runs as ``python -m gpufleet.extender serve`` through the real kubernetes client, and
everything is measured from outside:

- ready: process start to the first filter answer that admits every node (the pod asks 10 GiB), so
  interpreter start, imports, both lists and the index are in it; and the extender's CPU time until then,
  which leaves out the stand-in's own time to serve the lists. The stand-in encodes each object once per
  resourceVersion, before the extender starts (since session 15; before, once per list, which put about
  1.5 s of its own encoding into "ready"); Nodes come as metadata only when the extender asks, as it does
  since session 14;
- RSS: the process's VmRSS and VmHWM (peak) after the rounds;
- filter and prioritize: wall time per request on one keep-alive connection (what the scheduler holds),
  NodeNames mode (nodeCacheCapable), all N nodes as candidates; the reply is read in full. And the
  extender's CPU time per request (its process's, over the rounds, in 10 ms clock ticks: a mean), which a
  busy machine moves far less than the wall time.

``--api-server kube`` serves the same objects from the lab's real etcd and kube-apiserver (the Kubernetes
build ``make lab`` caches; no controller-manager, so pods stay Pending, bound, which the extender counts as
running ones), created through the API first (about 40 s for 5,000 nodes and 4,000 pods). Its lists come
from etcd page by page, as a real cluster's do, and it runs on the same two cores as the extender.

Issue 15's targets at 5,000 nodes: filter p99 < 5 ms, ready < 2 s, RSS < 150 MiB. Figures, not assertions.
"""

from __future__ import annotations

import argparse
import compileall
import concurrent.futures
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gpufleet
from gpufleet_harness.fakeapi import FakeApiServer, extender_command
from gpufleet_harness.memapi import InMemoryCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))
from extender_bench import GPUS_PER_NODE, make_node, make_pod

ASK_GIB = 10
TIMEOUT_S = 300


def real_node(i: int) -> dict[str, Any]:
    """The bench's GPU node dressed as the API server returns a Node (about 6 KB of JSON)."""
    node = make_node(i)
    name = node["metadata"]["name"]
    node["metadata"].update(
        uid=f"node-uid-{i:05d}",
        creationTimestamp="2026-01-05T10:00:00Z",
        managedFields=[
            {
                "manager": m,
                "operation": "Update",
                "apiVersion": "v1",
                "time": "2026-11-26T10:00:00Z",
                "fieldsType": "FieldsV1",
                "fieldsV1": {
                    "f:metadata": {"f:labels": {f"f:{k}": {} for k in "abcdef"}},
                    "f:status": {"f:conditions": {}, "f:images": {}},
                },
            }
            for m in ("kubelet", "kube-controller-manager", "gpufleet-device-plugin")
        ],
    )
    node["metadata"]["labels"].update(
        {
            "kubernetes.io/arch": "amd64",
            "kubernetes.io/os": "linux",
            "kubernetes.io/hostname": name,
            "node.kubernetes.io/instance-type": "p4de.24xlarge",
            "topology.kubernetes.io/region": "eu-west-1",
            "topology.kubernetes.io/zone": f"eu-west-1{'abc'[i % 3]}",
            "nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB",
            "nvidia.com/gpu.count": "8",
            "gpufleet.io/gpu-model": "A100-SXM4-80GB",
        }
    )
    resources = {
        "cpu": "96",
        "memory": "1176345612Ki",
        "pods": "110",
        "ephemeral-storage": "3750000000Ki",
        "hugepages-1Gi": "0",
        "hugepages-2Mi": "0",
        "gpufleet.io/gpu-mem": "640",
    }
    node["status"] = {
        "capacity": resources,
        "allocatable": resources,
        "conditions": [
            {
                "type": t,
                "status": "True" if t == "Ready" else "False",
                "reason": f"Kubelet{t}",
                "message": f"kubelet reports {t}",
                "lastHeartbeatTime": "2026-11-26T10:00:00Z",
                "lastTransitionTime": "2026-01-05T10:01:00Z",
            }
            for t in ("MemoryPressure", "DiskPressure", "PIDPressure", "Ready")
        ],
        "addresses": [
            {"type": "InternalIP", "address": f"10.{i // 250}.{i % 250}.10"},
            {"type": "Hostname", "address": name},
        ],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": f"{i:032x}",
            "systemUUID": f"{i:032x}",
            "bootID": f"{i:032x}",
            "kernelVersion": "6.1.0-27-amd64",
            "osImage": "Ubuntu 22.04.5 LTS",
            "containerRuntimeVersion": "containerd://1.7.24",
            "kubeletVersion": "v1.31.4",
            "kubeProxyVersion": "v1.31.4",
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
        "images": [
            {
                "names": [
                    f"registry.example/team/image-{k}@sha256:{k:064x}",
                    f"registry.example/team/image-{k}:v{k}",
                ],
                "sizeBytes": 100_000_000 + k,
            }
            for k in range(12)
        ],
    }
    return node


def system_pod(node: str, k: int) -> dict[str, Any]:
    """A DaemonSet-like pod on ``node`` that touches no GPU (about 2 KB of JSON)."""
    name = f"ds{k}-{node}"
    return {
        "metadata": {
            "name": name,
            "namespace": "kube-system",
            "uid": f"uid-{name}",
            "labels": {"app": f"ds{k}", "controller-revision-hash": "7d9f8b6c5"},
            "ownerReferences": [
                {
                    "apiVersion": "apps/v1",
                    "kind": "DaemonSet",
                    "name": f"ds{k}",
                    "uid": f"ds-uid-{k}",
                    "controller": True,
                }
            ],
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "main",
                    "image": f"registry.example/ds{k}:v1",
                    "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}},
                }
            ],
            "tolerations": [{"operator": "Exists"}],
            "serviceAccountName": f"ds{k}",
        },
        "status": {
            "phase": "Running",
            "podIP": "10.0.0.1",
            "hostIP": "10.0.0.1",
            "conditions": [{"type": t, "status": "True"} for t in ("Initialized", "Ready", "PodScheduled")],
            "containerStatuses": [
                {
                    "name": "main",
                    "ready": True,
                    "restartCount": 0,
                    "image": f"registry.example/ds{k}:v1",
                    "imageID": f"sha256:{k:064x}",
                    "containerID": f"containerd://{k:064x}",
                }
            ],
        },
    }


def objects(n: int, used: float, system_pods: int) -> Iterator[tuple[str, dict[str, Any]]]:
    """("node" | "pod", object): N nodes, GPU pods on a fraction ``used`` of the GPUs, ``system_pods`` per
    node."""
    rng = random.Random(1)
    for i in range(n):
        node = real_node(i)
        name = node["metadata"]["name"]
        yield "node", node
        for g in range(GPUS_PER_NODE):
            if rng.random() < used:
                yield "pod", make_pod(f"run-{i}-{g}", rng.randint(4, 40), name, f"GPU-{i:05d}-{g}")
        for k in range(system_pods):
            yield "pod", system_pod(name, k)


def populate(cluster: InMemoryCluster, n: int, used: float, system_pods: int) -> int:
    """The bench's objects into the in-memory cluster; the pod count."""
    pods = 0
    for kind, obj in objects(n, used, system_pods):
        if kind == "node":
            cluster.add_node(obj)
        else:
            cluster.add_pod(obj)
            pods += 1
    return pods


@contextlib.contextmanager
def stand_in(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Path, int]]:
    """The API server stand-in holding the bench's objects: (kubeconfig, pod count)."""
    cluster = InMemoryCluster()
    pods = populate(cluster, args.nodes, args.used, args.system_pods)
    api = FakeApiServer(cluster)
    try:
        # The stand-in encodes each object once per resourceVersion; done here, its Python encoder's time is
        # not counted as the extender's (a real API server's Go encoder takes a fraction of it).
        api.cluster.encoded("nodes", api.encoder("nodes", True))
        api.cluster.encoded("pods", api.encoder("pods", False))
        yield api.write_kubeconfig(tmp / "kubeconfig"), pods
    finally:
        api.close()


def _for_create(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as a client creates it: what the API server sets itself left out."""
    meta = {k: v for k, v in obj["metadata"].items() if k not in _SERVER_SET}
    return {**obj, "metadata": meta}


_SERVER_SET = frozenset({"uid", "creationTimestamp", "managedFields", "resourceVersion"})


def _pod_for_create(obj: dict[str, Any]) -> dict[str, Any]:
    """A bench pod as the API server accepts it: with an image, and no service account token (no token
    controller runs)."""
    containers = [{"image": "registry.example/gpu-job:v1", **c} for c in obj["spec"]["containers"]]
    spec = {**obj["spec"], "containers": containers, "automountServiceAccountToken": False}
    return {**_for_create(obj), "spec": spec}


@contextlib.contextmanager
def real_api_server(args: argparse.Namespace, tmp: Path) -> Iterator[tuple[Path, int]]:
    """The test cluster's etcd and kube-apiserver (`gpufleet cluster build`'s) holding the bench's objects,
    created through the API: (kubeconfig, pod count). A created pod is Pending (no kubelet runs it), which
    the extender counts as it counts a running one."""
    from kubernetes import client

    from gpufleet_harness.cluster.cluster import TestCluster
    from gpufleet_harness.cluster.k8s_build import ensure_k8s

    with TestCluster(ensure_k8s(build=False), tmp) as lab:
        cp = lab.start_control_plane(controller_manager=False)
        core = client.CoreV1Api(cp.api_client())
        core.create_namespace({"metadata": {"name": "bench"}})
        # No controller-manager: the service accounts the pods name are created here.
        core.create_namespaced_service_account("bench", {"metadata": {"name": "default"}})
        for k in range(args.system_pods):
            core.create_namespaced_service_account("kube-system", {"metadata": {"name": f"ds{k}"}})
        nodes: list[dict[str, Any]] = []
        pods: list[dict[str, Any]] = []
        for kind, obj in objects(args.nodes, args.used, args.system_pods):
            if kind == "node":
                nodes.append(_for_create(obj))
            else:
                pods.append(_pod_for_create(obj))
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda o: core.create_node(o), nodes))
            list(pool.map(lambda o: core.create_namespaced_pod(o["metadata"]["namespace"], o), pods))
        yield cp.kubeconfig(), len(pods)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def memory_kib(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0])
    return fields


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    p50, top = statistics.median(ordered), ordered[-1]
    return f"p50 {p50 * 1000:.2f} ms, p99 {p99 * 1000:.2f} ms, max {top * 1000:.2f} ms"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=5000)
    parser.add_argument("--used", type=float, default=0.10, help="fraction of GPUs with a GPU-memory pod")
    parser.add_argument("--system-pods", type=int, default=0, help="non-GPU pods per node")
    parser.add_argument("--rounds", type=int, default=500)
    parser.add_argument("--extender-src", help="run the extender from this src/ (an older checkout)")
    parser.add_argument(
        "--api-server",
        choices=("stand-in", "kube"),
        default="stand-in",
        help="the in-process stand-in, or the lab's real kube-apiserver and etcd (needs the cached "
        "Kubernetes build; creating 5,000 nodes takes minutes)",
    )
    args = parser.parse_args()

    names = [f"node-{i:05d}" for i in range(args.nodes)]
    filter_body = json.dumps({"Pod": make_pod("ask", ASK_GIB), "NodeNames": names}).encode()
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        started = time.monotonic()
        serve = stand_in if args.api_server == "stand-in" else real_api_server
        kubeconfig, pods = stack.enter_context(serve(args, Path(tmp)))
        what = "API server stand-in" if args.api_server == "stand-in" else "kube-apiserver"
        print(
            f"{args.nodes} nodes, {pods} pods (GPU pods on {args.used:.0%} of the GPUs, {args.system_pods} "
            f"system pods per node), {what} ready in {time.monotonic() - started:.1f} s"
        )
        port = free_port()
        older = {"PYTHONPATH": str(Path(args.extender_src).resolve())} if args.extender_src else {}
        # Bytecode compiled beforehand, as installing the wheel does (with PYTHONDONTWRITEBYTECODE set, a
        # source tree is compiled anew at each start: about 0.08 s of "ready").
        source = Path(args.extender_src) if args.extender_src else Path(gpufleet.__file__).parent.parent
        compileall.compile_dir(source / "gpufleet", quiet=1)
        argv = extender_command(kubeconfig, port)
        spawned = time.monotonic()
        proc = subprocess.Popen(
            argv, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1", **older}
        )
        synced = threading.Event()

        def read_log() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                if "event=synced" in line:
                    synced.set()

        threading.Thread(target=read_log, daemon=True).start()
        try:
            conn: http.client.HTTPConnection | None = None
            while True:
                if proc.poll() is not None:
                    raise SystemExit(f"the extender exited {proc.returncode} before it answered")
                if time.monotonic() - spawned > TIMEOUT_S:
                    raise SystemExit(f"no correct answer in {TIMEOUT_S} s")
                try:
                    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                    # /readyz, as a readiness probe asks, then the filter. A client sending the 70 KB filter
                    # in a tight loop would take the extender's CPU from the lists it is reading (the
                    # scheduler backs a pod off for a second or more after an extender error).
                    conn.request("GET", "/readyz")
                    probe = conn.getresponse()
                    probe.read()
                    if probe.status == 200:
                        conn.request("POST", "/gpufleet/filter", body=filter_body)
                        reply = json.loads(conn.getresponse().read())
                        # Every node known and fitting: none failed (since issue 31 the answer names only
                        # the node chosen; before, all of them).
                        if reply.get("NodeNames") and not reply.get("FailedNodes"):
                            break
                except (OSError, http.client.HTTPException, ValueError):
                    conn = None
                time.sleep(0.01)
            ready, cpu = time.monotonic() - spawned, cpu_seconds(proc.pid)
            print(
                f"ready (first filter admitting all {args.nodes} nodes): {ready:.2f} s, the extender's CPU "
                f"{cpu:.2f} s (the rest: waiting for the API server and the network)"
            )
            assert conn is not None
            # Timed from the "synced" log line on: the heap freeze that follows the first sync is done by
            # then, as in steady state.
            if not synced.wait(TIMEOUT_S):
                raise SystemExit("the extender never logged event=synced")
            print(f"synced (heap frozen): {time.monotonic() - spawned:.2f} s")
            for verb, rounds in (("filter", args.rounds), ("prioritize", max(args.rounds // 5, 20))):
                path = f"/gpufleet/{verb}"
                conn.request("POST", path, body=filter_body)  # warm
                conn.getresponse().read()
                samples = []
                cpu_before = cpu_seconds(proc.pid)
                for _ in range(rounds):
                    t0 = time.perf_counter()
                    conn.request("POST", path, body=filter_body)
                    conn.getresponse().read()
                    samples.append(time.perf_counter() - t0)
                cpu_each = (cpu_seconds(proc.pid) - cpu_before) / rounds
                print(
                    f"{verb} over HTTP, {args.nodes} candidates, {rounds} requests: {percentiles(samples)}; "
                    f"the extender's CPU {cpu_each * 1000:.2f} ms per request (mean)"
                )
            mem = memory_kib(proc.pid)
            print(f"extender RSS {mem['VmRSS'] / 1024:.0f} MiB, peak {mem['VmHWM'] / 1024:.0f} MiB")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
