"""A kubeadm cluster in podman systemd hosts: the real ``kubeadm init`` (and ``kubeadm join``) on
Kubernetes built from its Go modules (:mod:`gpufleet_harness.cluster.k8s_modbuild`), containerd as CRI v1
with systemd cgroups.

What a host is, the way a cluster installer leaves a kubeadm node:

- a Debian test-host image (debootstrap + systemd) plus Debian's ``containerd``, ``runc``, the CNI
  plugins and the tools kubeadm's preflight looks for (:func:`ensure_host_image`): containerd 1.7 is
  trixie's own, containerd 2.1 (with its runc 1.3) sid's package installed on trixie, because sid's
  systemd 262 refuses to boot on this machine's cgroup v1, containerd 1.6 Debian 12's on a bookworm host;
- ``/etc/containerd/config.toml`` for CRI v1: ``SystemdCgroup = true``, the sandbox image kubeadm names
  (``registry.k8s.io/pause:<kubeadm's PauseVersion>``), CNI binaries where Debian installs them
  (config version 3 for containerd 2, version 2 for 1.x; key names checked against each version's
  ``containerd config default``);
- a CNI bridge conflist (kubeadm installs no pod network; one host is one network namespace);
- ``kubeadm``, ``kubelet``, ``kubectl`` in ``/usr/bin`` with ``kubelet.service`` and its kubeadm drop-in
  (``/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf``), as the kubeadm packages install them:
  the kubelet reads ``/var/lib/kubelet/config.yaml`` and ``kubeadm-flags.env`` that kubeadm writes;
- the images ``kubeadm config images list`` names, imported into containerd's ``k8s.io`` namespace (no
  registry is reachable); kube-proxy and CoreDNS are disabled in kubeadm's configuration, so neither is
  listed nor deployed (the lab has never run either).

Lab glue (this machine, not the product), each the answer the 1.20 harness found to the same problem:

- ``/usr/local/sbin/runc`` clamps negative ``oom_score_adj`` and CRI's ``restrict_oom_score_adj``: root
  here lacks CAP_SYS_RESOURCE (static control-plane pods are critical pods, -997);
- ``gpufleet-sysctl-shield.service`` bind-mounts files over the sysctls the kubelet sets
  (``vm.overcommit_memory``, ``kernel.panic`` ...): they are not namespaced, and a privileged host would
  otherwise change this machine's values;
- ``failCgroupV1: false`` in the KubeletConfiguration: this machine is cgroup v1 (hybrid), which the
  kubelet refuses by default since 1.35.

Networking stays off this machine's interfaces: each host has its own user-mode network (slirp4netns) and
reaches this machine's loopback as 10.0.2.2; the control-plane host's API server (6443) is published on a
free 127.0.0.1 port P, which is kubeadm's ``controlPlaneEndpoint`` 10.0.2.2:P for every node, and
https://127.0.0.1:P for this machine (the serving certificate names both).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from gpufleet_harness.cluster import cri, oci_runtime
from gpufleet_harness.cluster.cri import CNI_CONFLIST, CONTAINERD_SOCKET, stream_import
from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.node import BUSYBOX_IMAGE
from gpufleet_harness.cluster.process import ClusterError, file_lock, free_ports, wait_for
from gpufleet_harness.testhosts.images import INIT_WRAPPER, ImageSpec, apt_mirror, build_image, image_key
from gpufleet_harness.testhosts.podman import podman
from gpufleet_harness.testhosts.workspace import state_dir

from .hostsetup import HostError, copy_in, exec_in, write_in
from .spec import GATEWAY

LABEL = "io.gpufleet.kubeadm"  # value: the cluster's id; every container and volume carries it
OWNER_LABEL = "io.gpufleet.kubeadm.owner"  # value: "<pid>:<start time>" of the process that made it
IMAGE_REPOSITORY = "localhost/gpufleet-kubeadmhost"
IMAGE_KEY_LABEL = "io.gpufleet.kubeadmhost.key"
IMAGE_REVISION = 1
# What a kubeadm node gets from its distribution before kubeadm runs: the runtime, the CNI plugins, and the
# commands kubeadm's preflight and the kubelet call (iptables, conntrack, socat, ethtool, ip, modprobe,
# sysctl).
HOST_PACKAGES = (
    "containerd",
    "runc",
    "containernetworking-plugins",
    "iptables",
    "conntrack",
    "socat",
    "ethtool",
    "iproute2",
    "kmod",
    "procps",
    "ca-certificates",
)
# containerd minor -> (the host's Debian suite, the suite its containerd and runc come from, or None: its
# own). containerd 2.1 is sid's package on a trixie host: sid's systemd (262) no longer boots on cgroup v1,
# which this machine has (trixie has 1.7, its backports none). 1.6 is Debian 12's, on a Debian 12 host.
CONTAINERD: dict[str, tuple[str, str | None]] = {
    "2.1": ("trixie", "sid"),
    "1.7": ("trixie", None),
    "1.6": ("bookworm", None),
}
API_PORT = 6443
POD_SUBNET = "10.244.0.0/16"
SERVICE_SUBNET = "10.96.0.0/12"
CNI_CONFLIST_PATH = "/etc/cni/net.d/10-gpufleet-lab.conflist"
# The sysctls kubelet's container manager sets (pkg/kubelet/cm/container_manager_linux.go,
# setupKernelTunables, 1.37): none is per network namespace.
KUBELET_SYSCTLS = (
    "vm/overcommit_memory",
    "vm/panic_on_oom",
    "kernel/panic",
    "kernel/panic_on_oops",
    "kernel/keys/root_maxkeys",
    "kernel/keys/root_maxbytes",
)
# kubeadm preflight checks that cannot pass here, for the machine's reason, not the cluster's: kubeadm's
# system verification rejects cgroup v1 (on 1.37 the only failure it reports on this machine; the kernel
# configuration checks pass) and says to skip it once the kubelet has failCgroupV1: false.
IGNORED_PREFLIGHT = ("SystemVerification",)

KUBELET_SERVICE = """\
# Installed by gpufleet_harness.lab.kubeadm as the kubelet package installs it: the unit only starts the
# kubelet; kubeadm's drop-in (kubelet.service.d/10-kubeadm.conf) gives it its flags.
[Unit]
Description=kubelet: The Kubernetes Node Agent
Wants=network-online.target
After=network-online.target

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target
"""
# The drop-in kubeadm's documentation describes ("Configuring each kubelet in your cluster using kubeadm"):
# kubeconfigs kubeadm writes (bootstrap, then the rotated one), the KubeletConfiguration file, the flags file
# `kubeadm init/join` writes (KUBELET_KUBEADM_ARGS) and an operator's own (KUBELET_EXTRA_ARGS).
KUBEADM_DROP_IN = """\
# Installed by gpufleet_harness.lab.kubeadm: how kubeadm's kubelet drop-in starts the kubelet.
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf \
--kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=/var/lib/kubelet/config.yaml"
EnvironmentFile=-/var/lib/kubelet/kubeadm-flags.env
EnvironmentFile=-/etc/default/kubelet
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS \
$KUBELET_EXTRA_ARGS
"""
SYSCTL_SHIELD_SERVICE = """\
# gpufleet lab glue: the kubelet sets these sysctls, which no namespace isolates; files bind-mounted over
# them take its writes, so this machine keeps its own values. Not something a real node does.
[Unit]
Description=gpufleet lab: keep the kubelet's sysctl writes inside this host
DefaultDependencies=no
Before=kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/sh -ec 'mkdir -p /run/gpufleet-sysctl; for k in {keys}; do \\
  f=/run/gpufleet-sysctl/$(echo $k | tr / _); \\
  grep -q " /proc/sys/$k " /proc/self/mountinfo && continue; \\
  cat /proc/sys/$k > $f; mount --bind $f /proc/sys/$k; done'

