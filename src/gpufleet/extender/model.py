"""What the extender reads from Kubernetes objects: its view of nodes and GPUs, and the request vocabulary.

The hand-off with the device plugin (resource names, the node's `gpus` annotation and bind-lock, the pod's
assignment and allocated annotations, the labels) is defined once in `gpufleet.handoff` (docs/handoff.md);
this module adds what only the extender derives from it and the pod-facing request annotations
(docs/extender.md). Parsers raise `ValueError` with a message an operator can act on; callers decide whether
that fails a request or only a node.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..handoff import (
    BIND_LOCK_ANNOTATION,
    GPUS_ANNOTATION,
    MPS_LABEL,
    PRODUCT_LABEL,
    SHARING_LABEL,
    SHARING_MEMORY,
    SHARING_TIME_SLICING,
    BindLock,
    GpuEntry,
    entry_fields,
    gpus_json,
)

# Pod annotations that shape a request (docs/extender.md).
MODEL_ANNOTATION = "gpufleet.io/gpu-model"
MIN_CC_ANNOTATION = "gpufleet.io/gpu-min-cc"
PREFER_ANNOTATION = "gpufleet.io/gpu-prefer"
GPU_COUNT_ANNOTATION = "gpufleet.io/gpu-count"
NODE_POLICY_ANNOTATION = "gpufleet.io/node-policy"
GPU_POLICY_ANNOTATION = "gpufleet.io/gpu-policy"

# nodeSelector keys that name a GPU model; a pod selecting on one asks for that model per GPU too,
# because on a node with mixed GPUs the label alone cannot say which card the pod gets. In order of
# precedence: the label the device plugin publishes (its value `mixed` asks for no model), the hand-set
# label older docs recommended, and NVIDIA GPU feature discovery's.
MODEL_LABELS = (PRODUCT_LABEL, "gpufleet.io/gpu-model", "nvidia.com/gpu.product")
# The MIG strategy the node's device plugin serves: gpufleet's label and NVIDIA GPU feature discovery's.
MIG_STRATEGY_LABELS = ("gpufleet.io/mig.strategy", "nvidia.com/mig.strategy")

_TOKEN_SPLIT = re.compile(r"[^0-9a-z]+")


def model_tokens(text: str) -> frozenset[str]:
    """Normalise a GPU model name or label value ("NVIDIA A100-SXM4-80GB") into comparable tokens."""
    return frozenset(t for t in _TOKEN_SPLIT.split(text.lower()) if t)


_CACHED_NAME_LENGTH = 128


def _kind_of(model: str, cc: tuple[int, int]) -> tuple[str, frozenset[str], tuple[int, int]]:
    """The model name, its tokens and the compute capability, as objects shared by every GPU of that kind:
    a fleet has a handful of models, and its 40,000 GPUs at 5,000 nodes would otherwise each hold copies.
    A hostile annotation's long names are not kept."""
    if len(model) <= _CACHED_NAME_LENGTH:
        return _shared_kind(model, cc)
    return model, model_tokens(model), cc


@functools.lru_cache(maxsize=1024)
def _shared_kind(model: str, cc: tuple[int, int]) -> tuple[str, frozenset[str], tuple[int, int]]:
    return model, model_tokens(model), cc


@dataclass(frozen=True, slots=True, kw_only=True)
class Gpu(GpuEntry):
    """A GPU of the node's `gpufleet.io/gpus` annotation plus what the extender derives from it once.

    Kept for every GPU of the fleet, so it holds what placement reads and no more: NVLink as the peers'
    UUIDs only (`nvlink` itself, with link counts, is left empty), each peer the same string object as that
    peer's own `uuid`, and the model's name, tokens and compute capability shared between GPUs of one kind."""

    nvlink_peers: tuple[str, ...]
    tokens: frozenset[str]

    @property
    def capability(self) -> tuple[int, int, int]:
        """Ordering for "most capable": compute capability first, then memory."""
        return (self.cc[0], self.cc[1], self.memory_gib)


