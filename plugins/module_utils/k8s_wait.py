# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""Waits the modules promise, and what to say when they time out.

- :func:`wait_rollout`: a DaemonSet or Deployment has every pod updated and available; on timeout the
  message lists each pod that is not (waiting reason, crash, unschedulable and why, last log lines).
- :func:`wait_node_resources`: nodes report an extended resource in capacity and allocatable; the caller
  turns each node that falls short into a reason (the device plugin module does it with pod status, logs
  and node status).
- helpers: pod summaries, whether a pod could run on a node (selector, taints), resource counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import RESOURCES, Kube, KubeError

POLL_SECONDS = 1.0
LOG_LINES = 5


class WaitTimeout(KubeError):
    """A wait ran out of time; the message says what is missing and why."""


def _poll(deadline: float, interval: float = POLL_SECONDS) -> bool:
    """Sleep one interval unless past the deadline; False when the time is up."""
    if time.monotonic() >= deadline:
        return False
    time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
    return True


def selector_string(match_labels: Mapping[str, str]) -> str:
    """A label selector from matchLabels."""
    return ",".join(f"{k}={v}" for k, v in sorted(match_labels.items()))


# -- pods ------------------------------------------------------------------------------------------
def pod_problem(kube: Kube, pod: Mapping[str, Any], with_logs: bool = True) -> str | None:
    """Why a pod is not ready (None when it is): scheduling, waiting/terminated containers, log tail."""
    meta, spec, status = pod.get("metadata") or {}, pod.get("spec") or {}, pod.get("status") or {}
    name, namespace = meta.get("name", "?"), meta.get("namespace")
    if meta.get("deletionTimestamp"):
        return f"pod {name} is terminating"
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled")
    if scheduled and scheduled.get("status") == "False":
        return f"pod {name} is not scheduled: {scheduled.get('message') or scheduled.get('reason')}"
    if conditions.get("Ready", {}).get("status") == "True":
        return None
    problems = []
    for cs in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        state = cs.get("state") or {}
        last = (cs.get("lastState") or {}).get("terminated") or {}
        if "waiting" in state:
            waiting = state["waiting"] or {}
            text = f"container {cs.get('name')} waiting: {waiting.get('reason')}"
            if waiting.get("message"):
                text += f" ({waiting['message']})"
            if last:
                text += f"; last exit {last.get('exitCode')} ({last.get('reason')})"
            problems.append(text)
        elif "terminated" in state:
            term = state["terminated"] or {}
            problems.append(
                f"container {cs.get('name')} terminated: exit {term.get('exitCode')} ({term.get('reason')})"
            )
        elif not cs.get("ready"):
            problems.append(f"container {cs.get('name')} running but not ready (readiness probe)")
        if with_logs and (cs.get("restartCount") or "terminated" in state or not cs.get("ready")):
            tail = log_tail(kube, name, namespace, cs.get("name"))
            if tail:
                problems.append(f"log of {cs.get('name')}: {tail}")
    phase = status.get("phase", "Pending")
    where = f" on node {spec['nodeName']}" if spec.get("nodeName") else ""
    if not problems and not spec.get("nodeName") and not scheduled:
        problems.append("not scheduled yet and no scheduler has looked at it (is kube-scheduler running?)")
    if not problems:
        problems.append(status.get("message") or status.get("reason") or "no container status yet")
        problems += warning_events(kube, "Pod", name, namespace)
    return f"pod {name}{where} is {phase}, not ready: {'; '.join(problems)}"


