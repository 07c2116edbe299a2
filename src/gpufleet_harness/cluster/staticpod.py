"""What the kubelet does with a static pod manifest, for kube-scheduler on a lab host: run the manifest's
command, and when the manifest changes stop the old process and start the new one.

The lab runs no kubelet on its control plane, and the extender module's scheduler part waits for exactly
this restart (a kube-scheduler process with the new ``--config`` that answers /healthz), so the lab (and the
module tests) play the kubelet's part with the real kube-scheduler binary.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import yaml

from gpufleet_harness.cluster.process import Daemon

# kube-scheduler's static pod as `kubeadm init` writes it, pointed at lab paths and a free secure port (the
# lab shares the machine; kubeadm leaves --secure-port at 10259) and without leader election.
# 1.37: from kubeadm v1.37.2 of the cache (`kubeadm init phase control-plane scheduler --dry-run`).
KUBEADM_MANIFEST = """\
apiVersion: v1
kind: Pod
metadata:
  labels:
    component: kube-scheduler
    tier: control-plane
  name: kube-scheduler
  namespace: kube-system
spec:
  containers:
  - command:
    - kube-scheduler
    - --authentication-kubeconfig={kubeconfig}
    - --authorization-kubeconfig={kubeconfig}
    - --bind-address=127.0.0.1
    - --kubeconfig={kubeconfig}
    - --leader-elect=false
    - --secure-port={secure_port}
    image: registry.k8s.io/kube-scheduler:{version}
    imagePullPolicy: IfNotPresent
    livenessProbe:
      failureThreshold: 8
      httpGet:
        host: 127.0.0.1
        path: /livez
        port: probe-port
        scheme: HTTPS
      initialDelaySeconds: 10
      periodSeconds: 10
      timeoutSeconds: 15
    name: kube-scheduler
    ports:
    - containerPort: {secure_port}
      name: probe-port
      protocol: TCP
    readinessProbe:
      failureThreshold: 3
      httpGet:
        host: 127.0.0.1
        path: /readyz
        port: probe-port
        scheme: HTTPS
      periodSeconds: 1
      timeoutSeconds: 15
    resources:
      requests:
        cpu: 100m
    startupProbe:
      failureThreshold: 24
      httpGet:
        host: 127.0.0.1
        path: /livez
        port: probe-port
        scheme: HTTPS
      initialDelaySeconds: 10
      periodSeconds: 10
      timeoutSeconds: 15
    volumeMounts:
    - mountPath: {kubeconfig}
      name: kubeconfig
      readOnly: true
  hostNetwork: true
  priority: 2000001000
  priorityClassName: system-node-critical
  securityContext:
    seccompProfile:
      type: RuntimeDefault
  volumes:
  - hostPath:
      path: {kubeconfig}
      type: FileOrCreate
    name: kubeconfig
status: {{}}
"""
# 1.20 (kubeadm 1.20's layout; `--port=0` switches off the insecure port 1.24 removed).
KUBEADM_MANIFEST_1_20 = """\
apiVersion: v1
kind: Pod
metadata:
  creationTimestamp: null
  labels:
    component: kube-scheduler
    tier: control-plane
  name: kube-scheduler
  namespace: kube-system
spec:
  containers:
  - command:
    - kube-scheduler
    - --authentication-kubeconfig={kubeconfig}
    - --authorization-kubeconfig={kubeconfig}
    - --bind-address=127.0.0.1
    - --secure-port={secure_port}
    - --port=0
    - --kubeconfig={kubeconfig}
    - --leader-elect=false
    image: k8s.gcr.io/kube-scheduler:{version}
    imagePullPolicy: IfNotPresent
    livenessProbe:
      failureThreshold: 8
      httpGet:
        host: 127.0.0.1
        path: /healthz
        port: {secure_port}
        scheme: HTTPS
      initialDelaySeconds: 10
      periodSeconds: 10
      timeoutSeconds: 15
    name: kube-scheduler
    resources:
      requests:
        cpu: 100m
    volumeMounts:
    - mountPath: {kubeconfig}
      name: kubeconfig
      readOnly: true
  hostNetwork: true
  priorityClassName: system-node-critical
  volumes:
  - hostPath:
      path: {kubeconfig}
      type: FileOrCreate
    name: kubeconfig
status: {{}}
"""


class StaticPodRunner:
    """Follows one manifest: (re)starts its first container's command with ``binary`` as argv[0]."""

    def __init__(self, manifest: Path, binary: Path, log_dir: Path) -> None:
        self.manifest, self.binary, self.log_dir = manifest, binary, log_dir
        self.daemon: Daemon | None = None
        self.restarts = 0
        self._seen: Any = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow, daemon=True, name="static-pod")

    def start(self) -> StaticPodRunner:
        self._sync()
        self._thread.start()
        return self

    def _sync(self) -> None:
        try:
            doc = yaml.safe_load(self.manifest.read_text())
        except (OSError, yaml.YAMLError):
            return
        if doc == self._seen:
            return
        self._seen = doc
        if self.daemon is not None:
            self.daemon.stop()
            self.restarts += 1
        argv = [str(self.binary), *doc["spec"]["containers"][0]["command"][1:]]
        self.daemon = Daemon(
            "static kube-scheduler", argv, self.log_dir / f"static-scheduler-{self.restarts}.log"
        )

    def _follow(self) -> None:
        while not self._stop.wait(0.3):
            self._sync()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        if self.daemon is not None:
            self.daemon.stop()

    def argv(self) -> list[str]:
        return list(self.daemon.argv) if self.daemon else []

    def log_tail(self) -> str:
        return self.daemon.tail() if self.daemon else ""


def write_kubeadm_manifest(path: Path, kubeconfig: Path, secure_port: int, version: str) -> str:
    """A kube-scheduler manifest as kubeadm of ``version`` (``v1.37.2``, ``v1.20.2``) writes it, pointed at
    lab paths; returns the text."""
    template = KUBEADM_MANIFEST_1_20 if version.startswith("v1.20.") else KUBEADM_MANIFEST
    text = template.format(kubeconfig=kubeconfig, secure_port=secure_port, version=version)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return text
