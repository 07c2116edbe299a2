"""Hypothesis strategies shared by the fuzz tests: JSON and YAML-ish values, hostile text."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

# Numbers a hostile writer picks: edges of every integer width, huge, negative, non-finite.
EDGE_INTS = st.sampled_from([0, -1, 1, 2**31 - 1, 2**31, 2**63, -(2**63), 10**100, 10**4000])
EDGE_FLOATS = st.sampled_from([0.0, -0.0, 0.5, -1.5, 1e308, -1e308, 1e-320, float("inf"), float("-inf")])
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    EDGE_INTS,
    st.floats(allow_nan=True, allow_infinity=True),
    EDGE_FLOATS,
    st.text(max_size=40),
)
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=10,
)
"""Any JSON value, NaN and Infinity included (Python's json reads and writes them)."""

HOSTILE_TEXT = st.one_of(
    st.text(),
    st.text(alphabet=st.sampled_from('[]{}",:0123456789.-+eE \n\t\\uNaInfity'), max_size=200),
    st.builds(json.dumps, JSON_VALUES),
)
"""Strings: arbitrary unicode, JSON-ish punctuation soup, and well-formed JSON of any shape."""


def maybe(value: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """The value, or any other JSON value in its place."""
    return st.one_of(value, JSON_VALUES)


# A billion laughs: nine levels of nine aliases, about 3e8 leaves once expanded, under 1 KiB as text.
LAUGHS = "".join(
    f"l{n}: &l{n} [{', '.join([f'*l{n - 1}'] * 9) if n else ', '.join(['lol'] * 9)}]\n" for n in range(9)
)
# The same as nested mappings, which a loader that walks mappings would expand.
MAPPING_LAUGHS = "".join(
    f"m{n}: &m{n} {{{', '.join(f'k{k}: *m{n - 1}' if n else f'k{k}: lol' for k in range(9))}}}\n"
    for n in range(9)
)
