"""Prometheus metrics in the text exposition format (0.0.4), standard library only.

A few counters, gauges and histograms per program do not justify a dependency on every GPU node.
Programs subclass `Metrics` to name their series (`HELP`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import ClassVar

Labels = tuple[tuple[str, str], ...]
GaugeSource = Callable[[], Iterable[tuple[str, str, Labels, float]]]

BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


def _key(labels: dict[str, str]) -> Labels:
    return tuple(sorted(labels.items()))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def series(name: str, labels: Labels, value: float) -> str:
    """One sample line of the text format: `name{k="v",...} value` (labels in the order given)."""
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    number = repr(float(value)) if value != int(value) else str(int(value))
    return f"{name}{{{body}}} {number}" if body else f"{name} {number}"


class Metrics:
    """Counters, gauges and histograms, thread-safe, plus gauge callbacks evaluated at scrape time."""

    HELP: ClassVar[dict[str, tuple[str, str]]] = {}  # name -> (type, help text)

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, dict[Labels, float]] = {}
        self._histograms: dict[str, dict[Labels, list[float]]] = {}
        self._gauges: list[GaugeSource] = []

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add to a counter."""
        key = _key(labels)
        with self._lock:
            series = self._values.setdefault(name, {})
            series[key] = series.get(key, 0.0) + amount

    def set(self, name: str, value: float, **labels: str) -> None:
        """Set a gauge."""
        with self._lock:
            self._values.setdefault(name, {})[_key(labels)] = value

    def get(self, name: str, **labels: str) -> float:
        """A counter's or gauge's current value (0 when never set)."""
        with self._lock:
            return self._values.get(name, {}).get(_key(labels), 0.0)

    def observe(self, name: str, value: float, **labels: str) -> None:
        """Record one observation (seconds) in a histogram."""
        key = _key(labels)
        with self._lock:
            # One count per bucket, then the +Inf count, then the sum.
            row = self._histograms.setdefault(name, {}).setdefault(key, [0.0] * (len(BUCKETS) + 2))
            for i, bound in enumerate(BUCKETS):
                if value <= bound:
                    row[i] += 1
            row[-2] += 1
            row[-1] += value

    def add_gauges(self, source: GaugeSource) -> None:
        """Register a callback yielding (name, help, labels, value) at each scrape."""
        self._gauges.append(source)

    def _header(self, name: str, default_kind: str) -> list[str]:
        kind, text = self.HELP.get(name, (default_kind, name))
        return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]

    def render(self) -> str:
        """All series as exposition text."""
        # A snapshot under the lock, formatted after it: the lock is shared with the hot paths (Allocate
        # counts under it), which must never wait for a scrape's string work.
        with self._lock:
            values = {name: list(series.items()) for name, series in self._values.items()}
            histograms = {
                name: [(labels, list(row)) for labels, row in series.items()]
                for name, series in self._histograms.items()
            }
        lines: list[str] = []
        for name in sorted(values):
            lines += self._header(name, "untyped")
            lines += [series(name, labels, v) for labels, v in sorted(values[name])]
        for name in sorted(histograms):
            lines += self._header(name, "histogram")
            for labels, row in sorted(histograms[name]):
                for bound, count in zip(BUCKETS, row, strict=False):
                    lines.append(series(f"{name}_bucket", (*labels, ("le", repr(bound))), count))
                lines.append(series(f"{name}_bucket", (*labels, ("le", "+Inf")), row[-2]))
                lines.append(series(f"{name}_count", labels, row[-2]))
                lines.append(series(f"{name}_sum", labels, row[-1]))
        seen: set[str] = set()
        for source in self._gauges:
            for name, text, labels, value in source():
                if name not in seen:
                    lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
                    seen.add(name)
                lines.append(series(name, labels, value))
        return "\n".join(lines) + "\n"
