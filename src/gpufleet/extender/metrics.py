"""Prometheus metrics for the extender, rendered in the text exposition format (0.0.4).

Standard library only: a few counters and two histograms do not justify a dependency. Gauges that
describe the cluster (GPUs, memory, reservations) are computed from the state at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

Labels = tuple[tuple[str, str], ...]

_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)

_HELP = {
    "gpufleet_extender_requests_total": ("counter", "HTTP requests by verb and status code."),
    "gpufleet_extender_request_seconds": ("histogram", "HTTP request handling time by verb."),
    "gpufleet_extender_filter_nodes_total": ("counter", "Nodes judged by filter, by outcome."),
    "gpufleet_extender_binds_total": ("counter", "Bind outcomes, by result and reason."),
    "gpufleet_extender_bind_seconds": ("histogram", "Bind time including API calls."),
    "gpufleet_extender_lock_conflicts_total": (
        "counter",
        "resourceVersion conflicts taking a node bind-lock.",
    ),
    "gpufleet_extender_recheck_replans_total": (
        "counter",
        "Binds whose GPUs changed on the re-check under the lock (the cache was behind).",
    ),
}


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _series(name: str, labels: Labels, value: float) -> str:
    body = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    number = repr(float(value)) if value != int(value) else str(int(value))
    return f"{name}{{{body}}} {number}" if body else f"{name} {number}"


class Metrics:
    """Counters and histograms, thread-safe, plus gauge callbacks evaluated at scrape time."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = {}
        self._histograms: dict[str, dict[Labels, list[float]]] = {}
        self._gauges: list[Callable[[], Iterable[tuple[str, str, Labels, float]]]] = []

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """Add to a counter."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            series = self._counters.setdefault(name, {})
            series[key] = series.get(key, 0.0) + amount

    def observe(self, name: str, seconds: float, **labels: str) -> None:
        """Record one duration in a histogram."""
        key = tuple(sorted(labels.items()))
        with self._lock:
            # Layout: one count per bucket, then +Inf count, then the sum.
            row = self._histograms.setdefault(name, {}).setdefault(key, [0.0] * (len(_BUCKETS) + 2))
            for i, bound in enumerate(_BUCKETS):
                if seconds <= bound:
                    row[i] += 1
            row[-2] += 1
            row[-1] += seconds

    def counter(self, name: str, **labels: str) -> float:
        """A counter's current value (tests and benchmarks)."""
        with self._lock:
            return self._counters.get(name, {}).get(tuple(sorted(labels.items())), 0.0)

    def add_gauges(self, source: Callable[[], Iterable[tuple[str, str, Labels, float]]]) -> None:
        """Register a callback yielding (name, help, labels, value) at each scrape."""
        self._gauges.append(source)

    def render(self) -> str:
        """The exposition text."""
        lines: list[str] = []
        with self._lock:
            for name in sorted(self._counters):
                kind, text = _HELP.get(name, ("counter", name))
                lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
                lines += [_series(name, labels, v) for labels, v in sorted(self._counters[name].items())]
            for name in sorted(self._histograms):
                kind, text = _HELP.get(name, ("histogram", name))
                lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
                for labels, row in sorted(self._histograms[name].items()):
                    for bound, count in zip(_BUCKETS, row, strict=False):
                        lines.append(_series(f"{name}_bucket", (*labels, ("le", repr(bound))), count))
                    lines.append(_series(f"{name}_bucket", (*labels, ("le", "+Inf")), row[-2]))
                    lines.append(_series(f"{name}_count", labels, row[-2]))
                    lines.append(_series(f"{name}_sum", labels, row[-1]))
        seen: set[str] = set()
        for source in self._gauges:
            for name, text, labels, value in source():
                if name not in seen:
                    lines += [f"# HELP {name} {text}", f"# TYPE {name} gauge"]
                    seen.add(name)
                lines.append(_series(name, labels, value))
        return "\n".join(lines) + "\n"
