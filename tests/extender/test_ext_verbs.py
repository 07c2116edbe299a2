"""filter / prioritize / bind through the protocol layer, on recorded-style ExtenderArgs."""

from __future__ import annotations

import copy
import json

import pytest
from extender_builders import load_fixture, settle

from gpufleet.extender.api import BadRequest


def test_filter_with_node_names_splits_fit_failed_and_unresolvable(world) -> None:  # type: ignore[no-untyped-def]
    result = world.api.filter(load_fixture("filter_nodenames.json"))
    assert set(result) == {"Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"}
    assert result["Nodes"] is None and result["Error"] == ""
    # 24 GiB: the A100s and H100s fit, the mixed node's A100-40 (12 used, 28 free) fits too; filter answers
    # the one it places the pod on (binpack: the fullest) and holds that placement until the bind.
    assert world.metrics.get("gpufleet_extender_filter_nodes_total", outcome="fit") == 3
    assert result["NodeNames"] == ["mixed-0"]
    uid = load_fixture("filter_nodenames.json")["Pod"]["metadata"]["uid"]
    assert world.state.reservation(uid).stage == "decided"
    assert world.state.reservation(uid).usage.node == "mixed-0"
    unresolvable = result["FailedAndUnresolvableNodes"]
    assert "largest qualifying healthy GPU has 16 GiB" in unresolvable["t4-0"]
    assert "does not share GPU memory" in unresolvable["v100-0"]
    assert "publishes no GPUs" in unresolvable["cpu-0"]
    # Duplicated into FailedNodes so a 1.20 scheduler (which ignores the new field) reports why.
    assert all(result["FailedNodes"][name] == reason for name, reason in unresolvable.items())


def test_filter_with_full_nodes_returns_the_fitting_node_objects(world) -> None:  # type: ignore[no-untyped-def]
    args = load_fixture("filter_nodes.json")
    result = world.api.filter(args)
    assert result["NodeNames"] is None
    assert result["Nodes"]["kind"] == "NodeList"
    items = result["Nodes"]["items"]
    assert [n["metadata"]["name"] for n in items] == ["mixed-0"]  # of the three that fit, as above
    assert items[0] == next(
        n for n in args["Nodes"]["items"] if n["metadata"]["name"] == items[0]["metadata"]["name"]
    )


def test_filter_counts_memory_already_assigned_in_the_cluster(world) -> None:  # type: ignore[no-untyped-def]
    args = load_fixture("filter_nodenames.json")
    args["Pod"]["spec"]["containers"][0]["resources"]["limits"]["gpufleet.io/gpu-mem"] = "30"
    args["Pod"]["spec"]["containers"][0]["resources"]["requests"]["gpufleet.io/gpu-mem"] = "30"
    result = world.api.filter(args)
    assert "mixed-0" in result["FailedNodes"] and "mixed-0" not in result["FailedAndUnresolvableNodes"]
    assert "most free on a qualifying GPU is 28 GiB" in result["FailedNodes"]["mixed-0"]


def test_a_succeeded_pods_memory_is_free_again(world) -> None:  # type: ignore[no-untyped-def]
    gpu0 = world.state.inspect_node("hgx-h100-0")["gpus"][0]
    assert gpu0["used_gib"] == 0 and gpu0["pods"] == []


def test_filter_reports_absurd_requests_as_errors(world) -> None:  # type: ignore[no-untyped-def]
    args = load_fixture("filter_nodenames.json")
    resources = args["Pod"]["spec"]["containers"][0]["resources"]
    resources["limits"]["gpufleet.io/gpu-mem"] = resources["requests"]["gpufleet.io/gpu-mem"] = "200"
    assert "largest healthy GPU in the cluster has 80 GiB" in world.api.filter(args)["Error"]
    resources["limits"]["gpufleet.io/gpu-mem"] = resources["requests"]["gpufleet.io/gpu-mem"] = "-3"
    assert "negative" in world.api.filter(args)["Error"]
    resources["limits"]["gpufleet.io/gpu-mem"] = resources["requests"]["gpufleet.io/gpu-mem"] = "2.5"
    assert "whole number" in world.api.filter(args)["Error"]


@pytest.mark.parametrize(
    "args",
    [
        [],
        {"NodeNames": ["a"]},
        {"Pod": "x", "NodeNames": []},
        {"Pod": {"metadata": {}}, "NodeNames": []},
        {"Pod": {"metadata": {"name": "p"}}},
        {"Pod": {"metadata": {"name": "p"}}, "NodeNames": [1]},
        {"Pod": {"metadata": {"name": "p"}}, "Nodes": {"items": [{}]}},
    ],
)
def test_malformed_extender_args_are_bad_requests(world, args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BadRequest):
        world.api.filter(args)
    with pytest.raises(BadRequest):
        world.api.prioritize(args)


@pytest.mark.parametrize(
    "args",
    [[], {}, {"PodName": "p"}, {"PodName": "p", "Node": ""}, {"PodName": "p", "Node": "n", "PodUID": 5}],
)
def test_malformed_binding_args_are_bad_requests(world, args) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(BadRequest):
        world.api.bind(args)


def test_prioritize_returns_a_host_priority_list_in_range(world) -> None:  # type: ignore[no-untyped-def]
    args = load_fixture("filter_nodenames.json")
    result = world.api.prioritize(args)
    assert [h["Host"] for h in result] == args["NodeNames"]
    assert all(set(h) == {"Host", "Score"} and 0 <= h["Score"] <= 10 for h in result)
    scores = {h["Host"]: h["Score"] for h in result}
    # binpack: the A100 box already runs two pods, the H100 box none.
    assert scores["dgx-a100-0"] > scores["hgx-h100-0"] > 0 and scores["t4-0"] == 0


