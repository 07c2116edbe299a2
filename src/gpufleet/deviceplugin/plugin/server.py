"""The DevicePlugin gRPC service for one resource, served with grpc.aio on a unix socket.

asyncio rather than a thread pool: each ListAndWatch stream is a coroutine parked on a wake-up, so any
number of watchers cost no threads, and a client that stops reading stalls only its own stream (its
writes wait on HTTP/2 flow control) while Allocate keeps being answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from grpc import aio

from gpufleet.deviceplugin.api import HEALTHY, UNHEALTHY, pb, pb_grpc
from gpufleet.deviceplugin.metrics import Metrics
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions, gpu_response, mig_response
from gpufleet.deviceplugin.rm.devices import PluginDevice, ResourceKind, ResourceSpec
from gpufleet.deviceplugin.rm.errors import DeviceUnhealthy, InvalidRequest, NotReady, RequestError
from gpufleet.deviceplugin.rm.manager import ResourceManager
from gpufleet.deviceplugin.rm.preferred import PreferenceError
from gpufleet.logs import log_event

# More container requests than any pod could carry is a malformed or hostile request.
MAX_CONTAINER_REQUESTS = 256
# A gpu-mem Allocate hands the container over to this callable (the extender hand-off), in a thread:
# it talks to the API server.
MemoryAllocator = Callable[[list[str]], pb.ContainerAllocateResponse]

_CODES: dict[type[RequestError], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    DeviceUnhealthy: grpc.StatusCode.FAILED_PRECONDITION,
    NotReady: grpc.StatusCode.UNAVAILABLE,
}


def status_for(exc: RequestError) -> grpc.StatusCode:
    """The gRPC status for a refused request (hand-off failures are FAILED_PRECONDITION)."""
    for kind, code in _CODES.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.FAILED_PRECONDITION


class Wakeup:
    """Wakes every waiting ListAndWatch stream of one loop; callable from any thread."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.tick = 0
        self._event = asyncio.Event()

    def poke(self) -> None:
        """Thread-safe: schedule a wake-up on the loop."""
        self.loop.call_soon_threadsafe(self._bump)

    def _bump(self) -> None:
        self.tick += 1
        self._event.set()
        self._event = asyncio.Event()

    async def wait_after(self, tick: int) -> int:
        """Wait until a poke newer than `tick`; return the new tick."""
        while self.tick <= tick:
            await self._event.wait()
        return self.tick


def to_pb(devices: list[PluginDevice]) -> pb.ListAndWatchResponse:
    """Devices as the kubelet reads them (NUMA node in the topology when known)."""
    resp = pb.ListAndWatchResponse()
    for d in devices:
        dev = resp.devices.add(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY)
        if d.numa is not None and d.numa >= 0:
            dev.topology.nodes.add(ID=d.numa)
    return resp


