"""A Kubernetes control plane on 127.0.0.1 for tests: etcd, kube-apiserver, controller-manager,
kube-scheduler (optionally with extenders), fake nodes and real kubelet nodes
(:mod:`gpufleet_harness.cluster.node`).

The daemons are those of the build handed in (:class:`~gpufleet_harness.cluster.k8s_build.K8sArtifacts`):
Kubernetes 1.37 from its Go modules with its etcd 3.7 by default, or (``GPUFLEET_K8S_VERSION=1.20``, and
still what ``gpufleet lab up`` runs) 1.20 from Debian's source with Debian's etcd 3.4. The few flags and
formats that differ between the two are chosen here by the build's minor version (:func:`legacy`).

Everything lives in one :class:`TestCluster`: a fresh directory (``/tmp/gpufleet-lab-<id>`` by default), ports
chosen free at start, and a cleanup stack run by :meth:`TestCluster.close` (also on ``with`` exit and at
interpreter exit)::

    with TestCluster(ensure_k8s()) as cluster:
        cp = cluster.start_control_plane()
        cluster.start_scheduler(extenders=[{"urlPrefix": "http://127.0.0.1:8888", "filterVerb": "filter"}])
        node = cluster.start_kubelet_node("lab-node")
        core = cp.core_v1()
"""

from __future__ import annotations

import atexit
import contextlib
import datetime as dt
import json
import logging
import os
import secrets
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s

from gpufleet_harness.cluster import pki
from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.node import KubeletNode, remove_node_leftovers
from gpufleet_harness.cluster.process import ClusterError, Daemon, free_ports, http_found, http_ok, wait_for
from gpufleet_harness.cluster.taints import remove_taint

log = logging.getLogger(__name__)

# On-disk and outside names keep "lab", the test cluster's old name: this directory prefix, node.py's cgroups,
# veths, network lock and image names, the kubeconfig context, and the variables GPUFLEET_LAB_DIR and
# GPUFLEET_LAB_KEEP. Stale-cluster reaping (reap_stale_clusters, `gpufleet cluster down`) finds what a killed
# run left behind by these names; renaming them would orphan what an older checkout left.
LAB_PREFIX = "gpufleet-lab-"
OWNER_FILE = "owner.json"
SCHEDULER_API = "kubescheduler.config.k8s.io/v1"  # what kube-scheduler reads from 1.25 on
SCHEDULER_API_LEGACY = "kubescheduler.config.k8s.io/v1beta1"  # 1.19-1.21
DEFAULT_SCHEDULER = "default-scheduler"
FAKE_NODE_BASE = {"cpu": "8", "memory": "32Gi", "pods": "110", "ephemeral-storage": "100Gi"}
# Paths the node namespace shadows: a cluster dir below them would vanish inside the node.
_SHADOWED = (Path("/var"), Path("/run"))
# 1.24 removed the insecure ports (apiserver, controller-manager, scheduler) and dockershim; everything this
# harness runs is either 1.20 (Debian's source) or a current release.
LEGACY_BEFORE_MINOR = 24


def legacy(artifacts: K8sArtifacts) -> bool:
    """True for a build older than 1.24 (Debian's 1.20): insecure ports to switch off, v1beta1 scheduler
    configuration, kubelet flags instead of a KubeletConfiguration file, dockershim available."""
    return artifacts.minor < LEGACY_BEFORE_MINOR


@dataclass(frozen=True)
class Credentials:
    """How one test-cluster user authenticates: a bearer token or a client certificate."""

    user: str
    token: str | None = None
    cert: pki.KeyPair | None = None


