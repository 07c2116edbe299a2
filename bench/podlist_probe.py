"""How a Kubernetes API server answers the reads of one node's pods the device plugin could make.

    .venv/bin/python bench/podlist_probe.py --k8s /var/cache/gpufleet/k8s/<version> [--pods 2500]
        [--nodes 50] [--calls 200] [--etcd PATH]

Starts its own etcd and kube-apiserver from the given build (``bin/``; etcd from there, else ``--etcd`` or
PATH), on loopback ports it picks, creates ``--pods`` pods spread over ``--nodes`` node names
(``spec.nodeName`` set at creation: nothing schedules or runs them) and measures, for one node's pods:

- ``quorum list``: ``GET /api/v1/pods?fieldSelector=spec.nodeName=N`` with no resourceVersion, the plugin's
  read before issue 31;
- ``cache list``: the same with ``resourceVersion=<rv>&resourceVersionMatch=NotOlderThan``;
- ``get pod``: one pod by name (what reading the lock holder costs);

each ``--calls`` times: wall time per call, kube-apiserver and etcd CPU per call (/proc), and etcd range
requests per call (etcd's own ``etcd_mvcc_range_total``, ``etcd_debugging_mvcc_range_total`` before 3.5): 0
means the API server answered from its watch cache. Then it checks what the plugin's exactness rests on:

- ``read-your-write``: a pod patched (its reply names resourceVersion W), then a cache list at
  NotOlderThan W shows the patch, every time;
- ``watch order``: a watch on the node's pods (``fieldSelector`` ``spec.nodeName``) delivers each of its own
  patches as an event with the reply's resourceVersion, in order;
- ``ahead of pods``: a cache list of pods at NotOlderThan the resourceVersion of a write to another
  resource (a ConfigMap, as a Node's lock would be): how long it blocks and what it answers while no pod
  changes. Figures and checks are printed; nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import urllib3
from prometheus_client.parser import text_string_to_metric_families

from gpufleet_harness.cluster import pki
from gpufleet_harness.cluster.process import Daemon, free_ports, wait_for

NAMESPACE = "probe"
RANGE_METRICS = ("etcd_mvcc_range_total", "etcd_debugging_mvcc_range_total")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class Cluster:
    """etcd + kube-apiserver of one build, token-authenticated, on loopback."""

    def __init__(self, bin_dir: Path, etcd: str, work: Path) -> None:
        self.work = work
        apiserver = bin_dir / "kube-apiserver"
        out = subprocess.run([apiserver, "--version"], capture_output=True, text=True, check=True).stdout
        self.version = out.split()[-1]
        minor = int(self.version.lstrip("v").split(".")[1])
        etcd_port, peer_port, port = free_ports(3)
        self.etcd_url = f"http://127.0.0.1:{etcd_port}"
        peer = f"http://127.0.0.1:{peer_port}"
        self.etcd = Daemon("etcd", [etcd, "--name", "probe", "--data-dir", work / "etcd",
                                    "--listen-client-urls", self.etcd_url, "--advertise-client-urls",
                                    self.etcd_url, "--listen-peer-urls", peer,
                                    "--initial-advertise-peer-urls", peer, "--initial-cluster",
                                    f"probe={peer}", "--unsafe-no-fsync"],
                           work / "etcd.log")  # fmt: skip
        wait_for("etcd", lambda: self._ok(self.etcd_url + "/health"), 30, alive=self.etcd.check)
        sa_key, sa_pub = pki.service_account_keys(work / "pki")
        self.token = secrets.token_hex(16)
        tokens = work / "pki" / "tokens.csv"
        tokens.write_text(f'{self.token},admin,uid-admin,"system:masters"\n')
        self.url = f"https://127.0.0.1:{port}"
        self.apiserver = Daemon("kube-apiserver", [
            apiserver, f"--etcd-servers={self.etcd_url}", "--bind-address=127.0.0.1",
            "--advertise-address=127.0.0.1", f"--secure-port={port}", f"--cert-dir={work / 'certs'}",
            f"--service-account-key-file={sa_pub}", f"--service-account-signing-key-file={sa_key}",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--token-auth-file={tokens}", "--authorization-mode=RBAC", "--endpoint-reconciler-type=none",
            *(["--insecure-port=0"] if minor < 24 else []),
        ], work / "kube-apiserver.log")  # fmt: skip
        self.http = urllib3.PoolManager(maxsize=32, cert_reqs="CERT_NONE")
        urllib3.disable_warnings()
        wait_for("kube-apiserver /readyz", lambda: self._ok(self.url + "/readyz", auth=True), 120,
                 interval=0.2, alive=self.apiserver.check)  # fmt: skip

    def _ok(self, url: str, auth: bool = False) -> bool:
        try:
            pool = self.http if hasattr(self, "http") else urllib3.PoolManager()
            headers = {"Authorization": f"Bearer {self.token}"} if auth else {}
            return bool(pool.request("GET", url, headers=headers, timeout=2, retries=False).status == 200)
        except Exception:
            return False

    def call(self, method: str, path: str, query: dict[str, Any] | None = None, body: Any = None,
             content_type: str = "application/json", stream: bool = False) -> Any:  # fmt: skip
        url = self.url + path + ("?" + urlencode(query) if query else "")
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        response = self.http.request(method, url, body=None if body is None else json.dumps(body).encode(),
                                     headers=headers, timeout=urllib3.Timeout(connect=5, read=60),
                                     preload_content=not stream, retries=False)  # fmt: skip
        if stream:
            return response
        return response.status, json.loads(response.data or b"{}")

    def ranges(self) -> float:
        text = self.http.request("GET", self.etcd_url + "/metrics").data.decode()
        return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                   if s.name in RANGE_METRICS)  # fmt: skip

    def stop(self) -> None:
        self.apiserver.stop()
        self.etcd.stop()


def populate(c: Cluster, pods: int, nodes: int) -> None:
    status, _ = c.call("POST", "/api/v1/namespaces", body={"metadata": {"name": NAMESPACE}})
    assert status == 201, status
    # No controller-manager: the namespace's default ServiceAccount, which admission looks up, by hand.
    status, _ = c.call(
        "POST", f"/api/v1/namespaces/{NAMESPACE}/serviceaccounts", body={"metadata": {"name": "default"}}
    )
    assert status == 201, status

    def one(i: int) -> None:
        body = {"metadata": {"name": f"p-{i:05d}", "annotations": {"probe": "0"}},
                "spec": {"nodeName": f"node-{i % nodes:03d}", "automountServiceAccountToken": False,
                         "containers": [{"name": "c0", "image": "registry.example/job:v1"}]}}  # fmt: skip
        for _ in range(10):
            status, doc = c.call("POST", f"/api/v1/namespaces/{NAMESPACE}/pods", body=body)
            if status in (201, 409):
                return
            time.sleep(0.5)
        raise RuntimeError(f"creating pod {i}: {status} {doc.get('message')}")

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(pods)))


def measure(c: Cluster, what: str, calls: int, one: Callable[[], None]) -> dict[str, Any]:
    one()  # warm the connection and the path
    ranges, api, etcd = c.ranges(), cpu_seconds(c.apiserver.pid), cpu_seconds(c.etcd.pid)
    walls = []
    for _ in range(calls):
        started = time.perf_counter()
        one()
        walls.append(time.perf_counter() - started)
    # The /metrics read itself is one more HTTP request to etcd, not a range.
    return {"read": what, "calls": calls, "wall_ms_p50": 1000 * statistics.median(walls),
            "apiserver_cpu_ms": 1000 * (cpu_seconds(c.apiserver.pid) - api) / calls,
            "etcd_cpu_ms": 1000 * (cpu_seconds(c.etcd.pid) - etcd) / calls,
            "etcd_ranges": (c.ranges() - ranges) / calls}  # fmt: skip


def pods_path() -> str:
    return "/api/v1/pods"


def probe(c: Cluster, args: argparse.Namespace) -> dict[str, Any]:
    node = "node-007"
    selector = {"fieldSelector": f"spec.nodeName={node}"}
    status, doc = c.call("GET", pods_path(), {**selector})
    assert status == 200, doc
    on_node = [p["metadata"]["name"] for p in doc["items"]]
    listed_rv = doc["metadata"]["resourceVersion"]

    def check(status: int, doc: dict[str, Any]) -> None:
        if status != 200:
            raise RuntimeError(f"{status}: {doc.get('message')}")

    cached = {**selector, "resourceVersion": listed_rv, "resourceVersionMatch": "NotOlderThan"}
    one_pod = f"/api/v1/namespaces/{NAMESPACE}/pods/{on_node[0]}"
    reads = [
        measure(c, "quorum list (no resourceVersion)", args.calls,
                lambda: check(*c.call("GET", pods_path(), selector))),
        measure(c, "cache list (NotOlderThan)", args.calls,
                lambda: check(*c.call("GET", pods_path(), cached))),
        measure(c, "get pod", args.calls, lambda: check(*c.call("GET", one_pod))),
    ]  # fmt: skip

    # read-your-write through the cache
    stale = 0
    for i in range(args.rounds):
        name = on_node[i % len(on_node)]
        value = f"ryw-{i}"
        status, doc = c.call("PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}",
                             body={"metadata": {"annotations": {"probe": value}}},
                             content_type="application/merge-patch+json")  # fmt: skip
        written = int(doc["metadata"]["resourceVersion"])
        status, doc = c.call("GET", pods_path(), {**selector, "resourceVersion": str(written),
                                                  "resourceVersionMatch": "NotOlderThan"})  # fmt: skip
        check(status, doc)
        seen = next(p for p in doc["items"] if p["metadata"]["name"] == name)
        if (
            seen["metadata"]["annotations"].get("probe") != value
            or int(doc["metadata"]["resourceVersion"]) < written
        ):
            stale += 1

    # the node-scoped watch delivers its own writes, in order
    status, doc = c.call("GET", pods_path(), selector)
    events: list[tuple[str, int, str]] = []
    response = c.call("GET", pods_path(), {**selector, "watch": "1", "allowWatchBookmarks": "true",
                                           "resourceVersion": doc["metadata"]["resourceVersion"],
                                           "timeoutSeconds": "60"}, stream=True)  # fmt: skip

    def read() -> None:
        with contextlib.suppress(urllib3.exceptions.HTTPError, OSError):  # the stream is shut at the end
            _read()

    def _read() -> None:
        buffer = b""
        for chunk in response.stream(4096):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                event = json.loads(line)
                meta = event["object"].get("metadata") or {}
                events.append((event["type"], int(meta.get("resourceVersion") or 0), meta.get("name", "")))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    time.sleep(0.5)
    writes = []
    for i in range(args.rounds):
        name = on_node[i % len(on_node)]
        status, doc = c.call("PATCH", f"/api/v1/namespaces/{NAMESPACE}/pods/{name}",
                             body={"metadata": {"annotations": {"probe": f"w-{i}"}}},
                             content_type="application/merge-patch+json")  # fmt: skip
        writes.append(int(doc["metadata"]["resourceVersion"]))
    wait_for("the watch's events", lambda: sum(1 for e in events if e[0] == "MODIFIED") >= len(writes), 30)
    response.shutdown() if hasattr(response, "shutdown") else response.release_conn()
    modified = [rv for kind, rv, _ in events if kind == "MODIFIED"]
    watch_ok = modified[: len(writes)] == writes

    # a pod list at NotOlderThan a later non-pod write, while no pod changes
    status, doc = c.call("POST", f"/api/v1/namespaces/{NAMESPACE}/configmaps",
                         body={"metadata": {"name": "ahead"}, "data": {"k": "v"}})  # fmt: skip
    ahead = doc["metadata"]["resourceVersion"]
    started = time.perf_counter()
    status, doc = c.call("GET", pods_path(), {**selector, "resourceVersion": ahead,
                                              "resourceVersionMatch": "NotOlderThan"})  # fmt: skip
    ahead_s = time.perf_counter() - started
    ahead_answer = f"{status} {doc.get('reason') or ''} {doc.get('message') or ''}".strip()[:160]
    return {"version": c.version, "pods": args.pods, "pods_on_node": len(on_node), "reads": reads,
            "read_your_write": f"{args.rounds - stale}/{args.rounds} fresh",
            "watch": f"{len(writes)} patches, events in order with the replies' resourceVersions: {watch_ok}",
            "ahead_of_pods": f"{ahead_s:.2f} s, {ahead_answer if status != 200 else '200 OK'}"}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--k8s", required=True, help="a Kubernetes cache entry directory (with bin/)")
    parser.add_argument("--etcd", help="the etcd binary (default: the build's, else PATH)")
    parser.add_argument("--pods", type=int, default=2500)
    parser.add_argument("--nodes", type=int, default=50)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    bin_dir = Path(args.k8s) / "bin"
    etcd = args.etcd or (str(bin_dir / "etcd") if (bin_dir / "etcd").exists() else shutil.which("etcd"))
    if not etcd:
        parser.error("no etcd: pass --etcd or put one on PATH")
    work = Path(tempfile.mkdtemp(prefix="gpufleet-podlist-"))
    cluster = Cluster(bin_dir, etcd, work)
    try:
        populate(cluster, args.pods, args.nodes)
        result = probe(cluster, args)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
