"""The fuzz harness's shared settings and its one cost bound.

Property tests run a bounded number of examples (`FUZZ`), never time them, and never write hypothesis's
example database into the checkout. Only explicitly constructed worst cases (megabyte strings, deep
nesting, huge lists) go through :func:`worst_case`, whose bound is deliberately generous: it tells a
parser that caps its input (microseconds to milliseconds) from one that does not (seconds to forever), and
nothing finer. It bounds CPU seconds, not wall seconds (the parsing thread's, or the serving process's),
so other work on a shared machine does not count against the parser.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

WORST_CASE_BUDGET_S = 1.0  # CPU seconds per worst-case input; capped parsers need milliseconds

# The test command's runs draw the same examples every time (a CI run must not fail by the luck of the
# draw); GPUFLEET_FUZZ_EXPLORE=1 draws new ones each run, to look for bugs (docs/testing.md).
EXPLORE = bool(os.environ.get("GPUFLEET_FUZZ_EXPLORE"))

FUZZ = settings(
    max_examples=100,
    deadline=None,
    database=None,
    derandomize=not EXPLORE,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""Settings for every property test of this folder."""

FUZZ_SLOW = settings(FUZZ, max_examples=40)
"""For properties whose example costs a round trip (gRPC, a file write)."""


def outcome(errors: tuple[type[BaseException], ...], fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`'s value, or the exception if it is one of `errors`; any other exception propagates."""
    try:
        return fn(*args)
    except errors as exc:
        return exc


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds process `pid` has used (all its threads), from /proc."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime


def worst_case(
    errors: tuple[type[BaseException], ...], fn: Callable[..., Any], *args: Any, server_pid: int | None = None
) -> Any:
    """:func:`outcome` of one constructed worst case, failing if it costs over WORST_CASE_BUDGET_S of CPU:
    this thread's, or with `server_pid` that process's (the work happens there)."""
    clock = time.thread_time if server_pid is None else lambda: process_cpu_seconds(server_pid)
    started = clock()
    result = outcome(errors, fn, *args)
    took = clock() - started
    assert took < WORST_CASE_BUDGET_S, (
        f"{getattr(fn, '__qualname__', fn)} used {took:.2f} CPU s on a worst case"
    )
    return result
