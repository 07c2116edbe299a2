"""Node labels and the gpus annotation (pure), and the publisher's patch."""

from __future__ import annotations

import json
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from dp_helpers import make_inventory, wait_for

from gpufleet.deviceplugin.labels import NodePublisher, gpus_annotation, node_labels, node_patch
from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.deviceplugin.rm.model import GIB
from gpufleet.handoff import (
    GPUS_ANNOTATION,
    PRODUCT_LABEL,
    format_gpus,
    parse_gpus,
    product_label_value,
)


def test_labels_describe_a_homogeneous_node() -> None:
    inv = replace(make_inventory(4, 80, [(0, 1, 12)]), nvswitch_count=6)
    inv = replace(inv, gpus=tuple(replace(g, model="NVIDIA A100-SXM4-80GB") for g in inv.gpus))
    assert node_labels(inv) == {
        "gpufleet.io/gpu.present": "true",
        "gpufleet.io/gpu.model": "NVIDIA-A100-SXM4-80GB",
        "gpufleet.io/gpu.count": "4",
        "gpufleet.io/gpu.product": "NVIDIA-A100-SXM4-80GB",
        "gpufleet.io/gpu.memory": "81920",
        "gpufleet.io/gpu.compute.major": "8",
        "gpufleet.io/gpu.compute.minor": "0",
        "gpufleet.io/gpu.nvlink": "true",
        "gpufleet.io/gpu.nvswitch": "true",
        "gpufleet.io/driver.version": "535.261.03",
        "gpufleet.io/driver.major": "535",
        # The CUDA version the driver supports under GFD's name for it (before: cuda.driver.*, which is the
        # driver's own version in GFD's set).
        "gpufleet.io/cuda.runtime-version.major": "12",
        "gpufleet.io/cuda.runtime-version.minor": "2",
    }


def test_a_mixed_node_says_mixed_in_gpu_model_and_gfds_pick_under_gfds_names() -> None:
    """gpufleet's own `gpu.model` says `mixed`; `gpu.product`, `.count`, `.memory` and `.compute.*` are GFD's
    names, so they carry GFD's values: one model's (the first GPU's), not `mixed` or the smallest."""
    inv = make_inventory(2, 16)
    big = replace(inv.gpus[1], model="Tesla V100-PCIE-32GB", memory_bytes=32 * GIB, cc=(7, 0))
    labels = node_labels(replace(inv, gpus=(inv.gpus[0], big)))
    assert labels["gpufleet.io/gpu.model"] == "mixed"
    assert labels["gpufleet.io/gpu.product"] == "NVIDIA-Test-GPU"
    assert (labels["gpufleet.io/gpu.count"], labels["gpufleet.io/gpu.memory"]) == ("1", "16384")
    assert (labels["gpufleet.io/gpu.compute.major"], labels["gpufleet.io/gpu.compute.minor"]) == ("8", "0")
    assert labels["gpufleet.io/gpu.nvlink"] == "false"


def test_no_gpus_no_labels() -> None:
    assert node_labels(replace(make_inventory(1), gpus=())) == {}


def test_gpus_annotation_matches_the_handoff_document() -> None:
    inv = make_inventory(2, 80, [(0, 1, 12)])
    doc = json.loads(gpus_annotation(inv, {inv.gpus[1].uuid: GpuHealth(False, "XID 79")}))
    assert doc[0] == {
        "index": 0,
        "uuid": inv.gpus[0].uuid,
        "model": "NVIDIA Test GPU",
        "memory_gib": 80,
        "cc": "8.0",
        "numa": 0,
        "healthy": True,
        "nvlink": {inv.gpus[1].uuid: 12},
    }
    assert doc[1]["healthy"] is False


def test_gpus_annotation_reads_back_with_the_extenders_parser() -> None:
    inv = make_inventory(2, 80, [(0, 1, 12)])
    raw = gpus_annotation(inv, {inv.gpus[1].uuid: GpuHealth(False, "XID 79")})
    entries = parse_gpus(raw)
    assert [(e.uuid, e.memory_gib, e.cc, e.healthy, dict(e.nvlink)) for e in entries] == [
        (inv.gpus[0].uuid, 80, (8, 0), True, {inv.gpus[1].uuid: 12}),
        (inv.gpus[1].uuid, 80, (8, 0), False, {inv.gpus[0].uuid: 12}),
    ]
    assert format_gpus(entries) == raw


def test_product_label_is_the_one_the_extender_reads() -> None:
    inv = make_inventory(1, 16)
    assert node_labels(inv)[PRODUCT_LABEL] == product_label_value([inv.gpus[0].model])


def test_patch_removes_our_stale_labels_only() -> None:
    previous = {
        "gpufleet.io/gpu.nvswitch": "true",
        "gpufleet.io/cuda.driver.major": "11",
        "team": "a",
        # Same domain, not ours: the operator's sharing switches (seen removed against a real API server).
        "gpufleet.io/gpu-sharing": "memory",
        "gpufleet.io/mps": "true",
    }
    patch = node_patch({"gpufleet.io/gpu.count": "2"}, "[]", previous, "gpufleet.io")
    assert patch["metadata"]["labels"] == {
        "gpufleet.io/gpu.nvswitch": None,
        "gpufleet.io/cuda.driver.major": None,
        "gpufleet.io/gpu.count": "2",
    }
    assert patch["metadata"]["annotations"] == {GPUS_ANNOTATION: "[]"}


class FakeCoreV1:
    def __init__(self) -> None:
        self.patches: list[dict[str, Any]] = []

    def read_node(self, name: str) -> Any:
        labels = {"gpufleet.io/gpu.old": "x", "gpufleet.io/gpu-sharing": "memory"}
        return SimpleNamespace(metadata=SimpleNamespace(labels=labels, annotations=None))

    def patch_node(self, name: str, body: dict[str, Any]) -> None:
        self.patches.append(body)


def test_publisher_writes_on_change_only() -> None:
    inv = make_inventory(2)
    health: dict[str, GpuHealth] = {}
    api = FakeCoreV1()
    pub = NodePublisher(api, "n1", "gpufleet.io", lambda: (inv, health))
    pub.start()
    try:
        wait_for(lambda: len(api.patches) == 1, "the first patch")
        assert api.patches[0]["metadata"]["labels"]["gpufleet.io/gpu.old"] is None
        assert "gpufleet.io/gpu-sharing" not in api.patches[0]["metadata"]["labels"]
        pub.poke()  # nothing changed: no second write
        health[inv.gpus[0].uuid] = GpuHealth(False, "XID 48")
        pub.poke()
        wait_for(lambda: len(api.patches) == 2, "a patch after the health change")
        assert '"healthy":false' in api.patches[1]["metadata"]["annotations"][GPUS_ANNOTATION]
    finally:
        pub.stop()
