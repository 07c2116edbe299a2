"""A real kubelet node: the build's kubelet (1.37 by default, or 1.20) on containerd 1.6 through CRI v1,
isolated from the host. With the 1.20 build the kubelet takes flags instead of a KubeletConfiguration file,
and can run on dockerd 20.10 through its dockershim (``runtime="docker"``; removed from the kubelet in 1.24).

Layout (host view, ``<node>`` = ``<cluster dir>/nodes/<node name>``)::

    <node>/var, <node>/run    /var and /run inside the node's mount namespace
    <node>/bin/oci-runtime    the runtime's runc: runc with negative oom_score_adj clamped
    <node>/kubelet.yaml       the kubelet's KubeletConfiguration (1.24 and later)
    <node>/containerd.toml    containerd's config (CRI: sandbox image, CNI, the runc above; its socket, root
                              and state under the node's /run and /var), so the host's never applies
    <node>/var/lib/gpufleet-node/cni
                              the pod network: a CNI bridge (Debian's containernetworking-plugins)
    <node>/daemon.json        dockerd's config, so a host /etc/docker/daemon.json never applies

Namespaces: :mod:`gpufleet_harness.cluster.node_init` is PID 1 of a private mount + PID namespace;
the container runtime, the kubelet and anything :meth:`KubeletNode.spawn` starts join it with ``nsenter``.
The runtime also gets its own network namespace, where pods' networks hang off its bridge and host-network
pods live. The kubelet stays in the host network namespace (it reaches the apiserver on 127.0.0.1) and needs
a non-loopback node IP on one of its interfaces: the host end of a veth pair whose peer sits in the
runtime's namespace, addressed from a documentation /30 (RFC 5737) that overlaps nothing on the machine.
containerd's streaming server (exec, attach, port-forward) listens on the peer address, where the kubelet
reaches it. The pair disappears with the runtime's namespace; stop() removes it anyway, and the cgroups the
pods got under ``/gpufleet-lab-<id>-<n>`` (the kubelet's ``--cgroup-root``, dockerd's ``--cgroup-parent``).
On-disk and kernel names (cgroups, veths, the network lock, image names) keep "lab", the test cluster's old
name: stale-cluster reaping finds them by it (``cluster.LAB_PREFIX``).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import yaml
from kubernetes import client as k8s

from gpufleet.imageref import qualified
from gpufleet_harness.cluster import cri, oci_runtime, pki
from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.process import ClusterError, Daemon, free_ports, http_ok, run, wait_for
from gpufleet_harness.cluster.taints import remove_taint

log = logging.getLogger(__name__)

PAUSE_IMAGE = "gpufleet-lab/pause:1"
BUSYBOX_IMAGE = "gpufleet-lab/busybox:1"
KUBELET_PORT = 10250  # on the node's own IP, so it cannot collide with another cluster
# RFC 5737 documentation networks: never routed, so a /30 from them is safe to put on a local veth.
NODE_NETWORKS = ("198.51.100.0/24", "203.0.113.0/24", "192.0.2.0/24")
# Serialises "pick a free /30 and put it on a veth" between test clusters on one machine. An abstract unix
# socket name: no file to leave behind, released by the kernel if its holder dies.
_NET_LOCK = b"\0gpufleet-lab-node-network"
_CGROUP_ROOT = Path("/sys/fs/cgroup")
_SOCKET_PATH_MAX = 107  # sun_path is 108 bytes including the terminating NUL
DEVICE_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"  # compile-time constant in the kubelet
RUNTIMES = ("containerd", "docker")  # containerd CRI, or dockershim (removed from the kubelet in 1.24)
KUBELET_CONFIG_API = "kubelet.config.k8s.io/v1beta1"
CNI_CONF_DIR = "/var/lib/gpufleet-node/cni"  # inside the node: the machine's /etc/cni stays untouched


def cgroup_parent(cluster_id: str, index: int) -> str:
    """The cgroup (under every controller) that holds one node's containers."""
    return f"gpufleet-lab-{cluster_id}-{index}"


def veth_names(cluster_id: str, index: int) -> tuple[str, str]:
    """Host and peer interface names for node ``index`` of cluster ``cluster_id`` (IFNAMSIZ: <= 15 chars)."""
    return f"gl{cluster_id}{index}h", f"gl{cluster_id}{index}n"


