"""The extender ↔ device plugin GPU-memory hand-off: the one definition of its wire format.

docs/handoff.md describes the protocol; this module is what both sides import, so a name or a format
changes in one place. It holds the resource names, every annotation and label either side reads from
what the other wrote, and the value formats with a parser and a writer each:

- node labels `gpufleet.io/gpu.model` and, before session 18, `gpufleet.io/gpu.product` (published by the
  device plugin): :func:`product_label_value`;
- node annotation `gpufleet.io/gpus` (device plugin → extender): :class:`GpuEntry`, :func:`format_gpus`,
  :func:`parse_gpus`;
- node annotation `gpufleet.io/bind-lock` (extender takes it, device plugin releases it): :class:`BindLock`;
- pod annotation `gpufleet.io/assignment` (extender → device plugin): :class:`Assignment`;
- pod annotation `gpufleet.io/allocated` (device plugin → extender): :func:`parse_allocated`,
  :func:`format_allocated`.

Pure and stdlib only. Parsers raise `ValueError` with a message an operator can act on; each side decides
what that means for it (the extender marks a node or counts a lock as free, the device plugin refuses the
Allocate with its own `HandoffError`).
"""

from __future__ import annotations

import functools
import json
import math
import re
import reprlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Optional

# ----- Resources (advertised by the device plugin) ------------------------------------------------------

GPU_MEM_RESOURCE = "gpufleet.io/gpu-mem"
"""Shared GPU memory, one device per GiB of each GPU (`<uuid>::<k>`); the extender picks the GPU."""
WHOLE_GPU_RESOURCE = "nvidia.com/gpu"
"""Whole GPUs; the kubelet picks them."""
MIG_RESOURCE_PREFIX = f"{WHOLE_GPU_RESOURCE.partition('/')[0]}/mig-"
"""MIG devices under the default resource name: `nvidia.com/mig-<profile>` (mig.strategy mixed)."""

# ----- Node labels --------------------------------------------------------------------------------------

LABEL_PREFIX = "gpufleet.io"
"""The device plugin's default label domain (its `labels.prefix` setting)."""
SHARING_LABEL = f"{LABEL_PREFIX}/gpu-sharing"
"""Set by the operator: with value :data:`SHARING_MEMORY` the node shares GPU memory."""
SHARING_MEMORY = "memory"
SHARING_TIME_SLICING = "time-slicing"  # published by the plugin with named configurations
MPS_LABEL = f"{LABEL_PREFIX}/mps"
"""Set by the operator: `true` when the node enforces GPU-memory limits with MPS."""
PRODUCT_LABEL_NAME = "gpu.product"
"""The model label's name under the device plugin's label prefix."""
PRODUCT_LABEL = f"{LABEL_PREFIX}/{PRODUCT_LABEL_NAME}"
"""Published by the device plugin with GFD's value of `nvidia.com/gpu.product` (docs/deviceplugin.md): the
GPU model as a label value, one model's on a node of several. It said :data:`PRODUCT_MIXED` there before
session 18 (now the value of `gpufleet.io/gpu.model`); the extender still reads that as no model wish."""
PRODUCT_MIXED = "mixed"

# ----- Annotations --------------------------------------------------------------------------------------

GPUS_ANNOTATION = f"{LABEL_PREFIX}/gpus"
"""Node, written by the device plugin: every GPU's memory, model, compute capability, health and NVLinks."""
BIND_LOCK_ANNOTATION = f"{LABEL_PREFIX}/bind-lock"
"""Node, written by the extender at bind, removed by the device plugin after the pod's last Allocate."""
ASSIGNMENT_ANNOTATION = f"{LABEL_PREFIX}/assignment"
"""Pod, written by the extender before the Binding: the GPUs of each GPU-memory container."""
ALLOCATED_ANNOTATION = f"{LABEL_PREFIX}/allocated"
"""Pod, written by the device plugin: the containers it has allocated, comma-separated."""

