"""What the extender reads from and writes to Kubernetes objects: names, GPUs, the bind lock, assignments.

Every annotation and label here is part of the extender ↔ device plugin hand-off (docs/handoff.md) or of
the pod-facing request vocabulary (docs/extender.md). Parsers raise `ValueError` with a message an
operator can act on; callers decide whether that fails a request or only a node.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Resources (advertised by the device plugin).
GPU_MEM_RESOURCE = "gpufleet.io/gpu-mem"
WHOLE_GPU_RESOURCE = "nvidia.com/gpu"

# Node side of the hand-off.
GPUS_ANNOTATION = "gpufleet.io/gpus"
BIND_LOCK_ANNOTATION = "gpufleet.io/bind-lock"
SHARING_LABEL = "gpufleet.io/gpu-sharing"
SHARING_MEMORY = "memory"
MPS_LABEL = "gpufleet.io/mps"

# Pod side of the hand-off.
ASSIGNMENT_ANNOTATION = "gpufleet.io/assignment"
ALLOCATED_ANNOTATION = "gpufleet.io/allocated"

# Pod annotations that shape a request (docs/extender.md).
MODEL_ANNOTATION = "gpufleet.io/gpu-model"
MIN_CC_ANNOTATION = "gpufleet.io/gpu-min-cc"
PREFER_ANNOTATION = "gpufleet.io/gpu-prefer"
GPU_COUNT_ANNOTATION = "gpufleet.io/gpu-count"
NODE_POLICY_ANNOTATION = "gpufleet.io/node-policy"
GPU_POLICY_ANNOTATION = "gpufleet.io/gpu-policy"

# nodeSelector keys that name a GPU model; a pod selecting on one asks for that model per GPU too,
# because on a node with mixed GPUs the label alone cannot say which card the pod gets.
MODEL_LABELS = ("gpufleet.io/gpu-model", "nvidia.com/gpu.product")

_TOKEN_SPLIT = re.compile(r"[^0-9a-z]+")


def model_tokens(text: str) -> frozenset[str]:
    """Normalise a GPU model name or label value ("NVIDIA A100-SXM4-80GB") into comparable tokens."""
    return frozenset(t for t in _TOKEN_SPLIT.split(text.lower()) if t)


def parse_cc(value: Any) -> tuple[int, int]:
    """Parse a CUDA compute capability: "8.0", "9", 8.6 or [8, 6]."""
    if isinstance(value, list | tuple) and len(value) == 2 and all(isinstance(v, int) for v in value):
        return int(value[0]), int(value[1])
    text = str(value).strip()
    match = re.fullmatch(r"(\d+)(?:\.(\d+))?", text)
    if not match:
        raise ValueError(f"compute capability {value!r} is not MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2) or 0)


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU as the device plugin publishes it in the node's `gpufleet.io/gpus` annotation."""

    index: int
    uuid: str
    model: str
    memory_gib: int
    cc: tuple[int, int]
    numa: int | None
    healthy: bool
    nvlink_peers: frozenset[str]
    tokens: frozenset[str]

    @property
    def capability(self) -> tuple[int, int, int]:
        """Ordering for "most capable": compute capability first, then memory."""
        return (self.cc[0], self.cc[1], self.memory_gib)


def _gpu_from_json(doc: Any, position: int) -> Gpu:
    if not isinstance(doc, dict):
        raise ValueError(f"entry {position} is not an object")
    try:
        uuid = doc["uuid"]
        memory = doc["memory_gib"]
    except KeyError as exc:
        raise ValueError(f"entry {position} lacks {exc.args[0]!r}") from None
    if not isinstance(uuid, str) or not uuid:
        raise ValueError(f"entry {position}: uuid must be a non-empty string")
    if isinstance(memory, bool) or not isinstance(memory, int | float) or memory < 0:
        raise ValueError(f"entry {position}: memory_gib must be a non-negative number")
    nvlink = doc.get("nvlink") or {}
    if not isinstance(nvlink, dict):
        raise ValueError(f"entry {position}: nvlink must be an object of peer uuid -> link count")
    model = str(doc.get("model") or "")
    numa = doc.get("numa")
    return Gpu(
        index=int(doc.get("index", position)),
        uuid=uuid,
        model=model,
        # The device plugin advertises one device per whole GiB, so a fractional GiB is not usable.
        memory_gib=math.floor(memory),
        cc=parse_cc(doc.get("cc", "0.0")),
        numa=numa if isinstance(numa, int) and not isinstance(numa, bool) else None,
        healthy=doc.get("healthy", True) is True,
        nvlink_peers=frozenset(p for p, links in nvlink.items() if isinstance(links, int) and links > 0),
        tokens=model_tokens(model),
    )


def parse_gpus(raw: str) -> tuple[Gpu, ...]:
    """Parse the `gpufleet.io/gpus` annotation; raise ValueError naming the first problem."""
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON ({exc.msg} at {exc.pos})") from None
    if not isinstance(doc, list):
        raise ValueError("not a JSON list")
    gpus = tuple(_gpu_from_json(entry, i) for i, entry in enumerate(doc))
    if len({g.uuid for g in gpus}) != len(gpus):
        raise ValueError("duplicate GPU uuid")
    return gpus


