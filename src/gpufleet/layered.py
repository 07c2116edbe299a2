"""Layered settings, the one loader under the device plugin's config and the extender's settings.

Sources, later ones winning: defaults < a YAML file < environment variables < command-line flags. A service
names its settings and gives each a parser (a function from a raw value to the typed value that raises
ValueError); a :class:`Layer` is what one source says, ``{setting: (raw value, where it was read)}``.
:func:`merge` parses every value with its setting's parser and returns the values, the layer each came
from, and every problem at once, each line naming its source and the setting. Cross-setting rules stay with
each service.

The scalar parsers refuse what would cost time or lose meaning: a digit string longer than nine digits
(``int()`` is quadratic in the digits), number text longer than 32 characters, booleans where numbers or
strings are expected, non-finite numbers, and anything that is not a scalar (a YAML alias bomb is refused
before it is walked). Values in messages go through reprlib: an alias bomb is small as a file and endless
as a repr.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

Parser = Callable[[Any], Any]

INT_TEXT = re.compile(r"\s*[+-]?[0-9]{1,9}\s*")  # int() of a long digit string costs quadratic time
NUMBER_TEXT_MAX = 32  # characters; a number of seconds or MiB needs a handful
_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def as_str(v: Any) -> str:
    """A scalar as text (YAML reads ``port: 80`` as an int; a string setting takes it as "80")."""
    if not (isinstance(v, str) or _number(v)):
        raise ValueError(f"expected a string, got {type(v).__name__}")
    return str(v)


def as_bool(v: Any) -> bool:
    """A YAML boolean, or true/false, 1/0, yes/no, on/off in text."""
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.lower() in _TRUE | _FALSE:
        return v.lower() in _TRUE
    raise ValueError(f"expected true or false, got {reprlib.repr(v)}")


def as_int(v: Any) -> int:
    """An int, a float with an integral value, or text of at most nine digits."""
    if isinstance(v, str) and INT_TEXT.fullmatch(v):
        return int(v)
    if isinstance(v, float) and v.is_integer():  # False for inf and NaN
        return int(v)
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise ValueError(f"expected an integer, got {reprlib.repr(v)}")


def int_in(lo: int, hi: int) -> Parser:
    """Parser of an integer in [lo, hi]."""

    def parse(v: Any) -> int:
        n = as_int(v)
        if not lo <= n <= hi:
            raise ValueError(f"expected an integer in [{lo}, {hi}], got {n}")
        return n

    return parse


def _float(v: Any) -> float:
    """``float(v)`` of a number or short text; an int beyond the float range is infinite; NaN when v is no
    number at all."""
    if not (_number(v) or (isinstance(v, str) and len(v) <= NUMBER_TEXT_MAX)):
        return math.nan
    try:
        return float(v)
    except OverflowError:
        return math.inf
    except ValueError:
        return math.nan


def as_number(v: Any) -> float:
    """A finite number (an int or float, or short text)."""
    x = _float(v)
    if not math.isfinite(x):
        raise ValueError(f"expected a finite number, got {reprlib.repr(v)}")
    return x


def seconds(maximum: float) -> Parser:
    """Parser of a number of seconds > 0 and at most ``maximum``."""

    def parse(v: Any) -> float:
        x = _float(v)
        if not x > 0:  # NaN too
            raise ValueError(f"expected a number > 0, got {reprlib.repr(v)}")
        if not x <= maximum:
            raise ValueError(f"expected a number > 0 and at most {maximum:g} seconds, got {reprlib.repr(v)}")
        return x

    return parse


def choice(*options: str) -> Parser:
    """Parser of one of ``options``, exactly."""

    def parse(v: Any) -> str:
        if not isinstance(v, str) or v not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {reprlib.repr(v)}")
        return v

    return parse


@dataclass(frozen=True)
class Layer:
    """What one source says: its name (``file``, ``env``, ``flag``) and ``{setting: (raw, where)}``."""

    name: str
    values: Mapping[str, tuple[Any, str]]


@dataclass
class Merged:
    """The parsed values by setting, the layer each came from, and every problem found."""

    values: dict[str, Any] = field(default_factory=dict)
    source: dict[str, str] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


def merge(parsers: Mapping[str, Parser], layers: Sequence[Layer]) -> Merged:
    """Parse each layer's values in order, later layers winning. A value that does not parse is an error
    ``<where>: <why>``; so is a setting no parser knows (``<where>: unknown setting``)."""
    out = Merged()
    for layer in layers:
        for name, (raw, where) in layer.values.items():
            parse = parsers.get(name)
            if parse is None:
                out.errors.append(f"{where}: unknown setting")
                continue
            try:
                out.values[name] = parse(raw)
            except ValueError as exc:
                out.errors.append(f"{where}: {exc}")
                continue
            out.source[name] = layer.name
    return out


__all__ = [
    "INT_TEXT",
    "NUMBER_TEXT_MAX",
    "Layer",
    "Merged",
    "Parser",
    "as_bool",
    "as_int",
    "as_number",
    "as_str",
    "choice",
    "int_in",
    "merge",
    "seconds",
]