_LABEL_VALUE = re.compile(r"[^A-Za-z0-9._-]+")

# ----- Limits on what the parsers accept ----------------------------------------------------------------

MAX_ANNOTATION_BYTES = 256 * 1024  # the apiserver's limit for all of an object's annotations together
MAX_GPU_INDEX = 4095  # NVML indexes a node's GPUs from 0; no machine has thousands
MAX_GPU_MEMORY_GIB = 1 << 20  # 1 PiB: no GPU has that much; a larger figure is garbage, not memory
MAX_CC_PART = 999  # compute capabilities are one or two digits per part (8.0, 10.0, 12.1)
MAX_EXPIRES_DIGITS = 12  # unix seconds to the year 33658; more digits is garbage, not a deadline

_CC = re.compile(r"([0-9]{1,3})(?:\.([0-9]{1,3}))?")
_SMALL_INT = re.compile(r"[0-9]{1,9}")  # int() of a long digit string costs time quadratic in its length
_EXPIRES = re.compile(rf"[0-9]{{1,{MAX_EXPIRES_DIGITS}}}(?:\.[0-9]{{1,9}})?")
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 60
_short.maxlevel = 2


def _annotation_text(raw: Any, what: str) -> str:
    """`raw` if it is a string the apiserver could have served as an annotation; ValueError otherwise."""
    if not isinstance(raw, str):
        raise ValueError(f"{what} is not a string but {type(raw).__name__}")
    # Every character is at least one byte, so a longer string is certainly over the limit.
    if len(raw) > MAX_ANNOTATION_BYTES:
        raise ValueError(f"{what} is {len(raw)} characters, over the {MAX_ANNOTATION_BYTES}-byte limit")
    return raw


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


