"""gpufleet.layered, the one layered-settings loader under the device plugin's config and the extender's
settings: its scalar parsers return their type or raise ValueError for any value, and merge lets the later
layer win and says which layer each value came from."""

from __future__ import annotations

import math
from typing import Any

import pytest
from budget import FUZZ, outcome
from hypothesis import given
from hypothesis import strategies as st
from strategies import JSON_VALUES

from gpufleet import layered
from gpufleet.deviceplugin import config as dpconfig
from gpufleet.extender import settings as extsettings

PARSERS = {
    "as_str": (layered.as_str, str),
    "as_bool": (layered.as_bool, bool),
    "as_int": (layered.as_int, int),
    "as_number": (layered.as_number, float),
    "int_in": (layered.int_in(-5, 5), int),
    "seconds": (layered.seconds(60.0), float),
    "choice": (layered.choice("a", "b"), str),
}


@FUZZ
@given(st.sampled_from(sorted(PARSERS)), st.one_of(JSON_VALUES, st.text(max_size=60)))
def test_each_scalar_parser_returns_its_type_or_raises_value_error(name: str, raw: Any) -> None:
    parse, kind = PARSERS[name]
    value = outcome((ValueError,), parse, raw)
    if isinstance(value, ValueError):
        return
    assert type(value) is kind, (name, raw, value)
    if kind is float:
        assert math.isfinite(value)


@pytest.mark.parametrize(
    ("parse", "raw", "expected"),
    [
        (layered.as_int, " 42 ", 42),
        (layered.as_int, 7.0, 7),
        (layered.as_number, "0.25", 0.25),
        (layered.as_bool, "On", True),
        (layered.as_str, 80, "80"),
        (layered.seconds(60.0), "1e1", 10.0),
    ],
)
def test_scalar_parsers_read_text_and_yaml_numbers(parse: Any, raw: Any, expected: Any) -> None:
    assert parse(raw) == expected


@pytest.mark.parametrize(
    ("parse", "raw", "message"),
    [
        (layered.as_int, "1234567890", "expected an integer"),  # ten digits: past the cheap-conversion cap
        (layered.as_int, True, "expected an integer"),
        (layered.as_int, math.inf, "expected an integer"),
        (layered.as_number, 10**400, "finite"),
        (layered.as_number, "1" * 33, "finite"),
        (layered.as_str, [1], "expected a string"),
        (layered.as_str, False, "expected a string"),
        (layered.int_in(0, 10), "11", "in [0, 10], got 11"),
        (layered.seconds(60.0), math.nan, "number > 0"),
        (layered.seconds(60.0), 10**400, "at most 60 seconds"),
        (layered.choice("a", "b"), "c", "one of a, b"),
    ],
)
def test_scalar_parsers_refuse_with_what_they_expected(parse: Any, raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse(raw)


LAYER_NAMES = ("file", "env", "flag")


@FUZZ
@given(
    st.lists(
        st.dictionaries(st.sampled_from(["a", "b", "c", "zz"]), st.integers(-9, 9)), min_size=3, max_size=3
    )
)
def test_merge_later_layer_wins_names_its_source_and_reports_unknown_settings(
    said: list[dict[str, int]],
) -> None:
    parsers = {"a": layered.as_int, "b": layered.int_in(0, 9), "c": layered.as_str}
    layers = [
        layered.Layer(name, {key: (value, f"{key} from {name}") for key, value in values.items()})
        for name, values in zip(LAYER_NAMES, said, strict=True)
    ]
    merged = layered.merge(parsers, layers)
    for key, parse in parsers.items():
        good = [(name, values[key]) for name, values in zip(LAYER_NAMES, said, strict=True)
                if key in values and not (key == "b" and values[key] < 0)]  # fmt: skip
        if good:
            name, raw = good[-1]
            assert merged.source[key] == name and merged.values[key] == parse(raw)
        else:
            assert key not in merged.values and key not in merged.source
    said_by = list(zip(LAYER_NAMES, said, strict=True))
    expected_errors = {f"zz from {name}: unknown setting" for name, values in said_by if "zz" in values}
    expected_errors |= {
        f"b from {name}: expected an integer in [0, 9], got {values['b']}"
        for name, values in said_by
        if values.get("b", 0) < 0
    }
    assert set(merged.errors) == expected_errors


def test_both_services_load_through_it() -> None:
    """One loader: the device plugin's settings and the extender's parse with gpufleet.layered's parsers."""
    scalar = {layered.as_str, layered.as_bool, layered.as_int, layered.as_number}
    assert set(extsettings.PARSERS.values()) - scalar == {extsettings._policy}
    dp = dpconfig.build(None, {"NODE_NAME": "n", "GPUFLEET_DP_HTTP_PORT": "9400"})
    assert dp.source == {"node_name": "env", "http.port": "env"}
    ext = extsettings.load_settings(None, env={"GPUFLEET_EXTENDER_PORT": "9000"}, flags={"port": "9001"})
    assert ext.port == 9001
