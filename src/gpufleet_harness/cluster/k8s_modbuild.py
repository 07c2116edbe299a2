"""Build a current Kubernetes release (and the etcd its kubeadm deploys) from their Go modules, cached by
version, with the images ``kubeadm init`` expects.

The main modules are the project's own (:mod:`gpufleet_harness.cluster.gomod`, committed go.mod and
go.sum); the code comes from the Go module proxy and is never kept in the repository. One cache entry per
Kubernetes version, beside the Debian-source 1.20 entries::

    ${GPUFLEET_CACHE:-/var/cache/gpufleet}/k8s/<version>/
        bin/            kube-apiserver kube-controller-manager kube-scheduler kubelet kubeadm kubectl etcd
        images/         root filesystems (one tarball per image): pause, busybox and kubeadm's control plane
        gomod/          the go.mod/go.sum the binaries were built from (copied from the repository)
        logs/           one log per build step
        manifest.json   written last: versions, image names, sha256s, step timings
    ${GPUFLEET_CACHE}/go-build   GOCACHE  } shared by every Go build of the project (1.20, vcsim, this):
    ${GPUFLEET_CACHE}/go-mod     GOMODCACHE }  the lab, the cluster tests and CI fill and reuse the same two

No registry is reachable, so each image ``kubeadm config images list`` names is a one-layer root filesystem
made here from the binaries (the release's ``build/pause/linux/pause.c`` for pause), imported into
containerd under that name. CoreDNS and kube-proxy are not built: the lab's clusters disable both addons
in kubeadm's configuration (``dns.disabled``, ``proxy.disabled``), so kubeadm neither lists nor deploys them.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from gpufleet_harness.cluster import gomod
from gpufleet_harness.cluster.k8s_cache import (
    MANIFEST,
    BuildError,
    K8sArtifacts,
    StepBuilder,
    _load,
    _write_tar,
    cache_root,
    file_sha256,
)
from gpufleet_harness.cluster.process import file_lock

log = logging.getLogger(__name__)

ETCD = "etcd"
BINARIES = (*gomod.KUBERNETES_COMMANDS, ETCD)
# Upstream's release build (hack/lib/golang.sh): these tags, -trimpath, symbols stripped, static binaries.
BUILD_TAGS = "selinux,notest,grpcnotrace"
IMAGE_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# kubeadm's ClusterConfiguration for the lab: no CoreDNS, no kube-proxy (never built, never deployed).
KUBEADM_IMAGES_CONFIG = """\
apiVersion: kubeadm.k8s.io/v1beta4
kind: ClusterConfiguration
kubernetesVersion: {version}
dns:
  disabled: true
proxy:
  disabled: true
