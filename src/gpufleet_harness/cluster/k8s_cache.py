"""The Kubernetes build cache both builders share: an entry's layout and record (:class:`K8sArtifacts`),
where the cache lives, and the steps every build runs alike (a logged, niced command; the pause and busybox
root filesystems).

:mod:`~gpufleet_harness.cluster.k8s_build` builds Debian's 1.20 source and chooses the builder for a version
(:func:`~gpufleet_harness.cluster.k8s_build.ensure_k8s`); :mod:`~gpufleet_harness.cluster.k8s_modbuild`
builds a current release from its Go modules. Both import this module, and neither imports the other's
insides, so the three have no import cycle.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

COMPONENTS = ("kube-apiserver", "kube-scheduler", "kube-controller-manager", "kubelet", "kubectl")
IMAGES = ("pause", "busybox")
MANIFEST = "manifest.json"
BUSYBOX_APPLETS_MIN = ("sh", "sleep", "cat", "echo", "env", "true")


class BuildError(RuntimeError):
    """A cold build cannot start or did not finish; the message names the cause."""


@dataclass(frozen=True)
class K8sArtifacts:
    """A complete cache entry: binaries and image tarballs for one Debian source version."""

    version: str
    root: Path
    manifest: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def bin_dir(self) -> Path:
        return self.root / "bin"

    @property
    def images_dir(self) -> Path:
        return self.root / "images"

    @property
    def git_version(self) -> str:
        """The upstream version the binaries report, e.g. ``v1.20.2``."""
        return str(self.manifest.get("git_version", ""))

    def binary(self, name: str) -> Path:
        """Path of one of :data:`COMPONENTS`."""
        return self.bin_dir / name

    def image(self, name: str) -> Path:
        """Path of the root filesystem tarball of one of :data:`IMAGES` (imported as a one-layer image)."""
        return self.images_dir / f"{name}.tar"

    @property
    def minor(self) -> int:
        """The minor release of the binaries (``v1.37.2`` -> 37): what flags and configuration they take."""
        match = re.match(r"v?1\.(\d+)\.", self.git_version or self.version)
        if match is None:
            raise BuildError(f"cannot tell the Kubernetes minor of {self.root} ({self.git_version!r})")
        return int(match.group(1))

    @property
    def from_modules(self) -> bool:
        """Built from the Go modules of an upstream release (:mod:`k8s_modbuild`), not Debian's source."""
        return self.manifest.get("source") == "go modules"

    @property
    def kubeadm_images(self) -> dict[str, tuple[Path, list[str]]]:
        """Image name kubeadm expects -> (root filesystem tarball, ``docker import -c`` changes); empty for
        the Debian-source builds, which have no kubeadm."""
        images = self.manifest.get("kubeadm_images") or {}
        assert isinstance(images, dict)
        out = {}
        for name, doc in images.items():
            changes = [arg for change in doc["changes"] for arg in ("-c", change)]
            out[name] = (self.root / str(doc["rootfs"]), changes)
        return out


