"""The Kubernetes side of validation: nodes as the API reports them, and short-lived GPU pods.

A GPU pod runs ``nvidia-smi -L``, lists its ``/dev/nvidia<N>`` device nodes and, when asked,
``nvidia-smi topo -m`` and ``nvidia-smi`` (whose "MIG devices" table has each MIG device's memory); the
checks read its log. Pod settings come from the expectations' ``cluster``
section: ``namespace`` (created if missing), ``workload.image`` (it needs ``sh``; ``nvidia-smi`` is
injected by the NVIDIA container runtime, or part of the image), ``workload.image_pull_policy``,
``workload.env``, ``workload.volumes`` (hostPath), ``workload.runtime_class_name`` (a host's own
``runtime_class`` expectation wins), ``workload.timeout``,
``workload.output``: ``log`` (default: the pod's log, which the API server fetches from the kubelet) or
``termination_message`` (the pod writes what it saw to ``/dev/termination-log`` and the kubelet reports it
in the pod's status: for clusters where the API server cannot reach kubelets, such as the lab's).
"""

from __future__ import annotations

import contextlib
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException

from gpufleet.gpu.topology import parse_matrix

SCRIPT = (
    'echo "== gpus"; {smi} -L; echo "== rc $?"; echo "== devices"; ls /dev | grep -E "^nvidia[0-9]+$"; '
    'echo "== topo"; if [ "{topo}" = 1 ]; then {smi} topo -m; fi; '
    'echo "== summary"; if [ "{summary}" = 1 ]; then {smi}; fi; echo "== end"'
)
# Pods held together (run_gpu_pods_at_once) wait for this annotation, which the kubelet writes into their
# downward-API volume when the API object changes.
RELEASE = {"gpufleet.io/validation-release": "now"}
PODINFO = "/etc/gpufleet-podinfo"
HOLD = (
    "i=0; until grep -q 'gpufleet.io/validation-release=\"now\"' " + PODINFO + "/annotations 2>/dev/null; "
    'do [ "$i" -ge {seconds} ] && {{ echo "== not released"; exit 3; }}; i=$((i+1)); sleep 1; done'
)
ENDED = ("Succeeded", "Failed")
HOLD_SLACK = 60.0  # after the release: the kubelet's volume refresh, then the pod's exit
GPU_LINE = re.compile(r"^GPU (\d+): (.+?) \(UUID: (GPU-[0-9a-fA-F-]+)\)")
# `nvidia-smi -L` under its GPU: "  MIG 1g.10gb     Device  0: (UUID: MIG-...)" (older drivers:
# MIG-GPU-<uuid>/<gi>/<ci>).
MIG_LINE = re.compile(r"^MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)\s]+)\)")
# A row of the summary's "MIG devices" table: | GPU GI CI MIG-dev | <used>MiB / <total>MiB | ...
MIG_MEMORY_ROW = re.compile(r"^\|\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s*\|\s*(\d+)MiB\s*/\s*(\d+)MiB")


@dataclass
class PodRun:
    """What a GPU pod saw."""

    name: str
    node: str | None
    phase: str
    pod: dict[str, Any]
    log: str
    problem: str = ""
    gpus: list[tuple[int, str, str]] = field(default_factory=list)  # (index, model, uuid)
    devices: list[str] = field(default_factory=list)
    topology: dict[str, dict[str, str]] = field(default_factory=dict)  # "GPU0" -> {"GPU1": "NV12", ...}
    mig_devices: list[tuple[str, str]] = field(default_factory=list)  # (profile, MIG UUID) from -L
    mig_memory: list[tuple[int, int]] = field(default_factory=list)  # (used, total) MiB per MIG table row

    def parse(self) -> PodRun:
        section = ""
        topo: list[str] = []
        for line in self.log.splitlines():
            if line.startswith("== "):
                section = line[3:].split()[0]
                continue
            if section == "gpus" and (match := GPU_LINE.match(line.strip())):
                self.gpus.append((int(match.group(1)), match.group(2), match.group(3)))
            elif section == "gpus" and (match := MIG_LINE.match(line.strip())):
                self.mig_devices.append((match.group(1), match.group(3)))
            elif section == "summary" and (match := MIG_MEMORY_ROW.match(line.strip())):
                self.mig_memory.append((int(match.group(5)), int(match.group(6))))
            elif section == "devices" and line.strip():
                self.devices.append(line.strip())
            elif section == "topo":
                topo.append(line)
        if topo:
            # An unreadable matrix leaves the topology empty: the pair check then names no link.
            with contextlib.suppress(ValueError):
                matrix = parse_matrix("\n".join(topo))
                labels = [f"GPU{index}" for index in matrix.indices]
                for label, row in zip(labels, matrix.matrix, strict=True):
                    self.topology[label] = dict(zip(labels, row, strict=True))
        return self