"""
# Control-plane image -> the binary it carries (the pause image carries /pause).
IMAGE_BINARIES = {
    "kube-apiserver": "kube-apiserver",
    "kube-controller-manager": "kube-controller-manager",
    "kube-scheduler": "kube-scheduler",
    "etcd": ETCD,
}


class _ModuleBuilder(StepBuilder):
    """One build of a release from the module proxy; every step is skipped when its output exists."""

    def __init__(self, release: gomod.ModuleBuild, entry: Path, cache: Path, niceness: int) -> None:
        super().__init__(release.version, entry, cache / "go-build", niceness)
        self.release = release
        self.cache = cache

    go = "go"

    def env(self) -> dict[str, str]:
        env = gomod.go_env(self.cache) | {"CGO_ENABLED": "0"}
        if os.sep in self.go:  # the go command check_go chose comes first for everything the build runs
            env["PATH"] = os.pathsep.join([str(Path(self.go).parent), env.get("PATH", "")])
        if os.environ.get("GOTOOLCHAIN"):
            env["GOTOOLCHAIN"] = os.environ["GOTOOLCHAIN"]  # e.g. go1.27.3: the go command fetches it
        return env

    def module_dirs(self) -> tuple[Path, Path]:
        """The committed go.mod/go.sum, copied into the entry (the record of what was built)."""
        dirs = []
        for source in (self.release.kubernetes_dir, self.release.etcd_dir):
            target = self.entry / "gomod" / source.name.split("-", 1)[0]
            target.mkdir(parents=True, exist_ok=True)
            for name in ("go.mod", "go.sum"):
                shutil.copyfile(source / name, target / name)
            dirs.append(target)
        return dirs[0], dirs[1]

    def check_go(self, *module_dirs: Path) -> None:
        """Find a go command at least every module's ``go`` line (Go never fetches a toolchain here unless
        GOTOOLCHAIN says so) and put it first on the build's PATH."""
        wanted = max(
            gomod.parse_go_version(str(gomod.read_gomod(d / "go.mod", gomod.go_env(self.cache))["Go"]))
            for d in module_dirs
        )
        go = gomod.find_go(wanted)
        text = ".".join(map(str, wanted))
        if go is None and os.environ.get("GOTOOLCHAIN", "local") == "local":
            raise BuildError(
                f"Kubernetes {self.release.version} needs Go >= {text}; neither $GPUFLEET_GO, `go` on PATH "
                f"({shutil.which('go')}) nor {', '.join(gomod.GO_CANDIDATES)} is: install Go >= {text} in "
                f"/usr/local/go, or set GOTOOLCHAIN=go{text} to let the go command fetch it"
            )
        self.go = go or "go"

    def download(self, k8s_dir: Path, etcd_dir: Path) -> None:
        """Fetch exactly the modules the binaries import (``go list -deps``), checked against go.sum."""
        if (self.entry / "logs" / ".downloaded").exists():
            return
        packages = [f"{gomod.KUBERNETES_MODULE}/cmd/{name}" for name in gomod.KUBERNETES_COMMANDS]
        self.run(
            "download-kubernetes",
            [self.go, "list", "-tags", BUILD_TAGS, "-deps", "-e=false", *packages],
            k8s_dir,
            self.env(),
        )
        self.run(
            "download-etcd", [self.go, "list", "-deps", "-e=false", gomod.ETCD_MODULE], etcd_dir, self.env()
        )
        (self.entry / "logs" / ".downloaded").touch()

    def ldflags(self, tree: Path) -> str:
        """Version stamps as upstream's hack/lib/version.sh sets them (no git here: no gitCommit, and so no
        gitTreeState, exactly as version.sh leaves them without KUBE_GIT_COMMIT); buildDate is the
        release's publication time on the proxy, so a rebuild is byte-identical."""
        major, minor, _ = self.release.version.split(".")
        values = {
            "gitVersion": f"v{self.release.version}",
            "gitMajor": major,
            "gitMinor": minor,
            "buildDate": self.release_time(),
        }
        flags = [
            f"-X {pkg}.{k}={v}"
            for pkg in ("k8s.io/client-go/pkg/version", "k8s.io/component-base/version")
            for k, v in values.items()
        ]
        return "all=" + " ".join(["-s", "-w", *flags])

    def release_time(self) -> str:
        info = self.cache / "go-mod" / "cache/download/k8s.io/kubernetes/@v" / f"v{self.release.version}.info"
        try:
            return str(json.loads(info.read_text())["Time"])
        except (OSError, ValueError, KeyError):
            return "1970-01-01T00:00:00Z"

    def compile_all(self, k8s_dir: Path, etcd_dir: Path) -> None:
        bindir = self.entry / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        common = [self.go, "build", "-trimpath", "-tags", BUILD_TAGS]
        ldflags = self.ldflags(k8s_dir)
        for name in gomod.KUBERNETES_COMMANDS:
            if (bindir / name).is_file():
                continue
            out = bindir / f".{name}.tmp"
            self.run(
                f"build-{name}",
                [*common, "-ldflags", ldflags, "-o", out, f"{gomod.KUBERNETES_MODULE}/cmd/{name}"],
                k8s_dir,
                self.env(),
            )
            out.rename(bindir / name)
        if not (bindir / ETCD).is_file():
            out = bindir / f".{ETCD}.tmp"
            # etcd's own build (scripts/build_lib.sh): static, -trimpath, -s -w. Its GitSHA stamp needs git.
            self.run(
                "build-etcd",
                [self.go, "build", "-trimpath", "-ldflags", "-s -w", "-o", out, gomod.ETCD_MODULE],
                etcd_dir,
                self.env(),
            )
            out.rename(bindir / ETCD)

    def module_source(self) -> Path:
        """The unpacked k8s.io/kubernetes module (read-only use: build/pause/linux/pause.c, Makefile)."""
        return self.cache / "go-mod" / f"k8s.io/kubernetes@v{self.release.version}"

    def versions(self) -> dict[str, str]:
        """What each binary says its version is; raises BuildError when one is not the release's."""
        bindir = self.entry / "bin"
        said = {}
        for name in BINARIES:
            argv = {"kubectl": ["version", "--client"], "kubeadm": ["version", "-o", "short"]}.get(
                name, ["--version"]
            )
            proc = subprocess.run([bindir / name, *argv], capture_output=True, text=True, check=False)
            said[name] = (proc.stdout or proc.stderr).strip()
            want = self.release.etcd_version if name == ETCD else f"v{self.release.version}"
            if proc.returncode != 0 or want not in said[name]:
                raise BuildError(
                    f"{bindir / name} says {said[name]!r} (exit {proc.returncode}), expected {want}"
                )
        return said

    def kubeadm_images(self) -> list[str]:
        """``kubeadm config images list`` for the lab's configuration (addons off): the names to import."""
        with tempfile.NamedTemporaryFile("w", suffix=".yaml") as config:
            config.write(KUBEADM_IMAGES_CONFIG.format(version=f"v{self.release.version}"))
            config.flush()
            proc = subprocess.run(
                [self.entry / "bin/kubeadm", "config", "images", "list", "--config", config.name],
                capture_output=True,
                text=True,
                check=False,
            )
        if proc.returncode != 0:
            raise BuildError(f"kubeadm config images list failed: {proc.stderr.strip()[-1000:]}")
        return [line.strip() for line in proc.stdout.splitlines() if line.strip()]

    def images(self, names: list[str]) -> dict[str, dict[str, object]]:
        """One root filesystem per image kubeadm lists; returns name -> {rootfs, config changes}."""
        images: dict[str, dict[str, object]] = {}
        for reference in names:
            repository = reference.rsplit(":", 1)[0].rsplit("/", 1)[-1]
            if repository == "pause":
                # the release's build/pause/linux/pause.c, at the tag kubeadm asks for
                self.pause_image(self.module_source(), reference.rsplit(":", 1)[1])
                images[reference] = {"rootfs": "images/pause.tar", "changes": ['ENTRYPOINT ["/pause"]']}
                continue
            binary = IMAGE_BINARIES.get(repository)
            if binary is None:
                raise BuildError(
                    f"kubeadm lists {reference}, which this build does not make (addons must be off)"
                )
            target = self.entry / "images" / f"{repository}.tar"
            if not target.is_file():
                with tempfile.TemporaryDirectory() as tmp:
                    root = Path(tmp)
                    (root / "usr/local/bin").mkdir(parents=True)
                    (root / "tmp").mkdir(mode=0o1777)
                    (root / "tmp").chmod(0o1777)
                    shutil.copy2(self.entry / "bin" / binary, root / "usr/local/bin" / binary)
                    _write_tar(root, target)
            images[reference] = {"rootfs": f"images/{repository}.tar", "changes": [f"ENV {IMAGE_PATH}"]}
        return images

    def write_module_manifest(
        self, images: dict[str, dict[str, object]], said: dict[str, str]
    ) -> dict[str, object]:
        files = sorted([*(self.entry / "bin").iterdir(), *(self.entry / "images").iterdir()])
        manifest: dict[str, object] = {
            "version": self.release.version,
            "git_version": f"v{self.release.version}",
            "etcd_version": self.release.etcd_version,
            "source": "go modules",
            "go": subprocess.run(
                [self.go, "version"], capture_output=True, text=True, check=False
            ).stdout.strip(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "step_seconds": self.timings,
            "binary_versions": said,
            "kubeadm_images": images,
            "files": [str(p.relative_to(self.entry)) for p in files if not p.name.startswith(".")],
            "sha256": {p.name: file_sha256(p) for p in files if not p.name.startswith(".")},
        }
        tmp = self.entry / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.rename(self.entry / MANIFEST)
        return manifest


def missing_requirements(version: str) -> list[str]:
    """What a build of ``version`` lacks here (empty: it can run)."""
    missing = []
    release = gomod.module_builds().get(version)
    if release is None:
        missing.append(
            f"committed go.mod/go.sum for Kubernetes {version} under {gomod.GOMOD_DIR} "
            f"(have: {', '.join(gomod.module_builds()) or 'none'}; make them with "
            f"`python -m gpufleet_harness.cluster.gomod {version}`)"
        )
    if gomod.find_go((1, 0, 0)) is None:
        missing.append("a go command (Go >= 1.26 in /usr/local/go, or $GPUFLEET_GO)")
    for command, package in (("gcc", "gcc"), ("apt-get", "apt")):
        if shutil.which(command) is None:
            missing.append(f"command {command!r} ({package})")
    return missing


def ensure_module_build(
    version: str, root: str | os.PathLike[str] | None = None, *, build: bool = True, niceness: int = 10
) -> K8sArtifacts:
    """The cache entry of Kubernetes ``version`` (e.g. ``1.37.2``) built from its modules, building it if
    needed under a file lock (concurrent callers wait, then find it)."""
    version = version.removeprefix("v")
    base = cache_root(root)
    entry = base / "k8s" / version
    found = _load(entry)
    if found is not None:
        return found
    if not build:
        raise BuildError(f"no complete cache entry for kubernetes {version} under {base / 'k8s'}")
    missing = missing_requirements(version)
    if missing:
        raise BuildError(f"cannot build kubernetes {version}; missing: " + "; ".join(missing))
    release = gomod.module_builds()[version]
    with file_lock(base / "k8s" / f"{version}.lock"):
        found = _load(entry)
        if found is not None:
            return found
        started = time.monotonic()
        builder = _ModuleBuilder(release, entry, base, niceness)
        k8s_dir, etcd_dir = builder.module_dirs()
        builder.check_go(k8s_dir, etcd_dir)
        builder.download(k8s_dir, etcd_dir)
        builder.compile_all(k8s_dir, etcd_dir)
        said = builder.versions()
        images = builder.images(builder.kubeadm_images())
        builder.busybox_image()
        builder.timings["total"] = round(time.monotonic() - started, 1)
        manifest = builder.write_module_manifest(images, said)
        log.info(
            "kubernetes %s built from modules in %.1fs into %s", version, builder.timings["total"], entry
        )
        return K8sArtifacts(version, entry, manifest)
