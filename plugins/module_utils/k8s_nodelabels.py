# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""The node label that picks each node's device plugin configuration, as the gpu_device_plugin module sets
it (``node_configs``): set on the Node and recorded in an annotation there, so that the module only ever
removes a label it set, and only while it still has the value the module gave it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_apply import (
    MERGE_PATCH,
    ApplyResult,
    Change,
    apply_patch,
    project,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import RESOURCES, Kube, KubeError

# On a Node: the "<label>=<value>" this module set; it removes only a label it set that still has that value.
CONFIG_LABEL_OWNER = "gpufleet.io/device-plugin.config-label"


def config_label_patch(node: Mapping[str, Any], label: str | None, value: str | None) -> dict[str, Any]:
    """The merge patch giving ``node`` the label ``label=value`` and recording it as this module's (value
    None: no label of this module's); empty when nothing changes. A label the module did not set, or whose
    value someone changed since, is never removed: the annotation recording it goes instead."""
    meta = node.get("metadata") or {}
    labels = meta.get("labels") or {}
    owned = (meta.get("annotations") or {}).get(CONFIG_LABEL_OWNER) or ""
    old_key, old_value = owned.partition("=")[::2]
    record = f"{label}={value}" if label and value is not None else ""
    new_labels: dict[str, str | None] = {}
    if old_key and labels.get(old_key) == old_value and (not record or old_key != label):
        new_labels[old_key] = None
    if record and labels.get(str(label)) != value:
        new_labels[str(label)] = value
    patch: dict[str, Any] = {}
    if new_labels:
        patch["labels"] = new_labels
    if owned != record:
        patch["annotations"] = {CONFIG_LABEL_OWNER: record or None}
    return {"metadata": patch} if patch else {}


def label_nodes(
    kube: Kube, wanted: Mapping[str, str | None], label: str | None, check_mode: bool
) -> ApplyResult:
    """Give each node of ``wanted`` the configuration label ``label`` with its value (None: remove the one
    this module set)."""
    result = ApplyResult()
    nodes = RESOURCES["Node"]
    for name, value in sorted(wanted.items()):
        node = kube.get(nodes, name)
        if node is None:
            if value is None:
                continue
            error = KubeError(f"node_configs.{name}: no such node in the cluster (to label {label}={value})")
            error.partial = result
            raise error
        patch = config_label_patch(node, label, value)
        if not patch:
            if value is not None:
                result.changes.append(Change("Node", name, None, "unchanged"))
            continue
        before = project(node, patch)
        if not check_mode:
            try:
                kube.request(
                    "PATCH",
                    nodes.path(None, name),
                    body=patch,
                    content_type=MERGE_PATCH,
                    what=("patch", nodes.display, None, name),
                )
            except KubeError as exc:
                exc.partial = result
                raise
        result.changes.append(Change("Node", name, None, "updated", before, apply_patch(before, patch)))
    return result
