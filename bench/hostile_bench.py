"""The extender beside a hostile pod: filter latency over HTTP before, while and after a pod asking
`gpufleet.io/gpu-mem: 1e20000000` enters a real Kubernetes API server, and start-up with it present.

    .venv/bin/python bench/hostile_bench.py [--nodes 300] [--rounds 400]
    PYTHONPATH=/path/to/older/src .venv/bin/python bench/hostile_bench.py   # an older extender

Needs the test cluster's Kubernetes build (`gpufleet cluster build`: 1.37; GPUFLEET_K8S_VERSION=1.20 for
Debian's). The bench starts etcd and kube-apiserver on loopback (gpufleet_harness.cluster), creates
`--nodes` kubelet-less nodes that share GPU memory (8 x A100-80GB each, published in `gpufleet.io/gpus`),
and runs the extender against it with its real watch. A client on a keep-alive connection sends `filter` in
NodeNames mode for a pod asking 10 GiB, one call after another:
- "before": the hostile pod does not exist;
- "while": calls run while the hostile pod is created and the watch delivers it (the review measured
  filters stalled 18.9 s here: the old parser raised ten to the twenty-millionth power under the GIL);
- "after": the pod exists (and is re-read on every relist).
Then a second extender starts with the pod present: "ready" is the time to its first synced cache.
The apiserver's stored form of the quantity is printed too (it canonicalises it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from typing import Any

from kubernetes import client as k8s

from gpufleet.extender.kube import KubeCluster
from gpufleet.extender.server import make_server
from gpufleet.extender.service import Extender
from gpufleet.extender.settings import Settings
from gpufleet_harness.cluster.cluster import TestCluster
from gpufleet_harness.cluster.k8s_build import BuildError, ensure_k8s

HOSTILE = "1e20000000"
GPUS_PER_NODE = 8


def gpus_annotation(i: int) -> str:
    ids = [f"GPU-{i:05d}-{g}" for g in range(GPUS_PER_NODE)]
    return json.dumps(
        [
            {
                "index": g,
                "uuid": ids[g],
                "model": "NVIDIA A100-SXM4-80GB",
                "memory_gib": 80,
                "cc": "8.0",
                "numa": g // 4,
                "healthy": True,
                "nvlink": {p: 12 for p in ids if p != ids[g]},
            }
            for g in range(GPUS_PER_NODE)
        ]
    )


def filter_body(names: list[str]) -> bytes:
    pod = {
        "metadata": {"name": "ask", "namespace": "default", "uid": "ask-uid"},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"gpufleet.io/gpu-mem": "10"}}}]},
    }
    return json.dumps({"Pod": pod, "NodeNames": names}).encode()


class Client:
    """Filter calls on one keep-alive connection; each call's wall time is kept."""

    def __init__(self, port: int, body: bytes) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        self.body = body

    def call(self) -> float:
        started = time.perf_counter()
        self.conn.request("POST", "/filter", body=self.body, headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        payload = json.loads(response.read())
        took = time.perf_counter() - started
        assert response.status == 200 and payload["NodeNames"], (response.status, payload.get("Error"))
        return took

    def run(self, rounds: int) -> list[float]:
        return [self.call() for _ in range(rounds)]


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    p50, worst = statistics.median(ordered), ordered[-1]
    return f"{len(samples):>6} {p50 * 1e3:>9.2f} {p99 * 1e3:>9.2f} {worst * 1e3:>10.2f}"


def start_extender(kubeconfig: str) -> tuple[Extender, Any, float]:
    started = time.perf_counter()
    extender = Extender(Settings(kubeconfig=kubeconfig), KubeCluster.from_config(kubeconfig))
    extender.start()
    if not extender.wait_synced(600):
        raise SystemExit("the extender did not sync within 600 s")
    ready = time.perf_counter() - started
    server = make_server(extender, Settings(listen_address="127.0.0.1", port=0))
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    return extender, server, ready


def seen(extender: Extender) -> bool:
    """Whether the extender's cache holds the hostile pod (older extenders: among its pod records)."""
    complaints = getattr(extender.state, "complaints", None)
    if complaints is not None:
        return bool(complaints.summary()["count"])
    with extender.state.lock:
        return any(r.key == "default/hostile" for r in extender.state._pods.values())


def hostile_pod() -> k8s.V1Pod:
    limits = {"gpufleet.io/gpu-mem": HOSTILE}
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name="hostile"),
        spec=k8s.V1PodSpec(
            automount_service_account_token=False,
            scheduler_name="no-such-scheduler",  # nobody binds it; the extender only watches it
            containers=[
                k8s.V1Container(name="c", image="pause", resources=k8s.V1ResourceRequirements(limits=limits))
            ],
        ),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=400)
    args = parser.parse_args()
    try:
        artifacts = ensure_k8s(build=False)
    except BuildError as err:
        raise SystemExit(f"{err}: run `gpufleet cluster build` first") from None
    with TestCluster(artifacts) as lab:
        cp = lab.start_control_plane(controller_manager=False)
        core = cp.core_v1()
        core.create_namespaced_service_account("default", k8s.V1ServiceAccount(metadata={"name": "default"}))
        started = time.perf_counter()
        names = []
        for i in range(args.nodes):
            name = f"node-{i:05d}"
            cp.fake_node(name, labels={"gpufleet.io/gpu-sharing": "memory"},
                         annotations={"gpufleet.io/gpus": gpus_annotation(i)})  # fmt: skip
            names.append(name)
        print(f"{args.nodes} nodes created in {time.perf_counter() - started:.1f} s")
        kubeconfig = str(cp.kubeconfig())
        extender, server, ready = start_extender(kubeconfig)
        client = Client(server.server_address[1], filter_body(names))
        client.run(20)  # warm-up

        rows = [("before", client.run(args.rounds))]
        during: list[float] = []
        done = threading.Event()
        created: list[float] = []

        def create() -> None:
            time.sleep(0.2)
            started = time.perf_counter()
            core.create_namespaced_pod("default", hostile_pod())
            created.extend((time.perf_counter() - started, time.perf_counter()))
            done.set()

        creator = threading.Thread(target=create)
        creator.start()
        seen_after = None
        create_started = time.perf_counter()
        while seen_after is None or len(during) < args.rounds:
            during.append(client.call())
            if seen_after is None and done.is_set() and seen(extender):
                seen_after = time.perf_counter() - created[1]
            if time.perf_counter() - create_started > 600:
                raise SystemExit("the extender never reported the hostile pod")
        creator.join()
        rows.append(("while", during))
        rows.append(("after", client.run(args.rounds)))
        stored = core.read_namespaced_pod("hostile", "default").spec.containers[0].resources.limits
        rejected = extender.state.inspect().get("rejected_objects", {"shown": [{"error": "(not reported)"}]})
        extender.stop()
        server.shutdown()

        second, second_server, ready_with = start_extender(kubeconfig)
        second.stop()
        second_server.shutdown()

    print(f"\nextender filter over HTTP, {args.nodes} nodes x {GPUS_PER_NODE} GPUs, pod asking 10 GiB (ms)")
    print(f"{'phase':<8} {'calls':>6} {'p50':>9} {'p99':>9} {'max':>10}")
    for phase, samples in rows:
        print(f"{phase:<8} {summary(samples)}")
    print(f"\nthe apiserver stored the hostile limit as {stored['gpufleet.io/gpu-mem']!r}")
    print(f"the apiserver took {created[0]:.1f} s to accept it (its own canonicalisation of the quantity)")
    print(f"in the extender's cache {seen_after * 1e3:.0f} ms after that: {rejected['shown'][0]['error']}")
    print(f"ready: {ready:.2f} s without it, {ready_with:.2f} s with it present")


if __name__ == "__main__":
    main()
