# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""Idempotent apply and delete of a list of Kubernetes objects, with check mode and diffs.

``apply`` reads each object; a missing one is created, an existing one is compared with what is wanted
and patched (JSON merge patch) with only the fields that differ. Comparison looks only at the fields the
manifest sets, so what the API server or controllers add (defaults, status, a ServiceAccount's token
secrets, a Service's clusterIP) never counts as drift; lists are compared element by element and must
have the same length. A field the manifest set last time and no longer sets is removed: the applied
manifest is kept in the annotation ``gpufleet.io/last-applied`` for that three-way comparison. Check mode
computes the same result and diff without writing anything.

Every object carries ``app.kubernetes.io/managed-by: gpufleet``; ``delete`` removes only objects with that
label (another owner's namesake is reported, not touched).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import (
    RESOURCES,
    Kube,
    KubeError,
    Resource,
    resource_for,
)

MANAGED_BY_LABEL = "app.kubernetes.io/managed-by"
MANAGED_BY = "gpufleet"
LAST_APPLIED = "gpufleet.io/last-applied"
MERGE_PATCH = "application/merge-patch+json"
# Kinds never adopted when someone else made them: state=absent would then delete a namespace with all it
# holds, or the RuntimeClass `nvidia` the GPU Operator (or an administrator) created for every GPU pod.
NOT_ADOPTED = ("Namespace", "RuntimeClass")


@dataclass
class Change:
    """What apply or delete did (or would do, in check mode) to one object."""

    kind: str
    name: str
    namespace: str | None
    action: str  # created | updated | unchanged | deleted | absent | skipped
    before: dict[str, Any] | None = None
    after: dict[str, Any] | None = None
    note: str = ""

    @property
    def ref(self) -> str:
        """``Kind namespace/name`` (or ``Kind name``)."""
        return f"{self.kind} {self.namespace}/{self.name}" if self.namespace else f"{self.kind} {self.name}"

    @property
    def changed(self) -> bool:
        return self.action in ("created", "updated", "deleted")

    def result(self) -> dict[str, Any]:
        """The module's per-object return value."""
        out = {"kind": self.kind, "name": self.name, "namespace": self.namespace, "action": self.action}
        if self.note:
            out["note"] = self.note
        return out

    def diff(self) -> dict[str, Any]:
        """An Ansible diff entry (before/after as YAML-ish JSON text of the managed fields)."""
        return {
            "before_header": self.ref,
            "after_header": self.ref,
            "before": _render(self.before),
            "after": _render(self.after),
        }


@dataclass
class ApplyResult:
    """Every object's change, in manifest order."""

    changes: list[Change] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return any(c.changed for c in self.changes)

    def objects(self) -> list[dict[str, Any]]:
        return [c.result() for c in self.changes]

    def diffs(self) -> list[dict[str, Any]]:
        return [c.diff() for c in self.changes if c.changed]


def _render(obj: Mapping[str, Any] | None) -> str:
    if obj is None:
        return ""
    try:
        import yaml

        return str(yaml.safe_dump(obj, sort_keys=False, default_flow_style=False))
    except ImportError:  # PyYAML comes with the kubernetes client; JSON is a fine fallback
        return json.dumps(obj, indent=2) + "\n"


# -- comparison ------------------------------------------------------------------------------------
def _scalar_equal(want: Any, have: Any) -> bool:
    if isinstance(want, bool) or isinstance(have, bool):
        return want is have or (want == have and type(want) is type(have))
    if isinstance(want, (int, float)) and isinstance(have, (int, float)):
        return want == have
    return bool(want == have)


def _empty(value: Any) -> bool:
    """Empty lists, maps and null: the API server drops them (omitempty), so absent means the same."""
    return value is None or value == [] or value == {}


def matches(want: Any, have: Any) -> bool:
    """Whether ``have`` (live) already has everything ``want`` (manifest) sets."""
    if isinstance(want, Mapping):
        return isinstance(have, Mapping) and all(
            matches(v, have[k]) if k in have else _empty(v) for k, v in want.items()
        )
    if isinstance(want, list):
        return (
            isinstance(have, list)
            and len(want) == len(have)
            and all(matches(w, h) for w, h in zip(want, have, strict=True))
        )
    return _scalar_equal(want, have)


def merge_patch(
    want: Mapping[str, Any], have: Mapping[str, Any], last: Mapping[str, Any] | None
) -> dict[str, Any]:
    """The JSON merge patch that makes ``have`` match ``want``, and drops what ``last`` set and ``want`` no
    longer does. Lists are replaced whole (merge patch semantics). Empty when nothing differs."""
    patch: dict[str, Any] = {}
    last = last if isinstance(last, Mapping) else {}
    for key, value in want.items():
        if key not in have:
            if not _empty(value):
                patch[key] = copy.deepcopy(value)
        elif isinstance(value, Mapping) and isinstance(have[key], Mapping):
            sub = merge_patch(value, have[key], last.get(key) if isinstance(last.get(key), Mapping) else None)
            if sub:
                patch[key] = sub
        elif not matches(value, have[key]):
            patch[key] = copy.deepcopy(value)
    for key in last:
        if key not in want and key in have:
            patch[key] = None
    return patch


def project(have: Mapping[str, Any], shape: Mapping[str, Any]) -> dict[str, Any]:
    """``have`` cut down to the keys ``shape`` has (recursively for mappings): the diff's "before"."""
    out: dict[str, Any] = {}
    for key, value in shape.items():
        if key not in have:
            continue
        if isinstance(value, Mapping) and isinstance(have[key], Mapping):
            out[key] = project(have[key], value)
        else:
            out[key] = copy.deepcopy(have[key])
    return out


def apply_patch(target: Mapping[str, Any], patch: Mapping[str, Any]) -> dict[str, Any]:
    """RFC 7386 merge patch applied to a copy of ``target``."""
    out = copy.deepcopy(dict(target))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = apply_patch(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _managed_manifest(obj: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest with gpufleet's ownership label (the last-applied annotation is added separately)."""
    out = copy.deepcopy(dict(obj))
    meta = out.setdefault("metadata", {})
    meta.setdefault("labels", {})[MANAGED_BY_LABEL] = MANAGED_BY
    return out


def _last_applied(live: Mapping[str, Any]) -> dict[str, Any] | None:
    text = ((live.get("metadata") or {}).get("annotations") or {}).get(LAST_APPLIED)
    if not text:
        return None
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def _identity(obj: Mapping[str, Any]) -> tuple[Resource, str, str | None]:
    res = resource_for(obj)
    meta = obj.get("metadata") or {}
    name = meta.get("name")
    if not name:
        raise KubeError(f"{res.kind} without metadata.name")
    namespace = meta.get("namespace") if res.namespaced else None
    if res.namespaced and not namespace:
        raise KubeError(f"{res.kind} {name}: metadata.namespace is required")
    return res, name, namespace


# -- apply / delete --------------------------------------------------------------------------------
def apply(kube: Kube, objects: Sequence[Mapping[str, Any]], *, check_mode: bool) -> ApplyResult:
    """Create or patch each object (in order) so that it matches its manifest."""
    result = ApplyResult()
    for obj in objects:
        try:
            result.changes.append(_apply_one(kube, obj, check_mode))
        except KubeError as exc:
            exc.partial = result  # what was done before the failure, for the module's report
            raise
    return result


def _apply_one(kube: Kube, obj: Mapping[str, Any], check_mode: bool) -> Change:
    res, name, namespace = _identity(obj)
    want = _managed_manifest(obj)
    stamp = json.dumps(want, sort_keys=True, separators=(",", ":"))
    live = kube.get(res, name, namespace)
    if live is None:
        body = copy.deepcopy(want)
        body["metadata"].setdefault("annotations", {})[LAST_APPLIED] = stamp
        if not check_mode:
            kube.request(
                "POST", res.path(namespace), body=body, what=("create", res.display, namespace, name)
            )
        return Change(res.kind, name, namespace, "created", None, want)
    labels = (live.get("metadata") or {}).get("labels") or {}
    if res.kind in NOT_ADOPTED and labels.get(MANAGED_BY_LABEL) != MANAGED_BY:
        return Change(res.kind, name, namespace, "unchanged", note="exists and is not gpufleet's: left as is")
    last = _last_applied(live)
    patch = merge_patch(want, live, last)
    if not patch:
        if last != json.loads(stamp) and not check_mode:
            # Same content, older stamp (e.g. key order): refresh silently; it changes nothing that matters.
            _patch(kube, res, name, namespace, {"metadata": {"annotations": {LAST_APPLIED: stamp}}})
        return Change(res.kind, name, namespace, "unchanged")
    before = project(live, {**want, **{k: None for k in (last or {}) if k not in want}})
    after = apply_patch(before, patch)
    if not check_mode:
        patch.setdefault("metadata", {}).setdefault("annotations", {})[LAST_APPLIED] = stamp
        _patch(kube, res, name, namespace, patch)
    return Change(res.kind, name, namespace, "updated", before, after)


def _patch(kube: Kube, res: Resource, name: str, namespace: str | None, patch: Mapping[str, Any]) -> None:
    kube.request(
        "PATCH",
        res.path(namespace, name),
        body=dict(patch),
        content_type=MERGE_PATCH,
        what=("patch", res.display, namespace, name),
    )


def delete(
    kube: Kube, objects: Sequence[Mapping[str, Any]], *, check_mode: bool, wait_timeout: float = 0
) -> ApplyResult:
    """Delete the objects gpufleet manages, in reverse manifest order; optionally wait until they are gone."""
    result = ApplyResult()
    pending: list[tuple[Resource, str, str | None]] = []
    for obj in reversed(list(objects)):
        res, name, namespace = _identity(obj)
        live = kube.get(res, name, namespace)
        if live is None:
            result.changes.append(Change(res.kind, name, namespace, "absent"))
            continue
        labels = (live.get("metadata") or {}).get("labels") or {}
        if labels.get(MANAGED_BY_LABEL) != MANAGED_BY:
            note = f"not deleted: it lacks the label {MANAGED_BY_LABEL}={MANAGED_BY} (another owner's object)"
            result.changes.append(Change(res.kind, name, namespace, "skipped", note=note))
            continue
        if res.kind == "Namespace":
            ours = {(r["kind"], (r.get("metadata") or {}).get("name")) for r in objects}
            others = namespace_leftovers(kube, name, ours)
            if others:
                note = (
                    "not deleted: it still holds "
                    + ", ".join(others[:5])
                    + (", ..." if len(others) > 5 else "")
                )
                result.changes.append(Change(res.kind, name, namespace, "skipped", note=note))
                continue
        if not check_mode:
            kube.request(
                "DELETE",
                res.path(namespace, name),
                body={"propagationPolicy": "Background"},
                what=("delete", res.display, namespace, name),
            )
            pending.append((res, name, namespace))
        result.changes.append(Change(res.kind, name, namespace, "deleted", project(live, obj), None))
    result.changes.reverse()
    if wait_timeout > 0 and pending:
        wait_gone(kube, pending, wait_timeout)
    return result


# What a namespace holds that is someone's work (the defaults every namespace gets are not).
_LEFTOVER_KINDS = ("DaemonSet", "Deployment", "Service", "ConfigMap", "ServiceAccount", "Secret", "Pod")
_DEFAULTS = {("ConfigMap", "kube-root-ca.crt"), ("ServiceAccount", "default")}


def namespace_leftovers(kube: Kube, namespace: str, ours: set[tuple[str, Any]]) -> list[str]:
    """Objects in ``namespace`` that are neither ours nor a namespace's defaults (tokens, pods of ours)."""
    names = {name for _kind, name in ours}
    found = []
    for kind in _LEFTOVER_KINDS:
        for item in kube.list(RESOURCES[kind], namespace):
            meta = item.get("metadata") or {}
            name = meta.get("name")
            if (kind, name) in ours or (kind, name) in _DEFAULTS or meta.get("deletionTimestamp"):
                continue
            if kind == "Secret" and item.get("type") == "kubernetes.io/service-account-token":
                continue
            if kind == "Pod" and any(o.get("name") in names for o in meta.get("ownerReferences") or []):
                continue
            if kind == "Pod" and (meta.get("labels") or {}).get("app.kubernetes.io/name") in names:
                continue  # pods of our ReplicaSets (owned by a ReplicaSet named after our Deployment)
            found.append(f"{kind} {name}")
    return found


def wait_gone(kube: Kube, objects: Iterable[tuple[Resource, str, str | None]], timeout: float) -> None:
    """Wait until every object returns 404 (finalizers done); raise KubeError naming the stragglers."""
    deadline = time.monotonic() + timeout
    remaining = list(objects)
    while remaining:
        remaining = [(r, n, ns) for r, n, ns in remaining if kube.get(r, n, ns) is not None]
        if not remaining:
            return
        if time.monotonic() > deadline:
            names = ", ".join(f"{r.kind} {ns + '/' if ns else ''}{n}" for r, n, ns in remaining)
            raise KubeError(f"still present {timeout:.0f}s after deletion: {names}")
        time.sleep(1)
