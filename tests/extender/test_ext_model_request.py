"""Parsing of the hand-off annotations and of pods' GPU requests."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest
from extender_builders import gpu, node, pod

from gpufleet.extender.model import model_tokens, node_gpus, node_info
from gpufleet.extender.request import Policy, RequestError, parse_pod, parse_quantity
from gpufleet.handoff import Assignment, BindLock, ContainerAssignment, parse_cc, parse_gpus
from gpufleet_harness.realgpu import H200, load_probe


def test_gpus_annotation_keeps_each_gpus_own_memory_model_and_links() -> None:
    gpus = node_gpus(
        json.dumps(
            [
                gpu(0, "GPU-a", model="NVIDIA A100-PCIE-40GB", mem=40, nvlink=["GPU-b"]),
                gpu(1, "GPU-b", model="Tesla T4", mem=16, cc="7.5", healthy=False),
            ]
        )
    )
    assert [(g.uuid, g.memory_gib, g.cc, g.healthy) for g in gpus] == [
        ("GPU-a", 40, (8, 0), True),
        ("GPU-b", 16, (7, 5), False),
    ]
    assert gpus[0].nvlink_peers == ("GPU-b",)
    assert gpus[1].tokens == {"tesla", "t4"}


@pytest.mark.parametrize(
    ("nvlink", "links"),
    [
        ({"GPU-b": 12, "GPU-c": 2}, (("GPU-b", 12), ("GPU-c", 2))),  # the usual object, taken as it is
        ({"GPU-b": 12, "GPU-c": 0}, (("GPU-b", 12),)),
        ({"GPU-b": True, "GPU-c": -1, "GPU-d": 4.0, "GPU-e": "4", "GPU-f": None}, (("GPU-b", 1),)),
        ({}, ()),
    ],
)
def test_nvlink_counts_that_are_not_positive_integers_are_no_link(
    nvlink: dict[str, object], links: tuple[tuple[str, int], ...]
) -> None:
    raw = json.dumps([{"uuid": "GPU-a", "memory_gib": 80, "nvlink": nvlink}])
    (entry,) = parse_gpus(raw)
    assert entry.nvlink == links
    assert all(type(n) is int for _, n in entry.nvlink)
    (record,) = node_gpus(raw)
    assert record.nvlink_peers == tuple(p for p, _ in links)


def test_fractional_gpu_memory_rounds_down_to_whole_advertised_gib() -> None:
    assert parse_gpus(json.dumps([gpu(0, mem=79.6)]))[0].memory_gib == 79  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "{}",
        '[{"index": 0}]',
        '[{"uuid": "x", "memory_gib": -1}]',
        '[{"uuid": "x", "memory_gib": 8}, {"uuid": "x", "memory_gib": 8}]',
    ],
)
def test_malformed_gpus_annotation_is_rejected_with_a_reason(raw: str) -> None:
    with pytest.raises(ValueError):
        parse_gpus(raw)


def test_node_without_or_with_bad_gpus_annotation_is_marked_not_fatal() -> None:
    assert "absent" in (node_info(node("n", None)).gpu_error or "")
    bad = node("n", [gpu(0)])
    bad["metadata"]["annotations"]["gpufleet.io/gpus"] = "[{"
    assert "malformed" in (node_info(bad).gpu_error or "")


def test_node_info_reads_sharing_label_and_lock() -> None:
    info = node_info(node("n", [gpu(0)], lock="uid-1 ns/p 1700000060"))
    assert info.sharing and info.lock == BindLock("uid-1", "ns/p", 1700000060.0)
    assert node_info(node("n", [gpu(0)], sharing=False)).sharing is False


def test_garbage_bind_lock_counts_as_free() -> None:
    assert node_info(node("n", [gpu(0)], lock="garbage")).lock is None


def test_bind_lock_round_trip_and_expiry() -> None:
    lock = BindLock("u", "ns/p", 100.2)
    assert lock.format() == "u ns/p 101"
    assert BindLock.parse(lock.format()) == BindLock("u", "ns/p", 101.0)
    assert lock.live(100.0) and not lock.live(100.2)
    with pytest.raises(ValueError):
        BindLock.parse("u ns/p soon")


def test_assignment_round_trip_in_handoff_field_order() -> None:
    a = Assignment("n1", (ContainerAssignment("c0", 4, ("GPU-a",)),), 1700000000.0)
    text = a.to_json()
    assert (
        text
        == '{"node":"n1","containers":[{"name":"c0","gpu_mem_gib":4,"gpus":["GPU-a"]}],"ts":1700000000.0}'
    )
    assert Assignment.from_json(text) == a


def test_assignment_shares_split_evenly_and_sum_per_gpu() -> None:
    a = Assignment("n", (ContainerAssignment("c0", 8, ("A", "B")), ContainerAssignment("c1", 3, ("A",))), 0.0)
    assert a.shares() == {"A": 7, "B": 4}
    # An uneven split (never written by us) is rounded up, never under-counted.
    assert ContainerAssignment("c", 5, ("A", "B")).shares() == {"A": 3, "B": 3}


@pytest.mark.parametrize(
    "raw",
    [
        "[]",
        '{"containers": []}',
        '{"node": "n", "containers": [{"gpu_mem_gib": -1}]}',
        '{"node": "n", "containers": [{"gpu_mem_gib": 2, "gpus": "GPU-a"}]}',
    ],
)
def test_malformed_assignment_is_rejected(raw: str) -> None:
    with pytest.raises(ValueError):
        Assignment.from_json(raw)


def test_model_tokens_and_cc() -> None:
    assert model_tokens("NVIDIA A100-SXM4-80GB") == {"nvidia", "a100", "sxm4", "80gb"}
    assert parse_cc("8.6") == (8, 6) and parse_cc("9") == (9, 0) and parse_cc([7, 5]) == (7, 5)
    with pytest.raises(ValueError):
        parse_cc("eight")


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("4", 4),
        (7, 7),
        ("1500m", Fraction(3, 2)),
        ("2Ki", 2048),
        ("1e3", 1000),
        ("1G", 10**9),
        ("-2", -2),
        (".5", Fraction(1, 2)),
    ],
)
def test_kubernetes_quantities_parse_exactly(raw: object, value: Fraction) -> None:
    assert parse_quantity(raw) == value


@pytest.mark.parametrize("raw", ["", "abc", "4 GiB", "1Gb", True])
def test_bad_quantities_are_rejected(raw: object) -> None:
    # Twice: short texts are remembered once parsed, and a bad one must stay an error.
    for _ in range(2):
        with pytest.raises(ValueError):
            parse_quantity(raw)


def test_pod_request_lists_gpu_mem_containers_init_first() -> None:
    req = parse_pod(pod("p", mem=[4, 0, 8], init_mem=[2]))
    assert [(c.name, c.gib, c.gpus) for c in req.mem] == [("init0", 2, 1), ("c0", 4, 1), ("c2", 8, 1)]
    assert req.kind == "mem" and req.max_share == 8


def test_pod_request_reads_limits_when_requests_are_absent() -> None:
    p = pod("p", mem=[6])
    del p["spec"]["containers"][0]["resources"]["requests"]
    assert parse_pod(p).mem[0].gib == 6


def test_whole_gpu_request_uses_the_kubelets_init_container_rule() -> None:
    p = pod("p", whole=2)
    p["spec"]["initContainers"] = [{"name": "i", "resources": {"limits": {"nvidia.com/gpu": "3"}}}]
    assert parse_pod(p).whole == 3
    p["spec"]["containers"].append({"name": "side", "resources": {"limits": {"nvidia.com/gpu": "2"}}})
    assert parse_pod(p).whole == 4


@pytest.mark.parametrize(("mem", "message"), [("-4", "negative"), ("2.5", "whole number"), ("4Gb", "suffix")])
def test_absurd_gpu_mem_quantities_are_request_errors(mem: str, message: str) -> None:
    p = pod("p", mem=[1])
    p["spec"]["containers"][0]["resources"] = {"limits": {"gpufleet.io/gpu-mem": mem}}
    with pytest.raises(RequestError, match=message):
        parse_pod(p)


def test_both_resource_kinds_in_one_pod_is_an_error() -> None:
    p = pod("p", mem=[4], whole=1)
    with pytest.raises(RequestError, match="both"):
        parse_pod(p)


def test_gpu_count_splits_memory_evenly_or_refuses() -> None:
    req = parse_pod(pod("p", mem=[16], annotations={"gpufleet.io/gpu-count": "2"}))
    assert (req.mem[0].gpus, req.mem[0].share) == (2, 8)
    with pytest.raises(RequestError, match="even"):
        parse_pod(pod("p", mem=[15], annotations={"gpufleet.io/gpu-count": "2"}))
    with pytest.raises(RequestError, match="gpu-count"):
        parse_pod(pod("p", mem=[16], annotations={"gpufleet.io/gpu-count": "0"}))


def test_gpu_constraints_and_policies_from_annotations() -> None:
    req = parse_pod(
        pod(
            "p",
            mem=[4],
            annotations={
                "gpufleet.io/gpu-model": "A100, H100",
                "gpufleet.io/gpu-min-cc": "8.0",
                "gpufleet.io/gpu-prefer": "most-capable",
                "gpufleet.io/node-policy": "Spread",
                "gpufleet.io/gpu-policy": "binpack",
            },
        )
    )
    assert req.models == (frozenset({"a100"}), frozenset({"h100"}))
    assert req.min_cc == (8, 0) and req.most_capable
    assert (req.node_policy, req.gpu_policy) == (Policy.SPREAD, Policy.BINPACK)
    assert req.gpu_qualifies(model_tokens("NVIDIA H100 80GB HBM3"), (9, 0))
    assert not req.gpu_qualifies(model_tokens("NVIDIA A10"), (8, 6))
    assert not req.gpu_qualifies(model_tokens("NVIDIA A100-PCIE-40GB"), (7, 5))


def test_node_selector_on_a_model_label_is_a_per_gpu_model_request() -> None:
    req = parse_pod(pod("p", mem=[4], node_selector={"nvidia.com/gpu.product": "Tesla-T4"}))
    assert req.models == (frozenset({"tesla", "t4"}),)


def test_node_selector_on_the_device_plugins_product_label_is_a_per_gpu_model_request() -> None:
    req = parse_pod(pod("p", mem=[4], node_selector={"gpufleet.io/gpu.product": "NVIDIA-A100-SXM4-80GB"}))
    assert req.models == (frozenset({"nvidia", "a100", "sxm4", "80gb"}),)
    # The plugin labels a node with several models `mixed`: selecting that asks for no model.
    assert parse_pod(pod("p", mem=[4], node_selector={"gpufleet.io/gpu.product": "mixed"})).models == ()
    # The hand-set label of older docs keeps working.
    assert parse_pod(pod("p", mem=[4], node_selector={"gpufleet.io/gpu-model": "T4"})).models == (
        frozenset({"t4"}),
    )


@pytest.mark.parametrize(
    "annotations",
    [
        {"gpufleet.io/gpu-policy": "fastest"},
        {"gpufleet.io/gpu-min-cc": "x"},
        {"gpufleet.io/gpu-prefer": "cheapest"},
        {"gpufleet.io/gpu-model": " , "},
    ],
)
def test_unknown_request_annotation_values_are_errors(annotations: dict[str, str]) -> None:
    with pytest.raises(RequestError):
        parse_pod(pod("p", mem=[4], annotations=annotations))


def test_pod_without_gpu_request_is_kind_none() -> None:
    assert parse_pod(pod("p")).kind == "none"


def test_a_selector_on_the_product_label_of_the_recorded_h200_asks_for_that_gpu() -> None:
    """The value GFD wrote on the real H200 (and the device plugin writes alike, tests/deviceplugin
    test_dp_gfd_labels.py), as a nodeSelector, is a wish for the GPU NVML names "NVIDIA H200" there."""
    recorded = (H200 / "gfd-labels.txt").read_text(encoding="utf-8").splitlines()
    product = dict(line.split("=", 1) for line in recorded)["nvidia.com/gpu.product"]
    name = load_probe(H200)["devices"][0]["nvmlDeviceGetName"]["ok"]
    req = parse_pod(pod("p", mem=[4], node_selector={"nvidia.com/gpu.product": product}))
    assert req.gpu_qualifies(model_tokens(name), (9, 0))
    assert not req.gpu_qualifies(model_tokens("NVIDIA H100 80GB HBM3"), (9, 0))
