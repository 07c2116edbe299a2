"""NVIDIA gpu-feature-discovery's node labels (`nvidia.com/...`), computed by the device plugin.

Workloads select GPU nodes on GFD's labels (`nodeSelector: {nvidia.com/gpu.product: NVIDIA-H200}`), so the
plugin can write GFD's label set with GFD's names and meanings where GFD itself does not run (the setting
`labels.gfd`, docs/deviceplugin.md). The rules are those of GFD v0.20.0 (NVIDIA/k8s-device-plugin,
internal/lm and the go-nvlib device helpers it calls), read there and written here. On the recorded real H200
(tests/realgpu/h200-580.159.04) the result is exactly what GFD wrote on that host.

Pure: the inventory in, labels out. Where GFD would fail as a whole (an unreadable driver version, MIG
attributes NVML will not give) this writes what it can and says so in the log.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from ..logs import log_event
from .gfd_names import DOMAIN, gfd_profile
from .rm.model import MIB, GpuInfo, MigDeviceInfo, NodeInventory

GPU = f"{DOMAIN}/gpu"  # the full-GPU resource; its labels are `nvidia.com/gpu.<name>`
MIG_PREFIX = f"{DOMAIN}/mig-"  # `nvidia.com/mig-<profile>.<name>` under mig.strategy mixed

# Who else writes these labels (docs/deviceplugin.md, "Who writes nvidia.com/"):
TIMESTAMP_LABEL = f"{DOMAIN}/gfd.timestamp"  # GFD's own on every run (unless --no-timestamp); never ours
OPERATOR_GFD_LABEL = f"{DOMAIN}/gpu.deploy.gpu-feature-discovery"  # the GPU operator's GFD DaemonSet selector
NFD_FEATURE_LABELS = "nfd.node.kubernetes.io/feature-labels"  # NFD's list of the labels it manages
OWNED_ANNOTATION = "gpufleet.io/gfd-labels"  # the nvidia.com labels this plugin wrote last

UNKNOWN = "unknown"
CLASS_VGA = 0x030000
CLASS_3D = 0x030200

# The per-resource label names: GFD's baseLabeler, memory, architecture and MIG attributes.
_RESOURCE_NAMES = (
    "product", "count", "replicas", "sharing-strategy", "memory", "family", "compute.major", "compute.minor",
    "multiprocessors", "slices.gi", "slices.ci", "engines.copy", "engines.decoder", "engines.encoder",
    "engines.jpeg", "engines.ofa",
)  # fmt: skip
# Every label name GFD v0.20.0 can write (the timestamp aside): the only nvidia.com labels the plugin ever
# deletes, whatever its ownership annotation says.
_CUDA_LABELS = (
    "driver.major", "driver.minor", "driver.rev", "runtime.major", "runtime.minor", "driver-version.major",
    "driver-version.minor", "driver-version.revision", "driver-version.full", "runtime-version.major",
    "runtime-version.minor", "runtime-version.full",
)  # fmt: skip
_NODE_LABELS = (
    "mig.capable", "mps.capable", "mig.strategy", "vgpu.present", "vgpu.host-driver-version",
    "vgpu.host-driver-branch",
)  # fmt: skip
GFD_LABELS = frozenset(
    [f"{GPU}.{name}" for name in (*_RESOURCE_NAMES, "machine", "mode", "clique")]
    + [f"{DOMAIN}/cuda.{name}" for name in _CUDA_LABELS]
    + [f"{DOMAIN}/{name}" for name in _NODE_LABELS]
)
_MIG_LABEL = re.compile(
    rf"{re.escape(MIG_PREFIX)}[0-9]+(?:c\.[0-9]+)?g\.[0-9]+gb(?:[.-][a-z.]+)?\."
    rf"(?:{'|'.join(re.escape(n) for n in _RESOURCE_NAMES)})"
)
_INSANE = re.compile(r"[^A-Za-z0-9\-_. ]")
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?")


@dataclass(frozen=True)
class Sharing:
    """How whole GPUs are shared, in GFD's terms: strategy `none` or `time-slicing`, devices per GPU, and
    whether the shared resource is renamed (then its product carries no `-SHARED`)."""

    strategy: str = "none"
    replicas: int = 1
    renamed: bool = False


def is_gfd_label(key: str) -> bool:
    """Whether `key` is a label GFD writes (the only `nvidia.com/` labels the plugin may delete)."""
    return key in GFD_LABELS or _MIG_LABEL.fullmatch(key) is not None


def sanitise(text: str) -> str:
    """GFD's label value of a name: characters other than letters, digits, `-_.` and space dropped, runs of
    spaces as one `-` ("NVIDIA H200" → "NVIDIA-H200")."""
    return "-".join(_INSANE.sub("", text).split())


def family(major: int, minor: int) -> str:
    """GFD's architecture family of a compute capability."""
    if major == 7:
        return "volta" if minor < 5 else "turing"
    if major == 8:
        return "ampere" if minor < 9 else "ada-lovelace"
    names = {1: "tesla", 2: "fermi", 3: "kepler", 5: "maxwell", 6: "pascal", 9: "hopper", 10: "blackwell",
             12: "blackwell", 13: "rubin"}  # fmt: skip
    return names.get(major, "undefined")


