"""Kubernetes resource quantities ("4", "1500m", "2Ki", "1e3", "100e19999998"), parsed in bounded work.

The grammar is apimachinery's (`<signedNumber><suffix>`, suffix one of the binary SI `Ki`…`Ei`, the
decimal SI `n u m "" k M G T P E`, or a decimal exponent `e`/`E` with a signed integer). The apiserver
accepts a pod asking `1e20000000` and stores it as `100e19999998`; an exact parser that raises ten to that
power holds the interpreter for seconds while every scheduling decision waits. This one never does
arithmetic whose size the input chooses:

- texts longer than :data:`MAX_QUANTITY_CHARS` are refused unread; shorter ones cost one regular-expression
  match and integer arithmetic on at most :data:`_KEPT_DIGITS` digits;
- a value of :data:`MAX_QUANTITY` or more raises :class:`QuantityTooLarge`, decided from the position of
  the first significant digit and the exponent, before any number is built;
- like the apiserver, precision stops at the nano scale: a value with digits below 10^-9 (after any binary
  suffix is applied) is rounded up, away from zero, to the next nano, so `1e-20000000` is `1n`, not a
  number with twenty million digits.

Pure and stdlib only: the extender (pod requests) and the device plugin both import it.
"""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import Any

MAX_QUANTITY = 2**63
"""Exclusive bound on a quantity's magnitude: int64, the apiserver's own scaled-integer range, and more GPUs
or GiB of GPU memory than any cluster has; a larger quantity asks for what no node offers."""
MAX_EXPONENT = 2**31 - 1
"""The apiserver keeps a quantity's decimal exponent in an int32; a larger `e` suffix is not a quantity."""
NANO_DIGITS = 9
MAX_QUANTITY_CHARS = 64
"""Longest quantity text read. The apiserver stores quantities in canonical form, and every value below
MAX_QUANTITY has one of at most 30 characters (28 digits at nano scale and a suffix); a longer text never
came from it, and rejecting it keeps even a failing match to a few dozen steps."""
"""Quantities are exact to 10^-9 (the apiserver's smallest scale, `n`); finer digits round up."""

# Integer digits of the largest value below MAX_QUANTITY; with the nano digits and the 60 more a binary
# suffix needs, every integer this module builds has at most _KEPT_DIGITS digits, whatever the input.
_MAX_DIGITS = len(str(MAX_QUANTITY))
_KEPT_DIGITS = _MAX_DIGITS + NANO_DIGITS + 60
_QUANTITY = re.compile(r"([+-]?)([0-9]*)(?:\.([0-9]*))?((?:[eE][+-]?[0-9]+)|[KMGTPE]i|[numkMGTPE]?)")
_TWENTY_DIGITS = re.compile(r"[1-9][0-9]{19}")
_NUMBER = re.compile(r"[+-]?([0-9]+(?:\.[0-9]*)?|\.[0-9]+)")
_DECIMAL_SI = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY_SI = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}


class QuantityError(ValueError):
    """The text is not a Kubernetes quantity."""


class QuantityTooLarge(QuantityError):
    """A well-formed quantity of MAX_QUANTITY or more: larger than anything a node can offer."""


def parse_quantity(value: Any) -> Fraction:
    """The exact value of a Kubernetes quantity (to the nano), in time linear in its length.

    Raises QuantityTooLarge from MAX_QUANTITY up, QuantityError for anything that is not a quantity.
    """
    if isinstance(value, str) and len(value) <= MAX_QUANTITY_CHARS:
        # The usual form: a cluster's pods ask for a handful of distinct quantities, each parsed once.
        return _parse_short_quantity(value)
    return _parse_quantity(value)


@functools.lru_cache(maxsize=1024)
def _parse_short_quantity(value: str) -> Fraction:
    return _parse_quantity(value)


