"""Build Kubernetes 1.20 from Debian's ``kubernetes`` source package into a version-keyed cache.

The test cluster needs kube-apiserver, kube-scheduler, kube-controller-manager, kubelet (CRI, or its built-in
dockershim) and kubectl, plus the root filesystems of two images (pause, busybox) because the build
machines reach no container registry. Debian ships the 1.20 source with a full ``vendor/`` tree but only
the client as a binary package, so the servers are compiled here, once per source version::

    ${GPUFLEET_CACHE:-/var/cache/gpufleet}/k8s/<debian-version>/
        bin/            the five binaries
        images/         pause.tar, busybox.tar (root filesystems, imported into a node's runtime)
        manifest.json   written last: its presence marks the entry complete
        src/, gopath/   the unpacked tree (kept for rebuilds; ``--prune`` removes it)
        logs/           one log per build step
    ${GPUFLEET_CACHE}/go-build   GOCACHE shared by all versions

Three fixes make Debian's tree build with Debian's Go 1.19 (TESTING.md (e)): GOPATH mode instead of
module mode, ``make generated_files`` first, and the vendored reflect2 1.0.1 swapped for Debian's 1.0.2.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

from gpufleet_harness.cluster.gomod import is_module_version
from gpufleet_harness.cluster.k8s_cache import (
    COMPONENTS,
    MANIFEST,
    BuildError,
    K8sArtifacts,
    StepBuilder,
    _key,
    _load,
    cache_root,
    file_sha256,
)
from gpufleet_harness.cluster.k8s_modbuild import ensure_module_build
from gpufleet_harness.cluster.process import file_lock

log = logging.getLogger(__name__)

SOURCE_PACKAGE = "kubernetes"
# The newest upstream release built from its Go modules (k8s_modbuild): the kubeadm cluster's, and what
# GPUFLEET_K8S_VERSION=1.37.2 runs the test cluster and its tests on.
NEWEST_K8S_VERSION = "1.37.2"
# Shorthand for this module's build: Debian's `kubernetes` source, 1.20.2 on Debian 12 (apt's newest source
# version, else the newest complete Debian-source entry in the cache).
DEBIAN_K8S = "1.20"
# The Kubernetes the test cluster, the cluster tests and `gpufleet cluster build` use unless told otherwise
# (argument, or $GPUFLEET_K8S_VERSION=1.20 for Debian's 1.20, which the same code still runs: every flag and
# format that differs is chosen by the build's minor version).
DEFAULT_K8S_VERSION = NEWEST_K8S_VERSION
# Debian's golang-github-modern-go-reflect2-dev: 1.0.2 works with Go >= 1.18, the vendored 1.0.1 does not.
REFLECT2_DIR = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
REFLECT2_OBSOLETE = ("go_above_17.go", "go_below_17.go", "go_below_19.go")
# Upstream commits of the releases Debian has packaged, for `version` output (`gitCommit`).
UPSTREAM_COMMITS = {"1.20.2": "faecb196815e248d3ecfb03c680a4507229c2a56"}

# What a cold build needs on the machine: command -> Debian package that provides it.
BUILD_COMMANDS = {
    "apt-get": "apt",
    "dpkg-source": "dpkg-dev",
    "go": "golang-go",
    "make": "make",
    "gcc": "gcc",
    "rsync": "rsync",
    "jq": "jq",
}


def upstream_version(debian_version: str) -> str:
    """``1.20.5+really1.20.2-1.1+deb12u1`` -> ``1.20.2`` (Debian's "+really" marks a downgrade)."""
    upstream = debian_version.split(":", 1)[-1].rsplit("-", 1)[0]
    match = re.search(r"really([0-9][0-9.]*)", upstream)
    return match.group(1) if match else re.sub(r"[+~].*", "", upstream)


def available_source_version() -> str | None:
    """Newest version of the ``kubernetes`` source package apt knows (deb-src needed), or None."""
    try:
        out = subprocess.run(
            ["apt-cache", "showsrc", SOURCE_PACKAGE], capture_output=True, text=True, check=False
        ).stdout
    except FileNotFoundError:
        return None
    versions = [line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Version:")]
    if not versions:
        return None
    newest = versions[0]
    for candidate in versions[1:]:
        newer = subprocess.run(["dpkg", "--compare-versions", candidate, "gt", newest], check=False)
        if newer.returncode == 0:
            newest = candidate
    return newest


def cached(version: str | None = None, root: str | os.PathLike[str] | None = None) -> K8sArtifacts | None:
    """The complete cache entry for ``version`` (default: newest complete one), or None."""
    base = cache_root(root) / "k8s"
    if version:
        candidates = [base / _key(version.removeprefix("v") if is_module_version(version) else version)]
    else:
        # Without a version: the newest Debian-source entry (the default line), module builds only by name.
        candidates = sorted(
            (p for p in base.glob("*/") if not is_module_version(p.name)), key=os.path.getmtime
        )
    for entry in reversed(candidates):
        artifacts = _load(entry)
        if artifacts is not None:
            return artifacts
    return None


def missing_build_requirements() -> list[str]:
    """Human-readable list of what a cold build lacks on this machine (empty when it can run)."""
    missing = [
        f"command {cmd!r} (apt package {pkg})" for cmd, pkg in BUILD_COMMANDS.items() if not shutil.which(cmd)
    ]
    if not (REFLECT2_DIR / "reflect2.go").is_file():
        missing.append(f"{REFLECT2_DIR} (apt package golang-github-modern-go-reflect2-dev)")
    if available_source_version() is None:
        missing.append(
            "the 'kubernetes' source package: enable deb-src for bookworm in apt and run apt-get update"
        )
    return missing


class _Builder(StepBuilder):
    """A build of Debian's ``kubernetes`` source (1.20): fetch, patch, generate, compile in GOPATH mode."""

    def fetch_source(self) -> Path:
        """``apt-get source kubernetes=<version>`` into src/ (once) and return the unpacked tree."""
        src = self.entry / "src"
        trees = [p for p in src.glob(f"{SOURCE_PACKAGE}-*") if p.is_dir()] if src.is_dir() else []
        if not trees:
            src.mkdir(parents=True, exist_ok=True)
            self.run(
                "apt-source",
                [
                    "apt-get",
                    "-o",
                    "APT::Sandbox::User=root",
                    "source",
                    "-q",
                    f"{SOURCE_PACKAGE}={self.version}",
                ],
                src,
                self.env(),
            )
            trees = [p for p in src.glob(f"{SOURCE_PACKAGE}-*") if p.is_dir()]
        if len(trees) != 1:
            raise BuildError(f"expected one unpacked source tree in {src}, found {trees}")
        return trees[0]

    def swap_reflect2(self, tree: Path) -> None:
        """Replace vendored reflect2 1.0.1 (crashes kube-apiserver on Go >= 1.18) with Debian's 1.0.2."""
        vendored = tree / "vendor/github.com/modern-go/reflect2"
        if not (vendored / "go_above_17.go").exists():
            return
        for name in REFLECT2_OBSOLETE:
            (vendored / name).unlink(missing_ok=True)
        for src in REFLECT2_DIR.iterdir():
            if src.suffix in (".go", ".s"):
                shutil.copy2(src, vendored / src.name)
        modules = tree / "vendor/modules.txt"
        text = modules.read_text()
        # Keep the module list truthful (GOPATH mode ignores it): the tree pins 1.0.1 via a replace line.
        modules.write_text(
            re.sub(r"^(# github\.com/modern-go/reflect2\b.*)v1\.0\.1$", r"\g<1>v1.0.2", text, flags=re.M)
        )
        log.info("vendored reflect2 swapped for Debian's copy from %s", REFLECT2_DIR)

    def generate(self, tree: Path) -> None:
        """``make generated_files`` (openapi definitions, bindata): not shipped in the tarball."""
        if (tree / "pkg/generated/openapi/zz_generated.openapi.go").is_file():
            return
        self.run("generated_files", ["make", "generated_files"], tree, self.env())

    def gopath(self, tree: Path) -> Path:
        """A GOPATH whose ``src/k8s.io/kubernetes`` is the tree (module mode fails on this tree)."""
        gopath = self.entry / "gopath"
        link = gopath / "src/k8s.io/kubernetes"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(tree)
        return gopath

    def ldflags(self, tree: Path) -> str:
        """Strip symbols and stamp the version as upstream's hack/lib/version.sh would."""
        upstream = upstream_version(self.version)
        stamp = subprocess.run(
            ["dpkg-parsechangelog", "-STimestamp"], cwd=tree, capture_output=True, text=True, check=False
        ).stdout.strip()
        build_date = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(int(stamp) if stamp.isdigit() else 0))
        major, minor = upstream.split(".")[:2]
        values = {
            "gitVersion": f"v{upstream}",
            "gitMajor": major,
            "gitMinor": minor,
            "gitCommit": UPSTREAM_COMMITS.get(upstream, ""),
            "gitTreeState": "clean",
            "buildDate": build_date,
        }
        flags = ["-s", "-w"]
        for pkg in ("k8s.io/component-base/version", "k8s.io/client-go/pkg/version"):
            flags += [f"-X k8s.io/kubernetes/vendor/{pkg}.{k}={v}" for k, v in values.items()]
        return " ".join(flags)

    def compile(self, tree: Path, components: Sequence[str]) -> None:
        """``go build`` each component in GOPATH mode into bin/."""
        gopath = self.gopath(tree)
        env = self.env() | {"GOPATH": str(gopath), "GO111MODULE": "off"}
        ldflags = self.ldflags(tree)
        bindir = self.entry / "bin"
        bindir.mkdir(parents=True, exist_ok=True)
        for name in components:
            if (bindir / name).is_file():
                continue
            out = bindir / f".{name}.tmp"
            self.run(
                f"build-{name}",
                [
                    "go",
                    "build",
                    "-tags",
                    "selinux,notest",
                    "-trimpath",
                    "-ldflags",
                    ldflags,
                    "-o",
                    out,
                    f"./cmd/{name}",
                ],
                gopath / "src/k8s.io/kubernetes",
                env,
            )
            out.rename(bindir / name)

    def write_manifest(self, tree: Path) -> dict[str, object]:
        manifest: dict[str, object] = {
            "debian_version": self.version,
            "git_version": f"v{upstream_version(self.version)}",
            "go": subprocess.run(
                ["go", "version"], capture_output=True, text=True, check=False
            ).stdout.strip(),
            "source_tree": str(tree),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "step_seconds": self.timings,
            "sha256": {
                p.name: file_sha256(p)
                for p in sorted([*(self.entry / "bin").iterdir(), *(self.entry / "images").iterdir()])
                if not p.name.startswith(".")
            },
        }
        tmp = self.entry / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.rename(self.entry / MANIFEST)
        return manifest


def resolve_version(version: str | None = None) -> str | None:
    """The version :func:`ensure_k8s` builds or finds for ``version``: the argument, else
    ``$GPUFLEET_K8S_VERSION``, else :data:`DEFAULT_K8S_VERSION`; :data:`DEBIAN_K8S` becomes apt's newest
    ``kubernetes`` source version (None without deb-src: then the newest Debian-source cache entry)."""
    version = version or os.environ.get("GPUFLEET_K8S_VERSION") or DEFAULT_K8S_VERSION
    return available_source_version() if version == DEBIAN_K8S else version


def ensure_k8s(
    version: str | None = None,
    root: str | os.PathLike[str] | None = None,
    *,
    build: bool = True,
    niceness: int = 10,
    prune: bool = False,
) -> K8sArtifacts:
    """Return the cached binaries for ``version``, building them if needed.

    ``version`` defaults to ``$GPUFLEET_K8S_VERSION``, else :data:`DEFAULT_K8S_VERSION`. An upstream release
    number (``1.37.2``, ``v1.37.2``) selects the build from Go modules
    (:mod:`gpufleet_harness.cluster.k8s_modbuild`); :data:`DEBIAN_K8S` (``1.20``: apt's newest source) or a
    Debian version (``1.20.5+really1.20.2-1.1+deb12u1``) the build from Debian's source package.

    Raises :class:`BuildError` naming what is missing when the cache is empty and the build cannot run
    (or ``build`` is False).
    """
    version = resolve_version(version)
    if version is not None and is_module_version(version):
        return ensure_module_build(version, root, build=build, niceness=niceness)
    if version is None:
        found = cached(root=root)
        if found is not None:
            return found
        raise BuildError("no cached Kubernetes build and " + "; ".join(missing_build_requirements()))
    found = cached(version, root)
    if found is not None:
        return found
    if not build:
        raise BuildError(f"no complete cache entry for kubernetes {version} under {cache_root(root) / 'k8s'}")
    missing = missing_build_requirements()
    if missing:
        raise BuildError(f"cannot build kubernetes {version}; missing: " + "; ".join(missing))
    base = cache_root(root)
    entry = base / "k8s" / _key(version)
    with file_lock(base / "k8s" / f"{_key(version)}.lock"):
        found = cached(version, root)  # another process may have finished while we waited
        if found is not None:
            return found
        started = time.monotonic()
        builder = _Builder(version, entry, base / "go-build", niceness)
        tree = builder.fetch_source()
        builder.swap_reflect2(tree)
        builder.generate(tree)
        builder.compile(tree, COMPONENTS)
        builder.pause_image(tree)
        builder.busybox_image()
        builder.timings["total"] = round(time.monotonic() - started, 1)
        manifest = builder.write_manifest(tree)
        if prune:
            shutil.rmtree(entry / "gopath", ignore_errors=True)
            shutil.rmtree(entry / "src", ignore_errors=True)
        log.info("kubernetes %s built in %.1fs into %s", version, builder.timings["total"], entry)
        return K8sArtifacts(version, entry, manifest)