def cache_root(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: the argument, else ``$GPUFLEET_CACHE``, else ``/var/cache/gpufleet``."""
    return Path(explicit or os.environ.get("GPUFLEET_CACHE") or "/var/cache/gpufleet")


def _key(version: str) -> str:
    # An epoch's ':' is legal in Debian versions but awkward in paths.
    return version.replace(":", "_")


def _load(entry: Path) -> K8sArtifacts | None:
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    version = manifest.get("version") or manifest.get("debian_version")
    if not version:
        return None
    artifacts = K8sArtifacts(str(version), entry, manifest)
    wanted = [artifacts.binary(c) for c in COMPONENTS] + [artifacts.image(i) for i in IMAGES]
    wanted += [entry / f for f in manifest.get("files", [])]
    return artifacts if all(p.is_file() for p in wanted) else None


class StepBuilder:
    """One cold (or resumed) build into a cache entry; each step is skipped when its output already exists.
    The Debian-source and Go-module builders add their own steps."""

    def __init__(self, version: str, entry: Path, gocache: Path, niceness: int) -> None:
        self.version = version
        self.entry = entry
        self.gocache = gocache
        self.niceness = niceness
        self.logs = entry / "logs"
        self.timings: dict[str, float] = {}

    def run(self, step: str, argv: Sequence[str | os.PathLike[str]], cwd: Path, env: dict[str, str]) -> None:
        """Run one build command niced, logging to logs/<step>.log; raise BuildError with its tail."""
        self.logs.mkdir(parents=True, exist_ok=True)
        logfile = self.logs / f"{step}.log"
        started = time.monotonic()
        log.info("build step %s: %s (log %s)", step, " ".join(map(str, argv[:4])), logfile)
        with logfile.open("w") as out:
            proc = subprocess.run(
                [str(a) for a in argv],
                cwd=cwd,
                # Go resolves GOPATH/vendor from $PWD: it must name the symlinked path, not the real tree.
                env=env | {"PWD": str(cwd)},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=lambda: os.nice(self.niceness),
                check=False,
            )
        self.timings[step] = round(time.monotonic() - started, 1)
        if proc.returncode != 0:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-30:])
            raise BuildError(f"{step} failed (exit {proc.returncode}), log {logfile}:\n{tail}")
        log.info("build step %s done in %.1fs", step, self.timings[step])

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(GOCACHE=str(self.gocache), GOFLAGS="", CGO_ENABLED="0")
        env.setdefault("HOME", str(self.entry))
        return env

    def pause_image(self, tree: Path, wanted_tag: str | None = None) -> None:
        """Static ``/pause`` from the tree's build/pause/linux/pause.c (the registry image is out of reach),
        versioned with build/pause/Makefile's TAG, which must be ``wanted_tag`` when one is given."""
        target = self.entry / "images/pause.tar"
        if target.is_file():
            return
        makefile = (tree / "build/pause/Makefile").read_text()
        found = re.search(r"^TAG\s*\??=\s*(\S+)", makefile, re.M)
        tag = found.group(1) if found else None
        if wanted_tag is not None and tag != wanted_tag:
            raise BuildError(f"pause {wanted_tag} is wanted but {tree}/build/pause/Makefile has TAG {tag}")
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp) / "rootfs"
            root.mkdir()
            self.run(
                "pause",
                [
                    "gcc",
                    "-Os",
                    "-Wall",
                    "-static",
                    "-s",
                    f"-DVERSION=v{tag or 'lab'}",
                    "-o",
                    root / "pause",
                    tree / "build/pause/linux/pause.c",
                ],
                Path(tmp),
                self.env(),
            )
            _write_tar(root, target)

    def busybox_image(self) -> None:
        """Root filesystem from Debian's busybox-static: /bin/busybox plus one link per applet."""
        target = self.entry / "images/busybox.tar"
        if target.is_file():
            return
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            self.run(
                "busybox-download",
                ["apt-get", "-o", "APT::Sandbox::User=root", "download", "-q", "busybox-static"],
                work,
                self.env(),
            )
            debs = list(work.glob("busybox-static_*.deb"))
            if len(debs) != 1:
                raise BuildError(f"apt-get download busybox-static gave {debs}")
            self.run("busybox-extract", ["dpkg-deb", "-x", debs[0], work / "x"], work, self.env())
            root = work / "rootfs"
            (root / "bin").mkdir(parents=True)
            (root / "tmp").mkdir()
            shutil.copy2(work / "x/bin/busybox", root / "bin/busybox")
            applets = subprocess.run(
                [root / "bin/busybox", "--list"], capture_output=True, text=True, check=True
            ).stdout.split()
            for applet in sorted(set(applets) | set(BUSYBOX_APPLETS_MIN)):
                if applet != "busybox":
                    (root / "bin" / applet).symlink_to("busybox")
            _write_tar(root, target)


def _write_tar(root: Path, target: Path) -> None:
    """Tar ``root``'s contents (owned by root) as a ``docker import`` input, atomically."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")

    def owned_by_root(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.uid = info.gid = 0
        info.uname = info.gname = "root"
        return info

    with tarfile.open(tmp, "w") as tar:
        for child in sorted(root.iterdir()):
            tar.add(child, arcname=child.name, filter=owned_by_root)
    tmp.rename(target)


def file_sha256(path: Path) -> str:
    """The sha256 (hex) of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
