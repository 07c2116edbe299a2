"""Sampling every GPU on a timer, with a deadline per GPU, off every request path.

Each tick of a ``Ticker`` runs a round of ``watchdog.Sampler`` (a deadline per GPU: a hung GPU is abandoned
with its worker thread and left out of later rounds until its call returns). Scrapes never wait for any of
this: they read the last finished round.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gpufleet.logs import log_event


class Ticker:
    """Calls `tick` every `interval_s` seconds on its own thread (the first call at once) until stopped."""

    def __init__(self, tick: Callable[[], None], interval_s: float, name: str) -> None:
        self.tick = tick
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.tick()
            except Exception as exc:  # a broken round must not end telemetry for good
                log_event("telemetry_round_failed", level="error", error=repr(exc))
            self._stop.wait(max(0.0, self.interval_s - (time.monotonic() - started)))
