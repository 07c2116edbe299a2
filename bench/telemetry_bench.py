"""GPU telemetry's cost on the simulator: scrape latency and CPU per scrape, CPU per collection round, and
Allocate latency with telemetry off and on.

    python bench/telemetry_bench.py [--runs 3] [--scrapes 500] [--rounds 50] [--allocs 1000] [FIXTURE ...]

Per fixture (default dgx-a100, 8 GPUs, and node-40-gpus) the plugin runs as its own process on a fresh sim
root, registered with this process playing the kubelet (deviceplugin_bench.plugin_session), with a fake
kubelet PodResources service that gives every GPU to a pod, so every series carries pod labels (the
largest text a node serves):

1. scrapes: telemetry every hour, i.e. one round at start and none while timing; `--scrapes` GETs of
   /metrics one after another, each on a new connection as Prometheus makes them to an HTTP/1.0 server.
   Latency at the client; the plugin's CPU over the loop (utime + stime of /proc/<pid>/stat, which keeps the
   time of the per-connection threads once they end) divided by the scrapes.
2. rounds: `--rounds` collection rounds back to back (Telemetry.tick: every GPU read through NVML, the
   fake kubelet asked over its socket, the text rendered) in a child process of their own, on the same sim
   root: wall time and CPU (getrusage of that process, every thread) per round.
3. Allocate p50/p99 (deviceplugin_bench.time_allocates) with telemetry off, then on at one round a second:
   Allocate makes no NVML call, and the rounds run on threads of their own.

Figures, not assertions. The machine is shared: look at the load printed with each row.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parent))
from deviceplugin_bench import ENDPOINT, free_port, percentile, plugin_session, run_fixtures, time_allocates

from gpufleet.deviceplugin.api import podresources_pb2 as pr
from gpufleet.deviceplugin.api import podresources_pb2_grpc as pr_grpc
from gpufleet_harness.sim import machine

TICK_S = os.sysconf("SC_CLK_TCK")
# Phase 2, run in a child pointed at the sim root (pynvml reads LD_LIBRARY_PATH once per process).
ROUNDS = """
import json, resource, sys, time
from gpufleet.deviceplugin.rm.nvml_source import NvmlDeviceSource
from gpufleet.deviceplugin.telemetry.exporter import Settings, Telemetry, nvml_reader
from gpufleet.deviceplugin.telemetry.pods import AssignmentCache, PodAttributor, PodResourcesClient
rounds, socket_path = int(sys.argv[1]), sys.argv[2]
source = NvmlDeviceSource()
inventory = source.inventory()
assignments = AssignmentCache(lambda namespace, name: None)
attribute = PodAttributor(PodResourcesClient(socket_path), {"gpufleet.io/gpu-mem"}, assignments)
read = nvml_reader(source.nvml)
telemetry = Telemetry(lambda: inventory, read, dict, attribute, "bench", Settings(1.0, 10.0))
telemetry.tick()  # NVML handles, the first connection, imports: not a round's cost
def cpu():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
started, before = time.perf_counter(), cpu()
for _ in range(rounds):
    telemetry.tick()
