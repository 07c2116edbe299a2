"""Calls into NVML under a deadline per GPU: a call that does not return holds up nobody else.

``Sampler.round(keys)`` reads the GPUs one after another on a worker thread. A watchdog (the caller's
thread) gives each GPU ``gpu_timeout_s``: a read that has not returned by then is abandoned together with
its worker thread (an NVML call cannot be interrupted), the GPU is marked hung, and a fresh worker carries
on with the next GPU. A hung GPU is left out of later rounds until its call returns, so each hung GPU holds
at most one thread. The telemetry's rounds (telemetry/collector.py) and the health probes (rm/manager.py)
both run through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpufleet.logs import log_event

K = TypeVar("K")  # what identifies a GPU (its UUID)
S = TypeVar("S")  # a sample


@dataclass(frozen=True)
class Outcome(Generic[S]):
    """The latest word on one GPU: its last good sample (None: none to serve) and, when it is not
    being read right now, why."""

    sample: S | None
    taken: float  # monotonic time of the sample (0 without one)
    problem: str = ""  # "" when the last read succeeded


@dataclass
class _Worker(Generic[K, S]):
    """Reads `keys` in order; publishes each result unless the watchdog gave up on it."""

    keys: Sequence[K]
    read: Callable[[K], S]
    done: Callable[[K, S | None, str, float], None]
    late: Callable[[K, float], None]
    cond: threading.Condition
    name: str  # the thread's name
    position: int = -1
    started: float = 0.0  # monotonic start of the current read
    reading: bool = False  # a read is in progress (the deadline runs only then)
    finished: bool = False
    abandoned: bool = False
    thread: threading.Thread = field(init=False)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def _run(self) -> None:
        for i, key in enumerate(self.keys):
            with self.cond:
                self.position, self.started, self.reading = i, time.monotonic(), True
                self.cond.notify_all()
            sample: S | None = None
            problem = ""
            try:
                sample = self.read(key)
            except Exception as exc:  # any failure of one GPU's read is that GPU's problem only
                problem = str(exc) or type(exc).__name__
            took = time.monotonic() - self.started
            with self.cond:
                self.reading = False
                if self.abandoned:
                    self.late(key, took)
                    return
                self.done(key, sample, problem, took)
                self.cond.notify_all()
        with self.cond:
            self.finished = True
            self.cond.notify_all()


@dataclass(frozen=True)
class Wording:
    """What a Sampler's log lines say: events ``<name>_gpu_hung`` / ``<name>_gpu_answered`` and what
    happens next in each case; its worker threads are called ``gpufleet-<name>-read``."""

    name: str = "telemetry"
    when_hung: str = "series dropped once the last sample is too old; other GPUs go on"
    when_answered: str = "read again next round"


class Sampler(Generic[K, S]):
    """Runs rounds over GPUs: ``round(keys)`` reads each one under a deadline and returns the outcomes."""

    def __init__(self, read: Callable[[K], S], gpu_timeout_s: float, wording: Wording | None = None) -> None:
        self.read = read
        self.gpu_timeout_s = gpu_timeout_s
        self.wording = wording or Wording()
        self._cond = threading.Condition()
        self._outcomes: dict[K, Outcome[S]] = {}
        self._hung: dict[K, float] = {}  # GPU -> monotonic time its read started
        self.read_seconds: dict[K, float] = {}  # how long each GPU's last finished read took

    def hung(self) -> dict[K, float]:
        """GPUs whose read has not returned, with the monotonic time it started."""
        with self._cond:
            return dict(self._hung)

    def round(self, keys: Sequence[K]) -> dict[K, Outcome[S]]:
        """Read every GPU of `keys` (but those still hung); the outcome of each, hung ones included."""
        with self._cond:
            for gone in set(self._outcomes) - set(keys):
                del self._outcomes[gone]
            pending = [k for k in keys if k not in self._hung]
        while pending:
            worker = _Worker(
                pending, self.read, self._done, self._late, self._cond, f"gpufleet-{self.wording.name}-read"
            )
            worker.thread.start()
            pending = self._watch(worker)
        with self._cond:
            now = time.monotonic()
            for key, since in self._hung.items():
                if key in keys:
                    old = self._outcomes.get(key) or Outcome(None, 0.0)
                    why = (
                        f"NVML call has not returned for {now - since:.1f} s "
                        f"(deadline {self.gpu_timeout_s:g} s)"
                    )
                    self._outcomes[key] = Outcome(old.sample, old.taken, why)
            return {k: self._outcomes[k] for k in keys if k in self._outcomes}

    def _watch(self, worker: _Worker[K, S]) -> list[K]:
        """Wait for `worker`; the GPUs left to read when it overran a deadline (none when it finished)."""
        with self._cond:
            while not worker.finished:
                if worker.reading:
                    remaining = worker.started + self.gpu_timeout_s - time.monotonic()
                    if remaining <= 0:
                        worker.abandoned = True
                        key = worker.keys[worker.position]
                        self._hung[key] = worker.started
                        log_event(
                            f"{self.wording.name}_gpu_hung",
                            level="warning",
                            gpu=str(key),
                            deadline_s=self.gpu_timeout_s,
                            action=self.wording.when_hung,
                        )
                        return list(worker.keys[worker.position + 1 :])
                    self._cond.wait(remaining)
                else:
                    self._cond.wait(self.gpu_timeout_s)
            return []

    def _done(self, key: K, sample: S | None, problem: str, took: float) -> None:  # under the condition
        self.read_seconds[key] = took
        if sample is not None:
            self._outcomes[key] = Outcome(sample, time.monotonic())
        else:
            # A failed read (GPU lost, driver gone): no value of the last sample may be served as current.
            self._outcomes[key] = Outcome(None, 0.0, problem)

    def _late(self, key: K, took: float) -> None:  # under the condition
        self._hung.pop(key, None)
        log_event(
            f"{self.wording.name}_gpu_answered",
            gpu=str(key),
            after_s=round(took, 3),
            action=self.wording.when_answered,
        )