class DevicePluginService(pb_grpc.DevicePluginServicer):
    """DevicePlugin for one resource; all device knowledge comes from the resource manager."""

    def __init__(
        self,
        spec: ResourceSpec,
        rm: ResourceManager,
        wakeup: Wakeup,
        opts: AllocateOptions,
        metrics: Metrics,
        memory_allocator: MemoryAllocator | None = None,
    ) -> None:
        self.spec = spec
        self.rm = rm
        self.wakeup = wakeup
        self.opts = opts
        self.metrics = metrics
        self.memory_allocator = memory_allocator
        self.streams = 0

    async def GetDevicePluginOptions(self, request: pb.Empty, context: Any) -> pb.DevicePluginOptions:
        """Options: GetPreferredAllocation is available, PreStartContainer is not needed."""
        return pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: pb.Empty, context: Any) -> AsyncIterator[pb.ListAndWatchResponse]:
        """The full list at once, then the full list after every change."""
        self.streams += 1
        self.metrics.set("gpufleet_dp_listandwatch_streams", self.streams, resource=self.spec.name)
        sent = -1
        try:
            while True:
                # Read the tick before the devices: a change landing in between still wakes us.
                tick = self.wakeup.tick
                version, devices = self.rm.devices(self.spec.name)
                if version != sent:
                    healthy = sum(d.healthy for d in devices)
                    self.metrics.set(
                        "gpufleet_dp_devices", healthy, resource=self.spec.name, health="healthy"
                    )
                    self.metrics.set(
                        "gpufleet_dp_devices",
                        len(devices) - healthy,
                        resource=self.spec.name,
                        health="unhealthy",
                    )
                    yield to_pb(devices)
                    sent = version
                await self.wakeup.wait_after(tick)
        finally:
            self.streams -= 1
            self.metrics.set("gpufleet_dp_listandwatch_streams", self.streams, resource=self.spec.name)

    async def GetPreferredAllocation(
        self, request: pb.PreferredAllocationRequest, context: Any
    ) -> pb.PreferredAllocationResponse:
        """Topology-aware choice per container (see rm.preferred)."""
        resp = pb.PreferredAllocationResponse()
        try:
            if len(request.container_requests) > MAX_CONTAINER_REQUESTS:
                raise PreferenceError(f"{len(request.container_requests)} container requests is too many")
            for creq in request.container_requests:
                available = list(dict.fromkeys(creq.available_deviceIDs))
                must = list(dict.fromkeys(creq.must_include_deviceIDs))
                self._check_preferred(available, must, creq.allocation_size)
                # In a thread: the search is combinatorial (bounded by the checks above), and the loop
                # keeps answering Allocate and ListAndWatch meanwhile.
                ids = await asyncio.to_thread(
                    self.rm.preferred, self.spec.name, available, must, creq.allocation_size
                )
                resp.container_responses.add(deviceIDs=ids)
                # The answer is advisory: logging it lets an operator (and the lab tests) compare it
                # with the devices the kubelet then passes to Allocate.
                log_event(
                    "preferred",
                    resource=self.spec.name,
                    size=creq.allocation_size,
                    available=len(creq.available_deviceIDs),
                    must_include=",".join(creq.must_include_deviceIDs[:8]) or None,
                    devices=",".join(ids[:8]),
                    count=len(ids),
                )
        except PreferenceError as exc:
            self.metrics.inc("gpufleet_dp_preferred_total", resource=self.spec.name, code="INVALID_ARGUMENT")
            log_event("preferred_refused", level="warning", resource=self.spec.name, error=str(exc))
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self.metrics.inc("gpufleet_dp_preferred_total", resource=self.spec.name, code="OK")
        return resp

    def _check_preferred(self, available: list[str], must: list[str], size: int) -> None:
        """Refuse, before any search, what no kubelet sends: more distinct IDs than the resource has devices
        (the search's cost grows with the square of the lists), more must-include devices than the size."""
        _, devices = self.rm.devices(self.spec.name)
        if len(available) > len(devices):
            raise PreferenceError(
                f"{len(available)} available device IDs but {self.spec.name} has only {len(devices)} devices"
            )
        if 0 < size < len(must):
            raise PreferenceError(f"{len(must)} must-include devices exceed allocation size {size}")

    async def Allocate(self, request: pb.AllocateRequest, context: Any) -> pb.AllocateResponse:
        """Per container: the GPUs' environment, device nodes, mounts (or the hand-off for GPU memory)."""
        started = time.perf_counter()
        granted: list[list[str]] = []
        try:
            resp = pb.AllocateResponse()
            if not request.container_requests:
                raise InvalidRequest("Allocate carries no container requests")
            if len(request.container_requests) > MAX_CONTAINER_REQUESTS:
                raise InvalidRequest(f"{len(request.container_requests)} container requests is too many")
            for n, creq in enumerate(request.container_requests):
                ids = list(creq.devices_ids)
                try:
                    resp.container_responses.append(await self._allocate_one(ids))
                except RequestError as exc:
                    raise type(exc)(f"container request {n}: {exc}") from exc
                granted.append(ids)
            # Logged once the answer is on its way: gRPC starts sending it as soon as this returns,
            # before the loop runs the next callback, so formatting and writing the lines (about half of
            # this handler's own time) is not part of the kubelet's wait.
            asyncio.get_running_loop().call_soon(self._log_allocated, granted)
            self._count_allocate("OK", started)
            return resp
        except RequestError as exc:
            # Containers before the refused one were answered (a GPU-memory hand-off is even recorded).
            self._log_allocated(granted)
            status = status_for(exc)
            log_event(
                "allocate_refused", level="warning", resource=self.spec.name, code=status.name, error=str(exc)
            )
            # Counted before the abort: the status can reach the caller before anything after it runs.
            self._count_allocate(status.name, started)
            await context.abort(status, str(exc))
            raise  # abort raises; this keeps type checkers aware that nothing is returned
        except Exception:
            self._log_allocated(granted)
            self._count_allocate("UNKNOWN", started)
            raise

    def _count_allocate(self, code: str, started: float) -> None:
        self.metrics.inc("gpufleet_dp_allocate_total", resource=self.spec.name, code=code)
        self.metrics.observe(
            "gpufleet_dp_allocate_seconds", time.perf_counter() - started, resource=self.spec.name
        )

    def _log_allocated(self, granted: list[list[str]]) -> None:
        for ids in granted:
            log_event("allocated", resource=self.spec.name, devices=",".join(ids[:8]), count=len(ids))

    async def _allocate_one(self, ids: list[str]) -> pb.ContainerAllocateResponse:
        if self.spec.kind is ResourceKind.MEMORY:
            # The units the kubelet picked only count GiB; which GPU the container gets is the
            # extender's decision, read from the pod (docs/handoff.md). Their health is irrelevant.
            self.rm.check_request(self.spec.name, ids, require_healthy=False)
            if self.memory_allocator is None:
                raise NotReady("GPU-memory hand-off is not configured")
            return await asyncio.to_thread(self.memory_allocator, ids)
        gpus = self.rm.check_request(self.spec.name, ids)
        if self.spec.kind is ResourceKind.MIG:
            return mig_response(self.rm.mig_devices(ids), self.opts)
        return gpu_response(gpus, self.opts)

    async def PreStartContainer(
        self, request: pb.PreStartContainerRequest, context: Any
    ) -> pb.PreStartContainerResponse:
        """Nothing to do before a container starts (the options say so; answer anyway)."""
        return pb.PreStartContainerResponse()


