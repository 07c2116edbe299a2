"""One lab host: the podman container, the simulated driver files in it, and its kubelet.

What is installed in a host, and where (the roles see only the one fact the lab sets, ``gpufleet_env``):

``/etc/gpufleet-sim/``            the simulated machine: ``machine.json``, ``control``, ``events``, ``lib/``
                                  (the simulator's ``libnvidia-ml.so.1``), ``host/`` (sysfs/procfs view),
                                  ``bin/nvidia-smi`` (stand-in, Python + pynvml from ``python/``)
``/dev/nvidia*``                  character devices with the driver's numbers, made at every boot by
                                  ``gpufleet-sim-devices.service`` as the driver's udev rules would
``/usr/local/sbin/runc``          lab glue, not NVIDIA's: clamps negative ``oom_score_adj`` (this
                                  machine's root lacks CAP_SYS_RESOURCE), execs Debian's ``/usr/sbin/runc``
``/usr/local/bin/kubelet``        the cached Kubernetes build, as ``kubelet.service``; client
                                  certificate from the lab CA; on containerd CRI or dockershim
``/etc/containerd/config.toml``   containerd hosts: CRI as a cluster installer configures it (sandbox image,
``/etc/cni/net.d/``               cgroupfs, CNI), the pod network's bridge conflist; docker.io purged
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from gpufleet.imageref import qualified
from gpufleet_harness.cluster import oci_runtime
from gpufleet_harness.cluster.cri import (
    CNI_CONFLIST,
    CONTAINERD_SOCKET,
    containerd_config,
    stream_import,
)
from gpufleet_harness.cluster.node import BUSYBOX_IMAGE, PAUSE_IMAGE
from gpufleet_harness.cluster.process import ClusterError, wait_for
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.testhosts.images import INIT_WRAPPER
from gpufleet_harness.testhosts.podman import podman

from .spec import EXTENDER_PORT, LABEL, METRICS_PORT, SIM_DIR, HostSpec, LabSpec

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # src
# What the nvidia-smi stand-in imports: gpufleet_harness.sim.smi and gpufleet.gpu (standard library + pynvml).
_SMI_SOURCES = (
    "gpufleet/__init__.py",
    "gpufleet/gpu",
    "gpufleet_harness/__init__.py",
    "gpufleet_harness/sim/__init__.py",
    "gpufleet_harness/sim/smi.py",
    "gpufleet_harness/sim/smi_query.py",
    # `nvidia-smi --gpu-reset` (a MIG mode change on an A100) imports these when it runs; with PyYAML,
    # which the MIG role installs where it applies a layout
    "gpufleet/files.py",
    "gpufleet/yamlfile.py",
    "gpufleet_harness/sim/control.py",
    "gpufleet_harness/sim/machine.py",
    "gpufleet_harness/sim/workload.py",
)

KUBELET_UNIT = """\
# Installed by `gpufleet lab up` (the lab plays the cluster installer). Kubernetes {version}, {runtime_note}.
[Unit]
Description=kubelet: the Kubernetes node agent
After={runtime_unit}
Requires={runtime_unit}

[Service]
ExecStart=/usr/local/bin/kubelet \\
  --kubeconfig=/etc/kubernetes/kubelet.conf \\
{runtime_flags}  --pod-infra-container-image={pause} \\
  --cgroup-driver=cgroupfs --cgroups-per-qos=false --enforce-node-allocatable= \\
  --fail-swap-on=false --read-only-port=0 \\
  --client-ca-file=/etc/kubernetes/pki/ca.crt --anonymous-auth=false \\
  --authentication-token-webhook=false --authorization-mode=AlwaysAllow \\
  --image-gc-high-threshold=100 --image-gc-low-threshold=99 --eviction-hard=memory.available<100Mi \\
  --node-status-update-frequency=2s --v=1
Restart=always
RestartSec=2