def warning_events(kube: Kube, kind: str, name: str, namespace: str | None, limit: int = 3) -> list[str]:
    """The latest Warning events about an object, as 'event Reason: message'."""
    if not namespace:
        return []
    selector = f"involvedObject.kind={kind},involvedObject.name={name},type=Warning"
    try:
        events = kube.list(RESOURCES["Event"], namespace, field_selector=selector)
    except KubeError:
        return []
    events.sort(key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")
    return [f"event {e.get('reason')}: {(e.get('message') or '').strip()}" for e in events[-limit:]]


def log_tail(
    kube: Kube, pod: str, namespace: str | None, container: str | None, lines: int = LOG_LINES
) -> str:
    """The last log lines of a container (warnings and errors first), joined with ' | '."""
    if not namespace:
        return ""
    text = kube.pod_log(pod, namespace, container, lines=200)
    rows = [line.strip() for line in text.splitlines() if line.strip()]
    loud = [
        line
        for line in rows
        if any(w in line.lower() for w in ("level=warning", "level=error", "error", "traceback"))
    ]
    chosen = (loud or rows)[-lines:]
    return " | ".join(chosen)


def tolerated(taint: Mapping[str, Any], tolerations: list[Mapping[str, Any]]) -> bool:
    """Whether one of the tolerations tolerates the taint (the scheduler's rules)."""
    for tol in tolerations:
        if tol.get("effect") and tol.get("effect") != taint.get("effect"):
            continue
        operator = tol.get("operator", "Equal")
        if not tol.get("key"):
            if operator == "Exists":
                return True
            continue
        if tol.get("key") != taint.get("key"):
            continue
        if operator == "Exists" or tol.get("value", "") == taint.get("value", ""):
            return True
    return False


def why_not_on_node(node: Mapping[str, Any], pod_spec: Mapping[str, Any]) -> str | None:
    """Why a pod with ``pod_spec`` would not run on ``node`` (selector, taints, readiness); None if it
    would."""
    labels = (node.get("metadata") or {}).get("labels") or {}
    selector = pod_spec.get("nodeSelector") or {}
    missing = {k: v for k, v in selector.items() if labels.get(k) != v}
    if missing:
        return "its labels do not match the nodeSelector " + ", ".join(f"{k}={v}" for k, v in missing.items())
    for taint in (node.get("spec") or {}).get("taints") or []:
        if taint.get("effect") in ("NoSchedule", "NoExecute") and not tolerated(
            taint, pod_spec.get("tolerations") or []
        ):
            value = f"={taint['value']}" if taint.get("value") else ""
            name = f"{taint.get('key')}{value}:{taint.get('effect')}"
            return f"it has the taint {name}, which the pods do not tolerate"
    conditions = {c.get("type"): c for c in (node.get("status") or {}).get("conditions") or []}
    ready = conditions.get("Ready", {})
    if ready.get("status") != "True":
        return f"it is not Ready ({ready.get('reason') or 'no status from its kubelet'})"
    return None


def resource_count(node: Mapping[str, Any], section: str, resource: str) -> int | None:
    """``status.<section>[resource]`` as an int (None when absent)."""
    value = ((node.get("status") or {}).get(section) or {}).get(resource)
    if value is None:
        return None
    try:
        return int(str(value))
    except ValueError:
        return None


# -- rollouts --------------------------------------------------------------------------------------
@dataclass
class Rollout:
    """Progress of a DaemonSet or Deployment."""

    done: bool
    summary: str
    failed: str | None = None


def rollout_status(obj: Mapping[str, Any]) -> Rollout:
    """Whether a DaemonSet/Deployment finished rolling out, from its status alone."""
    kind = obj.get("kind")
    meta, spec, status = obj.get("metadata") or {}, obj.get("spec") or {}, obj.get("status") or {}
    if status.get("observedGeneration", 0) < meta.get("generation", 1):
        return Rollout(False, "the controller has not seen the latest spec yet")
    if kind == "DaemonSet":
        desired = status.get("desiredNumberScheduled", 0)
        updated = status.get("updatedNumberScheduled", 0)
        available = status.get("numberAvailable", 0)
        text = f"{available} of {desired} pods available, {updated} updated"
        return Rollout(desired == updated == available and not status.get("numberUnavailable"), text)
    replicas = spec.get("replicas", 1)
    updated, available = status.get("updatedReplicas", 0), status.get("availableReplicas", 0)
    text = f"{available} of {replicas} replicas available, {updated} updated"
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            return Rollout(False, text, failed=f"progress deadline exceeded: {cond.get('message')}")
    done = updated == replicas == available and not status.get("unavailableReplicas")
    done = done and status.get("replicas", replicas) == replicas  # old pods gone
    return Rollout(done, text)


def wait_rollout(kube: Kube, kind: str, name: str, namespace: str, timeout: float) -> dict[str, Any]:
    """Wait until the DaemonSet/Deployment is rolled out; return its final object or raise WaitTimeout."""
    res = RESOURCES[kind]
    deadline = time.monotonic() + timeout
    while True:
        obj = kube.get(res, name, namespace)
        if obj is None:
            raise KubeError(f"{kind} {namespace}/{name} disappeared while waiting for its rollout")
        state = rollout_status(obj)
        if state.done:
            return obj
        if state.failed or not _poll(deadline):
            break
    selector = selector_string(((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {})
    pods = kube.list(RESOURCES["Pod"], namespace, label_selector=selector) if selector else []
    problems = [p for p in (pod_problem(kube, pod) for pod in pods) if p]
    reason = state.failed or f"not rolled out after {timeout:.0f}s"
    if not problems:
        # No pod to blame: what refused to make them (admission: PodSecurity, a quota) is in the
        # controller's events, e.g. "event FailedCreate: ... violates PodSecurity "baseline:latest": ..."
        problems = ["no pods yet" if not pods else state.summary]
        problems += controller_warnings(kube, kind, obj, namespace, selector)
    raise WaitTimeout(f"{kind} {namespace}/{name} {reason} ({state.summary}): {'; '.join(problems)}")


def controller_warnings(
    kube: Kube, kind: str, obj: Mapping[str, Any], namespace: str, selector: str
) -> list[str]:
    """Warning events of what creates the pods: a DaemonSet itself, a Deployment's newest ReplicaSet."""
    meta = obj.get("metadata") or {}
    if kind != "Deployment":
        return warning_events(kube, kind, meta.get("name", ""), namespace)
    try:
        sets = kube.list(RESOURCES["ReplicaSet"], namespace, label_selector=selector) if selector else []
    except KubeError:
        return []
    owned = [
        rs
        for rs in sets
        if any(
            ref.get("uid") == meta.get("uid")
            for ref in (rs.get("metadata") or {}).get("ownerReferences") or []
        )
    ]
    if not owned:
        return []
    newest = max(owned, key=lambda rs: (rs.get("metadata") or {}).get("creationTimestamp") or "")
    return warning_events(kube, "ReplicaSet", newest["metadata"]["name"], namespace)


# -- node resources --------------------------------------------------------------------------------
def wait_node_resources(
    kube: Kube,
    resource: str,
    expected: Mapping[str, int | None],
    timeout: float,
    explain: Callable[[str, dict[str, Any] | None], str],
) -> dict[str, dict[str, int | None]]:
    """Wait until each node in ``expected`` reports ``resource`` in capacity and allocatable at the expected
    count (None: any positive count). Returns {node: {capacity, allocatable}}; on timeout raises WaitTimeout
    with ``explain(node_name, node_or_None)`` for every node that is short."""
    nodes_res = RESOURCES["Node"]
    deadline = time.monotonic() + timeout
    while True:
        seen: dict[str, dict[str, Any] | None] = {n: kube.get(nodes_res, n) for n in expected}
        short = [n for n, node in seen.items() if not reports_resource(node, resource, expected[n])]
        if not short or not _poll(deadline, 2 * POLL_SECONDS):
            break
    if short:
        reasons = [f"{n}: {explain(n, seen[n])}" for n in sorted(short)]
        raise WaitTimeout(
            f"{len(short)} of {len(expected)} node(s) do not report the expected {resource} after "
            f"{timeout:.0f}s: " + "; ".join(reasons)
        )
    return {
        n: {
            "capacity": resource_count(node or {}, "capacity", resource),
            "allocatable": resource_count(node or {}, "allocatable", resource),
        }
        for n, node in seen.items()
    }


def reports_resource(node: Mapping[str, Any] | None, resource: str, want: int | None) -> bool:
    """The node reports ``want`` of ``resource`` (None: some) in capacity and the same in allocatable."""
    if node is None:
        return False
    capacity = resource_count(node, "capacity", resource)
    if want is None:
        return bool(capacity) and capacity == resource_count(node, "allocatable", resource)
    return capacity == want == resource_count(node, "allocatable", resource)
