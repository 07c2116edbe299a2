"""What a pod asks for: GPU memory per container or whole GPUs, plus model, capability and policy wishes.

Parsing is strict: an absurd request (negative, fractional, both kinds at once, an unknown policy) raises
`RequestError` with a message that ends up in the scheduler's event for the pod, because silently
rounding a GPU request is how pods end up on the wrong card.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..handoff import GPU_MEM_RESOURCE, PRODUCT_LABEL, PRODUCT_MIXED, WHOLE_GPU_RESOURCE, parse_cc
from ..quantity import QuantityError, QuantityTooLarge, parse_quantity, preview
from .model import (
    GPU_COUNT_ANNOTATION,
    GPU_POLICY_ANNOTATION,
    MIN_CC_ANNOTATION,
    MODEL_ANNOTATION,
    MODEL_LABELS,
    NODE_POLICY_ANNOTATION,
    PREFER_ANNOTATION,
    model_tokens,
)

# More GPUs than any machine carries; a larger gpu-count is a typo, not a wish.
MAX_GPUS_PER_CONTAINER = 64
# A model wish names a few card families ("a100,h100"); each alternative costs a check per GPU per node.
MAX_MODEL_ALTERNATIVES = 16
MAX_MODEL_ANNOTATION_CHARS = 1024


class RequestError(ValueError):
    """The pod's GPU request cannot be satisfied anywhere as written."""


class Policy(StrEnum):
    """How to place: fill what is used first (binpack) or keep load even (spread)."""

    BINPACK = "binpack"
    SPREAD = "spread"


def _mapping(value: Any, what: str) -> Mapping[str, Any]:
    """`value` when it is a JSON object (None counts as empty); RequestError otherwise."""
    if isinstance(value, dict):  # what JSON decodes to
        return value
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise RequestError(f"{what} is not an object")
    return value


def _objects(value: Any, what: str) -> list[Mapping[str, Any]]:
    """`value` when it is a list of JSON objects (None counts as empty); RequestError otherwise."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, Mapping) for item in value):
        raise RequestError(f"{what} is not a list of objects")
    return value


def _count(resources: Any, name: str, where: str) -> int:
    """A container's request for an extended resource, which Kubernetes only allows as a whole number."""
    resources = _mapping(resources, f"{where} resources")
    requests = _mapping(resources.get("requests"), f"{where} resources.requests")
    limits = _mapping(resources.get("limits"), f"{where} resources.limits")
    raw = requests.get(name, limits.get(name))
    if raw is None:
        return 0
    try:
        qty = parse_quantity(raw)
    except QuantityTooLarge:
        raise RequestError(f"{where} requests {name}: more than any node offers (2^63 or more)") from None
    except QuantityError as exc:
        raise RequestError(f"{where} requests {name}: {exc}") from None
    if qty < 0:
        raise RequestError(f"{where} requests {name}={preview(raw)}: negative")
    if qty.denominator != 1:
        raise RequestError(f"{where} requests {name}={preview(raw)}: not a whole number")
    return int(qty)


@dataclass(frozen=True, slots=True)
class ContainerRequest:
    """One container's GPU memory: `gib` in total, split evenly over `gpus` GPUs."""

    name: str
    gib: int
    gpus: int

    @property
    def share(self) -> int:
        """GiB needed on each of the container's GPUs."""
        return self.gib // self.gpus


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """Everything the extender needs to know about one pod's GPU wishes."""

    uid: str
    namespace: str
    name: str
    mem: tuple[ContainerRequest, ...]
    whole: int
    models: tuple[frozenset[str], ...]
    min_cc: tuple[int, int] | None
    most_capable: bool
    node_policy: Policy | None
    gpu_policy: Policy | None

    @property
    def key(self) -> str:
        """namespace/name."""
        return f"{self.namespace}/{self.name}"

    @property
    def kind(self) -> str:
        """ "mem" (shared GPU memory), "whole" (whole GPUs) or "none"."""
        if self.mem:
            return "mem"
        return "whole" if self.whole else "none"

    @property
    def constrained(self) -> bool:
        """Whether only some GPUs qualify (model or capability)."""
        return bool(self.models) or self.min_cc is not None

    @property
    def multi(self) -> bool:
        """Whether the pod takes several GPUs for one container (or whole GPUs): the score then weighs how
        well they are linked."""
        return self.whole > 1 or any(c.gpus > 1 for c in self.mem)

    @property
    def max_share(self) -> int:
        """The largest per-GPU share among the containers (0 for whole-GPU requests)."""
        return max((c.share for c in self.mem), default=0)

    def gpu_qualifies(self, tokens: frozenset[str], cc: tuple[int, int]) -> bool:
        """Whether a GPU with these model tokens and compute capability satisfies the constraints."""
        if self.min_cc is not None and cc < self.min_cc:
            return False
        return not self.models or any(want <= tokens for want in self.models)

    def describe_constraints(self) -> str:
        """Human-readable constraints for failure messages."""
        parts = []
        if self.models:
            parts.append("model " + " or ".join("-".join(sorted(m)) for m in self.models))
        if self.min_cc is not None:
            parts.append(f"compute capability >= {self.min_cc[0]}.{self.min_cc[1]}")
        return " and ".join(parts)


