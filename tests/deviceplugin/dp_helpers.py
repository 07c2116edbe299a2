"""Test doubles for the device plugin: a fake kubelet, a scripted device source, stream watchers."""

from __future__ import annotations

import asyncio
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc

from gpufleet.deviceplugin import config as configuration
from gpufleet.deviceplugin.api import KUBELET_SOCKET, pb, pb_grpc
from gpufleet.deviceplugin.app import App
from gpufleet.deviceplugin.rm.model import (
    GIB,
    GpuInfo,
    HealthEvent,
    NodeInventory,
    Probe,
    SourceUnavailable,
    TopologyLevel,
)

DEADLINE_S = 30.0  # generous: these waits never assert how long something took
REPO = Path(__file__).resolve().parents[2]


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = DEADLINE_S) -> Any:
    """Poll `predicate` until it returns something truthy; fail with `what` after the deadline."""
    end = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def short_dir(prefix: str = "dp") -> str:
    """A short temp dir: unix socket paths are limited to 107 bytes."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


# ----- device source ---------------------------------------------------------------------------------


def make_inventory(
    n: int = 4, memory_gib: int = 16, nvlink_pairs: Sequence[tuple[int, int, int]] = ()
) -> NodeInventory:
    """`n` GPUs, two per NUMA node, pairs (0,1), (2,3)… behind one PCIe switch, optional NVLinks."""
    uuids = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(n)]
    links: dict[int, dict[str, int]] = {i: {} for i in range(n)}
    for a, b, count in nvlink_pairs:
        links[a][uuids[b]] = count
        links[b][uuids[a]] = count
    gpus = tuple(
        GpuInfo(
            i,
            uuids[i],
            i,
            "NVIDIA Test GPU",
            memory_gib * GIB,
            (8, 0),
            i * 2 // n if n > 1 else 0,
            f"0000:{i + 1:02x}:00.0",
            links[i],
        )
        for i in range(n)
    )
    topology = {}
    for a in gpus:
        for b in gpus:
            if a.index != b.index:
                level = (
                    TopologyLevel.SINGLE
                    if a.index // 2 == b.index // 2
                    else TopologyLevel.NODE
                    if a.numa == b.numa
                    else TopologyLevel.SYSTEM
                )
                topology[(a.uuid, b.uuid)] = level
    return NodeInventory(gpus, topology, "535.261.03", 12020, 0)


class FakeEvents:
    def __init__(self, q: queue.Queue[HealthEvent]) -> None:
        self.q = q

    def wait(self, timeout_s: float) -> list[HealthEvent]:
        try:
            return [self.q.get(timeout=timeout_s)]
        except queue.Empty:
            return []

    def close(self) -> None:
        pass


class FakeSource:
    """A DeviceSource whose GPUs, events and probe answers the test scripts."""

    def __init__(self, inventory: NodeInventory | None = None, unavailable: str = "") -> None:
        self.inv = inventory or make_inventory()
        self.unavailable = unavailable
        self.events: queue.Queue[HealthEvent] = queue.Queue()
        self.unusable: dict[str, str] = {}

    def inventory(self) -> NodeInventory:
        if self.unavailable:
            raise SourceUnavailable(self.unavailable)
        return self.inv

    def open_events(self, uuids: Sequence[str]) -> FakeEvents:
        return FakeEvents(self.events)

    def probe(self, uuid: str) -> Probe:
        reason = self.unusable.get(uuid)
        return Probe(reason is None, reason or "")

    def close(self) -> None:
        pass


# ----- fake kubelet ----------------------------------------------------------------------------------


class FakeKubelet(pb_grpc.RegistrationServicer):
    """The kubelet's Registration service on `socket_dir/kubelet.sock`; records every request."""

    def __init__(self, socket_dir: str, refuse: str = "") -> None:
        self.socket_dir = socket_dir
        self.path = os.path.join(socket_dir, KUBELET_SOCKET)
        self.requests: list[pb.RegisterRequest] = []
        self.refuse = refuse
        self.server: grpc.Server | None = None

    def Register(self, request: pb.RegisterRequest, context: grpc.ServicerContext) -> pb.Empty:
        self.requests.append(request)
        if self.refuse:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.refuse)
        return pb.Empty()

    def start(self) -> FakeKubelet:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_RegistrationServicer_to_server(self, self.server)
        self.server.add_insecure_port("unix://" + self.path)
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server:
            self.server.stop(0).wait()
            self.server = None

    def restart(self) -> None:
        """What a kubelet restart does to the directory: wipe it, then bind a new kubelet.sock."""
        self.stop()
        for name in os.listdir(self.socket_dir):
            os.unlink(os.path.join(self.socket_dir, name))
        self.start()


