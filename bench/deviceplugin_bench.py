"""Device plugin benchmarks on the GPU simulator: Allocate latency, XID-to-Unhealthy latency, idle RSS.

    python bench/deviceplugin_bench.py [--allocs 2000] [--xids 20] [FIXTURE ...]

Each fixture (default: dgx-a100 and node-40-gpus) gets a fresh sim root, a fake kubelet, and the plugin as
a separate process (`python -m gpufleet.deviceplugin`), measured from this process over the unix socket.
Figures, not assertions: the issue's targets are Allocate p99 < 2 ms, health propagation median < 100 ms,
RSS < 60 MB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent import futures
from pathlib import Path

import grpc

from gpufleet.deviceplugin.api import KUBELET_SOCKET, pb, pb_grpc
from gpufleet.sim import control, machine

ENDPOINT = "gpufleet-nvidia.com-gpu.sock"


class Kubelet(pb_grpc.RegistrationServicer):
    """Just enough kubelet to be registered with."""

    def __init__(self) -> None:
        self.registered = threading.Event()

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.registered.set()
        return pb.Empty()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_side_p99(port: int) -> float:
    """Upper bound of the plugin's own Allocate p99, from its /metrics histogram buckets."""
    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP proxy
    with direct.open(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith("gpufleet_dp_allocate_seconds_bucket"):
            le = line.split('le="')[1].split('"')[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= 0.99 * total)


def bench(fixture: str, allocs: int, xids: int) -> dict[str, float]:
    base = tempfile.mkdtemp(prefix="dpb", dir="/tmp")
    root, sock = os.path.join(base, "root"), os.path.join(base, "sock")
    os.mkdir(sock)
    env = {**os.environ, **machine.sim_env(machine.materialize(fixture, root))}
    uuids = [g["uuid"] for g in sorted(machine.load_machine(root)["gpus"], key=lambda g: g["index"])]
    kubelet = Kubelet()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_RegistrationServicer_to_server(kubelet, server)
    server.add_insecure_port("unix://" + os.path.join(sock, KUBELET_SOCKET))
    server.start()
    log = open(os.path.join(base, "plugin.log"), "w")  # noqa: SIM115 - closed in finally
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gpufleet.deviceplugin",
            "--socket-dir",
            sock,
            "--health-probe-interval",
            "0.5",
            "--http-port",
            str(port),
            "--http-address",
            "127.0.0.1",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        if not kubelet.registered.wait(60):
            raise RuntimeError(f"plugin did not register; see {log.name}")
        stub = pb_grpc.DevicePluginStub(grpc.insecure_channel("unix://" + os.path.join(sock, ENDPOINT)))
        # Allocate latency, one GPU per call, round robin; warm up first.
        requests = [
            pb.AllocateRequest(container_requests=[pb.ContainerAllocateRequest(devices_ids=[u])])
            for u in uuids
        ]
        for r in requests * 5:
            stub.Allocate(r)
        times = []
        for n in range(allocs):
            start = time.perf_counter()
            stub.Allocate(requests[n % len(requests)])
            times.append(time.perf_counter() - start)
        server_p99 = server_side_p99(port)

        # XID -> Unhealthy at the client: a watcher notes when each GPU's health flips.
        seen: dict[str, str] = {}
        changed = threading.Condition()
        stream = stub.ListAndWatch(pb.Empty())

        def watch() -> None:
            try:
                for resp in stream:
                    with changed:
                        seen.clear()
                        seen.update({d.ID: d.health for d in resp.devices})
                        changed.notify_all()
            except grpc.RpcError:
                pass

        threading.Thread(target=watch, daemon=True).start()

        def wait_health(uuid: str, health: str) -> float:
            with changed:
                if not changed.wait_for(lambda: seen.get(uuid) == health, timeout=30):
                    raise RuntimeError(f"{uuid} never became {health}")
            return time.perf_counter()

        wait_health(uuids[0], "Healthy")
        latencies = []
        for n in range(xids):
            index = n % len(uuids)
            start = time.perf_counter()
            # `gpu N lost` raises XID 79 on the event set; `ok` lets the probe bring it back next round.
            control.inject(root, ["gpu", str(index), "lost"])
            latencies.append(wait_health(uuids[index], "Unhealthy") - start)
            control.inject(root, ["gpu", str(index), "ok"])
            wait_health(uuids[index], "Healthy")
        stream.cancel()
        time.sleep(2)  # idle
        return {
            "gpus": len(uuids),
            "alloc_p50_ms": statistics.median(times) * 1000,
            "alloc_p99_ms": percentile(times, 0.99) * 1000,
            "server_p99_le_ms": server_p99 * 1000,
            "xid_p50_ms": statistics.median(latencies) * 1000,
            "xid_max_ms": max(latencies) * 1000,
            "rss_mib": rss_mib(proc.pid),
        }
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()
        server.stop(0)
        shutil.rmtree(base, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("fixtures", nargs="*", default=["dgx-a100", "node-40-gpus"])
    parser.add_argument("--allocs", type=int, default=2000)
    parser.add_argument("--xids", type=int, default=20)
    args = parser.parse_args()
    print(
        f"{'fixture':<14} {'GPUs':>4} {'Allocate p50':>13} {'p99':>9} {'server p99 <=':>14} "
        f"{'XID->Unhealthy p50':>19} {'max':>9} {'idle RSS':>9}"
    )
    for fixture in args.fixtures:
        r = bench(fixture, args.allocs, args.xids)
        print(
            f"{fixture:<14} {r['gpus']:>4.0f} {r['alloc_p50_ms']:>10.3f} ms {r['alloc_p99_ms']:>6.3f} ms "
            f"{r['server_p99_le_ms']:>11.1f} ms {r['xid_p50_ms']:>16.1f} ms {r['xid_max_ms']:>6.1f} ms "
            f"{r['rss_mib']:>5.1f} MiB"
        )
    print(f"load average after the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
