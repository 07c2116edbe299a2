"""What a lab is made of: its hosts, names, where its state lives."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet_harness.cluster.k8s_build import DEBIAN_K8S

PROJECT = Path(__file__).resolve().parents[3]
# The Kubernetes `gpufleet lab up` and `gpufleet lab build` use: still Debian's 1.20 (its hosts' kubelets
# take 1.20 flags, one host runs dockershim; see hostsetup). The test cluster and its tests run
# k8s_build.DEFAULT_K8S_VERSION (also 1.20 for now; GPUFLEET_K8S_VERSION=1.37.2 for 1.37); this moves to 1.37
# when the lab moves to kubeadm (issue 32).
LAB_K8S_VERSION = DEBIAN_K8S
SIM_DIR = "/etc/gpufleet-sim"  # inside every host: where the simulated driver's files are installed
# slirp4netns maps the machine's loopback to this address inside a container (allow_host_loopback=true).
GATEWAY = "10.0.2.2"
EXTENDER_PORT = 8800  # the extender's port inside the host that runs it (host network)
# The device plugin's /metrics (http.port in inventory/lab/group_vars/all.yml) inside every host (host
# network): `up` publishes it on a free 127.0.0.1 port, which the lab's Prometheus scrapes.
METRICS_PORT = 9402
LABEL = "io.gpufleet.lab"  # podman label on everything a lab creates; its value is the lab name
# The container runtimes a lab host's kubelet can use: containerd through CRI (--container-runtime=remote),
# or dockerd through the kubelet's built-in dockershim (removed in Kubernetes 1.24; kept for one host).
RUNTIMES = ("containerd", "docker")


@dataclass(frozen=True)
class HostSpec:
    """One GPU host of the lab: its name (hostname, inventory name, Kubernetes node) and simulator fixture."""

    name: str
    fixture: str
    groups: tuple[str, ...] = ()
    runs_extender: bool = False
    runtime: str = "containerd"  # one of RUNTIMES: what the kubelet talks to
    # GPU pods name the RuntimeClass `nvidia` and runc stays containerd's default runtime (the GPU Operator's
    # other way); else nvidia is the default runtime. containerd only: dockershim runs no other handler.
    runtime_class: bool = False
    # The device plugin's named configuration the host picks (inventory/lab/group_vars: whole, memory,
    # sliced, mig); "" for the default (whole GPUs).
    device_plugin_config: str = ""
    # The MIG layout the host gets (role nvidia_mig, a layout of nvidia_mig_config in
    # inventory/lab/group_vars); "" for none.
    mig_layout: str = ""

    def __post_init__(self) -> None:
        if self.runtime not in RUNTIMES:
            raise ValueError(
                f"lab host {self.name}: runtime {self.runtime!r} is not one of {', '.join(RUNTIMES)}"
            )
        if self.runtime_class and self.runtime != "containerd":
            raise ValueError(
                f"lab host {self.name}: a RuntimeClass needs containerd (dockershim runs no other handler)"
            )


# The GPU hosts run containerd CRI kubelets, as current clusters do. The ESXi guest keeps dockershim: an
# older-generation (V100) VM fleet is where dockershim nodes linger, and one such host keeps the toolkit
# role's daemon.json merge proven end to end. The DGX stays on containerd: it runs the extender and the
# NVLink and fabric manager checks, the paths a current cluster exercises most. The T4 host keeps runc as
# containerd's default and its GPU pods name the RuntimeClass `nvidia`: both ways the GPU Operator supports.
# One DaemonSet serves each host the mode its configuration label picks: the DGX whole GPUs (NVLink pairs)
# and, on its GPU 7 (MIG layout lab-mixed), MIG devices under the mixed strategy; the T4 host GPU memory
# shared through the extender; the V100 VM time-sliced GPUs (docs/lab.md).
DEFAULT_HOSTS = (
    HostSpec(
        "dgx-a100",
        "dgx-a100",
        ("nvswitch",),
        runs_extender=True,
        runtime="containerd",
        device_plugin_config="mig",
        mig_layout="lab-mixed",
    ),
    HostSpec(
        "pcie-2x-t4", "pcie-2x-t4", runtime="containerd", runtime_class=True, device_plugin_config="memory"
    ),
    HostSpec(
        "esxi-vm-2x-v100",
        "esxi-vm-2x-v100",
        ("esxi_guests",),
        runtime="docker",
        device_plugin_config="sliced",
    ),
)


def with_runtime(hosts: tuple[HostSpec, ...], runtime: str | None) -> tuple[HostSpec, ...]:
    """``hosts`` all moved to ``runtime`` (GPUFLEET_LAB_RUNTIME); unchanged when it is empty."""
    if not runtime:
        return hosts
    return tuple(
        dataclasses.replace(h, runtime=runtime, runtime_class=h.runtime_class and runtime == "containerd")
        for h in hosts
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

    @classmethod
    def from_env(cls, hosts: tuple[HostSpec, ...] = DEFAULT_HOSTS) -> LabSpec:
        """The default lab, moved by GPUFLEET_LAB_NAME / GPUFLEET_LAB_STATE / GPUFLEET_LAB_INVENTORY;
        GPUFLEET_LAB_RUNTIME (``containerd`` or ``docker``) puts every host on that runtime."""
        hosts = with_runtime(hosts, os.environ.get("GPUFLEET_LAB_RUNTIME", "").strip())
        default = cls(hosts=hosts)
        return cls(
            name=os.environ.get("GPUFLEET_LAB_NAME", default.name),
            state_dir=Path(os.environ.get("GPUFLEET_LAB_STATE", default.state_dir)).resolve(),
            inventory_dir=Path(os.environ.get("GPUFLEET_LAB_INVENTORY", default.inventory_dir)).resolve(),
            hosts=hosts,
        )

    def container(self, host: HostSpec) -> str:
        return f"gpufleet-{self.name}-{host.name}"

    def volume(self, host: HostSpec) -> str:
        return f"gpufleet-{self.name}-{host.name}-docker"

    def containerd_volume(self, host: HostSpec) -> str:
        """/var/lib/containerd of a containerd host (overlayfs snapshots cannot sit on the root overlay)."""
        return f"gpufleet-{self.name}-{host.name}-containerd"

    def volumes(self, host: HostSpec) -> dict[str, str]:
        """Named volume → mount point in the host: the runtime's image and snapshot store."""
        if host.runtime == "containerd":
            return {self.containerd_volume(host): "/var/lib/containerd"}
        return {self.volume(host): "/var/lib/docker"}

    @property
    def state_file(self) -> Path:
        return self.state_dir / "state.json"

    @property
    def extender_host(self) -> HostSpec:
        return next(h for h in self.hosts if h.runs_extender)