[Install]
WantedBy=multi-user.target
"""

_CONTAINERD_V3 = """\
# Installed by gpufleet_harness.lab.kubeadm: containerd {version} as CRI v1 for a kubeadm kubelet.
version = 3

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '{pause}'

[plugins.'io.containerd.cri.v1.runtime']
  # lab glue: this machine's root lacks CAP_SYS_RESOURCE (negative oom_score_adj fails)
  restrict_oom_score_adj = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = true
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['/usr/lib/cni']
    conf_dir = '/etc/cni/net.d'
"""


def containerd_config(containerd_version: str, pause_image: str) -> str:
    """``/etc/containerd/config.toml`` for a kubeadm node: version 3 for containerd 2.x; for 1.x the lab's
    version 2 configuration (:func:`gpufleet_harness.cluster.cri.containerd_config`) with systemd cgroups."""
    if int(containerd_version.split(".")[0]) >= 2:
        return _CONTAINERD_V3.format(version=containerd_version, pause=pause_image)
    comment = (
        f"Installed by gpufleet_harness.lab.kubeadm: containerd {containerd_version} as CRI v1 for kubeadm."
    )
    return cri.containerd_config(pause_image, comment, systemd_cgroup=True)


# -- the host image ---------------------------------------------------------------------------------------
def _image_key(base_key: str, containerd: str) -> str:
    doc = {
        "base": base_key,
        "packages": HOST_PACKAGES,
        "containerd": CONTAINERD[containerd],
        "rev": IMAGE_REVISION,
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _install_script(containerd: str) -> str:
    """The shell that installs a node's packages; containerd and runc from ``from_suite`` when set."""
    _, from_suite = CONTAINERD[containerd]
    lines = ["set -e", "export DEBIAN_FRONTEND=noninteractive"]
    packages = list(HOST_PACKAGES)
    update = "apt-get update -q"
    if from_suite:
        # Only what is asked for by name comes from the newer suite (pin 100 < the release's 500).
        lines += [
            f"echo 'deb {apt_mirror()} {from_suite} main' > /etc/apt/sources.list.d/{from_suite}.list",
            f"printf 'Package: *\\nPin: release n={from_suite}\\nPin-Priority: 100\\n' "
            f"> /etc/apt/preferences.d/{from_suite}",
        ]
        packages = [f"{p}/{from_suite}" if p in ("containerd", "runc") else p for p in packages]
        # sid's Release file carries a Valid-Until, and the archive this machine reaches served one past it
        # (22 days on 2026-11-28); its signature is still checked. Stable suites carry none.
        update = "apt-get -o Acquire::Check-Valid-Until=false update -q"
    lines += [update, f"apt-get install -y -q --no-install-recommends {' '.join(packages)}"]
    if from_suite:
        # the node keeps its own suite's sources: later apt runs (the roles) never meet the stale Release
        lines.append(f"rm -f /etc/apt/sources.list.d/{from_suite}.list /etc/apt/preferences.d/{from_suite}")
    # the installed containerd is the one wanted, or the image is not built
    lines.append(f"containerd --version | grep -q ' v\\?{re.escape(containerd)}\\.'")
    lines += ["apt-get clean", "rm -rf /var/lib/apt/lists/*"]
    return "; ".join(lines)