wall, spent = time.perf_counter() - started, cpu() - before
assert "pod=" in telemetry.render()
print(json.dumps({"round_wall_ms": 1000 * wall / rounds, "round_cpu_ms": 1000 * spent / rounds}))
"""


class Kubelet(pr_grpc.PodResourcesListerServicer):
    """PodResources v1: one pod per GPU, holding it whole."""

    def __init__(self, uuids: list[str]) -> None:
        self.response = pr.ListPodResourcesResponse(
            pod_resources=[
                pr.PodResources(
                    name=f"train-{n}",
                    namespace="bench",
                    containers=[
                        pr.ContainerResources(
                            name="main",
                            devices=[pr.ContainerDevices(resource_name="nvidia.com/gpu", device_ids=[uuid])],
                        )
                    ],
                )
                for n, uuid in enumerate(uuids)
            ]
        )

    def List(self, request: Any, context: grpc.ServicerContext) -> Any:
        return self.response


def cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads (ended ones too), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S


def get(url: str) -> bytes:
    with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(url, timeout=30) as response:
        return bytes(response.read())


def bench(fixture: str, scrapes: int, rounds: int, allocs: int) -> dict[str, float]:
    base = tempfile.mkdtemp(prefix="telb", dir="/tmp")
    root = os.path.join(base, "root")
    env = {**os.environ, **machine.sim_env(machine.materialize(fixture, root))}
    uuids = [g["uuid"] for g in sorted(machine.load_machine(root)["gpus"], key=lambda g: g["index"])]
    socket_path = os.path.join(base, "pod-resources.sock")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pr_grpc.add_PodResourcesListerServicer_to_server(Kubelet(uuids), server)
    server.add_insecure_port("unix://" + socket_path)
    server.start()
    out: dict[str, float] = {"gpus": len(uuids)}
    try:
        port = free_port()
        http = ["--http-port", str(port), "--http-address", "127.0.0.1", "--telemetry-pod-resources-socket",
                socket_path]  # fmt: skip
        url = f"http://127.0.0.1:{port}/metrics"

        # 1. scrapes, no rounds while timing
        with plugin_session(env, [*http, "--telemetry-interval", "3600"], ENDPOINT, uuids[0]) as (_, _, proc):
            text = get(url).decode()
            families = list(text_string_to_metric_families(text))
            out["series"] = sum(len(f.samples) for f in families)
            out["kib"] = len(text) / 1024
            idle_before = cpu_s(proc.pid)
            time.sleep(1.0)
            out["idle_cpu_ms_per_s"] = (cpu_s(proc.pid) - idle_before) * 1000
            times = []
            before = cpu_s(proc.pid)
            for _ in range(scrapes):
                start = time.perf_counter()
                get(url)
                times.append(time.perf_counter() - start)
            spent_ms = (cpu_s(proc.pid) - before) * 1000
            out["scrape_cpu_ms"] = (spent_ms - out["idle_cpu_ms_per_s"] * sum(times)) / scrapes
            out["scrape_p50_ms"] = statistics.median(times) * 1000
            out["scrape_p99_ms"] = percentile(times, 0.99) * 1000

        # 2. rounds back to back, in a process of their own
        child = subprocess.run([sys.executable, "-c", ROUNDS, str(rounds), socket_path], env=env,
                               capture_output=True, text=True, timeout=600, check=True)  # fmt: skip
        out.update(json.loads(child.stdout.splitlines()[-1]))

        # 3. Allocate with rounds running every second, then without telemetry
        with plugin_session(env, [*http, "--telemetry-interval", "1"], ENDPOINT, uuids[0]) as (stub, _, proc):
            on = time_allocates(stub, uuids, allocs, proc.pid)
        without = [*http, "--telemetry-enabled", "false"]
        with plugin_session(env, without, ENDPOINT, uuids[0]) as (stub, _, proc):
            off = time_allocates(stub, uuids, allocs, proc.pid)
        out.update(alloc_off_p50=off["alloc_p50_ms"], alloc_off_p99=off["alloc_p99_ms"],
                   alloc_on_p50=on["alloc_p50_ms"], alloc_on_p99=on["alloc_p99_ms"])  # fmt: skip
        return out
    finally:
        server.stop(0)
        shutil.rmtree(base, ignore_errors=True)


COLUMNS = (
    ("gpus", "GPUs", 4, "{:.0f}"),
    ("series", "series", 7, "{:.0f}"),
    ("kib", "text", 9, "{:.0f} KiB"),
    ("scrape_p50_ms", "scrape p50", 11, "{:.2f} ms"),
    ("scrape_p99_ms", "p99", 9, "{:.2f} ms"),
    ("scrape_cpu_ms", "CPU/scrape", 11, "{:.2f} ms"),
    ("round_wall_ms", "round", 9, "{:.1f} ms"),
    ("round_cpu_ms", "CPU/round", 10, "{:.1f} ms"),
    ("alloc_off_p50", "Alloc off p50", 13, "{:.3f} ms"),
    ("alloc_off_p99", "p99", 9, "{:.3f} ms"),
    ("alloc_on_p50", "on p50", 9, "{:.3f} ms"),
    ("alloc_on_p99", "p99", 9, "{:.3f} ms"),
)


def row(label: str, r: dict[str, float]) -> str:
    return f"{label:<16}" + " ".join(f"{fmt.format(r[key]):>{width}}" for key, _, width, fmt in COLUMNS)


def main() -> int:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("fixtures", nargs="*", default=["dgx-a100", "node-40-gpus"])
    parser.add_argument("--scrapes", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=50, help="collection rounds timed back to back")
    parser.add_argument("--allocs", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=1, help="runs per fixture; medians are printed too")
    args = parser.parse_args()
    print(f"{'':<16}" + " ".join(f"{header:>{width}}" for _, header, width, _ in COLUMNS))
    def measure(fixture: str) -> dict[str, float]:
        return bench(fixture, args.scrapes, args.rounds, args.allocs)

    run_fixtures(args.fixtures, args.runs, measure, row)
    print(f"load average after the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
