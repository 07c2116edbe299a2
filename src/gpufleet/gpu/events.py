"""GPU health events (XID errors, double-bit ECC errors, lost GPUs) from NVML event sets."""

from __future__ import annotations

import ctypes
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import suppress
from typing import Any, NamedTuple

from .device import Gpu
from .errors import NvmlError, NvmlGpuLost, NvmlNotSupported, NvmlTimeout
from .nvml import Nvml

XID = "xid"
DOUBLE_BIT_ECC = "double-bit-ecc"
GPU_LOST = "gpu-lost"

# XIDs an application causes (bad memory access, illegal instruction, ...) rather than the GPU; a
# device that reports them is still healthy. The NVIDIA device plugin skips the same set by default.
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
XID_FALLEN_OFF_BUS = 79
_GPU_IS_LOST = 15  # nvmlReturn_t, the code a GPU_LOST event carries


class HealthEvent(NamedTuple):
    """(GPU UUID, kind, code): the XID for XID events, GPU_IS_LOST (15) for lost GPUs, else NVML's eventData.

    NVML documents eventData as 0 for anything but XIDs, so an ECC event's code carries no count.
    """

    uuid: str
    kind: str  # XID, DOUBLE_BIT_ECC or GPU_LOST
    code: int

    @property
    def critical(self) -> bool:
        """Whether the event makes the GPU unhealthy (application-caused XIDs do not)."""
        return not (self.kind == XID and self.code in APPLICATION_XIDS)


def _address(handle: Any) -> int | None:
    # Handles are opaque pointers: their address identifies the GPU an event came from.
    return ctypes.cast(handle, ctypes.c_void_p).value


class HealthMonitor:
    """Watches GPUs for health events from the moment it is created: NVML delivers none from before.

    Use as a context manager inside `nvml_session()`; iterate `events(timeout)` as often as needed.
    """

    def __init__(self, nvml: Nvml, gpus: Sequence[Gpu] | None = None, wait_slice: float = 5.0) -> None:
        self._nvml = nvml
        self._wait_slice = wait_slice
        self._pending: deque[HealthEvent] = deque()
        self._lost: set[str] = set()
        self._uuids: dict[int, str] = {}
        self._by_handle: dict[int | None, str] = {}
        self._set: Any = None
        self.unsupported: list[str] = []  # UUIDs whose driver offers no health events at all
        if gpus is None:
            self._uuids = self._enumerate()
        for gpu in gpus or ():
            if gpu.uuid:
                self._uuids[gpu.index] = gpu.uuid
                if gpu.lost:
                    self._mark_lost(gpu.uuid)
        self._open()

    def _enumerate(self) -> dict[int, str]:
        """{index: UUID} of every GPU NVML can still name."""
        found = {}
        for index in range(self._nvml.count()):
            with suppress(NvmlGpuLost):  # no UUID to report it by; discovery lists it as lost
                handle = self._nvml.handle(index)
                found[index] = self._nvml.call(f"GPU {index}", self._nvml.nv.nvmlDeviceGetUUID, handle)
        return found

    def _open(self) -> None:
        """Create the event set and register every GPU not known to be lost."""
        nv, call = self._nvml.nv, self._nvml.call
        self._set = call("event set", nv.nvmlEventSetCreate)
        self._by_handle.clear()
        wanted = nv.nvmlEventTypeXidCriticalError | nv.nvmlEventTypeDoubleBitEccError
        for index, uuid in self._uuids.items():
            if uuid in self._lost:
                continue
            what = f"GPU {index}"
            try:
                handle = self._nvml.handle(index)
                try:
                    call(what, nv.nvmlDeviceRegisterEvents, handle, wanted, self._set)
                except NvmlNotSupported:
                    # GPUs without ECC refuse the whole mask; XIDs alone still tell most failures.
                    xid_only = nv.nvmlEventTypeXidCriticalError
                    call(what, nv.nvmlDeviceRegisterEvents, handle, xid_only, self._set)
            except NvmlGpuLost:
                self._mark_lost(uuid)
                continue
            except NvmlNotSupported:
                self.unsupported.append(uuid)
                continue
            self._by_handle[_address(handle)] = uuid

    def close(self) -> None:
        """Free the event set."""
        if self._set is not None:
            with suppress(NvmlError):
                self._nvml.call("event set", self._nvml.nv.nvmlEventSetFree, self._set)
            self._set = None

    def __enter__(self) -> HealthMonitor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _mark_lost(self, uuid: str) -> bool:
        if uuid in self._lost:
            return False
        self._lost.add(uuid)
        self._pending.append(HealthEvent(uuid, GPU_LOST, _GPU_IS_LOST))
        return True

    def _probe(self, uuids: Sequence[str]) -> list[str]:
        """Which of `uuids` answer GPU_IS_LOST now."""
        index_of = {uuid: index for index, uuid in self._uuids.items()}
        lost = []
        for uuid in uuids:
            try:
                handle = self._nvml.handle(index_of[uuid])
                self._nvml.call(uuid, self._nvml.nv.nvmlDeviceGetMemoryInfo, handle)
            except NvmlGpuLost:
                lost.append(uuid)
            except NvmlError:
                pass  # any other answer means the GPU is still on the bus
        return lost

    def _forget(self, uuids: Sequence[str]) -> None:
        """Report `uuids` as lost and stop watching them."""
        if [uuid for uuid in uuids if self._mark_lost(uuid)]:
            # An event set cannot unregister a device; a fresh one without the lost GPUs keeps the wait
            # from failing on them forever. Events raised in between these two calls are not seen.
            self.close()
            self._open()

    def _to_event(self, data: Any) -> HealthEvent | None:
        nv = self._nvml.nv
        uuid = self._by_handle.get(_address(data.device))
        if uuid is None:
            return None
        if data.eventType & nv.nvmlEventTypeXidCriticalError:
            return HealthEvent(uuid, XID, int(data.eventData))
        if data.eventType & nv.nvmlEventTypeDoubleBitEccError:
            return HealthEvent(uuid, DOUBLE_BIT_ECC, int(data.eventData))
        return None

    def events(self, timeout: float | None = None) -> Iterator[HealthEvent]:
        """Yield events as they come until `timeout` seconds have passed (None: forever)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        nv = self._nvml.nv
        while True:
            while self._pending:
                yield self._pending.popleft()
            remaining = self._wait_slice if deadline is None else deadline - time.monotonic()
            if remaining <= 0:
                return
            wait = min(remaining, self._wait_slice)
            if not self._by_handle:
                time.sleep(wait)  # nothing left to watch: every GPU is lost or unsupported
                continue
            try:
                wait_ms = max(1, int(wait * 1000))
                data = self._nvml.call("event wait", nv.nvmlEventSetWait_v2, self._set, wait_ms)
            except NvmlTimeout:
                continue
            except NvmlGpuLost:
                watched = list(self._by_handle.values())
                # When no GPU admits to being lost, NVML would not say which one went: treat all
                # watched GPUs as lost rather than keep scheduling work onto one that may be gone.
                self._forget(self._probe(watched) or watched)
                continue
            event = self._to_event(data)
            if event is None:
                continue
            if event.kind == XID and event.code == XID_FALLEN_OFF_BUS:
                # Before the yield: a consumer that takes one event and stops must not skip it. The
                # lost event this queues follows the XID on the next call.
                self._forget(self._probe([event.uuid]))
            yield event

    def next_event(self, timeout: float | None = None) -> HealthEvent | None:
        """The next event, or None when `timeout` seconds pass without one."""
        return next(self.events(timeout), None)