class ControlPlane:
    """etcd + kube-apiserver (+ kube-controller-manager) on loopback, with token users and a cluster CA."""

    def __init__(
        self,
        cluster: TestCluster,
        *,
        controller_manager: bool = True,
        apiserver_args: Sequence[str] = (),
        serving_ips: Sequence[str] = (),
        node_lifecycle: bool = False,
    ) -> None:
        self.cluster = cluster
        self.dir = cluster.dir / "control-plane"
        self.pki = self.dir / "pki"
        self.logs = cluster.logs
        self.daemons: list[Daemon] = []
        self.etcd_port, self.etcd_peer_port, self.port, self.cm_port = free_ports(4)
        self.url = f"https://127.0.0.1:{self.port}"
        self.ca_file = self.dir / "apiserver-certs" / "apiserver.crt"
        self.users: dict[str, Credentials] = {}
        self._apiserver_args = list(apiserver_args)
        self._with_cm = controller_manager
        # Addresses besides 127.0.0.1 that clients dial (e.g. the gateway containers reach loopback through):
        # the cluster CA then signs the serving certificate and is what clients trust.
        self._serving_ips = list(serving_ips)
        # Off by default: it would taint and evict fake nodes, which never heartbeat. Real kubelets only need
        # it (it lifts the not-ready taint they register with).
        self._node_lifecycle = node_lifecycle
        self.legacy = legacy(cluster.artifacts)

    # -- start / stop -------------------------------------------------------------------------------------
    def start(self) -> ControlPlane:
        """Generate keys and tokens, start etcd and kube-apiserver, wait for /readyz, then the controllers."""
        started = time.monotonic()
        self.sa_key, self.sa_pub = pki.service_account_keys(self.pki)
        self.ca = pki.certificate_authority(self.pki)
        serving_args: list[str] = []
        if self._serving_ips:
            serving = pki.serving_certificate(
                self.ca,
                self.pki,
                "apiserver",
                "kube-apiserver",
                ["127.0.0.1", "10.0.0.1", *self._serving_ips],
                ["kubernetes", "kubernetes.default", "kubernetes.default.svc", "localhost"],
            )
            serving_args = [f"--tls-cert-file={serving.cert}", f"--tls-private-key-file={serving.key}"]
            self.ca_file = self.ca.cert
        kubelet_client = pki.client_certificate(
            self.ca, self.pki, "apiserver-kubelet-client", "kube-apiserver"
        )
        # user -> groups; tokens live in a static file that kube-apiserver reads once at start (still
        # --token-auth-file in 1.37)
        token_users = {
            "admin": ["system:masters"],
            "system:kube-scheduler": [],
            "system:kube-controller-manager": [],
        }
        lines = []
        for user, groups in token_users.items():
            token = secrets.token_hex(16)
            self.users[user] = Credentials(user, token=token)
            group_field = f',"{",".join(groups)}"' if groups else ""
            lines.append(f"{token},{user},uid-{user.replace(':', '-')}{group_field}")
        tokens = self.pki / "tokens.csv"
        tokens.write_text("\n".join(lines) + "\n")
        tokens.chmod(0o600)

        etcd_url = f"http://127.0.0.1:{self.etcd_port}"
        peer_url = f"http://127.0.0.1:{self.etcd_peer_port}"
        # 1.37: the etcd built with it (3.7.0, what its kubeadm deploys); 1.20: Debian's etcd-server (3.4)
        etcd_binary: str | Path = self.cluster.artifacts.binary("etcd")
        etcd_binary = etcd_binary if Path(etcd_binary).is_file() else "etcd"
        etcd = self._daemon(
            "etcd",
            [etcd_binary, "--name", "lab", "--data-dir", self.dir / "etcd",
             "--listen-client-urls", etcd_url, "--advertise-client-urls", etcd_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"lab={peer_url}", "--unsafe-no-fsync"],
        )  # fmt: skip
        wait_for("etcd /health", lambda: _etcd_healthy(etcd_url), 30, alive=etcd.check)
        self.timings = {"etcd": time.monotonic() - started}

        apiserver = self._daemon(
            "kube-apiserver",
            [self.cluster.artifacts.binary("kube-apiserver"),
             f"--etcd-servers={etcd_url}",
             "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1",
             f"--secure-port={self.port}", *(["--insecure-port=0"] if self.legacy else []),
             f"--cert-dir={self.ca_file.parent}",
             f"--service-account-key-file={self.sa_pub}",
             f"--service-account-signing-key-file={self.sa_key}",
             "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
             f"--token-auth-file={tokens}",
             f"--client-ca-file={self.ca.cert}",
             f"--kubelet-client-certificate={kubelet_client.cert}",
             f"--kubelet-client-key={kubelet_client.key}",
             "--authorization-mode=Node,RBAC",
             "--allow-privileged=true",
             # 127.0.0.1 is not a valid address for the `kubernetes` Endpoints: reconciling fails every 10 s
             "--endpoint-reconciler-type=none",
             # else `logs`/`exec` look node names up in DNS
             "--kubelet-preferred-address-types=InternalIP,Hostname,ExternalIP",
             *serving_args, *self._apiserver_args],
        )  # fmt: skip
        admin = self.users["admin"].token
        wait_for("kube-apiserver /readyz", lambda: http_ok(f"{self.url}/readyz", token=admin), 120,
                 interval=0.2, alive=apiserver.check)  # fmt: skip
        self.timings["apiserver"] = time.monotonic() - started
        for user in self.users:
            self.kubeconfig(user)
        if self._with_cm:
            self._start_controller_manager()
            self.timings["controller-manager"] = time.monotonic() - started
        log.info("control plane up at %s in %.1fs", self.url, time.monotonic() - started)
        return self

    def _start_controller_manager(self) -> None:
        kubeconfig = self.kubeconfig("system:kube-controller-manager")
        # renamed in 1.28 (controllers got "-controller" names)
        node_lifecycle_name = "nodelifecycle" if self.legacy else "node-lifecycle-controller"
        cm = self._daemon(
            "kube-controller-manager",
            [self.cluster.artifacts.binary("kube-controller-manager"),
             f"--kubeconfig={kubeconfig}",
             f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
             "--bind-address=127.0.0.1", f"--secure-port={self.cm_port}", "--leader-elect=false",
             *(["--port=0"] if self.legacy else []),
             f"--service-account-private-key-file={self.sa_key}", f"--root-ca-file={self.ca_file}",
             # the default, /usr/libexec/kubernetes/kubelet-plugins/volume/exec, would be created on the host
             f"--flex-volume-plugin-dir={self.dir / 'flexvolume'}",
             "--use-service-account-credentials=true",
             "--controllers=*" if self._node_lifecycle else f"--controllers=*,-{node_lifecycle_name}"],
        )  # fmt: skip
        wait_for("kube-controller-manager /healthz", lambda: http_ok(f"https://127.0.0.1:{self.cm_port}/healthz"),
                 60, alive=cm.check)  # fmt: skip
        # Admission refuses every pod in `default` until the service-account controller has made its account
        # (a test whose first act is creating a pod failed on that: "serviceaccount default not found").
        account = f"{self.url}/api/v1/namespaces/default/serviceaccounts/default"
        admin = self.users["admin"].token
        wait_for("service account default/default", lambda: http_found(account, token=admin), 60,
                 interval=0.2, alive=cm.check)  # fmt: skip

    def _daemon(self, name: str, argv: Sequence[str | os.PathLike[str]], **kwargs: Any) -> Daemon:
        daemon = Daemon(name, argv, self.logs / f"{name}.log", **kwargs)
        self.daemons.append(daemon)
        return daemon

    def stop(self) -> None:
        """Stop the controllers, then the apiserver, then etcd."""
        while self.daemons:
            self.daemons.pop().stop()

    # -- credentials ----------------------------------------------------------------------------------------
    def node_credentials(self, node_name: str) -> Credentials:
        """A client certificate for a kubelet (``system:node:<name>`` in ``system:nodes``)."""
        user = f"system:node:{node_name}"
        if user not in self.users:
            stem = f"node-{node_name}"
            cert = pki.client_certificate(self.ca, self.pki, stem, user, "system:nodes")
            self.users[user] = Credentials(user, cert=cert)
        return self.users[user]

    def kubeconfig(self, user: str = "admin") -> Path:
        """Path of a kubeconfig file for ``user`` (written on first use)."""
        creds = self.users[user]
        path = self.dir / "kubeconfigs" / f"{user.replace(':', '_')}.kubeconfig"
        if path.exists():
            return path
        entry: dict[str, str] = {}
        if creds.token:
            entry["token"] = creds.token
        if creds.cert:
            entry |= {"client-certificate": str(creds.cert.cert), "client-key": str(creds.cert.key)}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {"name": "lab", "cluster": {"server": self.url, "certificate-authority": str(self.ca_file)}}
            ],
            "users": [{"name": user, "user": entry}],
            "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": user}}],
            "current-context": "lab",
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)
        return path

    def api_client(self, user: str = "admin", *, token: str | None = None) -> k8s.ApiClient:
        """A ``kubernetes`` ApiClient for a cluster user, or for a bearer ``token`` (a service account's)."""
        config = k8s.Configuration()
        config.host = self.url
        config.ssl_ca_cert = str(self.ca_file)
        creds = self.users[user] if token is None else Credentials("token", token=token)
        if creds.token:
            config.api_key = {"authorization": creds.token}
            config.api_key_prefix = {"authorization": "Bearer"}
        if creds.cert:
            config.cert_file, config.key_file = str(creds.cert.cert), str(creds.cert.key)
        return k8s.ApiClient(config)

    def core_v1(self, user: str = "admin") -> k8s.CoreV1Api:
        """CoreV1Api as ``user``."""
        return k8s.CoreV1Api(self.api_client(user))

    def service_account_token(self, namespace: str, name: str, seconds: int = 3600) -> str:
        """A token of ServiceAccount ``namespace/name`` from the TokenRequest API, as the kubelet gets one
        for a pod. (1.24 stopped making a token Secret per ServiceAccount; 1.20 serves TokenRequest too.)"""
        request = k8s.AuthenticationV1TokenRequest(spec=k8s.V1TokenRequestSpec(
            audiences=[], expiration_seconds=seconds))  # fmt: skip
        reply = self.core_v1().create_namespaced_service_account_token(name, namespace, request)
        return str(reply.status.token)

    def fake_node(
        self,
        name: str,
        capacity: Mapping[str, str | int] | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> k8s.V1Node:
        """Create a kubelet-less Node the scheduler accepts; see :func:`create_fake_node`."""
        return create_fake_node(self.core_v1(), name, capacity, labels, annotations)


def _etcd_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return bool(json.loads(response.read()).get("health") == "true")
    except (OSError, ValueError):
        return False


def create_fake_node(
    core: k8s.CoreV1Api,
    name: str,
    capacity: Mapping[str, str | int] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
) -> k8s.V1Node:
    """Create a Node without a kubelet: capacity = allocatable (``FAKE_NODE_BASE`` plus ``capacity``),
    Ready, and without the ``not-ready`` taint that admission puts on every new Node.
    """
    resources = FAKE_NODE_BASE | {k: str(v) for k, v in (capacity or {}).items()}
    meta = k8s.V1ObjectMeta(
        name=name,
        labels={"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **(labels or {})},
        annotations=dict(annotations or {}),
    )
    created = core.create_node(k8s.V1Node(metadata=meta))
    now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    ready = {"type": "Ready", "status": "True", "reason": "LabFakeNode", "message": "fake node",
             "lastHeartbeatTime": now, "lastTransitionTime": now}  # fmt: skip
    # A list body makes the client send application/json-patch+json.
    core.patch_node_status(name, [
        {"op": "add", "path": "/status/capacity", "value": resources},
        {"op": "add", "path": "/status/allocatable", "value": resources},
        {"op": "add", "path": "/status/conditions", "value": [ready]},
    ])  # fmt: skip
    if created.spec and created.spec.taints:
        remove_taint(core, name, "node.kubernetes.io/not-ready")
    return core.read_node(name)


def scheduler_config(
    extenders: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None,
    *,
    kubeconfig: Path,
    health_port: int | None = None,
    scheduler_name: str = DEFAULT_SCHEDULER,
) -> dict[str, Any]:
    """A ``KubeSchedulerConfiguration`` around the given extenders: v1 (what kube-scheduler reads from 1.25
    on; health and metrics only on its secure port), or, with ``health_port`` (1.20), v1beta1 with plain-HTTP
    healthz and metrics on ``127.0.0.1:<health_port>``.

    ``extenders`` may be a YAML file path, a mapping holding an ``extenders`` list (a whole
    KubeSchedulerConfiguration of either version: only ``extenders``, ``profiles`` and
    ``percentageOfNodesToScore`` are taken, the fields v1beta1 and v1 share), or the list itself.
    """
    source: Any = extenders
    if isinstance(source, (str, os.PathLike)):
        source = yaml.safe_load(Path(source).read_text())
    config: dict[str, Any] = {
        "apiVersion": SCHEDULER_API if health_port is None else SCHEDULER_API_LEGACY,
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": str(kubeconfig)},
        "leaderElection": {"leaderElect": False},
    }
    if health_port is not None:
        # 1.20 serves plain-HTTP healthz/metrics on 0.0.0.0:10251 unless told otherwise (and ignores
        # --port=0 together with --config): keep them on loopback and on a free port.
        config["healthzBindAddress"] = config["metricsBindAddress"] = f"127.0.0.1:{health_port}"
    if isinstance(source, Mapping):
        for key in ("extenders", "profiles", "percentageOfNodesToScore"):
            if key in source:
                config[key] = source[key]
    elif source is not None:
        config["extenders"] = list(source)
    for extender in config.get("extenders", []):
        if "urlPrefix" not in extender:
            raise ValueError(f"extender without urlPrefix: {extender!r}")
    if "profiles" not in config and scheduler_name != DEFAULT_SCHEDULER:
        config["profiles"] = [{"schedulerName": scheduler_name}]
    return config


class Scheduler:
    """kube-scheduler with a generated configuration; secure port (and 1.20's plain-HTTP healthz) on
    loopback."""

    def __init__(
        self,
        control_plane: ControlPlane,
        extenders: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        scheduler_name: str = DEFAULT_SCHEDULER,
        verbosity: int = 2,
    ) -> None:
        self.control_plane = control_plane
        self.name = scheduler_name
        self.secure_port, health_port = free_ports(2)
        # 1.20: plain-HTTP /healthz on a port of its own; later: /healthz on the secure port (HTTPS, always
        # allowed without credentials: --authorization-always-allow-paths)
        self.health_port: int | None = health_port if control_plane.legacy else None
        self.health_url = (
            f"http://127.0.0.1:{health_port}/healthz"
            if control_plane.legacy
            else f"https://127.0.0.1:{self.secure_port}/healthz"
        )
        kubeconfig = control_plane.kubeconfig("system:kube-scheduler")
        self.config = scheduler_config(
            extenders, kubeconfig=kubeconfig, health_port=self.health_port, scheduler_name=scheduler_name
        )
        tag = f"{scheduler_name}-{self.secure_port}"
        self.config_path = control_plane.cluster.dir / "schedulers" / f"{tag}.yaml"
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(self.config, sort_keys=False))
        self.log_path = control_plane.logs / f"kube-scheduler-{tag}.log"
        self._argv: list[str | os.PathLike[str]] = [
            control_plane.cluster.artifacts.binary("kube-scheduler"),
            f"--config={self.config_path}",
            "--bind-address=127.0.0.1", f"--secure-port={self.secure_port}",
            *(["--port=0"] if control_plane.legacy else []),
            f"--authentication-kubeconfig={kubeconfig}", f"--authorization-kubeconfig={kubeconfig}",
            f"--v={verbosity}",
        ]  # fmt: skip
        self.daemon: Daemon | None = None

    def start(self) -> Scheduler:
        """Start and wait for /healthz (about a second)."""
        started = time.monotonic()
        self.daemon = Daemon(f"kube-scheduler[{self.name}]", self._argv, self.log_path)
        wait_for("kube-scheduler /healthz", lambda: http_ok(self.health_url), 60, alive=self.daemon.check)
        self.startup_seconds = time.monotonic() - started
        return self

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()
            self.daemon = None


class TestCluster:
    """One test cluster: its directory and every process, namespace, interface and cgroup started in it."""

    __test__ = False  # a harness class, not a test class, though its name starts with Test (pytest)

    def __init__(
        self,
        artifacts: K8sArtifacts,
        base_dir: str | os.PathLike[str] | None = None,
        *,
        keep: bool = False,
    ) -> None:
        base = Path(base_dir or os.environ.get("GPUFLEET_LAB_DIR") or tempfile.gettempdir()).resolve()
        if any(base == p or p in base.parents for p in _SHADOWED):
            raise ClusterError(
                f"cluster base {base} is under {' or '.join(map(str, _SHADOWED))}, hidden inside nodes"
            )
        base.mkdir(parents=True, exist_ok=True)
        reap_stale_clusters(base)
        self.artifacts = artifacts
        self.dir = Path(tempfile.mkdtemp(prefix=LAB_PREFIX, dir=base))
        self.id = self.dir.name.removeprefix(LAB_PREFIX)
        self.logs = self.dir / "logs"
        self.logs.mkdir()
        self.keep = keep
        self.control_plane: ControlPlane | None = None
        self.nodes: list[KubeletNode] = []
        self._cleanup = contextlib.ExitStack()
        (self.dir / OWNER_FILE).write_text(
            json.dumps({"pid": os.getpid(), "start": _start_time(os.getpid())})
        )
        atexit.register(self.close)
        log.info("test cluster %s in %s", self.id, self.dir)

    def __enter__(self) -> TestCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start_control_plane(
        self,
        *,
        controller_manager: bool = True,
        apiserver_args: Sequence[str] = (),
        serving_ips: Sequence[str] = (),
        node_lifecycle: bool = False,
    ) -> ControlPlane:
        """etcd + kube-apiserver (+ controller-manager with ``nodelifecycle`` off), stopped on close."""
        if self.control_plane is not None:
            raise ClusterError("this cluster already has a control plane")
        cp = ControlPlane(
            self,
            controller_manager=controller_manager,
            apiserver_args=apiserver_args,
            serving_ips=serving_ips,
            node_lifecycle=node_lifecycle,
        )
        self._cleanup.callback(cp.stop)
        self.control_plane = cp.start()
        return cp

    def start_scheduler(
        self,
        extenders: str | os.PathLike[str] | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
        scheduler_name: str = DEFAULT_SCHEDULER,
    ) -> Scheduler:
        """A kube-scheduler, optionally with extenders (see :func:`scheduler_config`); stop it when done."""
        scheduler = Scheduler(self._require_cp(), extenders, scheduler_name)
        self._cleanup.callback(scheduler.stop)
        return scheduler.start()

    def start_kubelet_node(
        self, name: str = "lab-node", labels: Mapping[str, str] | None = None, runtime: str = "containerd"
    ) -> KubeletNode:
        """A real kubelet node in private namespaces, on containerd CRI (or, with 1.20 only, dockershim:
        ``runtime="docker"``); Ready and untainted on return."""

        node = KubeletNode(
            self, self._require_cp(), name, index=len(self.nodes), labels=labels, runtime=runtime
        )
        self.nodes.append(node)
        self._cleanup.callback(node.stop)
        return node.start()

    def _require_cp(self) -> ControlPlane:
        if self.control_plane is None:
            raise ClusterError("start the control plane first")
        return self.control_plane

    def close(self) -> None:
        """Stop everything in reverse order and remove the cluster directory (unless ``keep``)."""
        atexit.unregister(self.close)
        try:
            self._cleanup.close()
        finally:
            if self.keep:
                log.info("test cluster %s kept in %s", self.id, self.dir)
            else:
                shutil.rmtree(self.dir, ignore_errors=True)


def _start_time(pid: int) -> str | None:
    """Process start time in clock ticks (field 22 of /proc/PID/stat): tells a reused PID apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap_stale_clusters(base: Path) -> list[Path]:
    """Remove test-cluster directories (and their cgroups and veths) whose owning process is gone."""

    removed = []
    for cluster_dir in base.glob(f"{LAB_PREFIX}*"):
        try:
            owner = json.loads((cluster_dir / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if owner.get("start") and _start_time(int(owner["pid"])) == owner["start"]:
            continue
        log.warning("removing stale test cluster %s (owner pid %s is gone)", cluster_dir, owner.get("pid"))
        remove_node_leftovers(cluster_dir.name.removeprefix(LAB_PREFIX))
        shutil.rmtree(cluster_dir, ignore_errors=True)
        removed.append(cluster_dir)
    return removed


def wait_for_pod_phase(
    core: k8s.CoreV1Api, name: str, namespace: str, phases: Iterable[str], timeout: float
) -> k8s.V1Pod:
    """Wait until the pod's phase is one of ``phases`` and return it."""
    wanted = set(phases)

    def probe() -> k8s.V1Pod | None:
        pod = core.read_namespaced_pod(name, namespace)
        return pod if pod.status and pod.status.phase in wanted else None

    return wait_for(f"pod {namespace}/{name} in {sorted(wanted)}", probe, timeout, interval=0.25)