class Cluster:
    """A Kubernetes API client for the checks, plus pod runs in the validation namespace."""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings
        self.workload: dict[str, Any] = dict(settings.get("workload") or {})
        self.namespace = str(settings.get("namespace", "gpufleet-validation"))
        self.resource = str(settings.get("resource", "nvidia.com/gpu"))
        self.memory_resource = str(settings.get("memory_resource", "gpufleet.io/gpu-mem"))
        self.label_prefix = str(settings.get("label_prefix", "gpufleet.io"))
        self.api = k8s_config.new_client_from_config(
            config_file=settings.get("kubeconfig"), context=settings.get("context"), persist_config=False
        )
        self.core = k8s.CoreV1Api(self.api)
        self._output = str(self.workload.get("output", "log"))
        if self._output not in ("log", "termination_message"):
            raise ValueError(f"cluster.workload.output is {self._output!r}: use log or termination_message")
        self._namespace_ready = False
        self._pods: list[str] = []

    def plain(self, obj: Any) -> Any:
        """A client model as the API's JSON (camelCase)."""
        return self.api.sanitize_for_serialization(obj)

    def node(self, name: str) -> dict[str, Any] | None:
        try:
            return self.plain(self.core.read_node(name))  # type: ignore[no-any-return]
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def _ensure_namespace(self) -> None:
        if self._namespace_ready:
            return
        try:
            self.core.read_namespace(self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
            self.core.create_namespace({"metadata": {"name": self.namespace}})  # type: ignore[arg-type]
        self._namespace_ready = True

    def run_gpu_pod(
        self,
        purpose: str,
        limits: dict[str, str],
        *,
        node: str | None = None,
        annotations: dict[str, str] | None = None,
        topology: bool = False,
        summary: bool = False,
        runtime_class: str | None = None,
    ) -> PodRun:
        """Run a GPU pod to completion (or timeout) and return what it saw: with ``topology`` also the
        connection matrix, with ``summary`` nvidia-smi's summary (MIG devices' memory). ``runtime_class``:
        the pod's runtimeClassName (else ``workload.runtime_class_name``, else none)."""
        name = self._create_gpu_pod(
            purpose,
            limits,
            node=node,
            annotations=annotations,
            topology=topology,
            summary=summary,
            runtime_class=runtime_class,
        )
        return self._wait(name, self._timeout)

    def run_gpu_pods_at_once(
        self, purpose: str, count: int, limits: dict[str, str], *, node: str, runtime_class: str | None = None
    ) -> list[PodRun]:
        """Run ``count`` GPU pods that hold their devices until every one of them is running, then return
        what each saw. Each pod waits for the annotation :data:`RELEASE` in its downward-API volume, set
        only once all ``count`` were seen Running together, so they held their devices at the same time.
        A pod never released (others did not start) gives up after the workload timeout; its run fails."""
        names = [
            self._create_gpu_pod(f"{purpose}{n}", limits, node=node, hold=True, runtime_class=runtime_class)
            for n in range(count)
        ]
        deadline = time.monotonic() + self._timeout
        # Running, or already past it: a pod that ended will not run again, so waiting for it is pointless.
        self._poll(names, lambda phase: phase in ("Running", *ENDED), deadline)
        for name in names:
            with contextlib.suppress(ApiException):
                self.core.patch_namespaced_pod(name, self.namespace, {"metadata": {"annotations": RELEASE}})
        return [self._wait(name, max(deadline - time.monotonic(), 0) + HOLD_SLACK) for name in names]

    @contextlib.contextmanager
    def held_gpu_pod(
        self, purpose: str, limits: dict[str, str], *, node: str, runtime_class: str | None = None
    ) -> Iterator[PodRun]:
        """A GPU pod that holds its devices while the block runs: yields it once Running (or why not, in
        ``problem``), releases it afterwards (it then exits; ``close`` deletes it)."""
        name = self._create_gpu_pod(purpose, limits, node=node, hold=True, runtime_class=runtime_class)
        try:
            deadline = time.monotonic() + self._timeout
            pod = self._poll([name], lambda phase: phase in ("Running", *ENDED), deadline)[name]
            phase = pod.get("status", {}).get("phase", "Pending")
            where = (pod.get("spec") or {}).get("nodeName")
            problem = "" if phase == "Running" else self._why(pod, self._timeout)
            yield PodRun(name, where, phase, pod, "", problem)
        finally:
            with contextlib.suppress(ApiException):
                self.core.patch_namespaced_pod(name, self.namespace, {"metadata": {"annotations": RELEASE}})

    @property
    def _timeout(self) -> float:
        return float(self.workload.get("timeout", 120))

    def _create_gpu_pod(
        self,
        purpose: str,
        limits: dict[str, str],
        *,
        node: str | None = None,
        annotations: dict[str, str] | None = None,
        topology: bool = False,
        summary: bool = False,
        hold: bool = False,
        runtime_class: str | None = None,
    ) -> str:
        self._ensure_namespace()
        name = f"gpufleet-validate-{purpose}-{secrets.token_hex(3)}"[:63]
        smi = str(self.workload.get("nvidia_smi", "nvidia-smi"))
        script = SCRIPT.format(smi=smi, topo=int(topology), summary=int(summary))
        if hold:
            script += "; " + HOLD.format(seconds=int(self._timeout))
        if self._output == "termination_message":
            script = f"( {script} ) >/dev/termination-log 2>&1; cat /dev/termination-log"
        container: dict[str, Any] = {
            "name": "check",
            "image": self.workload.get("image", "nvcr.io/nvidia/cuda:12.2.2-base-ubuntu22.04"),
            "imagePullPolicy": self.workload.get("image_pull_policy", "IfNotPresent"),
            "command": ["/bin/sh", "-c", script],
            "resources": {"limits": limits},
            "env": [{"name": str(k), "value": str(v)} for k, v in (self.workload.get("env") or {}).items()],
        }
        volumes = self.workload.get("volumes") or []
        mounts = [
            {"name": v["name"], "mountPath": v.get("mount_path") or v["host_path"], "readOnly": True}
            for v in volumes
        ]
        pod_volumes: list[dict[str, Any]] = [
            {"name": v["name"], "hostPath": {"path": v["host_path"]}} for v in volumes
        ]
        if hold:
            mounts.append({"name": "gpufleet-podinfo", "mountPath": PODINFO, "readOnly": True})
            pod_volumes.append(
                {
                    "name": "gpufleet-podinfo",
                    "downwardAPI": {
                        "items": [{"path": "annotations", "fieldRef": {"fieldPath": "metadata.annotations"}}]
                    },
                }
            )
        if mounts:
            container["volumeMounts"] = mounts
        spec: dict[str, Any] = {
            "restartPolicy": "Never",
            "containers": [container],
            "terminationGracePeriodSeconds": 0,
            "automountServiceAccountToken": False,
            "volumes": pod_volumes,
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        }
        if node:
            spec["nodeSelector"] = {"kubernetes.io/hostname": node}
        runtime_class = runtime_class or self.workload.get("runtime_class_name")
        if runtime_class:
            spec["runtimeClassName"] = str(runtime_class)
        body = {"metadata": {"name": name, "annotations": annotations or {}}, "spec": spec}
        self.core.create_namespaced_pod(self.namespace, body)  # type: ignore[arg-type]
        self._pods.append(name)
        return name

    def _poll(
        self, names: list[str], done: Callable[[str], bool], deadline: float
    ) -> dict[str, dict[str, Any]]:
        """Read the pods every half second until ``done`` holds for each one's phase, or the deadline (a
        monotonic time) passes; their last reads."""
        pods: dict[str, dict[str, Any]] = {}
        while True:
            for name in names:
                pods[name] = self.plain(self.core.read_namespaced_pod(name, self.namespace))
            phases = [pod.get("status", {}).get("phase", "Pending") for pod in pods.values()]
            if all(map(done, phases)) or time.monotonic() >= deadline:
                return pods
            time.sleep(0.5)

    def _wait(self, name: str, timeout: float) -> PodRun:
        pod = self._poll([name], ENDED.__contains__, time.monotonic() + timeout)[name]
        status = pod.get("status") or {}
        phase = status.get("phase", "Pending")
        node = (pod.get("spec") or {}).get("nodeName")
        log = ""
        if self._output == "termination_message":
            for cs in status.get("containerStatuses") or []:
                log = ((cs.get("state") or {}).get("terminated") or {}).get("message") or log
        elif node and phase in ("Succeeded", "Failed", "Running"):
            try:
                log = self.core.read_namespaced_pod_log(name, self.namespace)
            except ApiException:
                log = ""
        problem = "" if phase == "Succeeded" else self._why(pod, timeout)
        return PodRun(name, node, phase, pod, log, problem).parse()

    def _why(self, pod: dict[str, Any], timeout: float) -> str:
        """Why a pod did not succeed: its status, unschedulable reason, admission error, last events."""
        status = pod.get("status") or {}
        parts = [f"phase {status.get('phase', 'Pending')} after {timeout:.0f}s"]
        if status.get("reason") or status.get("message"):
            parts.append(f"{status.get('reason', '')}: {status.get('message', '')}".strip(": "))
        for cond in status.get("conditions") or []:
            if cond.get("status") == "False" and cond.get("message"):
                parts.append(f"{cond.get('type')}: {cond['message']}")
        for cs in status.get("containerStatuses") or []:
            state = cs.get("state") or {}
            for key in ("waiting", "terminated"):
                if key in state and (state[key] or {}).get("reason"):
                    parts.append(
                        f"container {key}: {state[key].get('reason')} {state[key].get('message') or ''}"
                    )
        name = (pod.get("metadata") or {}).get("name", "")
        events = self.core.list_namespaced_event(
            self.namespace, field_selector=f"involvedObject.name={name}"
        ).items
        for event in events[-3:]:
            if event.type == "Warning":
                parts.append(f"event {event.reason}: {event.message}")
        return "; ".join(p.strip() for p in parts if p.strip())

    def close(self) -> None:
        for name in self._pods:
            with contextlib.suppress(ApiException):
                self.core.delete_namespaced_pod(name, self.namespace, grace_period_seconds=0)
        self.api.close()
