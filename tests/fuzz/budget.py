"""The fuzz harness's shared settings and its one cost bound.

Property tests run a bounded number of examples (`FUZZ`), never time them, and never write hypothesis's
example database into the checkout. Only explicitly constructed worst cases (megabyte strings, deep
nesting, huge lists) go through :func:`worst_case`, whose wall bound is deliberately generous: it tells a
parser that caps its input (microseconds to milliseconds) from one that does not (seconds to forever), and
nothing finer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, settings

WORST_CASE_BUDGET_S = 1.0  # per worst-case input; capped parsers need milliseconds on a busy 2-core box

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
"""Settings for every property test of this folder."""

FUZZ_SLOW = settings(FUZZ, max_examples=50)
"""For properties whose example costs a round trip (gRPC, a file write)."""


def outcome(errors: tuple[type[BaseException], ...], fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`'s value, or the exception if it is one of `errors`; any other exception propagates."""
    try:
        return fn(*args)
    except errors as exc:
        return exc


def worst_case(errors: tuple[type[BaseException], ...], fn: Callable[..., Any], *args: Any) -> Any:
    """:func:`outcome` of one constructed worst case, failing if it takes over WORST_CASE_BUDGET_S."""
    started = time.perf_counter()
    result = outcome(errors, fn, *args)
    took = time.perf_counter() - started
    assert took < WORST_CASE_BUDGET_S, f"{getattr(fn, '__qualname__', fn)} took {took:.2f}s on a worst case"
    return result