def node_gpus(raw: str) -> tuple[Gpu, ...]:
    """Parse the `gpufleet.io/gpus` annotation into the extender's view: the checks of
    `gpufleet.handoff.parse_gpus` (`entry_fields`), each GPU built once (at 5,000 nodes, 40,000 of them
    while the extender gets ready), not a GpuEntry first."""
    fields = [entry_fields(entry, i) for i, entry in enumerate(gpus_json(raw))]
    uuids = {f[1]: f[1] for f in fields}
    if len(uuids) != len(fields):
        raise ValueError("duplicate GPU uuid")
    gpus = []
    for index, uuid, model_name, memory_gib, raw_cc, numa, healthy, links, mig in fields:
        model, tokens, cc = _kind_of(model_name, raw_cc)
        # Each peer as its own GPU's uuid object where the node has it (map: no Python step per peer).
        peers = tuple(sorted(map(uuids.get, links, links)))
        gpus.append(
            Gpu(index, uuid, model, memory_gib, cc, numa, healthy, (), mig, nvlink_peers=peers, tokens=tokens)
        )
    return tuple(gpus)


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """The parts of a Node the extender decides on, parsed once per resourceVersion."""

    name: str
    resource_version: str
    sharing: bool
    mps: bool
    gpus: tuple[Gpu, ...]
    gpu_error: str | None
    lock: BindLock | None
    # Why the kubelet alone counts this node's nvidia.com/gpu devices ("" when they are whole GPUs the
    # extender places): time-sliced replicas, or MIG devices under mig.strategy single.
    passthrough: str = ""
    # The GPUs that can take work, computed once per node version (every decision starts here), and
    # their distinct (model tokens, compute capability): usually one, so constraints are checked once.
    healthy: tuple[Gpu, ...] = ()
    kinds: tuple[tuple[frozenset[str], tuple[int, int]], ...] = ()
    # The raw `gpufleet.io/gpus` value these GPUs were parsed from: a node update that leaves it alone
    # (a bind-lock, a heartbeat) reuses the parse.
    gpus_raw: str | None = None

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        """The GPU with this uuid, if the node still publishes it."""
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None


def passthrough(labels: Mapping[str, Any]) -> str:
    """Why the node's nvidia.com/gpu devices are not whole GPUs ("" when they are): the device plugin's
    time-slicing (`gpufleet.io/gpu-sharing=time-slicing`), or MIG devices under strategy single (the
    plugin's `gpufleet.io/mig.strategy` or NVIDIA's `nvidia.com/mig.strategy`)."""
    if labels.get(SHARING_LABEL) == SHARING_TIME_SLICING:
        return "time-sliced: nvidia.com/gpu devices are replicas the kubelet counts"
    if any(labels.get(key) == "single" for key in MIG_STRATEGY_LABELS):
        return "MIG strategy single: nvidia.com/gpu devices are MIG devices the kubelet counts"
    return ""


def node_info(obj: Mapping[str, Any], previous: NodeInfo | None = None) -> NodeInfo:
    """Parse a Kubernetes Node (JSON as the API serves it); a bad annotation marks the node, not the call.

    With `previous` (the same node's last parse), GPUs published unchanged are not parsed again.
    """
    meta = obj.get("metadata") or {} if isinstance(obj, Mapping) else None
    if not isinstance(meta, Mapping):
        raise ValueError("node without metadata")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("node without metadata.name")
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    if not isinstance(labels, Mapping) or not isinstance(annotations, Mapping):
        raise ValueError(f"node {name}: metadata.labels and metadata.annotations must be objects")
    raw = annotations.get(GPUS_ANNOTATION)
    if previous is not None and previous.gpus_raw is not None and previous.gpus_raw == raw:
        gpus, gpu_error = previous.gpus, previous.gpu_error
        healthy, kinds = previous.healthy, previous.kinds
    else:
        gpus, gpu_error, healthy, kinds = _parse_node_gpus(raw)
    lock: BindLock | None = None
    raw_lock = annotations.get(BIND_LOCK_ANNOTATION)
    if raw_lock:
        try:
            lock = BindLock.parse(raw_lock)
        except ValueError:
            # Only extenders write the lock; garbage there protects nothing, so the next bind overwrites it.
            lock = None
    return NodeInfo(
        name=name,
        resource_version=str(meta.get("resourceVersion") or ""),
        passthrough=passthrough(labels),
        sharing=labels.get(SHARING_LABEL) == SHARING_MEMORY,
        mps=str(labels.get(MPS_LABEL, "")).lower() == "true",
        gpus=gpus,
        gpu_error=gpu_error,
        lock=lock,
        healthy=healthy,
        kinds=kinds,
        gpus_raw=raw if isinstance(raw, str) else None,
    )


def _parse_node_gpus(
    raw: Any,
) -> tuple[tuple[Gpu, ...], str | None, tuple[Gpu, ...], tuple[tuple[frozenset[str], tuple[int, int]], ...]]:
    """GPUs, error, healthy GPUs and their distinct kinds from the raw `gpufleet.io/gpus` value."""
    gpus: tuple[Gpu, ...] = ()
    gpu_error: str | None = None
    if raw is None:
        gpu_error = f"node publishes no GPUs (annotation {GPUS_ANNOTATION} absent)"
    else:
        try:
            gpus = node_gpus(raw)
        except ValueError as exc:
            gpu_error = f"annotation {GPUS_ANNOTATION} is malformed: {exc}"
    # A GPU in MIG mode is neither a whole GPU nor a memory share: its MIG devices are the kubelet's.
    healthy = tuple(g for g in gpus if g.healthy and not g.mig)
    return gpus, gpu_error, healthy, tuple(dict.fromkeys((g.tokens, g.cc) for g in healthy))
