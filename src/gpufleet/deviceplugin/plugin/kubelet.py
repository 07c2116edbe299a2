"""The kubelet dance: register on kubelet.sock, notice kubelet restarts, re-serve and re-register.

Restarts are noticed through inotify on the socket directory (ctypes, no dependency): a restarting kubelet
wipes the directory (our socket goes: IN_DELETE) and binds a new kubelet.sock (IN_CREATE), and both arrive
within milliseconds. A cheap stat of both sockets every few seconds backs it up, for the cases inotify
cannot see (queue overflow, the directory itself replaced, inotify unavailable).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import os
import struct

import grpc
from grpc import aio

from gpufleet.deviceplugin.api import KUBELET_SOCKET, VERSION, pb, pb_grpc
from gpufleet.deviceplugin.metrics import Metrics
from gpufleet.deviceplugin.plugin.server import PluginServer
from gpufleet.logs import log_event

IN_MOVED_FROM = 0x00000040
IN_MOVED_TO = 0x00000080
IN_CREATE = 0x00000100
IN_DELETE = 0x00000200
IN_DELETE_SELF = 0x00000400
IN_MOVE_SELF = 0x00000800
IN_Q_OVERFLOW = 0x00004000
IN_IGNORED = 0x00008000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_WATCH_MASK = IN_CREATE | IN_DELETE | IN_MOVED_TO | IN_MOVED_FROM | IN_DELETE_SELF | IN_MOVE_SELF
_EVENT = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then the name


class Inotify:
    """A non-blocking inotify watch on one directory."""

    def __init__(self, directory: str) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self.fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1 failed")
        if libc.inotify_add_watch(self.fd, os.fsencode(directory), _WATCH_MASK) < 0:
            err = ctypes.get_errno()
            os.close(self.fd)
            raise OSError(err, f"inotify_add_watch {directory} failed")

    def read(self) -> list[tuple[int, str]]:
        """Pending events as (mask, name); empty when none are queued."""
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        events, offset = [], 0
        while offset + _EVENT.size <= len(data):
            _wd, mask, _cookie, length = _EVENT.unpack_from(data, offset)
            raw = data[offset + _EVENT.size : offset + _EVENT.size + length]
            events.append((mask, raw.split(b"\0", 1)[0].decode(errors="replace")))
            offset += _EVENT.size + length
        return events

    def close(self) -> None:
        """Stop watching."""
        with contextlib.suppress(OSError):
            os.close(self.fd)


async def register(socket_dir: str, server: PluginServer, timeout_s: float = 5.0) -> None:
    """Register one plugin with the kubelet; raises grpc.aio.AioRpcError when the kubelet refuses."""
    request = pb.RegisterRequest(
        version=VERSION,
        endpoint=server.endpoint,
        resource_name=server.service.spec.name,
        options=pb.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
    )
    async with aio.insecure_channel("unix://" + os.path.join(socket_dir, KUBELET_SOCKET)) as channel:
        await pb_grpc.RegistrationStub(channel).Register(request, timeout=timeout_s)


class Supervisor:
    """Keeps every plugin server served and registered across kubelet restarts."""

    def __init__(
        self, servers: list[PluginServer], socket_dir: str, metrics: Metrics, resync_s: float = 5.0
    ) -> None:
        self.servers = servers
        self.socket_dir = socket_dir
        self.kubelet_socket = os.path.join(socket_dir, KUBELET_SOCKET)
        self.metrics = metrics
        self.resync_s = resync_s
        self.registered: dict[str, tuple[int, int] | None] = {s.endpoint: None for s in servers}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._lock = asyncio.Lock()
        self._inotify: Inotify | None = None
        self._changed = asyncio.Event()
        self.started = asyncio.Event()  # set once every server is serving for the first time

    @property
    def healthy(self) -> tuple[bool, str]:
        """(ok, why): every server serving and registered with the current kubelet."""
        missing = [s.endpoint for s in self.servers if not s.serving or self.registered[s.endpoint] is None]
        return (not missing, "ok" if not missing else f"not serving/registered: {', '.join(missing)}")

    async def run(self, stop: asyncio.Event) -> None:
        """Serve and register until `stop` is set; then stop serving and remove the sockets."""
        loop = asyncio.get_running_loop()
        try:
            for server in self.servers:
                await self._restart(server, "start")
            self._watch(loop)
            self.started.set()
            while not stop.is_set():
                self._changed.clear()
                waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._changed.wait())]
                await asyncio.wait(waiters, timeout=self.resync_s, return_when=asyncio.FIRST_COMPLETED)
                for w in waiters:
                    w.cancel()
                if stop.is_set():
                    break
                await self._on_wake(loop)
        finally:
            self._unwatch(loop)
            for task in self._tasks.values():
                task.cancel()
            for server in self.servers:
                await server.stop()
            log_event("stopped", sockets=",".join(s.path for s in self.servers))

    # ----- watching ---------------------------------------------------------------------------------

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self._inotify = Inotify(self.socket_dir)
        except OSError as exc:
            log_event(
                "inotify_unavailable",
                level="warning",
                error=str(exc),
                fallback=f"stat every {self.resync_s}s",
            )
            return
        loop.add_reader(self._inotify.fd, self._changed.set)

    def _unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._inotify is not None:
            loop.remove_reader(self._inotify.fd)
            self._inotify.close()
            self._inotify = None

    async def _on_wake(self, loop: asyncio.AbstractEventLoop) -> None:
        events = self._inotify.read() if self._inotify else []
        kubelet_new = any(m & (IN_CREATE | IN_MOVED_TO) and n == KUBELET_SOCKET for m, n in events)
        rewatch = any(m & (IN_DELETE_SELF | IN_MOVE_SELF | IN_IGNORED | IN_Q_OVERFLOW) for m, _ in events)
        if kubelet_new:
            self.metrics.inc("gpufleet_dp_kubelet_restarts_total")
            log_event("kubelet_restarted", socket=self.kubelet_socket)
        kubelet_ino = _inode(self.kubelet_socket)
        for server in self.servers:
            reason = ""
            if kubelet_new:
                reason = "kubelet.sock recreated"
            elif not server.socket_intact():
                reason = "plugin socket removed"
            elif (
                kubelet_ino is not None
                and kubelet_ino != self.registered[server.endpoint]
                and not self._busy(server)
            ):
                reason = "not registered with the current kubelet"
            if reason:
                await self._restart(server, reason)
        if rewatch:
            # The directory itself went away or events were lost: watch the (re-created) directory anew.
            self._unwatch(loop)
            self._watch(loop)

    def _busy(self, server: PluginServer) -> bool:
        task = self._tasks.get(server.endpoint)
        return task is not None and not task.done()

    # ----- serving and registering ----------------------------------------------------------------

    async def _restart(self, server: PluginServer, reason: str) -> None:
        async with self._lock:
            task = self._tasks.pop(server.endpoint, None)
            if task:
                task.cancel()
            self.registered[server.endpoint] = None
            if reason != "start":
                log_event("reserving", resource=server.service.spec.name, reason=reason)
            await server.stop(grace=0)
            await server.start()
            self._tasks[server.endpoint] = asyncio.create_task(self._register_loop(server))

    async def _register_loop(self, server: PluginServer) -> None:
        delay = 0.1
        while True:
            kubelet_ino = _inode(self.kubelet_socket)
            if kubelet_ino is None:
                # No kubelet yet: its socket's creation wakes us (inotify or the resync stat).
                log_event(
                    "kubelet_absent",
                    level="info",
                    socket=self.kubelet_socket,
                    resource=server.service.spec.name,
                )
                return
            try:
                await register(self.socket_dir, server)
            except grpc.aio.AioRpcError as exc:
                self.metrics.inc(
                    "gpufleet_dp_registrations_total", resource=server.service.spec.name, result="error"
                )
                log_event(
                    "register_failed",
                    level="warning",
                    resource=server.service.spec.name,
                    code=exc.code().name,
                    error=exc.details(),
                    retry_s=delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.registered[server.endpoint] = kubelet_ino
            self.metrics.inc(
                "gpufleet_dp_registrations_total", resource=server.service.spec.name, result="ok"
            )
            log_event(
                "registered",
                resource=server.service.spec.name,
                endpoint=server.endpoint,
                kubelet=self.kubelet_socket,
            )
            return


def _inode(path: str) -> tuple[int, int] | None:
    """A socket file's identity: inode plus change time, since a re-created file may reuse the inode."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_ino, st.st_ctime_ns)