class NodeCluster(Protocol):
    """What a node uses of the test cluster it belongs to (``cluster.TestCluster`` has it). A protocol, so
    this module needs nothing from ``cluster.py``, which starts nodes: no import loop, not even for type
    checking (tests/architecture/test_import_cycles.py)."""

    @property
    def artifacts(self) -> K8sArtifacts: ...
    @property
    def dir(self) -> Path: ...
    @property
    def id(self) -> str: ...
    @property
    def logs(self) -> Path: ...


class NodeUser(Protocol):
    """A control-plane user as a node sees it (``cluster.Credentials``): its name."""

    @property
    def user(self) -> str: ...


class NodeControlPlane(Protocol):
    """What a node uses of its control plane (``cluster.ControlPlane``): the minor-version switch, the CA
    that signs the apiserver's client certificate, the kubelet's credentials and kubeconfig, an API client."""

    @property
    def legacy(self) -> bool: ...
    @property
    def ca(self) -> pki.KeyPair: ...
    def node_credentials(self, node_name: str) -> NodeUser: ...
    def kubeconfig(self, user: str = "admin") -> Path: ...
    def core_v1(self, user: str = "admin") -> k8s.CoreV1Api: ...


class KubeletNode:
    """A container runtime + kubelet registered as ``name`` with the test cluster's control plane."""

    def __init__(
        self,
        cluster: NodeCluster,
        control_plane: NodeControlPlane,
        name: str,
        *,
        index: int = 0,
        labels: Mapping[str, str] | None = None,
        runtime: str = "containerd",
    ) -> None:
        if runtime not in RUNTIMES:
            raise ClusterError(f"node {name}: runtime must be one of {', '.join(RUNTIMES)}, not {runtime!r}")
        if runtime == "docker" and not control_plane.legacy:
            raise ClusterError(
                f"node {name}: runtime 'docker' is the kubelet's dockershim, removed in Kubernetes 1.24;"
                f" this cluster runs {cluster.artifacts.git_version}:"
                " use containerd (or GPUFLEET_K8S_VERSION=1.20)"
            )
        self.runtime = runtime
        self.cluster = cluster
        self.control_plane = control_plane
        self.name = name
        self.index = index
        self.labels = dict(labels or {})
        self.dir = cluster.dir / "nodes" / name
        self.var = self.dir / "var"
        self.run_dir = self.dir / "run"
        self.logs = cluster.logs
        self.cgroup = cgroup_parent(cluster.id, index)
        self.veth_host, self.veth_peer = veth_names(cluster.id, index)
        self.node_ip: str | None = None
        self.peer_ip: str | None = None
        self.init: Daemon | None = None
        self.init_pid: int | None = None
        self.runtime_daemon: Daemon | None = None
        self.kubelet: Daemon | None = None
        self.spawned: list[Daemon] = []
        self.timings: dict[str, float] = {}
        self.healthz_port = free_ports(1)[0]
        longest = self.device_plugin_dir / "kubelet.sock"
        if len(str(longest)) > _SOCKET_PATH_MAX:
            raise ClusterError(
                f"{longest} is longer than a unix socket path may be; use a shorter cluster dir/name"
            )

    # -- paths another test needs --------------------------------------------------------------------------
    @property
    def device_plugin_dir(self) -> Path:
        """Host path of the node's ``/var/lib/kubelet/device-plugins`` (kubelet.sock, plugin sockets)."""
        return self.var / DEVICE_PLUGIN_DIR.removeprefix("/var/")

    @property
    def kubelet_socket(self) -> Path:
        """Host path of the kubelet's device-plugin Registration socket."""
        return self.device_plugin_dir / "kubelet.sock"

    @property
    def docker_socket(self) -> Path:
        """Host path of the node's dockerd API socket."""
        return self.run_dir / "docker.sock"

    # -- start -----------------------------------------------------------------------------------------------
    def start(self, timeout: float = 120.0) -> KubeletNode:
        """Namespace, runtime and its veth, images, kubelet; return when the Node is Ready and untainted."""
        started = time.monotonic()
        self._prepare_dirs()
        self._start_namespace()
        self._start_runtime()
        self.timings[self.runtime] = time.monotonic() - started
        self._import_images()
        self._start_kubelet()
        self._wait_ready(timeout)
        self.timings["ready"] = time.monotonic() - started
        log.info("node %s Ready in %.1fs (ip %s)", self.name, self.timings["ready"], self.node_ip)
        return self

    def _prepare_dirs(self) -> None:
        for sub in ("lib/kubelet/device-plugins", "log/pods", "log/containers", "tmp"):
            (self.var / sub).mkdir(parents=True, exist_ok=True)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.var / "run").symlink_to("/run")
        (self.var / "lock").symlink_to("/run/lock")
        bindir = self.dir / "bin"
        bindir.mkdir()
        # The cache may live under /var, which the node namespace replaces: give the node its own copy.
        kubelet = self.cluster.artifacts.binary("kubelet")
        try:
            os.link(kubelet, bindir / "kubelet")
        except OSError:
            shutil.copy2(kubelet, bindir / "kubelet")
        runc = shutil.which("runc") or "/usr/sbin/runc"
        shim = bindir / "oci-runtime"
        shim.write_text(oci_runtime.shim(runc))
        shim.chmod(0o755)
        # dockerd 20.10 would otherwise write its trust key to the host's /etc/docker/key.json
        (self.dir / "daemon.json").write_text(
            json.dumps({"deprecated-key-path": str(self.dir / "docker-key.json")})
        )

    def _start_namespace(self) -> None:
        ready = self.dir / "init.ready"
        self.init = Daemon(
            f"node-init[{self.name}]",
            ["unshare", "--mount", "--pid", "--fork", "--kill-child", "--mount-proc",
             "--propagation", "private", "--",
             sys.executable, "-m", "gpufleet_harness.cluster.node_init",
             "--root", self.dir, "--ready", ready],
            self.logs / f"node-{self.name}-init.log",
        )  # fmt: skip
        wait_for("node namespace", ready.exists, 30, interval=0.05, alive=self.init.check)
        self.init_pid = wait_for("node init pid", lambda: _child_pid(self.init.pid if self.init else 0), 5)

    def nsenter(self, argv: Sequence[str | os.PathLike[str]]) -> list[str]:
        """``argv`` prefixed to run inside the node's mount and PID namespaces (host network)."""
        if self.init_pid is None:
            raise ClusterError(f"node {self.name} has no namespace yet")
        return ["nsenter", f"--target={self.init_pid}", "--mount", "--pid", "--wd=/", "--", *map(str, argv)]

    def spawn(
        self, name: str, argv: Sequence[str | os.PathLike[str]], env: Mapping[str, str] | None = None
    ) -> Daemon:
        """Start a process inside the node (it sees the node's /var/lib/kubelet); stopped with the node."""
        log_path = self.logs / f"node-{self.name}-{name}.log"
        daemon = Daemon(f"{name}[{self.name}]", self.nsenter(argv), log_path, env=env)
        self.spawned.append(daemon)
        return daemon

    def _start_runtime(self) -> None:
        """The runtime in a network namespace of its own: the namespace first (its process waits), then the
        veth into it, then the runtime's config (containerd's names the veth's address), then the runtime."""
        go = self.dir / "runtime.go"
        if self.runtime == "containerd":
            argv: list[str | os.PathLike[str]] = ["containerd", f"--config={self.dir / 'containerd.toml'}"]
            answers = self._containerd_answers
        else:
            argv = [
                "dockerd", f"--config-file={self.dir / 'daemon.json'}",
                "--data-root=/var/lib/docker", "--exec-root=/run/docker", "--pidfile=/run/docker.pid",
                "-H", "unix:///run/docker.sock", f"--cgroup-parent=/{self.cgroup}",
                "--storage-driver=overlay2", f"--add-runtime=lab-runc={self.dir / 'bin' / 'oci-runtime'}",
                "--default-runtime=lab-runc", "--shutdown-timeout=1",
            ]  # fmt: skip
            answers = lambda: _docker_ping(self.docker_socket)  # noqa: E731
        holder = 'ip link set lo up && while [ ! -e "$0" ]; do sleep 0.05; done && exec "$@"'
        daemon = Daemon(
            f"{self.runtime}[{self.name}]",
            self.nsenter(["unshare", "--net", "--", "sh", "-c", holder, go, *argv]),
            self.logs / f"node-{self.name}-{self.runtime}.log",
            stop_timeout=30,
        )
        self.runtime_daemon = daemon
        self._add_veth()
        if self.runtime == "containerd":
            self._write_containerd_config()
        go.touch()
        wait_for(self.runtime, answers, 60, interval=0.2, alive=daemon.check)

    def _write_containerd_config(self) -> None:
        (self.dir / "containerd.toml").write_text(
            cri.containerd_config(
                PAUSE_IMAGE,
                f"gpufleet test cluster node {self.name}: containerd for its CRI kubelet",
                address=cri.CONTAINERD_SOCKET,
                stream_server_address=self.peer_ip,
                cni_conf_dir=CNI_CONF_DIR,
                runc_binary=str(self.dir / "bin" / "oci-runtime"),
            )
        )
        cni_dir = self.var / CNI_CONF_DIR.removeprefix("/var/")
        cni_dir.mkdir(parents=True, exist_ok=True)
        (cni_dir / "10-gpufleet-node.conflist").write_text(json.dumps(cri.CNI_CONFLIST, indent=2) + "\n")

    def _ctr_argv(self, *args: str) -> list[str]:
        """``ctr`` against this node's containerd, from the host."""
        return self.nsenter(["ctr", "--address", cri.CONTAINERD_SOCKET, *args])

    def ctr(self, *args: str, **kwargs: object) -> str:
        """Run ``ctr`` against this node's containerd, namespace ``k8s.io`` (CRI's); return stdout."""
        return run(self._ctr_argv("--namespace", "k8s.io", *args), **kwargs).stdout

    def _containerd_answers(self) -> bool:
        return subprocess.run(self._ctr_argv("version"), capture_output=True, check=False).returncode == 0

    def netns_pid(self) -> int:
        """Host PID of a process in the runtime's network namespace (nsenter's child, which became the
        runtime by exec), once it is in that namespace: the child exists before ``unshare --net`` has made
        the namespace, and a veth moved to it then would land in this process's namespace instead."""
        daemon = self.runtime_daemon
        if daemon is None:
            raise ClusterError(f"node {self.name} has no container runtime yet")
        here = os.stat("/proc/self/ns/net").st_ino

        def unshared() -> int | None:
            pid = _child_pid(daemon.pid)
            try:
                return pid if pid is not None and os.stat(f"/proc/{pid}/ns/net").st_ino != here else None
            except OSError:
                return None

        return wait_for("runtime network namespace", unshared, 5)

    def _add_veth(self) -> None:
        pid = self.netns_pid()
        with _network_lock():
            net = pick_node_network()
            self.node_ip, self.peer_ip = (str(h) for h in net.hosts())
            run(["ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_peer,
                 "netns", str(pid)])  # fmt: skip
            run(["ip", "addr", "add", f"{self.node_ip}/{net.prefixlen}", "dev", self.veth_host])
            run(["ip", "link", "set", self.veth_host, "up"])
        inside = ["nsenter", f"--target={pid}", "--net", "--", "ip"]
        run([*inside, "addr", "add", f"{self.peer_ip}/{net.prefixlen}", "dev", self.veth_peer])
        run([*inside, "link", "set", self.veth_peer, "up"])

    def docker(self, *args: str, **kwargs: object) -> str:
        """Run the Docker CLI against this node's dockerd (``runtime="docker"``); return stdout."""
        # Debian's 20.10 client matches the daemon; a newer one elsewhere on PATH also works (API 1.41).
        cli = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
        return run([cli, "-H", f"unix://{self.docker_socket}", *args], **kwargs).stdout

    def has_image(self, image: str) -> bool:
        """True when the runtime holds ``image`` under the name pods use."""
        if self.runtime == "containerd":
            return qualified(image) in self.ctr("images", "ls", "-q").split()
        try:
            self.docker("image", "inspect", image)
        except ClusterError:
            return False
        return True

    def load_image(self, image: str, rootfs: Path, changes: Sequence[str]) -> None:
        """Import a root filesystem tarball as ``image`` (no registry here). ``changes``: ``docker import -c``
        instructions (ENV, ENTRYPOINT, CMD). containerd gets it as a one-layer ``docker save`` archive."""
        if self.runtime == "docker":
            self.docker("import", *changes, str(rootfs), image)
            return
        rc, said = cri.stream_import(self._ctr_argv("--namespace", "k8s.io", "images", "import", "-"), image,
                                     rootfs, changes)  # fmt: skip
        if rc != 0:
            raise ClusterError(f"node {self.name}: ctr images import of {image} exited {rc}: {said}")

    def _import_images(self) -> None:
        artifacts = self.cluster.artifacts
        self.load_image(PAUSE_IMAGE, artifacts.image("pause"), ["-c", 'ENTRYPOINT ["/pause"]'])
        self.load_image(BUSYBOX_IMAGE, artifacts.image("busybox"), ["-c", 'CMD ["/bin/sh"]'])

    def _remove_containers(self) -> None:
        """SIGKILL and remove all containers: dockerd's own shutdown waits up to 10 s per container
        (containerd's are killed with the node's namespace)."""
        try:
            ids = self.docker("ps", "-aq").split()
            if ids:
                self.docker("rm", "-f", *ids)
        except ClusterError as err:
            log.warning("could not remove containers of node %s: %s", self.name, err)

    def _start_kubelet(self, *, remove_stale_sockets: bool = True) -> None:
        cp = self.control_plane
        kubeconfig = cp.kubeconfig(cp.node_credentials(self.name).user)
        if remove_stale_sockets:
            # stale plugin sockets would be silently lost: the device manager recreates kubelet.sock at start
            for stale in self.device_plugin_dir.glob("*.sock"):
                stale.unlink()
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        argv: list[str | os.PathLike[str]] = [
            self.dir / "bin" / "kubelet",
            f"--kubeconfig={kubeconfig}", f"--hostname-override={self.name}", f"--node-ip={self.node_ip}",
            *([f"--node-labels={labels}"] if labels else []),
            "--v=2",
        ]  # fmt: skip
        if self.control_plane.legacy:
            argv += self._legacy_flags()
        else:
            config = self.dir / "kubelet.yaml"
            config.write_text(yaml.safe_dump(self.kubelet_config(), sort_keys=False))
            argv.append(f"--config={config}")
        self.kubelet = Daemon(
            f"kubelet[{self.name}]", self.nsenter(argv), self.logs / f"node-{self.name}-kubelet.log"
        )

    def kubelet_config(self) -> dict[str, Any]:
        """The KubeletConfiguration of a 1.24+ kubelet: the settings the 1.20 one takes as flags
        (:meth:`_legacy_flags`), plus the runtime endpoint (a flag until 1.27) and cgroup v1 allowed."""
        return {
            "apiVersion": KUBELET_CONFIG_API,
            "kind": "KubeletConfiguration",
            "containerRuntimeEndpoint": f"unix://{cri.CONTAINERD_SOCKET}",
            "runtimeRequestTimeout": "15m",
            # pod cgroups under the node's own parent (the kubelet sends it to CRI as the sandboxes' parent)
            "cgroupRoot": f"/{self.cgroup}",
            "cgroupDriver": "cgroupfs",
            "cgroupsPerQOS": False,
            "enforceNodeAllocatable": [],
            # the build machines run cgroup v1, which the kubelet refuses from 1.35 unless told not to
            "failCgroupV1": False,
            "failSwapOn": False,
            "makeIPTablesUtilChains": False,
            "oomScoreAdj": 0,
            "address": self.node_ip,
            "port": KUBELET_PORT,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": self.healthz_port,
            # only the apiserver (client certificate from the cluster CA) may use the kubelet API
            "authentication": {
                "x509": {"clientCAFile": str(self.control_plane.ca.cert)},
                "anonymous": {"enabled": False},
                "webhook": {"enabled": False},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi"},
            # status is sent only when changed: 1 s shows plugin capacity quickly (default 10 s)
            "nodeStatusUpdateFrequency": "1s",
            # keep the default under /usr/libexec off the host
            "volumePluginDir": "/var/lib/kubelet/volume-plugins",
        }

    def _legacy_flags(self) -> list[str | os.PathLike[str]]:
        """Kubelet 1.20's settings as flags (its configuration file lacks the runtime endpoint)."""
        cp = self.control_plane
        return [
            *self._runtime_flags(),
            f"--pod-infra-container-image={PAUSE_IMAGE}",
            "--fail-swap-on=false", "--cgroups-per-qos=false", "--enforce-node-allocatable=",
            "--cgroup-driver=cgroupfs", "--make-iptables-util-chains=false", "--oom-score-adj=0",
            f"--address={self.node_ip}", f"--port={KUBELET_PORT}", "--read-only-port=0",
            "--healthz-bind-address=127.0.0.1", f"--healthz-port={self.healthz_port}",
            # only the apiserver (client certificate from the cluster CA) may use the kubelet API
            f"--client-ca-file={cp.ca.cert}", "--anonymous-auth=false",
            "--authentication-token-webhook=false", "--authorization-mode=AlwaysAllow",
            # keep the default under /usr/libexec off the host
            "--volume-plugin-dir=/var/lib/kubelet/volume-plugins",
            "--image-gc-high-threshold=100", "--image-gc-low-threshold=99",
            "--eviction-hard=memory.available<100Mi",
            # status is sent only when changed: 1 s shows plugin capacity quickly (default 10 s)
            "--node-status-update-frequency=1s",
        ]  # fmt: skip

    def _runtime_flags(self) -> list[str]:
        if self.runtime == "docker":
            return ["--container-runtime=docker", "--docker-endpoint=unix:///run/docker.sock"]
        # Pod cgroups under the node's own parent (the kubelet sends it to CRI as the sandboxes' parent).
        return ["--container-runtime=remote", f"--container-runtime-endpoint=unix://{cri.CONTAINERD_SOCKET}",
                "--runtime-request-timeout=15m", f"--cgroup-root=/{self.cgroup}"]  # fmt: skip

    def _wait_ready(self, timeout: float) -> None:
        assert self.kubelet is not None
        kubelet = self.kubelet
        started = time.monotonic()
        wait_for("kubelet /healthz", lambda: http_ok(f"http://127.0.0.1:{self.healthz_port}/healthz"),
                 timeout, interval=0.2, alive=kubelet.check)  # fmt: skip
        self.timings["kubelet_healthz"] = time.monotonic() - started
        core = self.control_plane.core_v1()

        def ready() -> bool:
            try:
                node = core.read_node(self.name)
            except k8s.ApiException:
                return False
            conditions = (node.status.conditions or []) if node.status else []
            return any(c.type == "Ready" and c.status == "True" for c in conditions)

        wait_for(f"node {self.name} Ready", ready, timeout, interval=0.25, alive=kubelet.check)
        # nodelifecycle is off (it would evict fake nodes), so nobody lifts the taint set at registration
        remove_taint(core, self.name, "node.kubernetes.io/not-ready")
        wait_for("kubelet.sock", self.kubelet_socket.exists, 30, alive=kubelet.check)

    # -- restart ---------------------------------------------------------------------------------------------
    def restart_kubelet(self, timeout: float = 120.0) -> None:
        """Stop the kubelet alone (SIGTERM) and start it again with the same flags, as a service restart does.

        The runtime, containers and spawned processes (device plugins) keep running. The plugin directory is
        left alone here: the new kubelet's device manager wipes it and binds a new ``kubelet.sock`` itself,
        which is what plugins must notice. Returns when the new ``kubelet.sock`` exists and the Node is
        Ready.
        """
        if self.kubelet is None:
            raise ClusterError(f"node {self.name} has no kubelet to restart")
        before = _identity(self.kubelet_socket)
        self.kubelet.stop()
        self._start_kubelet(remove_stale_sockets=False)
        kubelet = self.kubelet
        assert kubelet is not None
        wait_for(
            "a new kubelet.sock",
            lambda: _identity(self.kubelet_socket) not in (None, before),
            timeout,
            interval=0.1,
            alive=kubelet.check,
        )
        self._wait_ready(timeout)

    # -- stop ------------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop spawned processes, kubelet, the runtime, the namespace; remove the veth and cgroups."""
        for daemon in [*reversed(self.spawned), self.kubelet]:
            if daemon is not None:
                daemon.stop()
        if self.runtime_daemon is not None:
            if self.runtime == "docker" and self.runtime_daemon.running():
                self._remove_containers()
            self.runtime_daemon.stop()
        self.spawned.clear()
        if self.init is not None:
            if self.init_pid is not None:
                # PID 1 of the namespace stops what is left there, then exits (unshare follows).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.init_pid, signal.SIGTERM)
                with contextlib.suppress(Exception):
                    self.init.proc.wait(15)
            self.init.stop()
        self.init = self.init_pid = None
        remove_node_leftovers(self.cluster.id, self.index)


def remove_node_leftovers(cluster_id: str, index: int | None = None) -> None:
    """Delete the veth pair and cgroups of node ``index`` (every node if None) of cluster ``cluster_id``."""
    host, _ = veth_names(cluster_id, index) if index is not None else (f"gl{cluster_id}*h", "")
    for link in Path("/sys/class/net").glob(host):
        run(["ip", "link", "del", link.name])
    every = cgroup_parent(cluster_id, 0)[:-1] + "*"
    parent = cgroup_parent(cluster_id, index) if index is not None else every
    for top in _CGROUP_ROOT.glob(f"*/{parent}"):
        _remove_cgroup_tree(top)


def _remove_cgroup_tree(top: Path, timeout: float = 10.0) -> None:
    """rmdir a cgroup and its children, deepest first, retrying while exiting tasks still hold them."""
    deadline = time.monotonic() + timeout
    while top.exists():
        for directory in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
            with contextlib.suppress(OSError):
                directory.rmdir()
        try:
            top.rmdir()
        except OSError as err:
            if time.monotonic() > deadline:
                raise ClusterError(f"cannot remove cgroup {top}: {err}") from err
            time.sleep(0.2)


def _identity(path: Path) -> tuple[int, int] | None:
    """(inode, ctime) of a file, None when it is missing: tells a re-created socket from the old one."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_ctime_ns


def _child_pid(parent: int) -> int | None:
    """PID of one child of ``parent`` (scans /proc: the kernel here lacks /proc/PID/task/*/children)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
            return int(entry)
    return None


def _docker_ping(sock_path: Path) -> bool:
    """True when dockerd answers ``GET /_ping`` on its unix socket."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(2)
            sock.connect(str(sock_path))
            sock.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            reply = sock.recv(4096)
    except OSError:
        return False
    return reply.startswith(b"HTTP/1.") and b" 200 " in reply.split(b"\r\n", 1)[0]


def machine_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    """Every IPv4 network on an interface or in any routing table of this machine (default routes aside)."""
    nets = []
    for entry in json.loads(run(["ip", "-j", "-4", "addr", "show"]).stdout or "[]"):
        for addr in entry.get("addr_info", []):
            nets.append(ipaddress.ip_network(f"{addr['local']}/{addr['prefixlen']}", strict=False))
    for route in json.loads(run(["ip", "-j", "-4", "route", "show", "table", "all"]).stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            nets.append(ipaddress.ip_network(dst if "/" in dst else f"{dst}/32", strict=False))
    return nets


def pick_node_network() -> ipaddress.IPv4Network:
    """The first /30 of :data:`NODE_NETWORKS` that overlaps nothing on this machine (call under the lock)."""
    taken = machine_networks()
    for block in NODE_NETWORKS:
        for candidate in ipaddress.IPv4Network(block).subnets(new_prefix=30):
            if not any(candidate.overlaps(net) for net in taken):
                return candidate
    raise ClusterError(f"every /30 in {', '.join(NODE_NETWORKS)} overlaps a network of this machine")


@contextlib.contextmanager
def _network_lock(timeout: float = 60.0) -> Iterator[None]:
    """Machine-wide mutex for choosing node networks (see :data:`_NET_LOCK`)."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                lock.bind(_NET_LOCK)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise ClusterError(
                        "another test cluster holds the node-network lock for too long"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        lock.close()