class PluginServer:
    """Serves one DevicePlugin on `socket_dir/<endpoint>`; can be stopped and started again."""

    def __init__(self, service: DevicePluginService, socket_dir: str) -> None:
        self.service = service
        self.socket_dir = socket_dir
        self.endpoint = service.spec.socket_name
        self.path = os.path.join(socket_dir, self.endpoint)
        self._server: aio.Server | None = None
        self.identity: tuple[int, int] | None = None  # (inode, ctime) of the socket we bound

    @property
    def serving(self) -> bool:
        """True while the socket is bound and served."""
        return self._server is not None

    async def start(self) -> None:
        """Bind the socket (replacing a stale one) and serve."""
        os.makedirs(self.socket_dir, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        server = aio.server(options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_DevicePluginServicer_to_server(self.service, server)
        if server.add_insecure_port("unix://" + self.path) == 0:
            raise OSError(f"cannot bind {self.path}")
        await server.start()
        self._server = server
        st = os.stat(self.path)
        self.identity = (st.st_ino, st.st_ctime_ns)
        log_event("serving", resource=self.service.spec.name, socket=self.path)

    async def stop(self, grace: float | None = 0.5) -> None:
        """Stop serving (streams end) and remove the socket if it is still ours."""
        server, self._server = self._server, None
        if server is not None:
            await server.stop(grace)
        if self.socket_intact():
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
        self.identity = None

    def socket_intact(self) -> bool:
        """Whether our socket file is still the one we bound (the kubelet wipes the directory)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        return self.identity == (st.st_ino, st.st_ctime_ns)
