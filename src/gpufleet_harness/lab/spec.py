"""What a lab is made of: its hosts, names, where its state lives."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet_harness.cluster.k8s_build import NEWEST_K8S_VERSION

PROJECT = Path(__file__).resolve().parents[3]
SIM_DIR = "/etc/gpufleet-sim"  # inside every host: where the simulated driver's files are installed
# slirp4netns maps the machine's loopback to this address inside a container (allow_host_loopback=true).
GATEWAY = "10.0.2.2"
EXTENDER_PORT = 8800  # the extender's port inside the host that runs it (host network)
# The device plugin's /metrics (http.port in inventory/lab/group_vars/all.yml) inside every host (host
# network): `up` publishes it on a free 127.0.0.1 port, which the lab's Prometheus scrapes.
METRICS_PORT = 9402
LABEL = "io.gpufleet.lab"  # podman label on everything a lab creates; its value is the lab name
# The Kubernetes release the lab runs: built from its Go modules and cached by version
# (gpufleet_harness.cluster.k8s_modbuild); kubeadm makes its control plane (gpufleet_harness.lab.kubeadm).
# The test cluster's default is the same release (k8s_build.DEFAULT_K8S_VERSION), so CI builds one Kubernetes.
K8S_VERSION = NEWEST_K8S_VERSION
# The control plane's host: kubeadm's node (static pods, PKI, kubeconfigs), on containerd 2.1. Its name is
# the inventory name (group kube_control_plane) and the Kubernetes node name.
CONTROL_PLANE = "lab-control-plane"
CONTROL_PLANE_CONTAINERD = "2.1"
# containerd minor -> the Debian release its host runs (gpufleet_harness.lab.kubeadm.CONTAINERD: 2.1 is sid's
# package on trixie, 1.7 trixie's own, 1.6 Debian 12's).
DEBIAN_RELEASE = {"2.1": "13", "1.7": "13", "1.6": "12"}
# The NVIDIA driver (branch, version) of each Debian release: the userspace Debian ships (nvidia-smi,
# libnvidia-ml1), which the driver role installs, and the version the host's simulated GPUs report. Debian 12:
# bookworm's 535.261.03 (the role's default there is bookworm-security's 535.309.01, which neither the
# simulator's machines nor the stand-in fabric manager have); Debian 13: trixie's 550.163.01, the role's
# default. CUDA: what the branch's driver reports (nvidia-smi's "CUDA Version": 12.2 for 535, 12.4 for 550).
DRIVERS = {"12": ("535", "535.261.03", 12020), "13": ("550", "550.163.01", 12040)}
# Where the extender's TLS files are on the control-plane host (the scheduler's client certificate and the CA
# that signed the extender's serving certificate), as an operator puts them; the role mounts them into the
# kube-scheduler static pod. And the Secret the extender serves HTTPS from (tls.crt, tls.key, client-ca.crt).
SCHEDULER_TLS_DIR = "/etc/kubernetes/gpufleet"
EXTENDER_TLS_SECRET = "gpufleet-extender-tls"
EXTENDER_NAMESPACE = "gpufleet-system"


@dataclass(frozen=True)
class HostSpec:
    """One GPU host of the lab: its name (hostname, inventory name, Kubernetes node) and simulator fixture."""

    name: str
    fixture: str
    groups: tuple[str, ...] = ()
    runs_extender: bool = False
    # The host's containerd (a key of DEBIAN_RELEASE), which decides its Debian release and so its driver.
    containerd: str = "1.7"
    # GPU pods name the RuntimeClass `nvidia` and runc stays containerd's default runtime (the GPU Operator's
    # other way); else nvidia is the default runtime.
    runtime_class: bool = False
    # The device plugin's named configuration the host picks (inventory/lab/group_vars: whole, memory,
    # sliced, mig); "" for the default (whole GPUs).
    device_plugin_config: str = ""
    # The MIG layout the host gets (role nvidia_mig, a layout of nvidia_mig_config in
    # inventory/lab/group_vars); "" for none.
    mig_layout: str = ""
    # GPUs through CDI: the toolkit role writes NVIDIA's CDI specification and turns on containerd's CDI,
    # and the device plugin's configuration returns CDI device names (its named configuration must say so).
    cdi: bool = False

    def __post_init__(self) -> None:
        if self.containerd not in DEBIAN_RELEASE:
            raise ValueError(
                f"lab host {self.name}: containerd {self.containerd!r} is not one of "
                f"{', '.join(DEBIAN_RELEASE)}"
            )
        if self.cdi and self.containerd == "1.6":
            raise ValueError(
                f"lab host {self.name}: CDI needs containerd 1.7 or later (1.6 has no enable_cdi)"
            )

    @property
    def runtime(self) -> str:
        """What the kubelet talks to (the runtime validation suite's gpufleet_validation_runtime)."""
        return "containerd"

    @property
    def debian(self) -> str:
        """The host's Debian major release."""
        return DEBIAN_RELEASE[self.containerd]

    @property
    def driver(self) -> tuple[str, str, int]:
        """(branch, version, CUDA version as NVML reports it) of the host's driver."""
        return DRIVERS[self.debian]


# Runtimes as fleets run them now: every kubelet on containerd through CRI v1 with systemd cgroups, no
# dockershim (Kubernetes 1.24 removed it). The DGX stays on Debian 12 with its containerd 1.6 (kubelet 1.37
# still runs on it, over CRI v1): its fabric manager and MIG paths are the ones proven on Debian 12's driver,
# and nvidia stays CRI's default runtime there. The two PCIe hosts run Debian 13 with the containerd fleets
# run today: the T4 host trixie's containerd 1.7, the V100 VM containerd 2.1 (sid's package); both keep runc
# as the default and their GPU pods name the RuntimeClass `nvidia`, so the toolkit role's drop-in and the
# RuntimeClass are proven on both. The V100 VM gets its GPUs through CDI (the plugin returns CDI names,
# containerd 2.1 injects NVIDIA's CDI specification). One DaemonSet serves each host the mode its
# configuration label picks: the DGX whole GPUs (NVLink pairs) and, on its GPU 7 (MIG layout lab-mixed), MIG
# devices under the mixed strategy; the T4 host GPU memory shared through the extender; the V100 VM
# time-sliced GPUs (docs/lab.md).
DEFAULT_HOSTS = (
    HostSpec(
        "dgx-a100",
        "dgx-a100",
        ("nvswitch",),
        runs_extender=True,
        containerd="1.6",
        device_plugin_config="mig",
        mig_layout="lab-mixed",
    ),
    HostSpec("pcie-2x-t4", "pcie-2x-t4", containerd="1.7", runtime_class=True, device_plugin_config="memory"),
    HostSpec(
        "esxi-vm-2x-v100",
        "esxi-vm-2x-v100",
        ("esxi_guests",),
        containerd="2.1",
        runtime_class=True,
        device_plugin_config="sliced-cdi",
        cdi=True,
    ),
)


@dataclass(frozen=True)
class LabSpec:
    """A lab: its name (a prefix of every container and volume), state directory, inventory and hosts."""

    name: str = "lab"
    state_dir: Path = field(default_factory=lambda: PROJECT / ".lab" / "fleet")
    inventory_dir: Path = field(default_factory=lambda: PROJECT / "inventory" / "lab")
    hosts: tuple[HostSpec, ...] = DEFAULT_HOSTS

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]{0,19}", self.name):
            raise ValueError(f"lab name {self.name!r}: use 1-20 lowercase letters, digits and '-'")
        names = [h.name for h in self.hosts]
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"lab hosts need distinct names: {names}")
        if sum(h.runs_extender for h in self.hosts) != 1:
            raise ValueError("exactly one lab host runs the scheduler extender")
        if CONTROL_PLANE in names:
            raise ValueError(f"{CONTROL_PLANE!r} is the control plane's name, not a GPU host's")

    @classmethod
    def from_env(cls, hosts: tuple[HostSpec, ...] = DEFAULT_HOSTS) -> LabSpec:
        """The default lab, moved by GPUFLEET_LAB_NAME / GPUFLEET_LAB_STATE / GPUFLEET_LAB_INVENTORY."""
        default = cls(hosts=hosts)
        return cls(
            name=os.environ.get("GPUFLEET_LAB_NAME", default.name),
            state_dir=Path(os.environ.get("GPUFLEET_LAB_STATE", default.state_dir)).resolve(),
            inventory_dir=Path(os.environ.get("GPUFLEET_LAB_INVENTORY", default.inventory_dir)).resolve(),
            hosts=hosts,
        )

    def container(self, host: HostSpec) -> str:
        return f"gpufleet-{self.name}-{host.name}"

    @property
    def control_plane_container(self) -> str:
        """The kubeadm control plane's host (kubeadm.KubeadmCluster names it ``<prefix>-control-plane``)."""
        return f"{self.prefix}-control-plane"

    @property
    def prefix(self) -> str:
        """What every container and volume name of the lab starts with."""
        return f"gpufleet-{self.name}"

    def containerd_volume(self, host: HostSpec) -> str:
        """/var/lib/containerd of a host (overlayfs snapshots cannot sit on the root overlay)."""
        return f"{self.container(host)}-containerd"

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def extender_host(self) -> HostSpec:
        return next(h for h in self.hosts if h.runs_extender)
