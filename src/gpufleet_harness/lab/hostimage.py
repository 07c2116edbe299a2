"""The lab's host image: a Debian 12 test host as a cluster installer leaves a node before gpufleet runs.

gpufleet takes over nodes that already run a container runtime and a kubelet (kubeadm, kubespray ...). The
image adds to the test-host image (debootstrap bookworm + systemd, :mod:`gpufleet_harness.testhosts.images`)
what such an installer puts there: Debian's docker.io (with containerd and runc), the CNI plugins, the
tools the kubelet calls, and a ``/etc/docker/daemon.json`` with the installer's own settings, which the
runtime role must keep when it adds the NVIDIA runtime. One image serves both kinds of host: at ``lab up`` a
containerd CRI host drops docker.io and gets containerd's CRI configuration, a dockershim host keeps dockerd
(:func:`gpufleet_harness.lab.hostsetup.configure_runtime`). The kubelet itself is installed at ``lab up`` (its
binary is the cached build of the version the lab runs).

Cached by content: the image carries a label with the key of what it was built from.
"""

from __future__ import annotations

import hashlib
import json

from gpufleet_harness.cluster.process import file_lock
from gpufleet_harness.testhosts.images import INIT_WRAPPER, ImageSpec, build_image, image_key
from gpufleet_harness.testhosts.podman import podman
from gpufleet_harness.testhosts.workspace import state_dir

REPOSITORY = "localhost/gpufleet-labhost"
KEY_LABEL = "io.gpufleet.labhost.key"
PACKAGES = (
    "docker.io",
    # CNI plugins for containerd's CRI (bridge, host-local, loopback, portmap in /usr/lib/cni, the bin_dir
    # Debian's /etc/containerd/config.toml names); dockershim hosts use docker's own bridge instead
    "containernetworking-plugins",
    "iptables",
    "conntrack",
    "ebtables",
    "socat",
    "ethtool",
    "iproute2",
    "kmod",
    "ca-certificates",
)
REVISION = 1
# What the cluster installer configured for dockerd (kubeadm's documented settings for docker).
INSTALLER_DAEMON_JSON = {
    "exec-opts": ["native.cgroupdriver=cgroupfs"],
    "log-driver": "json-file",
    "log-opts": {"max-size": "100m"},
    "storage-driver": "overlay2",
}


def _key(base_key: str) -> str:
    doc = {"base": base_key, "packages": PACKAGES, "daemon": INSTALLER_DAEMON_JSON, "rev": REVISION}
    blob = json.dumps(doc, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def ensure_host_image() -> str:
    """Build (or reuse) the lab host image; return its name.

    Under the test hosts' image lock (the molecule scenarios' fixture takes it too): on a cold machine a lab
    and the scenarios started side by side would otherwise both debootstrap the same base image.
    """
    with file_lock(state_dir() / "images.lock"):
        return _ensure_host_image()


def _ensure_host_image() -> str:
    base = ImageSpec("bookworm")
    build_image(base)
    key = _key(base.key())
    name = f"{REPOSITORY}:{key}"
    if image_key(name, KEY_LABEL) == key:
        return name
    builder = f"gpufleet-labhost-build-{key}"
    podman("rm", "-f", builder, check=False)
    script = (
        "set -e; export DEBIAN_FRONTEND=noninteractive; apt-get update -q; "
        f"apt-get install -y -q --no-install-recommends {' '.join(PACKAGES)}; "
        "apt-get clean; rm -rf /var/lib/apt/lists/*; mkdir -p /etc/docker; "
        f"printf '%s\\n' '{json.dumps(INSTALLER_DAEMON_JSON, indent=2)}' > /etc/docker/daemon.json"
    )
    try:
        result = podman("run", "--name", builder, "--network=slirp4netns", base.name, "sh", "-c", script,
                        check=False)  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"building {name} failed: {(result.stderr or result.stdout)[-2000:]}")
        podman("commit", "--change", f'CMD ["{INIT_WRAPPER}"]', "--change", "STOPSIGNAL SIGRTMIN+3",
               "--change", f"LABEL {KEY_LABEL}={key}", builder, name)  # fmt: skip
    finally:
        podman("rm", "-f", builder, check=False)
    return name


__all__ = ["REPOSITORY", "ensure_host_image"]
