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
from fractions import Fraction
from typing import Any

from gpufleet.extender.model import (
    GPU_COUNT_ANNOTATION,
    GPU_POLICY_ANNOTATION,
    MIN_CC_ANNOTATION,
    MODEL_ANNOTATION,
    MODEL_LABELS,
    NODE_POLICY_ANNOTATION,
    PREFER_ANNOTATION,
    model_tokens,
)
from gpufleet.handoff import GPU_MEM_RESOURCE, PRODUCT_LABEL, PRODUCT_MIXED, WHOLE_GPU_RESOURCE, parse_cc

# More GPUs than any machine carries; a larger gpu-count is a typo, not a wish.
MAX_GPUS_PER_CONTAINER = 64


class RequestError(ValueError):
    """The pod's GPU request cannot be satisfied anywhere as written."""


class Policy(StrEnum):
    """How to place: fill what is used first (binpack) or keep load even (spread)."""

    BINPACK = "binpack"
    SPREAD = "spread"


_QUANTITY = re.compile(r"([+-]?)(\d+(?:\.\d*)?|\.\d+)(.*)")
_SUFFIX = {
    "": Fraction(1),
    "n": Fraction(1, 10**9),
    "u": Fraction(1, 10**6),
    "m": Fraction(1, 1000),
    "k": Fraction(10**3),
    "M": Fraction(10**6),
    "G": Fraction(10**9),
    "T": Fraction(10**12),
    "P": Fraction(10**15),
    "E": Fraction(10**18),
    "Ki": Fraction(2**10),
    "Mi": Fraction(2**20),
    "Gi": Fraction(2**30),
    "Ti": Fraction(2**40),
    "Pi": Fraction(2**50),
    "Ei": Fraction(2**60),
}


def parse_quantity(value: Any) -> Fraction:
    """Parse a Kubernetes resource quantity ("4", "1500m", "2Ki", "1e3") exactly."""
    if isinstance(value, bool):
        raise ValueError(f"quantity {value!r} is not a number")
    if isinstance(value, int):
        return Fraction(value)
    text = str(value).strip()
    match = _QUANTITY.fullmatch(text)
    if not match:
        raise ValueError(f"quantity {value!r} is not a Kubernetes quantity")
    sign, digits, suffix = match.groups()
    number = Fraction(digits)
    if suffix in _SUFFIX:
        number *= _SUFFIX[suffix]
    elif re.fullmatch(r"[eE][+-]?\d+", suffix):
        number *= Fraction(10) ** int(suffix[1:])
    else:
        raise ValueError(f"quantity {value!r} has an unknown suffix {suffix!r}")
    return -number if sign == "-" else number


def _count(resources: Mapping[str, Any], name: str, where: str) -> int:
    """A container's request for an extended resource, which Kubernetes only allows as a whole number."""
    requests = resources.get("requests") or {}
    limits = resources.get("limits") or {}
    raw = requests.get(name, limits.get(name))
    if raw is None:
        return 0
    try:
        qty = parse_quantity(raw)
    except ValueError as exc:
        raise RequestError(f"{where} requests {name}={raw!r}: {exc}") from None
    if qty < 0:
        raise RequestError(f"{where} requests {name}={raw}: negative")
    if qty.denominator != 1:
        raise RequestError(f"{where} requests {name}={raw}: not a whole number")
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


def _policy(annotations: Mapping[str, str], key: str) -> Policy | None:
    raw = annotations.get(key)
    if raw is None:
        return None
    try:
        return Policy(raw.strip().lower())
    except ValueError:
        raise RequestError(f"annotation {key}={raw!r}: use binpack or spread") from None


def whole_gpus(spec: Mapping[str, Any]) -> int:
    """Whole GPUs the kubelet reserves for a pod: init containers run one at a time and hand devices on."""
    init = [
        _count(c.get("resources") or {}, WHOLE_GPU_RESOURCE, f"init container {c.get('name')!r}")
        for c in spec.get("initContainers") or []
    ]
    app = [
        _count(c.get("resources") or {}, WHOLE_GPU_RESOURCE, f"container {c.get('name')!r}")
        for c in spec.get("containers") or []
    ]
    return max(max(init, default=0), sum(app))


def parse_pod(pod: Mapping[str, Any]) -> GpuRequest:
    """Read a pod (Kubernetes JSON) into a GpuRequest; raise RequestError for requests that make no sense."""
    if not isinstance(pod, Mapping):
        raise RequestError("Pod is not an object")
    meta = pod.get("metadata") or {}
    spec = pod.get("spec") or {}
    if not isinstance(meta, Mapping) or not isinstance(spec, Mapping):
        raise RequestError("Pod metadata/spec are not objects")
    name = meta.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("Pod lacks metadata.name")
    namespace = str(meta.get("namespace") or "default")
    uid = str(meta.get("uid") or "")
    annotations = meta.get("annotations") or {}

    gpu_count = 1
    if GPU_COUNT_ANNOTATION in annotations:
        raw = annotations[GPU_COUNT_ANNOTATION]
        if not re.fullmatch(r"\s*\d+\s*", str(raw)) or not 1 <= int(raw) <= MAX_GPUS_PER_CONTAINER:
            raise RequestError(
                f"annotation {GPU_COUNT_ANNOTATION}={raw!r}: "
                f"a whole number from 1 to {MAX_GPUS_PER_CONTAINER}"
            )
        gpu_count = int(raw)

    mem: list[ContainerRequest] = []
    # Init containers first: the kubelet admits (and the device plugin allocates) them in that order.
    for group, label in (("initContainers", "init container"), ("containers", "container")):
        for container in spec.get(group) or []:
            cname = str(container.get("name") or "")
            gib = _count(container.get("resources") or {}, GPU_MEM_RESOURCE, f"{label} {cname!r}")
            if gib == 0:
                continue
            if gib % gpu_count:
                raise RequestError(
                    f"{label} {cname!r} asks {gib} GiB over {gpu_count} GPUs; the split must be even"
                )
            mem.append(ContainerRequest(cname, gib, gpu_count))
    whole = whole_gpus(spec)
    if mem and whole:
        raise RequestError(
            f"pod requests both {GPU_MEM_RESOURCE} and {WHOLE_GPU_RESOURCE}; a node offers one or the other"
        )

    models: list[frozenset[str]] = []
    if MODEL_ANNOTATION in annotations:
        for alternative in str(annotations[MODEL_ANNOTATION]).split(","):
            tokens = model_tokens(alternative)
            if tokens:
                models.append(tokens)
        if not models:
            raise RequestError(f"annotation {MODEL_ANNOTATION} names no model")
    selector = spec.get("nodeSelector") or {}
    for label in MODEL_LABELS:
        if label in selector and not models:
            value = str(selector[label])
            if label == PRODUCT_LABEL and value == PRODUCT_MIXED:
                continue  # the device plugin's label on a node with several models: no model wish
            models.append(model_tokens(value))

    min_cc = None
    if MIN_CC_ANNOTATION in annotations:
        try:
            min_cc = parse_cc(annotations[MIN_CC_ANNOTATION])
        except ValueError as exc:
            raise RequestError(f"annotation {MIN_CC_ANNOTATION}: {exc}") from None

    prefer = str(annotations.get(PREFER_ANNOTATION, "")).strip().lower()
    if prefer not in ("", "most-capable"):
        raise RequestError(f"annotation {PREFER_ANNOTATION}={prefer!r}: the only preference is most-capable")

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