[Install]
WantedBy=multi-user.target
"""
# Kubelet 1.20 flags per runtime: (what the unit says, the runtime's unit, flags). dockershim is built into
# the kubelet. containerd: CRI (v1alpha2 in 1.20, which containerd 1.6 serves) on containerd's socket, with
# --runtime-request-timeout=15m as containerd's CRI guide for kubeadm nodes sets it (the default 2 min can
# cut off long image operations). --pod-infra-container-image stays on both: with dockershim it is the
# sandbox image; with CRI containerd's sandbox_image is, and the kubelet only keeps it from image GC.
KUBELET_RUNTIME_FLAGS = {
    "docker": ("dockershim", "docker.service", "  --container-runtime=docker \\\n"),
    "containerd": (
        "containerd CRI",
        "containerd.service",
        "  --container-runtime=remote \\\n"
        f"  --container-runtime-endpoint=unix://{CONTAINERD_SOCKET} \\\n"
        "  --runtime-request-timeout=15m \\\n",
    ),
}

CONTAINERD_COMMENT = (
    "Installed by `gpufleet lab up` (the lab plays the cluster installer): containerd for a CRI kubelet."
)
CNI_CONFLIST_PATH = "/etc/cni/net.d/10-gpufleet-lab.conflist"
DEVICES_UNIT = """\
# Installed by `gpufleet lab up`: the simulated GPUs' device nodes, as the driver's udev rules make them.
[Unit]
Description=gpufleet lab: device nodes of the simulated NVIDIA GPUs
DefaultDependencies=no
Before=docker.service containerd.service kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart={sim}/bin/gpufleet-sim-devices

[Install]
WantedBy=multi-user.target
"""

SMI_WRAPPER = """\
#!/bin/sh
# nvidia-smi stand-in of the gpufleet lab: gpufleet-sim-smi against the simulated machine in {sim}.
: "${{GPUFLEET_SIM_ROOT:={sim}}}"
: "${{LD_LIBRARY_PATH:={sim}/lib}}"
: "${{GPUFLEET_HOST_ROOT:={sim}/host}}"
export GPUFLEET_SIM_ROOT LD_LIBRARY_PATH GPUFLEET_HOST_ROOT
PYTHONPATH={sim}/python exec /usr/bin/python3 -m gpufleet_harness.sim.smi "$@"
"""


class HostError(RuntimeError):
    """A lab host could not be created or set up; the message says which step and why."""


def exec_in(container: str, *argv: str, check: bool = True, input_text: str | None = None) -> str:
    """Run a command in the container; return its stdout."""
    result = subprocess.run(
        ["podman", "exec", *(["-i"] if input_text is not None else []), container, *argv],
        input=input_text, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise HostError(f"{container}: {' '.join(argv)} exited {result.returncode}: "
                        f"{(result.stderr or result.stdout).strip()[-800:]}")  # fmt: skip
    return result.stdout


def write_in(container: str, path: str, text: str, mode: int = 0o644) -> None:
    script = f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode:o} "$1"'
    exec_in(container, "sh", "-c", script, "sh", path, input_text=text)


def copy_in(container: str, source: Path, dest: str) -> None:
    result = podman("cp", str(source), f"{container}:{dest}", check=False)
    if result.returncode != 0:
        raise HostError(f"podman cp {source} {container}:{dest}: {result.stderr.strip()}")


def create(
    spec: LabSpec, host: HostSpec, image: str, extender_port: int | None, metrics_port: int | None = None
) -> None:
    """Start the host's container (systemd as PID 1) and wait for systemd to finish booting."""
    name = spec.container(host)
    mounts: list[str] = []
    for volume, where in spec.volumes(host).items():
        podman("volume", "create", "--label", f"{LABEL}={spec.name}", volume, check=False)
        mounts += ["-v", f"{volume}:{where}"]
    argv = [
        "run", "-d", "--name", name, "--hostname", host.name, "--label", f"{LABEL}={spec.name}",
        # a kubelet and dockerd run inside: privileged with a private cgroup namespace (docs/lab.md)
        "--privileged", "--cgroupns=private", "--systemd=always",
        # a reboot inside (playbooks/upgrade-driver.yml) ends systemd, and podman starts the host again
        "--restart=always",
        # this machine's loopback (control plane, APT repository) is 10.0.2.2 inside; nothing else is bridged
        "--network=slirp4netns:allow_host_loopback=true",
        # dockerd's overlay2 and containerd's overlayfs snapshots cannot sit on the container's overlay root
        *mounts,
    ]  # fmt: skip
    if extender_port is not None:
        argv += ["-p", f"127.0.0.1:{extender_port}:{EXTENDER_PORT}"]
    if metrics_port is not None:
        argv += ["-p", f"127.0.0.1:{metrics_port}:{METRICS_PORT}"]
    result = podman(*argv, image, INIT_WRAPPER, check=False)
    if result.returncode != 0:
        raise HostError(f"podman run {name}: {result.stderr.strip()}")
    try:
        wait_for(f"{name}: systemd to finish booting",
                 lambda: exec_in(name, "systemctl", "is-system-running", check=False).strip()
                 in ("running", "degraded"), 120, interval=0.5)  # fmt: skip
    except ClusterError as err:
        raise HostError(str(err)) from None