# One decoder for every annotation: json.loads with an option builds a decoder and its scanner per call,
# which at 5,000 nodes is a quarter of the time spent decoding their GPU lists.
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def _load_json(raw: Any, what: str) -> Any:
    """Decode an annotation's JSON; ValueError (never RecursionError) on anything but plain JSON."""
    text = _annotation_text(raw, what)
    try:
        return _DECODER.decode(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{what} is not JSON ({exc.msg} at {exc.pos})") from None
    except RecursionError:
        raise ValueError(f"{what} is nested too deeply") from None


def _bounded_int(value: Any, lo: int, hi: int) -> int | None:
    """`value` as an int in [lo, hi] if it is one (a JSON integer or a short digit string), else None."""
    if isinstance(value, str) and _SMALL_INT.fullmatch(value.strip()):
        value = int(value)
    if isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi:
        return value
    return None


def label_value(text: str) -> str:
    """`text` as a label value: at most 63 of [A-Za-z0-9._-], starting and ending alphanumeric."""
    return _LABEL_VALUE.sub("-", text).strip("-._")[:63].rstrip("-._")


def product_label_value(models: Collection[str]) -> str:
    """The `gpufleet.io/gpu.model` value for a node with GPUs of these models (one entry per GPU or model).

    One model gives that model as a label value (`NVIDIA A100-SXM4-80GB` → `NVIDIA-A100-SXM4-80GB`);
    several give :data:`PRODUCT_MIXED`, because a node label cannot say which card a pod gets.
    """
    distinct = set(models)
    return label_value(distinct.pop()) if len(distinct) == 1 else PRODUCT_MIXED


# ----- gpufleet.io/gpus ---------------------------------------------------------------------------------


def parse_cc(value: Any) -> tuple[int, int]:
    """Parse a CUDA compute capability: "8.0", "9", 8.6 or [8, 6]; ValueError otherwise."""
    if isinstance(value, str) and len(value) <= 16:  # the usual form: a fleet has a handful, parsed once each
        return _parse_short_cc(value)
    return _parse_cc(value)


@functools.lru_cache(maxsize=256)
def _parse_short_cc(value: str) -> tuple[int, int]:
    return _parse_cc(value)


def _parse_cc(value: Any) -> tuple[int, int]:
    if isinstance(value, list | tuple) and len(value) == 2:
        major, minor = (_bounded_int(v, 0, MAX_CC_PART) if isinstance(v, int) else None for v in value)
        if major is not None and minor is not None:
            return major, minor
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        match = _CC.fullmatch(str(value).strip())
        if match:
            return int(match.group(1)), int(match.group(2) or 0)
    raise ValueError(f"compute capability {_short.repr(value)} is not MAJOR.MINOR")


@dataclass(frozen=True, slots=True)
class GpuEntry:
    """One GPU of the node's `gpufleet.io/gpus` annotation.

    JSON: `{"index": 0, "uuid": "GPU-…", "model": "NVIDIA A100-SXM4-80GB", "memory_gib": 80, "cc": "8.0",
    "numa": 0, "healthy": true, "nvlink": {"GPU-peer": 12}}`. `memory_gib` is whole GiB, the number of
    `gpufleet.io/gpu-mem` devices the plugin advertises for the GPU. `"mig": true` (written only then) marks a
    GPU in MIG mode: its MIG devices are the kubelet's (`nvidia.com/mig-*`), not a whole GPU or memory share.
    """

    index: int
    uuid: str
    model: str
    memory_gib: int
    cc: tuple[int, int]
    numa: int | None
    healthy: bool
    nvlink: tuple[tuple[str, int], ...]  # (peer uuid, number of NVLinks joining the two), by peer
    mig: bool = False  # MIG mode on

    def to_json_obj(self) -> dict[str, Any]:
        """The entry as the JSON object above, keys in that order."""
        return {
            "index": self.index,
            "uuid": self.uuid,
            "model": self.model,
            "memory_gib": self.memory_gib,
            "cc": f"{self.cc[0]}.{self.cc[1]}",
            "numa": self.numa,
            "healthy": self.healthy,
            "nvlink": dict(sorted(self.nvlink)),
        } | ({"mig": True} if self.mig else {})

    @classmethod
    def from_json_obj(cls, doc: Any, position: int) -> GpuEntry:
        """Parse entry number `position` of the list; ValueError naming the entry and the problem."""
        index, uuid, model, memory_gib, cc, numa, healthy, links, mig = entry_fields(doc, position)
        return cls(index, uuid, model, memory_gib, cc, numa, healthy, tuple(sorted(links.items())), mig)


EntryFields = tuple[int, str, str, int, tuple[int, int], Optional[int], bool, Mapping[str, int], bool]  # noqa: UP045 (ansible-test's pylint reads | at run time as for Python 3.8)


def entry_fields(doc: Any, position: int) -> EntryFields:
    """The checked fields of entry number `position` of the list, in GpuEntry's order, NVLink as peer uuid ->
    link count in the published order (counts that are not positive integers mean no link, `_links`);
    ValueError naming the entry and the problem. GpuEntry.from_json_obj and the extender's own GPU
    records are both built from it."""
    if not isinstance(doc, dict):
        raise ValueError(f"entry {position} is not an object")
    try:
        uuid = doc["uuid"]
        memory = doc["memory_gib"]
    except KeyError as exc:
        raise ValueError(f"entry {position} lacks {exc.args[0]!r}") from None
    if not isinstance(uuid, str) or not uuid:
        raise ValueError(f"entry {position}: uuid must be a non-empty string")
    if (
        isinstance(memory, bool)
        or not isinstance(memory, (int, float))
        or not 0 <= memory <= MAX_GPU_MEMORY_GIB
    ):
        raise ValueError(f"entry {position}: memory_gib must be a number from 0 to {MAX_GPU_MEMORY_GIB}")
    nvlink = doc.get("nvlink") or {}
    if not isinstance(nvlink, dict):
        raise ValueError(f"entry {position}: nvlink must be an object of peer uuid -> link count")
    index = _bounded_int(doc.get("index", position), 0, MAX_GPU_INDEX)
    if index is None:
        raise ValueError(
            f"entry {position}: index {_short.repr(doc.get('index'))} is not an integer "
            f"from 0 to {MAX_GPU_INDEX}"
        )
    model = doc.get("model") or ""
    if not isinstance(model, str):
        raise ValueError(f"entry {position}: model must be a string")
    try:
        cc = parse_cc(doc.get("cc", "0.0"))
    except ValueError as exc:
        raise ValueError(f"entry {position}: {exc}") from None
    numa = doc.get("numa")
    return (
        index,
        uuid,
        model,
        # The device plugin advertises one device per whole GiB, so a fractional GiB is not usable.
        int(memory) if isinstance(memory, int) else math.floor(memory),
        cc,
        numa if isinstance(numa, int) and not isinstance(numa, bool) else None,
        doc.get("healthy", True) is True,
        _links(nvlink),
        doc.get("mig", False) is True,
    )


def _links(nvlink: dict[Any, Any]) -> Mapping[str, int]:
    """peer uuid -> link count of an entry's `nvlink`, without the counts that are not positive integers (no
    link). The usual object, every count a plain positive int, is returned as it is: checked by two C loops,
    not a Python step per peer (40,000 GPUs with seven peers each at 5,000 NVSwitch nodes)."""
    if not nvlink or (set(map(type, nvlink.values())) == {int} and min(nvlink.values()) > 0):
        return nvlink
    return {p: int(n) for p, n in nvlink.items() if isinstance(n, int) and n > 0}


def format_gpus(entries: Iterable[GpuEntry]) -> str:
    """The `gpufleet.io/gpus` annotation value: a compact JSON list, entries in the order given."""
    return json.dumps([e.to_json_obj() for e in entries], separators=(",", ":"))


def parse_gpus(raw: str) -> tuple[GpuEntry, ...]:
    """Parse the `gpufleet.io/gpus` annotation; ValueError naming the first problem."""
    doc = gpus_json(raw)
    gpus = tuple(GpuEntry.from_json_obj(entry, i) for i, entry in enumerate(doc))
    if len({g.uuid for g in gpus}) != len(gpus):
        raise ValueError("duplicate GPU uuid")
    return gpus


def gpus_json(raw: str) -> list[Any]:
    """The `gpufleet.io/gpus` annotation decoded, its entries not yet checked (`entry_fields` checks each;
    the uuids must differ); ValueError when it is not a JSON list."""
    doc = _load_json(raw, GPUS_ANNOTATION)
    if not isinstance(doc, list):
        raise ValueError("not a JSON list")
    return doc


# ----- gpufleet.io/bind-lock ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BindLock:
    """The node's `gpufleet.io/bind-lock`: which pod is between bind and Allocate, and until when.

    Value: `"<pod-uid> <namespace>/<name> <expires-unix-seconds>"`. Absent or expired means free.
    """

    pod_uid: str
    pod_key: str  # namespace/name
    expires: float

    def live(self, now: float) -> bool:
        """Whether the lock still holds at `now` (unix seconds)."""
        return now < self.expires

    def format(self) -> str:
        """The annotation value; the expiry is rounded up to whole seconds."""
        return f"{self.pod_uid} {self.pod_key} {math.ceil(self.expires)}"

    @classmethod
    def parse(cls, raw: str) -> BindLock:
        """Parse the annotation value; ValueError unless it is '<uid> <namespace>/<name> <expires>'.

        The expiry is unix seconds in digits (at most :data:`MAX_EXPIRES_DIGITS` before the point): never
        `inf` or `nan`, which would hold the node forever or never.
        """
        parts = _annotation_text(raw, BIND_LOCK_ANNOTATION).split()
        if len(parts) != 3 or "/" not in parts[1]:
            raise ValueError(
                f"{BIND_LOCK_ANNOTATION} {_short.repr(raw)} is not '<uid> <namespace>/<name> <expires>'"
            )
        if not _EXPIRES.fullmatch(parts[2]):
            raise ValueError(f"{BIND_LOCK_ANNOTATION} expiry {_short.repr(parts[2])} is not unix seconds")
        return cls(parts[0], parts[1], float(parts[2]))


def lock_held_by(raw: str | None, pod_uid: str) -> bool:
    """Whether the raw annotation value names `pod_uid` as its holder (its first field), live or not.

    Used before removing a lock: a lock taken by another pod in the meantime must survive.
    """
    return bool(raw) and str(raw).startswith(pod_uid + " ")


# ----- gpufleet.io/assignment ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainerAssignment:
    """One container's GPU memory: `gpu_mem_gib` in total, split evenly over `gpus`."""

    name: str
    gpu_mem_gib: int
    gpus: tuple[str, ...]

    def shares(self) -> dict[str, int]:
        """GiB per GPU uuid; an uneven split (never written by the extender) rounds up, never under-counts."""
        if not self.gpus:
            return {}
        each = -(-self.gpu_mem_gib // len(self.gpus))
        out: dict[str, int] = {}
        for uuid in self.gpus:
            out[uuid] = out.get(uuid, 0) + each
        return out


@dataclass(frozen=True, slots=True)
class Assignment:
    """The pod's `gpufleet.io/assignment`: which GPUs each GPU-memory container gets.

    JSON: `{"node": "n1", "containers": [{"name": "c0", "gpu_mem_gib": 4, "gpus": ["GPU-…"]}],
    "ts": 1700000000.0}`, containers in admission order (`spec.initContainers`, then `spec.containers`);
    `ts` is the bind time in unix seconds.
    """

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

    def pending(self, allocated: Collection[str]) -> tuple[ContainerAssignment, ...]:
        """The containers not yet in `allocated` (see :func:`parse_allocated`), in admission order."""
        return tuple(c for c in self.containers if c.name not in allocated)

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
        """Parse the annotation; ValueError on anything the device plugin could not act on."""
        doc = _load_json(raw, ASSIGNMENT_ANNOTATION)
        if not isinstance(doc, dict) or not isinstance(doc.get("node"), str):
            raise ValueError("assignment lacks a node")
        entries = doc.get("containers")
        if not isinstance(entries, list):
            raise ValueError("assignment containers must be a list")
        containers = []
        for entry in entries:
            if not isinstance(entry, dict):
                raise ValueError("assignment container entry is not an object")
            name = entry.get("name")
            gib = entry.get("gpu_mem_gib")
            gpus = entry.get("gpus")
            if not isinstance(name, str):
                raise ValueError("assignment container entry lacks a name")
            if isinstance(gib, bool) or not isinstance(gib, int) or gib < 0:
                raise ValueError(f"assignment container {name!r}: gpu_mem_gib must be a non-negative integer")
            if not isinstance(gpus, list) or not all(isinstance(g, str) for g in gpus):
                raise ValueError(f"assignment container {name!r}: gpus must be a list of uuids")
            containers.append(ContainerAssignment(name, gib, tuple(gpus)))
        ts = doc.get("ts", 0.0)
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not 0 <= ts < 10**MAX_EXPIRES_DIGITS:
            raise ValueError("assignment ts must be unix seconds")
        return cls(doc["node"], tuple(containers), float(ts))


# ----- gpufleet.io/allocated ----------------------------------------------------------------------------


def parse_allocated(raw: str | None) -> tuple[str, ...]:
    """Container names in the pod's `gpufleet.io/allocated` (comma-separated; absent or empty: none).

    ValueError when the value is not a string the apiserver could have served.
    """
    if raw is None:
        return ()
    return tuple(n for n in _annotation_text(raw, ALLOCATED_ANNOTATION).split(",") if n)


def format_allocated(names: Iterable[str]) -> str:
    """The `gpufleet.io/allocated` value for these container names, in allocation order."""
    return ",".join(names)