def ensure_host_image(containerd: str) -> str:
    """A kubeadm node's image with containerd ``containerd`` (a key of :data:`CONTAINERD`), built once and
    cached by content key; returns its name."""
    if containerd not in CONTAINERD:
        raise HostError(f"kubeadm host containerd {containerd!r}: expected one of {', '.join(CONTAINERD)}")
    suite, _ = CONTAINERD[containerd]
    with file_lock(state_dir() / "images.lock"):
        base = ImageSpec(suite)
        build_image(base)
        key = _image_key(base.key(), containerd)
        name = f"{IMAGE_REPOSITORY}:containerd-{containerd}-{key}"
        if image_key(name, IMAGE_KEY_LABEL) == key:
            return name
        builder = f"gpufleet-kubeadmhost-build-{key}"
        podman("rm", "-f", builder, check=False)
        script = _install_script(containerd)
        try:
            result = podman(
                "run", "--name", builder, "--network=slirp4netns", base.name, "sh", "-c", script, check=False
            )
            if result.returncode != 0:
                raise HostError(f"building {name} failed: {(result.stderr or result.stdout)[-2000:]}")
            podman(
                "commit",
                "--change",
                f'CMD ["{INIT_WRAPPER}"]',
                "--change",
                "STOPSIGNAL SIGRTMIN+3",
                "--change",
                f"LABEL {IMAGE_KEY_LABEL}={key}",
                builder,
                name,
            )
        finally:
            podman("rm", "-f", builder, check=False)
        return name