def _policy(annotations: Mapping[str, Any], key: str) -> Policy | None:
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        return Policy(str(raw).strip().lower())
    except ValueError:
        raise RequestError(f"annotation {key}={preview(raw)}: use binpack or spread") from None


def whole_gpus(spec: Mapping[str, Any]) -> int:
    """Whole GPUs the kubelet reserves for a pod: init containers run one at a time and hand devices on."""
    init = [
        _count(c.get("resources"), WHOLE_GPU_RESOURCE, f"init container {preview(c.get('name'))}")
        for c in _objects(spec.get("initContainers"), "spec.initContainers")
    ]
    app = [
        _count(c.get("resources"), WHOLE_GPU_RESOURCE, f"container {preview(c.get('name'))}")
        for c in _objects(spec.get("containers"), "spec.containers")
    ]
    return max([*init, sum(app)])


def parse_pod(pod: Mapping[str, Any]) -> GpuRequest:
    """Read a pod (Kubernetes JSON) into a GpuRequest; raise RequestError for requests that make no sense."""
    if not isinstance(pod, Mapping):
        raise RequestError("Pod is not an object")
    meta = _mapping(pod.get("metadata"), "Pod metadata")
    spec = _mapping(pod.get("spec"), "Pod spec")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("Pod lacks metadata.name")
    namespace = str(meta.get("namespace") or "default")
    uid = str(meta.get("uid") or "")
    annotations = _mapping(meta.get("annotations"), "Pod metadata.annotations")

    gpu_count = 1
    if GPU_COUNT_ANNOTATION in annotations:
        raw = annotations[GPU_COUNT_ANNOTATION]
        # At most three digits before int(): the annotation is user-written and int() of a long digit
        # string costs time quadratic in its length.
        if (
            not re.fullmatch(r"\s{0,8}\d{1,3}\s{0,8}", str(raw))
            or not 1 <= int(raw) <= MAX_GPUS_PER_CONTAINER
        ):
            raise RequestError(
                f"annotation {GPU_COUNT_ANNOTATION}={preview(raw)}: "
                f"a whole number from 1 to {MAX_GPUS_PER_CONTAINER}"
            )
        gpu_count = int(raw)

    mem: list[ContainerRequest] = []
    # Init containers first: the kubelet admits (and the device plugin allocates) them in that order.
    for group, label in (("initContainers", "init container"), ("containers", "container")):
        for container in _objects(spec.get(group), f"spec.{group}"):
            cname = str(container.get("name") or "")
            gib = _count(container.get("resources"), GPU_MEM_RESOURCE, f"{label} {preview(cname)}")
            if gib == 0:
                continue
            if gib % gpu_count:
                raise RequestError(
                    f"{label} {preview(cname)} asks {gib} GiB over {gpu_count} GPUs; the split must be even"
                )
            mem.append(ContainerRequest(cname, gib, gpu_count))
    whole = whole_gpus(spec)
    if mem and whole:
        raise RequestError(
            f"pod requests both {GPU_MEM_RESOURCE} and {WHOLE_GPU_RESOURCE}; a node offers one or the other"
        )

    models: list[frozenset[str]] = []
    if MODEL_ANNOTATION in annotations:
        raw = str(annotations[MODEL_ANNOTATION])
        # Every alternative is checked against every GPU of every candidate node: a pod naming thousands
        # would multiply each filter's work by thousands.
        if len(raw) > MAX_MODEL_ANNOTATION_CHARS or raw.count(",") >= MAX_MODEL_ALTERNATIVES:
            raise RequestError(
                f"annotation {MODEL_ANNOTATION}: at most {MAX_MODEL_ALTERNATIVES} models "
                f"in {MAX_MODEL_ANNOTATION_CHARS} characters"
            )
        for alternative in raw.split(","):
            tokens = model_tokens(alternative)
            if tokens and tokens not in models:
                models.append(tokens)
        if not models:
            raise RequestError(f"annotation {MODEL_ANNOTATION} names no model")
    selector = _mapping(spec.get("nodeSelector"), "Pod spec.nodeSelector")
    for label in MODEL_LABELS:
        if label in selector and not models:
            value = str(selector[label])
            if label == PRODUCT_LABEL and value == PRODUCT_MIXED:
                continue  # the plugin's value on a node of several models before session 18: no model wish
            models.append(model_tokens(value))

    min_cc = None
    if MIN_CC_ANNOTATION in annotations:
        try:
            min_cc = parse_cc(annotations[MIN_CC_ANNOTATION])
        except ValueError as exc:
            raise RequestError(f"annotation {MIN_CC_ANNOTATION}: {exc}") from None

    prefer = str(annotations.get(PREFER_ANNOTATION, "")).strip().lower()
    if prefer not in ("", "most-capable"):
        raise RequestError(
            f"annotation {PREFER_ANNOTATION}={preview(prefer)}: the only preference is most-capable"
        )

    return GpuRequest(
        uid=uid,
        namespace=namespace,
        name=name,
        mem=tuple(mem),
        whole=whole,
        models=tuple(models),
        min_cc=min_cc,
        most_capable=prefer == "most-capable",
        node_policy=_policy(annotations, NODE_POLICY_ANNOTATION),
        gpu_policy=_policy(annotations, GPU_POLICY_ANNOTATION),
    )