def _resource(name: str, labels: Mapping[str, object]) -> dict[str, str]:
    return {f"{name}.{key}": str(value) for key, value in labels.items()}


def _base(count: int, replicas: int, strategy: str, *parts: str, shared: bool = False) -> dict[str, object]:
    """GFD's product, count, replicas and sharing-strategy of one resource."""
    words = [sanitise(p) for p in parts if p]
    words = [w for w in words if w]
    if shared:
        words.append("SHARED")
    return {"product": "-".join(words), "count": count, "replicas": replicas, "sharing-strategy": strategy}


def _versions(inv: NodeInventory) -> dict[str, str]:
    """The driver's and CUDA's versions, in GFD's deprecated and current names."""
    out: dict[str, str] = {}
    parts = inv.driver_version.split(".")
    if 2 <= len(parts) <= 3:
        major, minor, rev = parts[0], parts[1], parts[2] if len(parts) == 3 else ""
        out |= {"cuda.driver.major": major, "cuda.driver.minor": minor, "cuda.driver.rev": rev}
        out |= {
            "cuda.driver-version.major": major,
            "cuda.driver-version.minor": minor,
            "cuda.driver-version.revision": rev,
            "cuda.driver-version.full": inv.driver_version,
        }
    else:
        why = f"driver version {inv.driver_version!r} is not X.Y[.Z]"
        log_event("gfd_label_skipped", level="warning", labels="cuda.driver*", reason=why)
    if inv.cuda_driver_version:
        cuda_major, cuda_minor = inv.cuda_driver_version // 1000, inv.cuda_driver_version % 1000 // 10
        out |= {"cuda.runtime.major": str(cuda_major), "cuda.runtime.minor": str(cuda_minor)}
        out |= {
            "cuda.runtime-version.major": str(cuda_major),
            "cuda.runtime-version.minor": str(cuda_minor),
            "cuda.runtime-version.full": f"{cuda_major}.{cuda_minor}",
        }
    return {f"{DOMAIN}/{k}": v for k, v in out.items()}


def _whole_gpus(inv: NodeInventory, sharing: Sharing) -> dict[str, str]:
    """`nvidia.com/gpu.*` for whole GPUs: one model's (GFD writes every model's under the same names and
    keeps whichever comes last, in random order; here the first GPU's, of those without MIG if any)."""
    whole = [g for g in inv.gpus if not g.mig_enabled]
    pick = (whole or list(inv.gpus))[0]
    if len({g.model for g in inv.gpus}) > 1:
        log_event(
            "gfd_mixed_models", models=",".join(sorted({g.model for g in inv.gpus})), labelled=pick.model
        )
    count = sum(g.model == pick.model for g in inv.gpus)
    if whole:  # with sharing as configured
        replicas = sharing.replicas if sharing.strategy != "none" else 1
        strategy = sharing.strategy if replicas > 1 else "none"
        labels = _base(count, replicas, strategy, pick.model, shared=replicas > 1 and not sharing.renamed)
    else:  # GPUs in MIG mode only: GFD labels them without sharing
        labels = _base(count, 0, "none", pick.model)
    mib = pick.memory_bytes // MIB
    if mib:
        labels["memory"] = mib
    major, minor = pick.cc
    if major:
        labels |= {"family": family(major, minor), "compute.major": major, "compute.minor": minor}
    return _resource(GPU, labels)


