"""Devices the kubelet counts, not the extender: time-sliced nodes, MIG strategy single, and GPUs in MIG mode.

On such nodes `nvidia.com/gpu` (or `nvidia.com/mig-*`) are replicas or MIG devices, not whole GPUs: the
extender lets whole-GPU pods pass there and records no GPU for them; it never places GPU memory on a GPU in
MIG mode. `/inspect` says so per node and per GPU.
"""

from __future__ import annotations

import json

from extender_builders import gpu, machine, node, pod

from gpufleet.extender.request import Policy, parse_pod
from gpufleet.extender.scheduling import filter_nodes, prioritize_nodes
from gpufleet.extender.state import ClusterState
from gpufleet.handoff import GpuEntry, format_gpus, parse_gpus

NOW = 1_800_000_000.0


def cluster(*nodes: dict) -> ClusterState:
    state = ClusterState(clock=lambda: NOW)
    state.replace_nodes(list(nodes))
    state.replace_pods([])
    return state


def test_a_time_sliced_node_takes_whole_gpu_pods_the_extender_does_not_count() -> None:
    sliced = node("sliced", machine("s", 2, mesh=False, model="Tesla T4", mem=16, cc="7.5"), sharing=False,
                  labels={"gpufleet.io/gpu-sharing": "time-slicing"})  # fmt: skip
    whole = node("whole", machine("w", 2), sharing=False)
    single = node("single", machine("m", 1), sharing=False, labels={"nvidia.com/mig.strategy": "single"})
    state = cluster(sliced, whole, single)
    three = parse_pod(pod("three", whole=3))  # more than either node has GPUs: replicas / MIG devices may do
    out = filter_nodes(state, three, ["sliced", "whole", "single"], Policy.BINPACK, NOW)
    assert sorted(out.fits) == ["single", "sliced"]
    assert out.unresolvable["whole"] == "node has 2 healthy GPUs; the pod needs 3"
    scores = dict(prioritize_nodes(state, three, ["sliced", "single"], Policy.BINPACK, Policy.BINPACK, NOW))
    assert set(scores) == {"sliced", "single"}
    # GPU memory is never placed there
    mem = parse_pod(pod("mem", mem=[4]))
    out = filter_nodes(state, mem, ["sliced"], Policy.BINPACK, NOW)
    assert out.fits == [] and "does not share GPU memory" in out.unresolvable["sliced"]
    seen = state.inspect_node("sliced")
    assert seen["left_to_kubelet"].startswith("time-sliced")
    assert state.inspect_node("whole")["left_to_kubelet"] is None
    assert state.inspect_node("single")["left_to_kubelet"].startswith("MIG strategy single")


def test_gpus_in_mig_mode_take_neither_memory_nor_whole_gpu_pods() -> None:
    shared = [gpu(0, "GPU-a-0", mem=80), {**gpu(1, "GPU-a-1", mem=80), "mig": True}]
    dgx = machine("d", 8)
    for g in dgx[:2]:
        g["mig"] = True
    state = cluster(node("mem", shared), node("dgx", dgx, sharing=False))
    # two 60 GiB containers would fit on two 80 GiB GPUs; one of them is in MIG mode
    out = filter_nodes(state, parse_pod(pod("two", mem=[60, 60])), ["mem"], Policy.BINPACK, NOW)
    assert out.fits == []
    out = filter_nodes(state, parse_pod(pod("one", mem=[60])), ["mem"], Policy.BINPACK, NOW)
    assert out.fits == ["mem"]
    out = filter_nodes(state, parse_pod(pod("seven", whole=7)), ["dgx"], Policy.BINPACK, NOW)
    assert out.unresolvable == {"dgx": "node has 6 healthy GPUs; the pod needs 7"}  # 2 are in MIG mode
    assert filter_nodes(state, parse_pod(pod("six", whole=6)), ["dgx"], Policy.BINPACK, NOW).fits == ["dgx"]
    view = {g["uuid"]: (g["mig"], g["free_gib"]) for g in state.inspect_node("mem")["gpus"]}
    assert view == {"GPU-a-0": (False, 80), "GPU-a-1": (True, 0)}


def test_the_gpus_annotation_marks_mig_gpus_only_when_in_mig_mode() -> None:
    plain = GpuEntry(0, "GPU-x", "NVIDIA A100-SXM4-80GB", 80, (8, 0), 0, True, ())
    mig = GpuEntry(1, "GPU-y", "NVIDIA A100-SXM4-80GB", 80, (8, 0), 0, True, (), mig=True)
    doc = json.loads(format_gpus([plain, mig]))
    assert "mig" not in doc[0] and doc[1]["mig"] is True  # GPUs without MIG publish what they always did
    assert parse_gpus(format_gpus([plain, mig])) == (plain, mig)