def test_prioritize_on_full_nodes_matches_node_names(world) -> None:  # type: ignore[no-untyped-def]
    by_name = world.api.prioritize(load_fixture("filter_nodenames.json"))
    by_object = world.api.prioritize(load_fixture("filter_nodes.json"))
    assert by_name == by_object


def test_prioritize_json_is_exactly_the_encoded_host_priority_list(world) -> None:  # type: ignore[no-untyped-def]
    # What the HTTP server sends (pre-encoded fragments) must be what encoding `prioritize` would give.
    for fixture in ("filter_nodenames.json", "filter_nodes.json"):
        args = load_fixture(fixture)
        expected = json.dumps(world.api.prioritize(args), separators=(",", ":")).encode()
        assert world.api.prioritize_json(args) == expected
        assert world.api.prioritize_json(args) == expected  # fragments cached
    odd = {**load_fixture("filter_nodenames.json"), "NodeNames": ['quo"te', "ünï", "ghost"]}
    assert json.loads(world.api.prioritize_json(odd)) == world.api.prioritize(odd)


def test_filter_json_is_exactly_the_encoded_filter_result(world) -> None:  # type: ignore[no-untyped-def]
    # What the HTTP server sends (failure maps from pre-encoded fragments) must be the encoded result.
    for fixture in ("filter_nodenames.json", "filter_nodes.json"):
        for gib in ("4", "30", "500"):  # fits, some fail, none fits (with an Error)
            args = copy.deepcopy(load_fixture(fixture))
            args["Pod"]["spec"]["containers"][0]["resources"]["limits"]["gpufleet.io/gpu-mem"] = gib
            args["Pod"]["spec"]["containers"][0]["resources"]["requests"]["gpufleet.io/gpu-mem"] = gib
            world.api.filter(args)  # the pod's decided node may move: the failure maps' order with it
            expected = json.dumps(world.api.filter(args), separators=(",", ":")).encode()
            assert world.api.filter_json(args) == expected
            assert world.api.filter_json(args) == expected  # fragments cached
    odd = {**load_fixture("filter_nodenames.json"), "NodeNames": ['quo"te', "ünï", "ghost", "t4-0"]}
    assert json.loads(world.api.filter_json(odd)) == world.api.filter(odd)
    bad = {**load_fixture("filter_nodenames.json")}
    bad["Pod"] = copy.deepcopy(bad["Pod"])
    bad["Pod"]["metadata"]["annotations"]["gpufleet.io/gpu-count"] = "x"
    assert world.api.filter_json(bad) == json.dumps(world.api.filter(bad), separators=(",", ":")).encode()


def test_model_request_routes_to_the_right_nodes(world) -> None:  # type: ignore[no-untyped-def]
    args = load_fixture("filter_nodenames.json")
    args["Pod"]["metadata"]["annotations"]["gpufleet.io/gpu-model"] = "H100"
    assert world.api.filter(args)["NodeNames"] == ["hgx-h100-0"]
    args["Pod"]["metadata"]["annotations"]["gpufleet.io/gpu-model"] = "A100"
    assert world.api.filter(args)["NodeNames"] == ["mixed-0"]  # the A100s fit, binpack takes the fullest
    assert world.metrics.get("gpufleet_extender_filter_nodes_total", outcome="fit") == 3  # 1 + 2


def test_bind_from_recorded_args_writes_the_handoff_and_binds(world, cluster) -> None:  # type: ignore[no-untyped-def]
    assert world.api.bind(load_fixture("bind.json")) == {"Error": ""}
    settle(cluster)
    bound = next(p for p in cluster.pods() if p["metadata"]["name"] == "llm-serve-5d8f7")
    assert bound["spec"]["nodeName"] == "dgx-a100-0"
    assignment = bound["metadata"]["annotations"]["gpufleet.io/assignment"]
    # binpack: GPU 1 holds 60 GiB (20 free), GPU 0 60 GiB (20 free) -> neither fits 24; the fullest that
    # fits is any empty card, the lowest index first.
    assert '"gpus":["GPU-a100x8-0-2"]' in assignment and '"gpu_mem_gib":24' in assignment
    lock = cluster.node("dgx-a100-0")["metadata"]["annotations"]["gpufleet.io/bind-lock"]
    assert lock.startswith("6f1c2a9e-3b7d-4e0a-9c11-2d5e8f7a6b40 ml/llm-serve-5d8f7 ")


def test_bind_unknown_pod_or_node_is_an_error_result(world) -> None:  # type: ignore[no-untyped-def]
    args = load_fixture("bind.json")
    assert "not found" in world.api.bind({**args, "PodName": "nope"})["Error"]
    assert "not in the extender's cache" in world.api.bind({**args, "Node": "ghost"})["Error"]


def test_unsynced_extender_refuses_to_decide(world) -> None:  # type: ignore[no-untyped-def]
    world.state.watch.listed.clear()
    assert "not synced" in world.api.filter(load_fixture("filter_nodenames.json"))["Error"]
    assert all(h["Score"] == 0 for h in world.api.prioritize(load_fixture("filter_nodenames.json")))
    assert "not synced" in world.api.bind(load_fixture("bind.json"))["Error"]


def test_pod_without_gpus_passes_everywhere(world) -> None:  # type: ignore[no-untyped-def]
    args = copy.deepcopy(load_fixture("filter_nodenames.json"))
    resources = args["Pod"]["spec"]["containers"][0]["resources"]
    del resources["limits"]["gpufleet.io/gpu-mem"], resources["requests"]["gpufleet.io/gpu-mem"]
    assert world.api.filter(args)["NodeNames"] == args["NodeNames"]