def _parse_quantity(value: Any) -> Fraction:
    if isinstance(value, bool):
        raise QuantityError(f"quantity {value!r} is not a number")
    if isinstance(value, int):
        if not -MAX_QUANTITY < value < MAX_QUANTITY:
            raise QuantityTooLarge(f"quantity {preview(value)} is 2^63 or more")
        return Fraction(value)
    if not isinstance(value, str | float):
        raise QuantityError(f"quantity of type {type(value).__name__} is not a number")
    text = str(value).strip()
    if len(text) > MAX_QUANTITY_CHARS:
        # Only the head is read: twenty integer digits after the zeros already make 10^19 > 2^63.
        if _TWENTY_DIGITS.match(text[:MAX_QUANTITY_CHARS].lstrip("+-").lstrip("0")):
            raise QuantityTooLarge(f"quantity {preview(text)} is 2^63 or more")
        raise QuantityError(
            f"quantity {preview(text)} is longer than {MAX_QUANTITY_CHARS} characters; "
            "no canonical Kubernetes quantity is"
        )
    match = _QUANTITY.fullmatch(text)
    if not match or not (match.group(2) or match.group(3)):
        number = _NUMBER.match(text)
        if number and number.group(1) and number.end() < len(text):
            raise QuantityError(
                f"quantity {preview(text)} has an unknown suffix {preview(text[number.end() :])} "
                "(Ki Mi Gi Ti Pi Ei, n u m k M G T P E, or an exponent e<N>)"
            )
        raise QuantityError(f"quantity {preview(text)} is not a Kubernetes quantity")
    sign, whole, frac, suffix = match.groups()
    frac = frac or ""
    shift, binary = _suffix(suffix, text)
    # The value is int(digits) * 10^(shift - len(frac)) * 2^binary; drop zeros that carry no information.
    digits = (whole + frac).lstrip("0")
    if not digits:
        return Fraction(0)
    exponent = shift - len(frac)
    stripped = digits.rstrip("0")
    exponent += len(digits) - len(stripped)
    digits = stripped
    # Integer digits of the decimal part: len(digits) + exponent. From 20 on it is 10^19 > 2^63 (and a binary
    # suffix only grows it): too large, decided before any number is built.
    magnitude = len(digits) + exponent
    if magnitude > _MAX_DIGITS:
        raise QuantityTooLarge(f"quantity {preview(text)} is 2^63 or more")
    # Keep the digits that can matter at the nano once multiplied by 2^binary: 9 + binary fractional
    # digits (a nano boundary divided by 2^binary is a decimal with that many). Dropped digits are never
    # all zero (trailing zeros are gone), so the value lies strictly above the kept one.
    precision = NANO_DIGITS + binary
    keep = magnitude + precision
    if keep <= 0:
        kept, exponent, dropped = 0, -precision, True
    elif keep < len(digits):
        kept, exponent, dropped = int(digits[:keep]), -precision, True
    else:
        kept, dropped = int(digits), False
    # The value in nanos, rounded up as the apiserver rounds anything finer than its smallest scale.
    if exponent + NANO_DIGITS >= 0:
        nanos = (kept * 10 ** (exponent + NANO_DIGITS) << binary) + (1 if dropped else 0)
    else:
        nanos, rest = divmod(kept << binary, 10 ** -(exponent + NANO_DIGITS))
        nanos += 1 if rest or dropped else 0
    number = Fraction(nanos, 10**NANO_DIGITS)
    if number >= MAX_QUANTITY:
        raise QuantityTooLarge(f"quantity {preview(text)} is 2^63 or more")
    return -number if sign == "-" else number


def _suffix(suffix: str, text: str) -> tuple[int, int]:
    """(power of ten, power of two) a suffix multiplies by."""
    if suffix in _BINARY_SI:
        return 0, _BINARY_SI[suffix]
    if suffix in _DECIMAL_SI:
        return _DECIMAL_SI[suffix], 0
    body = suffix[1:]
    negative = body.startswith("-")
    body = body.lstrip("+-").lstrip("0") or "0"
    if len(body) > len(str(MAX_EXPONENT)) or int(body) > MAX_EXPONENT:
        raise QuantityError(f"quantity {preview(text)} has an exponent beyond the apiserver's int32")
    return (-int(body) if negative else int(body)), 0


def preview(value: Any, limit: int = 40) -> str:
    """A user-written value as error messages show it: repr cut short for text and numbers, the type's name
    for anything else, so that no message grows with the input or walks a deep structure."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"{value}" if value.bit_length() < 128 else f"an integer of {value.bit_length()} bits"
    elif isinstance(value, float | bool) or value is None:
        value = repr(value)
    elif not isinstance(value, str):
        return f"<{type(value).__name__}>"
    return repr(value if len(value) <= limit else f"{value[:limit]}… ({len(value)} characters)")
