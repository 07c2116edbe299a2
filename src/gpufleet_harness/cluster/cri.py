"""What a kubelet on containerd CRI needs, shared by the lab's hosts and the test clusters' nodes.

- containerd's configuration for a CRI kubelet (:func:`containerd_config`) and the pod network's CNI
  bridge (:data:`CNI_CONFLIST`);
- images without a registry: a root filesystem tarball as a one-layer ``docker save`` archive
  (:func:`write_docker_archive`), streamed to ``ctr images import`` (:func:`stream_import`; CRI then finds
  it by the name :func:`gpufleet.imageref.qualified` gives).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import subprocess
import tarfile
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from gpufleet_harness.cluster.k8s_cache import file_sha256

CONTAINERD_SOCKET = "/run/containerd/containerd.sock"

# containerd as a cluster installer configures it for a kubelet (kubeadm's "container runtimes" page for
# containerd): config version 2, CRI plugin enabled (Debian's package does not disable it), runc through
# the runc v2 shim with the cgroup driver the kubelet uses (SystemdCgroup: false for the lab's cgroupfs
# kubelets, true for the kubeadm hosts' systemd driver), the sandbox (pause)
# image the lab loads, CNI binaries where Debian's containernetworking-plugins puts them. Checked against
# `containerd config dump` of Debian 12's containerd 1.6.20 (docs/lab.md).
# restrict_oom_score_adj is lab glue like /usr/local/sbin/runc: this machine's root lacks CAP_SYS_RESOURCE,
# so negative oom_score_adj (CRI asks -998 for sandboxes) is clamped to containerd's own score.
_CONTAINERD_TEMPLATE = """\
# {comment}
version = 2
{top}
[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "{pause}"
    restrict_oom_score_adj = true
{cri}    [plugins."io.containerd.grpc.v1.cri".cni]
      bin_dir = "/usr/lib/cni"
      conf_dir = "{cni_conf_dir}"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      snapshotter = "overlayfs"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = {systemd_cgroup}
{runc}  [plugins."io.containerd.internal.v1.opt"]
    path = "/var/lib/containerd/opt"
"""


def containerd_config(
    sandbox_image: str,
    comment: str,
    *,
    address: str | None = None,
    stream_server_address: str | None = None,
    cni_conf_dir: str = "/etc/cni/net.d",
    runc_binary: str | None = None,
    systemd_cgroup: bool = False,
) -> str:
    """containerd's ``config.toml`` for a CRI kubelet. The defaults are a host's own containerd; a test
    cluster's node, which shares the machine's /etc and network, names its own socket (``address``; root and
    state stay containerd's defaults under the node's private /var and /run), the address its streaming
    server (exec, attach, port-forward) listens on where the kubelet can reach it, its CNI directory, and
    the runc it runs (``runc_binary``). ``systemd_cgroup``: runc's cgroups through systemd, for a kubelet
    with ``cgroupDriver: systemd``."""
    top = ""
    if address is not None:
        top = f'root = "/var/lib/containerd"\nstate = "/run/containerd"\n\n[grpc]\n  address = "{address}"\n'
    cri = f'    stream_server_address = "{stream_server_address}"\n' if stream_server_address else ""
    runc = f'          BinaryName = "{runc_binary}"\n' if runc_binary else ""
    return _CONTAINERD_TEMPLATE.format(
        comment=comment,
        top=top,
        pause=sandbox_image,
        cri=cri,
        cni_conf_dir=cni_conf_dir,
        runc=runc,
        systemd_cgroup=str(systemd_cgroup).lower(),
    )


# The pod network of a containerd host: one bridge on the host (each lab host is its own network namespace,
# so every host may use the same range), addresses from host-local, portmap for hostPort; containerd's CRI
# adds the loopback plugin to every pod itself. CNI spec 1.0.0, which containernetworking-plugins 1.1.1 and
# containerd 1.6's libcni speak.
CNI_CONFLIST = {
    "cniVersion": "1.0.0",
    "name": "gpufleet-lab",
    "plugins": [
        {
            "type": "bridge",
            "bridge": "cni0",
            "isGateway": True,
            "ipMasq": True,
            "hairpinMode": True,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": "10.88.0.0/16"}]],
                "routes": [{"dst": "0.0.0.0/0"}],
            },
        },
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}


def _changes_to_config(changes: list[str]) -> dict[str, Any]:
    """``docker import -c`` instructions (ENV, ENTRYPOINT, CMD) as an image config's ``config``."""
    config: dict[str, Any] = {}
    values = [c for c in changes if c != "-c"]
    for change in values:
        verb, _, rest = change.partition(" ")
        if verb == "ENV":
            config.setdefault("Env", []).extend(rest.split())
        elif verb in ("ENTRYPOINT", "CMD"):
            config["Entrypoint" if verb == "ENTRYPOINT" else "Cmd"] = json.loads(rest)
        else:
            raise ValueError(f"image change {change!r}: only ENV, ENTRYPOINT and CMD are translated")
    return config


_DIGESTS: dict[tuple[str, int, int], str] = {}
_DIGESTS_LOCK = threading.Lock()


def _sha256(path: Path) -> str:
    """sha256 of a file, once per file version per process (the hosts load the same tarballs in parallel)."""
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _DIGESTS_LOCK:
        if key not in _DIGESTS:
            _DIGESTS[key] = file_sha256(path)
        return _DIGESTS[key]


def write_docker_archive(out: IO[bytes], image: str, rootfs: Path, changes: list[str]) -> None:
    """A one-layer image in ``docker save`` format (what ``docker import`` of ``rootfs`` would make), streamed
    to ``out``: manifest.json naming ``image``, the image config, the rootfs tarball as the layer."""
    layer = _sha256(rootfs)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": _changes_to_config(changes),
        "rootfs": {"type": "layers", "diff_ids": [f"sha256:{layer}"]},
        "history": [{"created_by": f"gpufleet lab: {rootfs.name} as a single layer"}],
    }
    config_blob = json.dumps(config, sort_keys=True).encode()
    config_name = hashlib.sha256(config_blob).hexdigest() + ".json"
    manifest = [{"Config": config_name, "RepoTags": [image], "Layers": [f"{layer}/layer.tar"]}]
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for member, data in ((config_name, config_blob), ("manifest.json", json.dumps(manifest).encode())):
            info = tarfile.TarInfo(member)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
        info = tar.gettarinfo(str(rootfs), arcname=f"{layer}/layer.tar")
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        with rootfs.open("rb") as fh:
            tar.addfile(info, fh)


def stream_import(argv: Sequence[str], image: str, rootfs: Path, changes: Sequence[str]) -> tuple[int, str]:
    """Run ``argv`` (a ``ctr images import -`` reachable however the caller reaches its containerd) with the
    image's archive on its standard input; its exit code and the last of what it said."""
    with tempfile.TemporaryFile() as output:
        proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=output, stderr=subprocess.STDOUT)
        assert proc.stdin is not None
        with contextlib.suppress(BrokenPipeError), proc.stdin:
            write_docker_archive(proc.stdin, image, rootfs, list(changes))
        rc = proc.wait(timeout=600)
        output.seek(0)
        return rc, output.read().decode(errors="replace").strip()[-800:]
