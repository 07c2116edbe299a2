"""Node labels and the `gpufleet.io/gpus` annotation: computed purely, written with the kubernetes client.

Labels let pods select GPU models (`nodeSelector: {gpufleet.io/gpu.product: NVIDIA-A100-SXM4-80GB}`);
the annotation gives the extender each GPU's memory, health and NVLinks (docs/handoff.md).
Where a label of ours has a name gpu-feature-discovery also uses (after the domain), its value is GFD's,
taken from `gpufleet.deviceplugin.gfd` (:data:`GFD_NAMES`); gpufleet's own meanings have names GFD does not
use (`gpu.model`: every GPU's model, `mixed` on a node of several, whatever the sharing or MIG). GFD's own
label set, under `nvidia.com/`, is written beside ours with `labels.gfd`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from gpufleet.deviceplugin import gfd
from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.deviceplugin.rm.model import NodeInventory
from gpufleet.handoff import (
    GPUS_ANNOTATION,
    LABEL_PREFIX,
    PRODUCT_LABEL_NAME,
    GpuEntry,
    format_gpus,
    label_value,
    product_label_value,
)
from gpufleet.logs import log_event

# The label families the plugin writes under its prefix (`gpu.count`, `driver.major`,
# `cuda.runtime-version.major`, `mig.strategy`, `mig-<profile>.count`). Only these are the plugin's to delete:
# other labels under the same domain belong to the operator or the extender (`gpufleet.io/gpu-sharing`,
# `gpufleet.io/mps`) and must survive every publish.
OWNED_LABEL_FAMILIES = ("gpu.", "driver.", "cuda.", "mig.", "mig-")


# The names gpufleet writes under its prefix that gpu-feature-discovery also writes (after the domain). Their
# values are GFD's, taken from :func:`gpufleet.deviceplugin.gfd.gfd_labels` and never computed a second time:
# a selector on `gpufleet.io/gpu.product` matches where one on `nvidia.com/gpu.product` does, in every case
# (time-slicing's `-SHARED`, a node of several models, `-MIG-INVALID`). `mig-<profile>.*` likewise.
GFD_NAMES = (
    "gpu.count", PRODUCT_LABEL_NAME, "gpu.memory", "gpu.compute.major", "gpu.compute.minor",
    "cuda.runtime-version.major", "cuda.runtime-version.minor", "mig.strategy",
)  # fmt: skip
GFD_MIG_NAMES = ("count", "memory", "product")  # of each `mig-<profile>.` under mig.strategy mixed
MODEL_LABEL_NAME = "gpu.model"  # gpufleet's own: every GPU's model, `mixed` with several; no GFD name


def node_labels(
    inv: NodeInventory,
    prefix: str = LABEL_PREFIX,
    mig_strategy: str = "none",
    sharing: gfd.Sharing | None = None,
    gfd_set: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """Labels describing the node's GPUs (empty when there are none): gpufleet's own, and those of
    :data:`GFD_NAMES` with GFD's values for this MIG strategy and sharing (``gfd_set``: GFD's labels already
    computed for them, saving a second computation and its log lines)."""
    if not inv.gpus:
        return {}
    theirs = gfd.gfd_labels(inv, mig_strategy, sharing) if gfd_set is None else gfd_set
    labels = {
        "gpu.present": "true",
        MODEL_LABEL_NAME: product_label_value([g.model for g in inv.gpus]),
        "gpu.nvlink": "true" if any(g.nvlinks for g in inv.gpus) else "false",
        "gpu.nvswitch": "true" if inv.nvswitch_count else "false",
    }
    if inv.driver_version:
        labels["driver.version"] = label_value(inv.driver_version)
        labels["driver.major"] = label_value(inv.driver_version.split(".")[0])  # NVML's text, made a value
    labels |= gfd_named(theirs)
    return {f"{prefix}/{k}": v for k, v in labels.items()}


def gfd_named(theirs: Mapping[str, str]) -> dict[str, str]:
    """Of GFD's labels (``nvidia.com/...``), those gpufleet also writes under its prefix, unprefixed."""
    out = {}
    for key, value in theirs.items():
        name = key.removeprefix(f"{gfd.DOMAIN}/")
        head, _, tail = name.rpartition(".")
        if name in GFD_NAMES or (name.startswith("mig-") and tail in GFD_MIG_NAMES and head):
            out[name] = value
    return out


def gpus_annotation(inv: NodeInventory, health: Mapping[str, GpuHealth]) -> str:
    """The `gpufleet.io/gpus` annotation (`gpufleet.handoff.GpuEntry`), in GPU index order."""
    return format_gpus(
        GpuEntry(
            index=g.index,
            uuid=g.uuid,
            model=g.model,
            memory_gib=g.memory_gib,
            cc=g.cc,
            numa=g.numa,
            healthy=health.get(g.uuid, GpuHealth()).healthy,
            nvlink=tuple(sorted(g.nvlinks.items())),
            mig=g.mig_enabled,
        )
        for g in inv.gpus
    )