def _mig_resource(name: str, mig: MigDeviceInfo, parent: GpuInfo, count: int) -> dict[str, str]:
    """One MIG resource (`nvidia.com/gpu` under single, `nvidia.com/mig-<profile>` under mixed): product
    `<model>-MIG-<profile>`, count, and the first device's attributes (memory from its memory info where NVML
    gives no attributes)."""
    labels = _base(count, 1, "none", parent.model, "MIG", gfd_profile(mig.profile))
    attributes = dict(mig.attributes)
    if not attributes:
        why = f"NVML gave no attributes of MIG device {mig.uuid}; memory from its memory info"
        log_event("gfd_label_skipped", level="warning", labels=f"{name}.<attributes>", reason=why)
        attributes = {"memory": mig.memory_bytes // MIB}
    return _resource(name, labels | attributes)


def _mig(inv: NodeInventory, strategy: str) -> dict[str, str]:
    out = {f"{DOMAIN}/mig.strategy": strategy}
    enabled = [g for g in inv.gpus if g.mig_enabled]
    devices = [(m, g) for g in enabled for m in g.mig_devices]
    by_profile: dict[str, list[tuple[MigDeviceInfo, GpuInfo]]] = {}
    for mig, parent in devices:
        by_profile.setdefault(gfd_profile(mig.profile), []).append((mig, parent))
    if strategy == "mixed":
        for profile, found in by_profile.items():
            out |= _mig_resource(f"{MIG_PREFIX}{profile}", *found[0], len(found))
        return out
    if not enabled:  # single without a GPU in MIG mode: whole GPUs, as strategy none
        return out
    problem = (
        "a GPU in MIG mode has no MIG device" if any(not g.mig_devices for g in enabled)
        else "some GPUs have MIG enabled and some not" if len(enabled) != len(inv.gpus)
        else "MIG devices of more than one profile" if len(by_profile) != 1
        else ""
    )  # fmt: skip
    if problem:  # GFD's labels for a layout strategy single cannot serve
        log_event("gfd_mig_invalid", level="warning", reason=problem)
        invalid = _base(0, 0, "", enabled[0].model, "MIG", "INVALID") | {"memory": 0}
        return out | _resource(GPU, invalid)
    found = next(iter(by_profile.values()))  # one profile: `problem` is empty only then
    return out | _mig_resource(GPU, *found[0], len(found))


def _mode(inv: NodeInventory) -> str:
    """`compute` (3D controllers), `graphics` (VGA controllers) or `unknown` (mixed or unread classes)."""
    classes = {g.pci_class for g in inv.gpus}
    if len(classes) != 1:
        return UNKNOWN
    return {CLASS_3D: "compute", CLASS_VGA: "graphics"}.get(classes.pop(), UNKNOWN)


def _vgpu(inv: NodeInventory) -> dict[str, str]:
    if inv.vgpu is None:  # GFD writes no vgpu label when it cannot read the PCI configuration either
        return {}
    out = {f"{DOMAIN}/vgpu.present": "true" if inv.vgpu else "false"}
    for vgpu in inv.vgpu:
        if vgpu.host_driver_version or vgpu.host_driver_branch:
            out[f"{DOMAIN}/vgpu.host-driver-version"] = vgpu.host_driver_version
            out[f"{DOMAIN}/vgpu.host-driver-branch"] = vgpu.host_driver_branch
    return out


def gfd_labels(
    inv: NodeInventory, mig_strategy: str = "none", sharing: Sharing | None = None
) -> dict[str, str]:
    """GFD's labels for a node with these GPUs, MIG strategy and sharing ({} without GPUs).

    GFD's `nvidia.com/gfd.timestamp` is never written: it changes on every run, and its presence is how
    another writer (GFD itself) is told apart (see :func:`gfd_elsewhere`). `mps.capable` is always false:
    GFD's MPS strategy replicates `nvidia.com/gpu`, which the plugin does not do (its MPS enforces GPU-memory
    shares, `gpufleet.io/gpu-sharing=memory`). A value that is not a valid label value is left out.
    """
    if not inv.gpus:
        return {}
    machine = UNKNOWN if inv.machine is None else sanitise(inv.machine)
    labels = {f"{GPU}.machine": machine}
    labels |= _versions(inv)
    labels[f"{DOMAIN}/mig.capable"] = "true" if any(g.mig_capable for g in inv.gpus) else "false"
    labels[f"{DOMAIN}/mps.capable"] = "false"
    labels |= _whole_gpus(inv, sharing or Sharing())
    if mig_strategy != "none":
        labels |= _mig(inv, mig_strategy)
    labels[f"{GPU}.mode"] = _mode(inv)
    cliques = {g.clique for g in inv.gpus if g.clique}
    if len(cliques) == 1:
        labels[f"{GPU}.clique"] = cliques.pop()
    labels |= _vgpu(inv)
    bad = sorted(k for k, v in labels.items() if len(v) > 63 or not _LABEL_VALUE.fullmatch(v))
    if bad:
        log_event(
            "gfd_label_skipped", level="warning", labels=",".join(bad), reason="not a valid label value"
        )
    return {k: v for k, v in labels.items() if k not in bad}


def nfd_managed(annotations: Mapping[str, str]) -> set[str]:
    """The GFD labels node-feature-discovery manages on this node (its `feature-labels` annotation, or an
    NFD instance's `<instance>.nfd.node.kubernetes.io/feature-labels`)."""
    managed: set[str] = set()
    for key, value in annotations.items():
        if key == NFD_FEATURE_LABELS or key.endswith("." + NFD_FEATURE_LABELS):
            managed |= {name for name in str(value).split(",") if is_gfd_label(name)}
    return managed


def gfd_elsewhere(labels: Mapping[str, str], annotations: Mapping[str, str]) -> str:
    """Why GFD itself labels this node ("" when nothing says so): the GPU operator schedules its GFD here,
    GFD's timestamp label is present, or NFD manages GFD's labels."""
    if labels.get(OPERATOR_GFD_LABEL) == "true":
        return f"the GPU operator runs gpu-feature-discovery here ({OPERATOR_GFD_LABEL}=true)"
    if TIMESTAMP_LABEL in labels:
        return f"gpu-feature-discovery labels this node ({TIMESTAMP_LABEL})"
    managed = nfd_managed(annotations)
    if managed:
        return f"node-feature-discovery applies gpu-feature-discovery's labels ({min(managed)}, ...)"
    return ""


def owned(annotations: Mapping[str, str]) -> set[str]:
    """The GFD labels this plugin wrote last (its annotation), GFD's names only."""
    return {k for k in str(annotations.get(OWNED_ANNOTATION, "")).split(",") if is_gfd_label(k)}


def gfd_patch(
    wanted: Mapping[str, str], labels: Mapping[str, str], annotations: Mapping[str, str]
) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """(labels, annotations) of a merge patch that makes this plugin's GFD labels `wanted`: sets them,
    deletes those it wrote before and no longer wants (never one NFD manages now), and records what it
    wrote in :data:`OWNED_ANNOTATION` (removed when nothing is)."""
    keep: Collection[str] = nfd_managed(annotations)
    stale: dict[str, str | None] = {
        k: None for k in owned(annotations) if k not in wanted and k in labels and k not in keep
    }
    record = ",".join(sorted(wanted)) or None
    changes = {k: v for k, v in wanted.items() if labels.get(k) != v}
    return {**stale, **changes}, (
        {OWNED_ANNOTATION: record} if annotations.get(OWNED_ANNOTATION) != record else {}
    )