# -- the simulated driver --------------------------------------------------------------------------------
def stage_sim(fixture: str, stage: Path, library: Path) -> Path:
    """A sim root for ``fixture`` laid out for /etc/gpufleet-sim in a host: real files, no host paths."""
    root = simmachine.materialize(fixture, stage / "gpufleet-sim", library=library)
    for link in (root / "lib/libnvidia-ml.so.1", root / "host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"):
        link.unlink()
        shutil.copy2(library, link)
    (root / "lib/.libnvidia-ml.so.1.target").write_text(f"{SIM_DIR}/lib/libnvidia-ml.so.1\n")
    # Device nodes become a boot script: podman cp would not carry them, and /dev is the host's own.
    lines = ["#!/bin/sh", "# Device nodes of the simulated GPUs, at /dev and in the sim root's host view.",
             "set -e", f"mkdir -p {SIM_DIR}/host/dev"]  # fmt: skip
    dev, made = root / "host/dev", {"/dev", f"{SIM_DIR}/host/dev"}
    # (nvidia-caps/: the MIG capability nodes of MIG-capable GPUs, which MIG devices' pods are given)
    for node in sorted(dev.rglob("*")):
        st = node.lstat()
        if not stat.S_ISCHR(st.st_mode):
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        name = node.relative_to(dev).as_posix()
        for where in (f"/dev/{name}", f"{SIM_DIR}/host/dev/{name}"):
            parent = where.rsplit("/", 1)[0]
            if parent not in made:
                made.add(parent)
                lines.append(f"mkdir -p {parent}")
            lines.append(f"[ -c {where} ] || mknod -m 666 {where} c {major} {minor}")
        node.unlink()
    script = root / "bin/gpufleet-sim-devices"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    (root / "bin/nvidia-smi").write_text(SMI_WRAPPER.format(sim=SIM_DIR))
    python = root / "python"
    for rel in _SMI_SOURCES:
        source = SOURCE_ROOT / rel
        target = python / rel
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    import pynvml  # the same nvidia-ml-py the project pins; one pure-Python module

    shutil.copy2(pynvml.__file__, python / "pynvml.py")
    return root


def install_sim(spec: LabSpec, host: HostSpec, library: Path) -> None:
    name = spec.container(host)
    with tempfile.TemporaryDirectory(prefix="gpufleet-lab-sim-") as tmp:
        root = stage_sim(host.fixture, Path(tmp), library)
        exec_in(name, "rm", "-rf", SIM_DIR)
        copy_in(name, root, SIM_DIR)
    write_in(name, "/etc/systemd/system/gpufleet-sim-devices.service", DEVICES_UNIT.format(sim=SIM_DIR))
    exec_in(name, "systemctl", "daemon-reload")
    exec_in(name, "systemctl", "enable", "--now", "gpufleet-sim-devices.service")


# -- the node: runc glue, images, kubelet -----------------------------------------------------------------
def install_runc_glue(spec: LabSpec, host: HostSpec) -> None:
    name = spec.container(host)
    copy_in(name, Path(oci_runtime.__file__), "/usr/local/lib/gpufleet-lab-oci-runtime.py")
    shim = oci_runtime.shim("/usr/sbin/runc", "/usr/bin/python3").replace(
        repr(str(Path(oci_runtime.__file__).resolve())), repr("/usr/local/lib/gpufleet-lab-oci-runtime.py")
    )
    write_in(name, "/usr/local/sbin/runc", shim, 0o755)


def configure_runtime(spec: LabSpec, host: HostSpec) -> None:
    """The container runtime as the cluster installer leaves it for the host's kubelet.

    docker: the image's dockerd, as it is. containerd: docker.io is purged (a CRI node runs no dockerd, and
    the toolkit role then finds only containerd, as on such a node), containerd is configured for CRI and the
    pod network is a CNI bridge."""
    name = spec.container(host)
    if host.runtime != "containerd":
        return
    purge = (
        "systemctl stop docker.socket docker.service 2>/dev/null; "
        "DEBIAN_FRONTEND=noninteractive dpkg --purge docker.io >/dev/null && rm -rf /etc/docker"
    )
    exec_in(name, "sh", "-c", purge)
    write_in(name, "/etc/containerd/config.toml", containerd_config(PAUSE_IMAGE, CONTAINERD_COMMENT))
    write_in(name, CNI_CONFLIST_PATH, json.dumps(CNI_CONFLIST, indent=2) + "\n")
    exec_in(name, "systemctl", "enable", "containerd.service")
    exec_in(name, "systemctl", "restart", "containerd.service")
    try:
        wait_for(f"{name}: containerd to answer on {CONTAINERD_SOCKET}",
                 lambda: exec_in(name, "ctr", "version", check=False).count("Version:") >= 2, 60,
                 interval=0.5)  # fmt: skip
    except ClusterError as err:
        raise HostError(str(err)) from None