def node_patch(
    labels: Mapping[str, str],
    annotation: str,
    previous_labels: Mapping[str, str],
    prefix: str,
    gfd_labels: Mapping[str, str] | None = None,
    previous_annotations: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A merge patch setting our labels and annotation and deleting our labels that no longer apply.

    "Ours" means the families of :data:`OWNED_LABEL_FAMILIES` under ``prefix``; anything else under the
    domain (the node's `gpu-sharing` and `mps` switches) is left alone. With ``gfd_labels`` (None: leave
    `nvidia.com/` alone), GFD's labels are made exactly those this plugin writes, by
    :func:`gpufleet.deviceplugin.gfd.gfd_patch`: it deletes only GFD labels it recorded writing itself.
    """
    owned = tuple(f"{prefix}/{family}" for family in OWNED_LABEL_FAMILIES)
    stale = {k: None for k in previous_labels if k.startswith(owned) and k not in labels}
    patch_labels: dict[str, str | None] = {**stale, **labels}
    annotations: dict[str, str | None] = {GPUS_ANNOTATION: annotation}
    if gfd_labels is not None:
        gfd_set, gfd_annotations = gfd.gfd_patch(gfd_labels, previous_labels, previous_annotations or {})
        patch_labels |= gfd_set
        annotations |= gfd_annotations
    return {"metadata": {"labels": patch_labels, "annotations": annotations}}


class NodePublisher:
    """Writes labels and the annotation whenever they change; runs its own thread, never blocks health."""

    def __init__(
        self,
        core_v1: Any,
        node: str,
        prefix: str,
        snapshot: Callable[[], tuple[NodeInventory, Mapping[str, GpuHealth]]],
        retry_s: float = 10.0,
        extra: Callable[[], Mapping[str, str]] | None = None,
        mig_strategy: Callable[[], str] | None = None,
        gfd_mode: Callable[[], str] | None = None,
        sharing: Callable[[], gfd.Sharing] | None = None,
    ) -> None:
        self.api = core_v1
        self.mig_strategy = mig_strategy  # the running configuration's mig.strategy
        self.gfd_mode = gfd_mode  # labels.gfd: auto, on or off (None: off)
        self.sharing = sharing  # the running configuration's sharing, in GFD's terms
        self._gfd_elsewhere = ""  # why GFD's labels are left to GFD itself, last seen
        self.extra = extra  # more labels to keep set (the running named configuration and its mode)
        self.node = node
        self.prefix = prefix
        self.snapshot = snapshot
        self.retry_s = retry_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._written: tuple[dict[str, str], str, str, dict[str, str]] | None = None
        self._thread = threading.Thread(target=self._run, name="gpufleet-labels", daemon=True)

    def start(self) -> None:
        """Publish now and after every poke."""
        self._wake.set()
        self._thread.start()

    def poke(self) -> None:
        """Something changed: publish if the result differs."""
        self._wake.set()

    def stop(self) -> None:
        """Stop the thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
            except Exception as exc:  # API down: keep the last good labels, try again later
                log_event(
                    "labels_failed", level="warning", node=self.node, error=repr(exc), retry_s=self.retry_s
                )
                self._stop.wait(self.retry_s)
                self._wake.set()

    def _publish(self) -> None:
        inv, health = self.snapshot()
        if not inv.gpus:
            return
        strategy = self.mig_strategy() if self.mig_strategy is not None else "none"
        sharing = self.sharing() if self.sharing is not None else None
        theirs = gfd.gfd_labels(inv, strategy, sharing)  # ours under GFD's names carry these values too
        labels = node_labels(inv, self.prefix, strategy, sharing, theirs)
        annotation = gpus_annotation(inv, health)
        if self.extra is not None:
            labels.update(self.extra())
        mode = self.gfd_mode() if self.gfd_mode is not None else "off"
        wanted = theirs if mode != "off" else {}
        state = (labels, annotation, mode, wanted)
        if self._written == state:
            return
        meta = self.api.read_node(self.node).metadata
        current, current_annotations = meta.labels or {}, meta.annotations or {}
        writing = self._gfd_writes(mode, wanted, current, current_annotations)
        patch = node_patch(labels, annotation, current, self.prefix, writing, current_annotations)
        self.api.patch_node(self.node, patch)
        self._written = state
        log_event("node_labels_published", node=self.node, labels=len(labels), gfd_labels=len(writing))

    def _gfd_writes(
        self, mode: str, wanted: dict[str, str], labels: Mapping[str, str], annotations: Mapping[str, str]
    ) -> dict[str, str]:
        """The GFD labels to write: none with `off`; with `auto`, none while GFD itself labels the node
        (the plugin's own are handed over: those NFD does not manage go); with `on`, all, with a warning
        when GFD runs too (two writers of one label: the last write wins until the other's next)."""
        elsewhere = gfd.gfd_elsewhere(labels, annotations) if mode != "off" else ""
        if elsewhere != self._gfd_elsewhere:
            if elsewhere:
                event = "gfd_labels_handed_over" if mode == "auto" else "gfd_labels_contested"
                log_event(
                    event, level="warning" if mode == "on" else "info", node=self.node, reason=elsewhere
                )
            else:
                log_event("gfd_labels_taken_up", node=self.node, mode=mode)
            self._gfd_elsewhere = elsewhere
        return {} if elsewhere and mode == "auto" else wanted