# -- one host -----------------------------------------------------------------------------------------------
@dataclass
class KubeadmHost:
    """One podman systemd host of a kubeadm cluster."""

    container: str
    hostname: str
    containerd: str
    volume: str
    timings: dict[str, float] = field(default_factory=dict)

    def sh(self, script: str, check: bool = True) -> str:
        return exec_in(self.container, "sh", "-c", script, check=check)

    def journal(self, unit: str, lines: int = 40) -> str:
        return self.sh(f"journalctl -u {unit} --no-pager -n {lines} 2>&1", check=False)


def _owner() -> str:
    stat = Path(f"/proc/{os.getpid()}/stat").read_text().rsplit(")", 1)[1].split()
    return f"{os.getpid()}:{stat[19]}"


def _owner_alive(owner: str) -> bool:
    pid, _, start = owner.partition(":")
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return False
    return stat[19] == start


def reap_stale() -> list[str]:
    """Remove the containers and volumes of kubeadm clusters whose owner process is gone; list them."""
    removed = []
    listed = podman("ps", "-a", "--filter", f"label={LABEL}", "--format", "json", check=False).stdout
    for entry in json.loads(listed or "[]"):
        labels = entry.get("Labels") or {}
        if _owner_alive(labels.get(OWNER_LABEL, "")):
            continue
        for name in entry.get("Names") or []:
            podman("rm", "-f", "-t", "0", name, check=False)
            removed.append(name)
    volumes = podman("volume", "ls", "--filter", f"label={LABEL}", "--format", "json", check=False).stdout
    for volume in json.loads(volumes or "[]"):
        if not _owner_alive((volume.get("Labels") or {}).get(OWNER_LABEL, "")):
            podman("volume", "rm", "-f", volume["Name"], check=False)
            removed.append(volume["Name"])
    return removed


