"""Node labels and the `gpufleet.io/gpus` annotation: computed purely, written with the kubernetes client.

Labels let pods select GPU models (`nodeSelector: {gpufleet.io/gpu.product: NVIDIA-A100-SXM4-80GB}`);
the annotation gives the extender each GPU's memory, health and NVLinks (docs/handoff.md).
On a node with mixed models the product label says `mixed` and memory/compute labels give the smallest
GPU's values, so a selector never promises more than every GPU of the node has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.deviceplugin.rm.model import MIB, NodeInventory
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

# The label families the plugin writes under its prefix (`gpu.count`, `driver.major`, `cuda.driver.minor`).
# Only these are the plugin's to delete: other labels under the same domain belong to the operator or the
# extender (`gpufleet.io/gpu-sharing`, `gpufleet.io/mps`) and must survive every publish.
OWNED_LABEL_FAMILIES = ("gpu.", "driver.", "cuda.", "mig.", "mig-")


def node_labels(inv: NodeInventory, prefix: str = LABEL_PREFIX, mig_strategy: str = "none") -> dict[str, str]:
    """Labels describing the node's GPUs (empty when there are none); with a MIG strategy, the MIG labels
    gpu-feature-discovery writes (see :func:`mig_labels`)."""
    if not inv.gpus:
        return {}
    smallest_cc = min(g.cc for g in inv.gpus)
    driver = inv.driver_version.split(".")
    labels = {
        "gpu.present": "true",
        "gpu.count": str(len(inv.gpus)),
        PRODUCT_LABEL_NAME: product_label_value([g.model for g in inv.gpus]),
        "gpu.memory": str(min(g.memory_bytes for g in inv.gpus) // MIB),  # MiB, as nvidia-smi prints
        "gpu.compute.major": str(smallest_cc[0]),
        "gpu.compute.minor": str(smallest_cc[1]),
        "gpu.nvlink": "true" if any(g.nvlinks for g in inv.gpus) else "false",
        "gpu.nvswitch": "true" if inv.nvswitch_count else "false",
    }
    if inv.driver_version:
        labels["driver.version"] = label_value(inv.driver_version)
        labels["driver.major"] = label_value(driver[0])  # NVML's text: never trusted to be a label value
    if inv.cuda_driver_version:
        labels["cuda.driver.major"] = str(inv.cuda_driver_version // 1000)
        labels["cuda.driver.minor"] = str(inv.cuda_driver_version % 1000 // 10)
    labels.update(mig_labels(inv, mig_strategy))
    return {f"{prefix}/{k}": v for k, v in labels.items()}


def mig_labels(inv: NodeInventory, strategy: str) -> dict[str, str]:
    """gpu-feature-discovery's MIG labels (unprefixed), for strategies single and mixed:

    - both: ``mig.strategy``;
    - single, every GPU in MIG mode: the ``gpu.*`` labels describe the MIG devices: ``gpu.count`` is their
      number, ``gpu.product`` the GPU's with ``-MIG-<profile>``, ``gpu.memory`` the MIG device's MiB;
    - mixed: ``gpu.*`` keep describing whole GPUs and each profile gets ``mig-<profile>.count``,
      ``.memory`` (MiB) and ``.product``.
    """
    if strategy == "none":
        return {}
    out = {"mig.strategy": strategy}
    migs = [m for g in inv.gpus for m in g.mig_devices]
    product = product_label_value([g.model for g in inv.gpus])
    if strategy == "single":
        if migs and all(g.mig_enabled for g in inv.gpus):
            profiles = sorted({m.profile for m in migs})
            out["gpu.count"] = str(len(migs))
            out[PRODUCT_LABEL_NAME] = label_value(f"{product}-MIG-{'-'.join(profiles)}")
            out["gpu.memory"] = str(min(m.memory_bytes for m in migs) // MIB)
        return out
    for profile in sorted({m.profile for m in migs}):
        of = [m for m in migs if m.profile == profile]
        out[f"mig-{profile}.count"] = str(len(of))
        out[f"mig-{profile}.memory"] = str(min(m.memory_bytes for m in of) // MIB)
        out[f"mig-{profile}.product"] = label_value(f"{product}-MIG-{profile}")
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
    labels: Mapping[str, str], annotation: str, previous_labels: Mapping[str, str], prefix: str
) -> dict[str, Any]:
    """A merge patch setting our labels and annotation and deleting our labels that no longer apply.

    "Ours" means the families of :data:`OWNED_LABEL_FAMILIES` under ``prefix``; anything else under the
    domain (the node's `gpu-sharing` and `mps` switches) is left alone.
    """
    owned = tuple(f"{prefix}/{family}" for family in OWNED_LABEL_FAMILIES)
    stale = {k: None for k in previous_labels if k.startswith(owned) and k not in labels}
    return {"metadata": {"labels": {**stale, **labels}, "annotations": {GPUS_ANNOTATION: annotation}}}


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
    ) -> None:
        self.api = core_v1
        self.mig_strategy = mig_strategy  # the running configuration's mig.strategy
        self.extra = extra  # more labels to keep set (the running named configuration and its mode)
        self.node = node
        self.prefix = prefix
        self.snapshot = snapshot
        self.retry_s = retry_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._written: tuple[dict[str, str], str] | None = None
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
        labels, annotation = node_labels(inv, self.prefix, strategy), gpus_annotation(inv, health)
        if self.extra is not None:
            labels.update(self.extra())
        if self._written == (labels, annotation):
            return
        current = self.api.read_node(self.node).metadata.labels or {}
        self.api.patch_node(self.node, node_patch(labels, annotation, current, self.prefix))
        self._written = (labels, annotation)
        log_event("node_labels_published", node=self.node, labels=len(labels))