@dataclass(frozen=True, slots=True)
class BindLock:
    """The node's `gpufleet.io/bind-lock`: which pod is between bind and Allocate, and until when."""

    pod_uid: str
    pod_key: str
    expires: float

    def live(self, now: float) -> bool:
        """Whether the lock still holds at `now` (unix seconds)."""
        return now < self.expires

    def format(self) -> str:
        """The annotation value: "<pod-uid> <namespace>/<name> <expires-unix-seconds>"."""
        return f"{self.pod_uid} {self.pod_key} {math.ceil(self.expires)}"

    @classmethod
    def parse(cls, raw: str) -> BindLock:
        """Parse the annotation value; raise ValueError when it is not three fields."""
        parts = raw.split()
        if len(parts) != 3 or "/" not in parts[1]:
            raise ValueError(f"bind-lock {raw!r} is not '<uid> <namespace>/<name> <expires>'")
        try:
            expires = float(parts[2])
        except ValueError:
            raise ValueError(f"bind-lock expiry {parts[2]!r} is not a number") from None
        return cls(parts[0], parts[1], expires)


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
    # The GPUs that can take work, computed once per node version (every decision starts here), and
    # their distinct (model tokens, compute capability): usually one, so constraints are checked once.
    healthy: tuple[Gpu, ...] = ()
    kinds: tuple[tuple[frozenset[str], tuple[int, int]], ...] = ()

    def gpu_by_uuid(self, uuid: str) -> Gpu | None:
        """The GPU with this uuid, if the node still publishes it."""
        for gpu in self.gpus:
            if gpu.uuid == uuid:
                return gpu
        return None


def node_info(obj: Mapping[str, Any]) -> NodeInfo:
    """Parse a Kubernetes Node (JSON as the API serves it); a bad annotation marks the node, not the call."""
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("node without metadata.name")
    labels = meta.get("labels") or {}
    annotations = meta.get("annotations") or {}
    gpus: tuple[Gpu, ...] = ()
    gpu_error: str | None = None
    raw = annotations.get(GPUS_ANNOTATION)
    if raw is None:
        gpu_error = f"node publishes no GPUs (annotation {GPUS_ANNOTATION} absent)"
    else:
        try:
            gpus = parse_gpus(raw)
        except ValueError as exc:
            gpu_error = f"annotation {GPUS_ANNOTATION} is malformed: {exc}"
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
        sharing=labels.get(SHARING_LABEL) == SHARING_MEMORY,
        mps=str(labels.get(MPS_LABEL, "")).lower() == "true",
        gpus=gpus,
        gpu_error=gpu_error,
        lock=lock,
        healthy=tuple(g for g in gpus if g.healthy),
        kinds=tuple(dict.fromkeys((g.tokens, g.cc) for g in gpus if g.healthy)),
    )


@dataclass(frozen=True, slots=True)
class ContainerAssignment:
    """One container's GPU memory: `gpu_mem_gib` in total, split evenly over `gpus`."""

    name: str
    gpu_mem_gib: int
    gpus: tuple[str, ...]

    def shares(self) -> dict[str, int]:
        """GiB per GPU uuid; an uneven split (never written by us) rounds up, so it is never under-counted."""
        if not self.gpus:
            return {}
        each = -(-self.gpu_mem_gib // len(self.gpus))
        out: dict[str, int] = {}
        for uuid in self.gpus:
            out[uuid] = out.get(uuid, 0) + each
        return out


@dataclass(frozen=True, slots=True)
class Assignment:
    """The pod's `gpufleet.io/assignment` annotation: which GPUs each GPU-memory container gets."""

    node: str
    containers: tuple[ContainerAssignment, ...]
    ts: float

    def shares(self) -> dict[str, int]:
        """GiB per GPU uuid summed over the containers."""
        out: dict[str, int] = {}
        for container in self.containers:
            for uuid, gib in container.shares().items():
                out[uuid] = out.get(uuid, 0) + gib
        return out

    def to_json(self) -> str:
        """Serialise in the field order docs/handoff.md shows."""
        doc = {
            "node": self.node,
            "containers": [
                {"name": c.name, "gpu_mem_gib": c.gpu_mem_gib, "gpus": list(c.gpus)} for c in self.containers
            ],
            "ts": round(self.ts, 3),
        }
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str) -> Assignment:
        """Parse the annotation; raise ValueError on anything the device plugin could not act on either."""
        try:
            doc = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"assignment is not JSON ({exc.msg})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
            raise ValueError("assignment lacks a node")
        containers = []
        for entry in doc.get("containers") or []:
            if not isinstance(entry, dict):
                raise ValueError("assignment container entry is not an object")
            gib = entry.get("gpu_mem_gib")
            gpus = entry.get("gpus") or []
            if isinstance(gib, bool) or not isinstance(gib, int) or gib < 0:
                raise ValueError("assignment gpu_mem_gib must be a non-negative integer")
            if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
                raise ValueError("assignment gpus must be a list of uuids")
            containers.append(ContainerAssignment(str(entry.get("name", "")), gib, tuple(gpus)))
        ts = doc.get("ts", 0.0)
        if isinstance(ts, bool) or not isinstance(ts, int | float):
            raise ValueError("assignment ts must be unix seconds")
        return cls(doc["node"], tuple(containers), float(ts))