def _ctr_import(container: str, image: str, rootfs: Path, changes: list[str]) -> None:
    """Stream the image into the host's containerd, namespace ``k8s.io`` (where CRI keeps its images)."""
    argv = ["podman", "exec", "-i", container, "ctr", "--namespace", "k8s.io", "images", "import", "-"]
    rc, said = stream_import(argv, image, rootfs, changes)
    if rc != 0:
        raise HostError(f"{container}: ctr images import of {image} exited {rc}: {said}")


def load_images(spec: LabSpec, host: HostSpec, k8s_images: Path, gpufleet_image: tuple[str, Path]) -> None:
    """pause, busybox and the gpufleet image into the host's runtime (no registry here): ``docker import``
    into dockerd, or a ``docker save`` archive imported into containerd's ``k8s.io`` namespace."""
    name = spec.container(host)
    from gpufleet_harness.cluster.images import IMPORT_CHANGES

    wanted = [
        (PAUSE_IMAGE, k8s_images / "pause.tar", ["-c", 'ENTRYPOINT ["/pause"]']),
        (BUSYBOX_IMAGE, k8s_images / "busybox.tar", ["-c", 'CMD ["/bin/sh"]']),
        (gpufleet_image[0], gpufleet_image[1], list(IMPORT_CHANGES)),
    ]
    if host.runtime == "containerd":
        present = set(exec_in(name, "ctr", "--namespace", "k8s.io", "images", "ls", "-q").split())
        for image, tarball, changes in wanted:
            if qualified(image) not in present:
                _ctr_import(name, image, tarball, changes)
        return
    exec_in(name, "systemctl", "start", "docker")
    present = set(exec_in(name, "docker", "images", "--format", "{{.Repository}}:{{.Tag}}").split())
    for image, tarball, changes in wanted:
        if image in present:
            continue
        copy_in(name, tarball, "/tmp/image.tar")
        exec_in(name, "docker", "import", *changes, "/tmp/image.tar", image)
        exec_in(name, "rm", "-f", "/tmp/image.tar")


def install_kubelet(spec: LabSpec, host: HostSpec, state: dict, kubelet: Path) -> None:
    name = spec.container(host)
    creds = state["nodes"][host.name]
    copy_in(name, kubelet, "/usr/local/bin/kubelet")
    exec_in(name, "mkdir", "-p", "/etc/kubernetes/pki", "/var/lib/kubelet")
    copy_in(name, Path(state["ca"]), "/etc/kubernetes/pki/ca.crt")
    copy_in(name, Path(creds["cert"]), "/etc/kubernetes/pki/kubelet-client.crt")
    copy_in(name, Path(creds["key"]), "/etc/kubernetes/pki/kubelet-client.key")
    exec_in(name, "chmod", "600", "/etc/kubernetes/pki/kubelet-client.key")
    kubeconfig = (
        "apiVersion: v1\nkind: Config\nclusters:\n- name: lab\n  cluster:\n"
        f"    server: {state['apiserver']['gateway_url']}\n"
        "    certificate-authority: /etc/kubernetes/pki/ca.crt\n"
        f"users:\n- name: system:node:{host.name}\n  user:\n"
        "    client-certificate: /etc/kubernetes/pki/kubelet-client.crt\n"
        "    client-key: /etc/kubernetes/pki/kubelet-client.key\n"
        f"contexts:\n- name: lab\n  context: {{cluster: lab, user: 'system:node:{host.name}'}}\n"
        "current-context: lab\n"
    )
    write_in(name, "/etc/kubernetes/kubelet.conf", kubeconfig, 0o600)
    note, runtime_unit, flags = KUBELET_RUNTIME_FLAGS[host.runtime]
    unit = KUBELET_UNIT.format(version=state["k8s_version"], pause=PAUSE_IMAGE, runtime_note=note,
                               runtime_unit=runtime_unit, runtime_flags=flags)  # fmt: skip
    write_in(name, "/etc/systemd/system/kubelet.service", unit)
    exec_in(name, "systemctl", "daemon-reload")
    exec_in(name, "systemctl", "enable", "--now", "kubelet.service")
