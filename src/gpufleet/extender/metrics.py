"""The extender's Prometheus series; the registry itself is gpufleet.metrics."""

from __future__ import annotations

from typing import ClassVar

from gpufleet.metrics import Labels
from gpufleet.metrics import Metrics as BaseMetrics

__all__ = ["Labels", "Metrics"]


class Metrics(BaseMetrics):
    """The extender's series; cluster gauges are computed from the state at scrape time."""

    HELP: ClassVar[dict[str, tuple[str, str]]] = {
        "gpufleet_extender_requests_total": ("counter", "HTTP requests by verb and status code."),
        "gpufleet_extender_request_seconds": ("histogram", "HTTP request handling time by verb."),
        "gpufleet_extender_filter_nodes_total": ("counter", "Nodes judged by filter, by outcome."),
        "gpufleet_extender_binds_total": ("counter", "Bind outcomes, by result and reason."),
        "gpufleet_extender_bind_seconds": ("histogram", "Bind time including API calls."),
        "gpufleet_extender_lock_conflicts_total": (
            "counter",
            "resourceVersion conflicts taking a node bind-lock.",
        ),
        "gpufleet_extender_lock_waits_total": (
            "counter",
            "Binds that waited for another pod's GPU-memory hand-off on the node to release its bind-lock.",
        ),
        "gpufleet_extender_filter_waits_total": (
            "counter",
            "Filters that waited for a node's queue of hand-offs to shorten (filter_wait).",
        ),
        "gpufleet_extender_requeues_total": (
            "counter",
            "Refused binds whose pod got gpufleet.io/bind-refused, so the scheduler retries it soon.",
        ),
        "gpufleet_extender_reservations_refused_total": (
            "counter",
            "Filters refused because the reservation table was at max_reservations.",
        ),
        "gpufleet_extender_recheck_replans_total": (
            "counter",
            "Binds whose GPUs changed on the re-check under the lock (the cache was behind).",
        ),
    }
