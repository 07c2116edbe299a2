"""Hostile hand-off annotations and labels (gpufleet.handoff, gpufleet.extender.model): a value or a
ValueError, bounded cost, and nothing parsed that the writer could not have meant."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import pytest
from budget import FUZZ, outcome, worst_case
from hypothesis import given
from hypothesis import strategies as st
from strategies import HOSTILE_TEXT, JSON_VALUES, maybe

from gpufleet.extender.model import NodeInfo, model_tokens, node_info
from gpufleet.handoff import (
    ALLOCATED_ANNOTATION,
    BIND_LOCK_ANNOTATION,
    GPUS_ANNOTATION,
    MAX_ANNOTATION_BYTES,
    MAX_CC_PART,
    MAX_GPU_INDEX,
    MAX_GPU_MEMORY_GIB,
    Assignment,
    BindLock,
    ContainerAssignment,
    GpuEntry,
    format_gpus,
    label_value,
    parse_allocated,
    parse_cc,
    parse_gpus,
    product_label_value,
)

LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")

# ----- strategies ---------------------------------------------------------------------------------------

GPU_OBJECTS = st.fixed_dictionaries(
    {"uuid": maybe(st.text(min_size=1, max_size=20)), "memory_gib": maybe(st.integers(0, 200))},
    optional={
        "index": maybe(st.integers(0, 16)),
        "model": maybe(st.text(max_size=30)),
        "cc": maybe(st.sampled_from(["8.0", "9.0", "7.5", [8, 6], 8.6])),
        "numa": maybe(st.integers(-1, 3)),
        "healthy": maybe(st.booleans()),
        "nvlink": maybe(st.dictionaries(st.text(max_size=10), maybe(st.integers(0, 18)), max_size=4)),
    },
)
GPUS_ANNOTATIONS = st.one_of(HOSTILE_TEXT, st.builds(json.dumps, st.lists(maybe(GPU_OBJECTS), max_size=6)))
CONTAINERS = st.fixed_dictionaries(
    {},
    optional={
        "name": maybe(st.text(max_size=10)),
        "gpu_mem_gib": maybe(st.integers(0, 100)),
        "gpus": maybe(st.lists(maybe(st.text(max_size=10)), max_size=4)),
    },
)
ASSIGNMENTS = st.one_of(
    HOSTILE_TEXT,
    st.builds(
        json.dumps,
        st.fixed_dictionaries(
            {},
            optional={
                "node": maybe(st.text(max_size=10)),
                "containers": maybe(st.lists(maybe(CONTAINERS), max_size=4)),
                "ts": maybe(st.floats(0, 2e9)),
            },
        ),
    ),
)
LOCKS = st.one_of(
    HOSTILE_TEXT,
    st.builds(
        lambda uid, key, exp: f"{uid} {key} {exp}",
        st.text(max_size=10),
        st.text(max_size=10),
        st.one_of(st.integers(), st.floats(), st.text(max_size=12)),
    ),
)
VALID_ENTRIES = st.lists(
    st.builds(
        GpuEntry,
        index=st.integers(0, MAX_GPU_INDEX),
        uuid=st.text(min_size=1, max_size=20),
        model=st.text(max_size=30),
        memory_gib=st.integers(0, MAX_GPU_MEMORY_GIB),
        cc=st.tuples(st.integers(0, MAX_CC_PART), st.integers(0, MAX_CC_PART)),
        numa=st.none() | st.integers(0, 7),
        healthy=st.booleans(),
        nvlink=st.dictionaries(st.text(max_size=10), st.integers(1, 18), max_size=3).map(
            lambda d: tuple(sorted(d.items()))
        ),
    ),
    max_size=6,
    unique_by=lambda e: e.uuid,
)


def check_gpu(gpu: GpuEntry) -> None:
    """What every parsed GPU promises its readers."""
    assert isinstance(gpu.uuid, str) and gpu.uuid
    assert isinstance(gpu.model, str)
    assert type(gpu.index) is int and 0 <= gpu.index <= MAX_GPU_INDEX
    assert type(gpu.memory_gib) is int and 0 <= gpu.memory_gib <= MAX_GPU_MEMORY_GIB
    assert all(type(p) is int and 0 <= p <= MAX_CC_PART for p in gpu.cc)
    assert gpu.numa is None or type(gpu.numa) is int
    assert type(gpu.healthy) is bool
    assert all(isinstance(peer, str) and type(n) is int and n > 0 for peer, n in gpu.nvlink)


# ----- properties ---------------------------------------------------------------------------------------


@FUZZ
@given(GPUS_ANNOTATIONS)
def test_gpus_annotation_parses_or_raises_value_error(raw: str) -> None:
    result = outcome((ValueError,), parse_gpus, raw)
    if not isinstance(result, ValueError):
        for gpu in result:
            check_gpu(gpu)
        assert len({g.uuid for g in result}) == len(result)


@FUZZ
@given(VALID_ENTRIES)
def test_gpus_annotation_round_trips(entries: list[GpuEntry]) -> None:
    assert parse_gpus(format_gpus(entries)) == tuple(entries)


@FUZZ
@given(JSON_VALUES)
def test_any_json_value_in_place_of_an_annotation_string_is_a_value_error(value: Any) -> None:
    for parse in (parse_gpus, BindLock.parse, Assignment.from_json):
        if not isinstance(value, str):
            with pytest.raises(ValueError):
                parse(value)
    if value is not None and not isinstance(value, str):
        with pytest.raises(ValueError):
            parse_allocated(value)


@FUZZ
@given(JSON_VALUES)
def test_compute_capability_parses_or_raises_value_error(value: Any) -> None:
    result = outcome((ValueError,), parse_cc, value)
    if not isinstance(result, ValueError):
        assert all(type(p) is int and 0 <= p <= MAX_CC_PART for p in result)


@FUZZ
@given(LOCKS)
def test_bind_lock_parses_to_a_finite_expiry_or_raises_value_error(raw: str) -> None:
    result = outcome((ValueError,), BindLock.parse, raw)
    if not isinstance(result, ValueError):
        assert math.isfinite(result.expires) and result.expires >= 0
        assert "/" in result.pod_key and BindLock.parse(result.format()).pod_uid == result.pod_uid


@FUZZ
@given(ASSIGNMENTS)
def test_assignment_parses_or_raises_value_error(raw: str) -> None:
    result = outcome((ValueError,), Assignment.from_json, raw)
    if not isinstance(result, ValueError):
        assert isinstance(result.node, str) and math.isfinite(result.ts)
        for c in result.containers:
            assert isinstance(c.name, str) and type(c.gpu_mem_gib) is int and c.gpu_mem_gib >= 0
            assert all(isinstance(g, str) for g in c.gpus)
        assert all(type(gib) is int for gib in result.shares().values())
        assert Assignment.from_json(result.to_json()).containers == result.containers


@FUZZ
@given(st.text())
def test_allocated_names_are_non_empty_and_comma_free(raw: str) -> None:
    names = parse_allocated(raw)
    assert all(n and "," not in n for n in names)


@FUZZ
@given(st.text(), st.lists(st.text(), max_size=4))
def test_label_values_are_always_valid_kubernetes_label_values(text: str, models: list[str]) -> None:
    assert LABEL_VALUE.fullmatch(label_value(text))
    if models:
        assert LABEL_VALUE.fullmatch(product_label_value(models))


@FUZZ
@given(st.text())
def test_model_tokens_are_lowercase_alphanumeric(text: str) -> None:
    assert all(re.fullmatch(r"[0-9a-z]+", t) for t in model_tokens(text))


NODES = st.one_of(
    JSON_VALUES,
    st.fixed_dictionaries(
        {
            "metadata": maybe(
                st.fixed_dictionaries(
                    {"name": maybe(st.text(min_size=1, max_size=8))},
                    optional={
                        "labels": maybe(st.dictionaries(st.text(max_size=20), JSON_VALUES, max_size=3)),
                        "annotations": maybe(
                            st.fixed_dictionaries(
                                {},
                                optional={
                                    GPUS_ANNOTATION: maybe(GPUS_ANNOTATIONS),
                                    BIND_LOCK_ANNOTATION: maybe(LOCKS),
                                },
                            )
                        ),
                        "resourceVersion": JSON_VALUES,
                    },
                )
            )
        }
    ),
)


@FUZZ
@given(NODES)
def test_node_info_reads_any_node_object_or_raises_value_error(obj: Any) -> None:
    result = outcome((ValueError,), node_info, obj)
    if isinstance(result, NodeInfo):
        assert result.gpu_error is None or result.gpus == ()
        for gpu in result.gpus:
            check_gpu(gpu)
        assert result.lock is None or math.isfinite(result.lock.expires)


# ----- worst cases --------------------------------------------------------------------------------------

MIB = 1 << 20
WITHIN_CAP_GPUS = format_gpus(
    GpuEntry(i % 4096, f"GPU-{i:08d}", "NVIDIA A100-SXM4-80GB", 80, (8, 0), 0, True, (("GPU-x", 12),))
    for i in range(MAX_ANNOTATION_BYTES // 150)
)
WORST_CASES = {
    "deep array": (parse_gpus, "[" * 100_000),
    "deep object": (Assignment.from_json, '{"a":' * 100_000),
    "megabyte of spaces": (parse_gpus, " " * MIB),
    "million-element list": (parse_gpus, "[" + "0," * 1_000_000 + "0]"),
    "million-digit number": (parse_gpus, "9" * 1_000_000),
    "4299-digit numbers under the cap": (parse_gpus, "[" + ",".join(["9" * 4299] * 60) + "]"),
    "million-digit expiry": (BindLock.parse, "uid ns/p " + "9" * 1_000_000),
    "million-digit compute capability": (parse_cc, "9" * 1_000_000),
    "megabyte of commas": (parse_allocated, "," * MIB),
    "megabyte label value": (label_value, "a." * (MIB // 2)),
    "megabyte model tokens": (model_tokens, "a-" * (MIB // 2)),
}


@pytest.mark.parametrize("name", sorted(WORST_CASES))
def test_worst_case_inputs_cost_a_bounded_time(name: str) -> None:
    parse, raw = WORST_CASES[name]
    worst_case((ValueError,), parse, raw)


def test_largest_gpus_annotation_under_the_cap_parses_within_budget() -> None:
    assert len(WITHIN_CAP_GPUS) <= MAX_ANNOTATION_BYTES
    assert len(worst_case((), parse_gpus, WITHIN_CAP_GPUS)) == MAX_ANNOTATION_BYTES // 150


# ----- regressions (each was a crash, a hang or a lie before the fix) -----------------------------------


@pytest.mark.parametrize("raw", ["[" * 100_000, '[{"uuid":' * 5_000])
def test_deeply_nested_annotation_is_a_value_error_not_a_recursion_error(raw: str) -> None:
    with pytest.raises(ValueError, match="nested too deeply"):
        parse_gpus(raw)
    with pytest.raises(ValueError, match="nested too deeply"):
        Assignment.from_json(raw)


@pytest.mark.parametrize(
    "entry",
    [
        {"uuid": "a", "memory_gib": 1, "index": float("inf")},
        {"uuid": "a", "memory_gib": float("inf")},
        {"uuid": "a", "memory_gib": float("nan")},
        {"uuid": "a", "memory_gib": 1e300},
        {"uuid": "a", "memory_gib": 1, "index": 1e300},
        {"uuid": "a", "memory_gib": 1, "cc": [10**100, 0]},
        {"uuid": "a", "memory_gib": 1, "cc": [-1, 5]},
        {"uuid": "a", "memory_gib": 1, "model": ["not", "a", "name"]},
    ],
)
def test_non_finite_huge_or_mistyped_gpu_fields_are_refused(entry: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        parse_gpus(json.dumps([entry]))


@pytest.mark.parametrize("value", [5, None, ["x"], {"a": 1}, b"[]"])
def test_non_string_annotation_is_a_value_error(value: Any) -> None:
    for parse in (parse_gpus, BindLock.parse, Assignment.from_json):
        with pytest.raises(ValueError, match="not a string"):
            parse(value)


def test_allocated_annotation_that_is_not_a_string_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=ALLOCATED_ANNOTATION):
        parse_allocated(["c0"])  # type: ignore[arg-type]
    assert parse_allocated(None) == ()


@pytest.mark.parametrize("expiry", ["inf", "Infinity", "nan", "1e999", "-5", "1e9"])
def test_bind_lock_expiry_must_be_unix_seconds_never_infinite(expiry: str) -> None:
    with pytest.raises(ValueError, match="unix seconds"):
        BindLock.parse(f"uid ns/pod {expiry}")


def test_bind_lock_written_by_format_still_parses() -> None:
    assert BindLock.parse(BindLock("u", "ns/p", 1700000000.5).format()).expires == 1700000001.0
    assert BindLock.parse("u ns/p 1700000000.25").expires == 1700000000.25


@pytest.mark.parametrize("ts", ["Infinity", "NaN", "-1", "1e300"])
def test_assignment_timestamp_must_be_finite_unix_seconds(ts: str) -> None:
    with pytest.raises(ValueError):
        Assignment.from_json(f'{{"node": "n", "containers": [], "ts": {ts}}}')


def test_assignment_round_trip_survives_the_new_checks() -> None:
    a = Assignment("n", (ContainerAssignment("c", 4, ("GPU-a",)),), 1700000000.0)
    assert Assignment.from_json(a.to_json()) == a


# Arabic-Indic and fullwidth digits, which int() and \d accept.
@pytest.mark.parametrize("text", ["\u0668.\u0660", "\uff18.\uff10", "8.\u0660", "1" * 5000])
def test_compute_capability_in_non_ascii_or_endless_digits_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"MAJOR\.MINOR"):
        parse_cc(text)


def test_compute_capability_forms_still_accepted() -> None:
    assert [parse_cc(v) for v in ("8.6", "9", 8.6, [7, 5], (12, 0), " 10.0 ")] == [
        (8, 6),
        (9, 0),
        (8, 6),
        (7, 5),
        (12, 0),
        (10, 0),
    ]


def test_oversized_annotation_is_refused_before_it_is_parsed() -> None:
    raw = json.dumps([{"uuid": "a", "memory_gib": 1, "model": "x" * MAX_ANNOTATION_BYTES}])
    with pytest.raises(ValueError, match="limit"):
        parse_gpus(raw)


@pytest.mark.parametrize(
    "obj",
    [
        [],
        {"metadata": []},
        {"metadata": "node-a"},
        {"metadata": {"name": "n", "labels": ["a"]}},
        {"metadata": {"name": "n", "annotations": "x"}},
    ],
)
def test_node_with_malformed_metadata_is_a_value_error(obj: Any) -> None:
    with pytest.raises(ValueError):
        node_info(obj)


def test_node_with_non_string_annotations_is_marked_not_fatal() -> None:
    info = node_info(
        {"metadata": {"name": "n", "annotations": {GPUS_ANNOTATION: 7, BIND_LOCK_ANNOTATION: [1]}}}
    )
    assert "malformed" in (info.gpu_error or "") and info.lock is None and info.gpus == ()
