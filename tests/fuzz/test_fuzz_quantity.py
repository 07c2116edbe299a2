"""Kubernetes quantities (gpufleet.quantity): exact where the apiserver is exact, bounded everywhere."""

from __future__ import annotations

from fractions import Fraction

import pytest
from budget import FUZZ, outcome, worst_case
from hypothesis import given
from hypothesis import strategies as st

from gpufleet.extender.request import RequestError, parse_pod
from gpufleet.quantity import (
    MAX_QUANTITY,
    MAX_QUANTITY_CHARS,
    QuantityError,
    QuantityTooLarge,
    parse_quantity,
)

DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
NANO = Fraction(1, 10**9)


def reference(sign: str, whole: str, frac: str, suffix: str) -> Fraction:
    """The quantity's value by plain exact arithmetic (small exponents only), rounded up to the nano."""
    value = Fraction(int(whole or "0")) + (Fraction(int(frac), 10 ** len(frac)) if frac else 0)
    if suffix in BINARY:
        value *= 2 ** BINARY[suffix]
    elif suffix in DECIMAL:
        value *= Fraction(10) ** DECIMAL[suffix]
    else:
        value *= Fraction(10) ** int(suffix[1:])
    nanos = value / NANO
    if nanos.denominator != 1:
        value = (nanos.numerator // nanos.denominator + 1) * NANO
    return -value if sign == "-" else value


suffixes = st.sampled_from([*DECIMAL, *BINARY]) | st.builds(
    lambda e, n: f"{e}{n}", st.sampled_from(["e", "E", "e+", "e-", "E-"]), st.integers(0, 40)
)


@FUZZ
@given(
    st.sampled_from(["", "+", "-"]),
    st.text("0123456789", max_size=25),
    st.none() | st.text("0123456789", max_size=15),
    suffixes,
)
def test_well_formed_quantities_match_exact_arithmetic(
    sign: str, whole: str, frac: str | None, suffix: str
) -> None:
    text = f"{sign}{whole}{'' if frac is None else '.' + frac}{suffix}"
    if not (whole or frac) or len(text) > MAX_QUANTITY_CHARS:
        with pytest.raises(QuantityError):
            parse_quantity(text)
        return
    expected = reference(sign, whole, frac or "", suffix)
    if abs(expected) >= MAX_QUANTITY:
        with pytest.raises(QuantityTooLarge):
            parse_quantity(text)
    else:
        assert parse_quantity(text) == expected


@FUZZ
@given(st.text(max_size=80) | st.binary(max_size=80).map(lambda b: b.decode("latin-1")))
def test_any_text_is_a_value_or_a_quantity_error(text: str) -> None:
    result = outcome((QuantityError,), parse_quantity, text)
    assert isinstance(result, QuantityError | Fraction)
    if isinstance(result, Fraction):
        assert abs(result) < MAX_QUANTITY and (result / NANO).denominator == 1


@FUZZ
@given(st.integers() | st.floats() | st.none() | st.booleans() | st.lists(st.integers(), max_size=3))
def test_any_json_value_is_a_value_or_a_quantity_error(value: object) -> None:
    assert isinstance(outcome((QuantityError,), parse_quantity, value), QuantityError | Fraction)


# The inputs of the review that found the stall (1e20000000 cost 19 s), the apiserver's canonical form of
# it, and the largest texts a body can carry.
@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("1e20000000", QuantityTooLarge),
        ("100e19999998", QuantityTooLarge),
        ("1e10000000", QuantityTooLarge),
        ("1e5000", QuantityTooLarge),
        (10**4000, QuantityTooLarge),
        ("1e-20000000", None),
        ("1e2147483648", QuantityError),
        ("1" * 3_000_000, QuantityTooLarge),
        ("9" * 3_000_000 + "x", QuantityTooLarge),
        ("0" * 3_000_000 + "x", QuantityError),
        ("1e" + "0" * 3_000_000 + "5", QuantityError),
        (" " * 3_000_000 + "1", None),
    ],
    ids=lambda v: str(v)[:16] if not isinstance(v, type) else v.__name__,
)
def test_worst_case_quantities_are_decided_within_the_budget(text: object, error: type | None) -> None:
    result = worst_case((QuantityError,), parse_quantity, text)
    if error is None:
        assert isinstance(result, Fraction) and 0 < result <= 1
    else:
        assert type(result) is error


def _pod(annotations: dict[str, str] | None = None, mem: str = "4") -> dict[str, object]:
    return {
        "metadata": {"name": "p", "uid": "u", "annotations": annotations or {}},
        "spec": {"containers": [{"name": "c", "resources": {"limits": {"gpufleet.io/gpu-mem": mem}}}]},
    }


@pytest.mark.parametrize(
    "pod",
    [
        _pod(mem="1e20000000"),
        _pod({"gpufleet.io/gpu-count": "9" * 1_000_000}),
        _pod({"gpufleet.io/gpu-count": "1" + " " * 100_000 + "x"}),
        _pod({"gpufleet.io/gpu-model": "a," * 100_000}),
        _pod({"gpufleet.io/gpu-prefer": "x" * 1_000_000}),
    ],
    ids=["quantity", "gpu-count-digits", "gpu-count-tail", "model-list", "prefer"],
)
def test_worst_case_pods_are_request_errors_within_the_budget(pod: dict[str, object]) -> None:
    result = worst_case((RequestError,), parse_pod, pod)
    assert isinstance(result, RequestError)
    assert len(str(result)) < 400, "the reason reaches the pod's events: it must not grow with the input"