# ----- running the plugin in-process -------------------------------------------------------------------


class _LoopThread:
    """One event loop for every in-process plugin of the test session: grpc.aio keeps process-wide
    state tied to the loop it first ran on, so a fresh loop per test is asking for trouble."""

    _instance: _LoopThread | None = None

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="test-loop", daemon=True).start()

    @classmethod
    def get(cls) -> asyncio.AbstractEventLoop:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance.loop


class RunningApp:
    """An App running on the shared test loop."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.loop = _LoopThread.get()
        self.stop_event: asyncio.Event | None = None
        self.future: Any = None

    async def _main(self) -> None:
        self.stop_event = asyncio.Event()
        await self.app.run(self.stop_event)

    def start(self) -> RunningApp:
        self.future = asyncio.run_coroutine_threadsafe(self._main(), self.loop)
        wait_for(lambda: self.future.done() or self.app.ready.is_set(), "the plugin to start")
        if self.future.done():
            self.future.result()  # raises what the app raised
        return self

    def stop(self) -> None:
        if self.stop_event is not None:
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self.future.result(DEADLINE_S)


def make_config(socket_dir: str, **overrides: Any) -> configuration.Config:
    base = configuration.build(environ={}, file_values={"socket_dir": socket_dir, "labels.enabled": False})
    return replace(base, **overrides)


@contextmanager
def running_plugin(cfg: configuration.Config, source: Any, **kwargs: Any) -> Iterator[RunningApp]:
    app = RunningApp(App(cfg, source=source, **kwargs)).start()
    try:
        yield app
    finally:
        app.stop()


def plugin_channel(socket_dir: str, endpoint: str) -> grpc.Channel:
    return grpc.insecure_channel("unix://" + os.path.join(socket_dir, endpoint))


class Watcher:
    """Reads a ListAndWatch stream in the background; keeps every list received."""

    def __init__(self, channel: grpc.Channel) -> None:
        self.stream = pb_grpc.DevicePluginStub(channel).ListAndWatch(pb.Empty())
        self.lists: list[dict[str, str]] = []
        self.topology: dict[str, list[int]] = {}
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            for resp in self.stream:
                self.topology = {d.ID: [n.ID for n in d.topology.nodes] for d in resp.devices}
                self.lists.append({d.ID: d.health for d in resp.devices})
        except grpc.RpcError:
            pass

    @property
    def latest(self) -> dict[str, str]:
        return self.lists[-1] if self.lists else {}

    def wait(self, predicate: Callable[[dict[str, str]], bool], what: str) -> dict[str, str]:
        return wait_for(lambda: self.lists and predicate(self.latest) and self.latest, what)

    def cancel(self) -> None:
        self.stream.cancel()


# ----- the simulator -----------------------------------------------------------------------------------


def materialize_sim(fixture: str, root: str) -> dict[str, str]:
    """A fresh sim root for `fixture`; returns the environment that points NVML at it."""
    from gpufleet_harness.sim import machine

    machine.materialize(fixture, root)
    return machine.sim_env(root)


def inject(root: str, *words: str) -> None:
    from gpufleet_harness.sim import control

    control.inject(root, list(words))


class PluginProcess:
    """`python -m gpufleet.deviceplugin` in a subprocess with a simulator environment."""

    def __init__(self, env: dict[str, str], args: Sequence[str]) -> None:
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        self.log_path = Path(tempfile.mkstemp(prefix="dp-log-", suffix=".txt")[1])
        self.log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpufleet.deviceplugin", *args],
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

        self._final: str | None = None

    def output(self) -> str:
        return self._final if self._final is not None else self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            return self.proc.wait(DEADLINE_S)
        finally:
            if self._final is None:
                self.log.close()
                self._final = self.log_path.read_text()
                self.log_path.unlink()