@contextlib.contextmanager
def _timed(timings: dict[str, float], what: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        timings[what] = round(time.monotonic() - started, 1)


class KubeadmCluster:
    """A kubeadm control plane in one podman host, and workers that join it. Use as a context manager:
    everything it made is removed on exit, also when bringing it up failed."""

    def __init__(
        self,
        artifacts: K8sArtifacts,
        *,
        cluster_id: str | None = None,
        prefix: str | None = None,
        labels: dict[str, str] | None = None,
        workdir: Path | None = None,
    ) -> None:
        """``prefix`` names every container and volume (default ``gpufleet-kadm-<id>``); ``labels`` replace
        the owner labels (the lab labels its own and removes them itself, so nothing is reaped by owner);
        ``workdir`` keeps the admin kubeconfig (default: a temporary directory removed by :meth:`close`)."""
        if not artifacts.kubeadm_images:
            raise ClusterError(
                f"the Kubernetes build in {artifacts.root} has no kubeadm images: a kubeadm cluster needs a "
                "release built from Go modules (gpufleet cluster build --version 1.37.2)"
            )
        self.artifacts = artifacts
        self.id = cluster_id or secrets.token_hex(3)
        self.prefix = prefix or f"gpufleet-kadm-{self.id}"
        self.owner = _owner()
        self.owned = labels is None
        self.labels = {LABEL: self.id, OWNER_LABEL: self.owner} if labels is None else dict(labels)
        self.hosts: list[KubeadmHost] = []
        self.control_plane: KubeadmHost | None = None
        self.port: int | None = None
        self._own_dir = workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-")) if workdir is None else workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.timings: dict[str, float] = {}
        self._join_command: list[str] | None = None
        self._join_lock = threading.Lock()  # workers may join from several threads (the lab's hosts)

    def __enter__(self) -> KubeadmCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hosts --------------------------------------------------------------------------------------------
    def _create_host(
        self,
        role: str,
        containerd: str,
        publish: list[str],
        *,
        hostname: str | None = None,
        restart: bool = False,
    ) -> KubeadmHost:
        image = ensure_host_image(containerd)
        host = KubeadmHost(
            container=f"{self.prefix}-{role}",
            hostname=hostname or f"kadm-{self.id}-{role}",
            containerd=containerd,
            volume=f"{self.prefix}-{role}-containerd",
        )
        self.hosts.append(host)
        labels = [a for k, v in self.labels.items() for a in ("--label", f"{k}={v}")]
        podman("volume", "create", *labels, host.volume, check=True)
        argv = [
            "run",
            "-d",
            "--name",
            host.container,
            "--hostname",
            host.hostname,
            *labels,
            # a kubelet and containerd run inside: privileged, with a private cgroup namespace (TESTING.md)
            "--privileged",
            "--cgroupns=private",
            "--systemd=always",
            # a reboot inside ends systemd; podman then starts the host again (the lab's driver rollout)
            *(["--restart=always"] if restart else []),
            # user-mode network: this machine's loopback is 10.0.2.2 inside; no interface is added here
            "--network=slirp4netns:allow_host_loopback=true",
            # containerd's overlayfs snapshots cannot sit on the container's own overlay root
            "-v",
            f"{host.volume}:/var/lib/containerd",
            *publish,
            image,
            INIT_WRAPPER,
        ]
        result = podman(*argv, check=False)
        if result.returncode != 0:
            raise HostError(f"podman run {host.container}: {result.stderr.strip()}")
        wait_for(
            f"{host.container}: systemd to finish booting",
            lambda: (
                exec_in(host.container, "systemctl", "is-system-running", check=False).strip()
                in ("running", "degraded")
            ),
            180,
            interval=0.5,
        )
        return host

    @property
    def pause_image(self) -> str:
        """The sandbox image kubeadm names (``registry.k8s.io/pause:<kubeadm's PauseVersion>``)."""
        return next(n for n in self.artifacts.kubeadm_images if n.rsplit("/", 1)[-1].startswith("pause:"))

    def worker_images(self) -> dict[str, tuple[Path, list[str]]]:
        """What a worker needs without a registry: the sandbox image and busybox."""
        return {
            self.pause_image: self.artifacts.kubeadm_images[self.pause_image],
            BUSYBOX_IMAGE: (self.artifacts.image("busybox"), ["-c", 'CMD ["/bin/sh"]']),
        }

    def _prepare_node(
        self, host: KubeadmHost, images: dict[str, tuple[Path, list[str]]] | None = None
    ) -> None:
        """What the installer does before kubeadm: runtime, CNI, glue, binaries, images (``images``: name ->
        root filesystem and image changes; default every kubeadm image and busybox)."""
        name = host.container
        pause = self.pause_image
        with _timed(host.timings, "runtime"):
            copy_in(name, Path(oci_runtime.__file__), "/usr/local/lib/gpufleet-lab-oci-runtime.py")
            shim = oci_runtime.shim("/usr/sbin/runc", "/usr/bin/python3").replace(
                repr(str(Path(oci_runtime.__file__).resolve())),
                repr("/usr/local/lib/gpufleet-lab-oci-runtime.py"),
            )
            write_in(name, "/usr/local/sbin/runc", shim, 0o755)
            version = host.sh("containerd --version").split()[2]
            write_in(name, "/etc/containerd/config.toml", containerd_config(version, pause))
            write_in(name, CNI_CONFLIST_PATH, json.dumps(CNI_CONFLIST, indent=2) + "\n")
            # kubeadm's preflight wants forwarding on; net.* sysctls belong to the host's own namespace
            write_in(name, "/etc/sysctl.d/99-kubernetes.conf", "net.ipv4.ip_forward = 1\n")
            host.sh("sysctl -q -p /etc/sysctl.d/99-kubernetes.conf")
            host.sh("systemctl enable -q containerd && systemctl restart containerd")
            wait_for(
                f"{name}: containerd on {CONTAINERD_SOCKET}",
                lambda: exec_in(name, "ctr", "version", check=False).count("Version:") >= 2,
                60,
                interval=0.5,
            )
        with _timed(host.timings, "kubelet and kubeadm"):
            for binary in ("kubeadm", "kubelet", "kubectl"):
                copy_in(name, self.artifacts.binary(binary), f"/usr/bin/{binary}")
            write_in(name, "/usr/lib/systemd/system/kubelet.service", KUBELET_SERVICE)
            write_in(name, "/usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf", KUBEADM_DROP_IN)
            shield = SYSCTL_SHIELD_SERVICE.format(keys=" ".join(KUBELET_SYSCTLS))
            write_in(name, "/etc/systemd/system/gpufleet-sysctl-shield.service", shield)
            host.sh(
                "systemctl daemon-reload && systemctl enable -q --now gpufleet-sysctl-shield.service "
                "&& systemctl enable -q kubelet.service"
            )
        with _timed(host.timings, "images"):
            present = set(exec_in(name, "ctr", "--namespace", "k8s.io", "images", "ls", "-q").split())
            if images is None:
                wanted = dict(self.artifacts.kubeadm_images)
                wanted[BUSYBOX_IMAGE] = (self.artifacts.image("busybox"), ["-c", 'CMD ["/bin/sh"]'])
            else:
                wanted = dict(images)
            for image, (rootfs, changes) in wanted.items():
                if _qualified(image) in present:
                    continue
                argv = ["podman", "exec", "-i", name, "ctr", "--namespace", "k8s.io", "images", "import", "-"]
                rc, said = stream_import(argv, image, rootfs, changes)
                if rc != 0:
                    raise HostError(f"{name}: ctr images import of {image} exited {rc}: {said}")

    # -- kubeadm ------------------------------------------------------------------------------------------
    def kubeadm_config(self, host: KubeadmHost) -> str:
        """kubeadm's InitConfiguration + ClusterConfiguration + KubeletConfiguration for the control plane."""
        assert self.port is not None
        address = host.sh("ip -4 -o addr show dev tap0 | awk '{print $4}'").strip().split("/")[0]
        docs: list[dict[str, Any]] = [
            {
                "apiVersion": "kubeadm.k8s.io/v1beta4",
                "kind": "InitConfiguration",
                "localAPIEndpoint": {"advertiseAddress": address, "bindPort": API_PORT},
                "nodeRegistration": {
                    "name": host.hostname,
                    "criSocket": f"unix://{CONTAINERD_SOCKET}",
                    "imagePullPolicy": "Never",
                    "ignorePreflightErrors": list(IGNORED_PREFLIGHT),
                },
                # kubeadm's 4 min for the control plane to turn healthy is short on two cores shared with
                # other work (the static pods start from cold images and etcd)
                "timeouts": {"controlPlaneComponentHealthCheck": "10m0s", "kubeletHealthCheck": "5m0s"},
            },
            {
                "apiVersion": "kubeadm.k8s.io/v1beta4",
                "kind": "ClusterConfiguration",
                "kubernetesVersion": self.artifacts.git_version,
                "clusterName": self.prefix,
                # every node reaches the API server through this machine's loopback (slirp4netns)
                "controlPlaneEndpoint": f"{GATEWAY}:{self.port}",
                "apiServer": {"certSANs": ["127.0.0.1", GATEWAY]},
                "networking": {"podSubnet": POD_SUBNET, "serviceSubnet": SERVICE_SUBNET},
                "dns": {"disabled": True},
                "proxy": {"disabled": True},
            },
            self.kubelet_configuration(),
        ]
        return yaml.safe_dump_all(docs, sort_keys=False)

    @staticmethod
    def kubelet_configuration() -> dict[str, Any]:
        return {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "cgroupDriver": "systemd",
            "containerRuntimeEndpoint": f"unix://{CONTAINERD_SOCKET}",
            # this machine is cgroup v1 (hybrid); the kubelet refuses it by default since 1.35
            "failCgroupV1": False,
            # no image is ever pulled (no registry): keep the imported ones from image GC
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi"},
        }

    def init(self, containerd: str = "2.1", *, hostname: str | None = None) -> KubeadmHost:
        """Create the control-plane host and run ``kubeadm init`` in it; return the host."""
        if self.owned:
            reap_stale()
        (self.port,) = free_ports(1)
        with _timed(self.timings, "control-plane host"):
            host = self._create_host(
                "cp" if hostname is None else "control-plane",
                containerd,
                ["-p", f"127.0.0.1:{self.port}:{API_PORT}"],
                hostname=hostname,
            )
            self.control_plane = host
            self._prepare_node(host)
        with _timed(self.timings, "kubeadm init"):
            self._kubeadm(host, "init", self.kubeadm_config(host), "/etc/kubernetes/admin.conf")
        self._write_admin_kubeconfig(host)
        return host

    def _kubeadm(self, host: KubeadmHost, verb: str, config: str, made: str) -> None:
        """``kubeadm <verb> --config`` in ``host`` (log in /var/log/kubeadm-<verb>.log); it worked when
        ``made`` exists. Fails with kubeadm's last words and the kubelet's journal."""
        path = f"/etc/kubernetes/kubeadm-{verb}.yaml"
        write_in(host.container, path, config, 0o600)
        logfile = f"/var/log/kubeadm-{verb}.log"
        said = host.sh(
            f"kubeadm {verb} --config {path} > {logfile} 2>&1; rc=$?; tail -n 60 {logfile}; exit $rc",
            check=False,
        )
        if not host.sh(f"test -f {made} && echo ok", check=False).strip():
            raise HostError(
                f"kubeadm {verb} failed on {host.container} (log {logfile} there):\n{said}\n"
                f"kubelet:\n{host.journal('kubelet')}"
            )

    def _write_admin_kubeconfig(self, host: KubeadmHost) -> None:
        doc = yaml.safe_load(exec_in(host.container, "cat", "/etc/kubernetes/admin.conf"))
        for cluster in doc["clusters"]:
            cluster["cluster"]["server"] = f"https://127.0.0.1:{self.port}"
        path = self.kubeconfig
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        path.chmod(0o600)

    @property
    def kubeconfig(self) -> Path:
        """kubeadm's admin.conf, pointed at this machine's published port."""
        return self.dir / "admin.conf"

    def join_command(self) -> list[str]:
        """``kubeadm join ...`` as ``kubeadm token create --print-join-command`` prints it."""
        assert self.control_plane is not None
        with self._join_lock:
            if self._join_command is None:
                said = exec_in(
                    self.control_plane.container, "kubeadm", "token", "create", "--print-join-command"
                )
                self._join_command = shlex.split(said.strip())
            return list(self._join_command)

    def join(self, role: str, containerd: str = "1.7") -> KubeadmHost:
        """Create a worker host and ``kubeadm join`` it to the control plane."""
        return self.join_host(self.add_worker(role, containerd))

    def add_worker(
        self,
        role: str,
        containerd: str,
        *,
        hostname: str | None = None,
        publish: list[str] | None = None,
        restart: bool = False,
        images: dict[str, tuple[Path, list[str]]] | None = None,
    ) -> KubeadmHost:
        """Create a worker host as the installer leaves it before ``kubeadm join`` (:meth:`join_host`)."""
        with _timed(self.timings, f"{role} host"):
            host = self._create_host(role, containerd, publish or [], hostname=hostname, restart=restart)
            self._prepare_node(host, images)
        return host

    def join_host(self, host: KubeadmHost) -> KubeadmHost:
        """``kubeadm join`` a host :meth:`add_worker` made; returns it."""
        join_config = {
            "apiVersion": "kubeadm.k8s.io/v1beta4",
            "kind": "JoinConfiguration",
            "discovery": self._discovery(),
            "nodeRegistration": {
                "name": host.hostname,
                "criSocket": f"unix://{CONTAINERD_SOCKET}",
                "imagePullPolicy": "Never",
                "ignorePreflightErrors": list(IGNORED_PREFLIGHT),
            },
        }
        # kubeadm join takes the cluster's KubeletConfiguration from the kubelet-config ConfigMap init made
        role = host.container.removeprefix(self.prefix + "-")
        with _timed(self.timings, f"kubeadm join {role}"):
            self._kubeadm(host, "join", yaml.safe_dump(join_config), "/etc/kubernetes/kubelet.conf")
        return host

    def _discovery(self) -> dict[str, Any]:
        argv = self.join_command()
        value = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
        return {
            "bootstrapToken": {
                "apiServerEndpoint": argv[2],
                "token": value["--token"],
                "caCertHashes": [value["--discovery-token-ca-cert-hash"]],
            }
        }

    # -- teardown -----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove every container and volume this cluster made, and its directory."""
        for host in reversed(self.hosts):
            podman("rm", "-f", "-t", "2", host.container, check=False)
            podman("volume", "rm", "-f", host.volume, check=False)
        if self.owned:
            listed = podman(
                "ps", "-a", "-q", "--filter", f"label={LABEL}={self.id}", check=False
            ).stdout.split()
            for leftover in listed:
                podman("rm", "-f", "-t", "0", leftover, check=False)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


def _qualified(image: str) -> str:
    from gpufleet.imageref import qualified

    return qualified(image)
