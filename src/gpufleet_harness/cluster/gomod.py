"""The project's own ``go.mod`` files that build Kubernetes and etcd from their Go modules, by version.

``k8s.io/kubernetes`` cannot be built with ``go install ...@version``: its go.mod requires its staging
modules (``k8s.io/api``, ``k8s.io/apiserver`` ...) at ``v0.0.0`` and replaces them with directories of its
own repository, which a module download does not carry. A small main module of ours requires
``k8s.io/kubernetes`` at the release and pins every staging module it requires to the matching published
``v0.<minor>.<patch>`` by ``replace`` (the way out-of-tree schedulers build kube-scheduler); the programs to
build are ``tool`` lines, so ``go mod tidy`` keeps their whole import graph in go.sum. etcd gets a main
module of its own, so it builds with the dependencies etcd's release chose, not those Kubernetes' graph
would raise them to.

The files are committed (``gomod/kubernetes-<version>/``, ``gomod/etcd-<version>/``): go.sum then pins
every module's hash, so a build verifies what the proxy serves against what was reviewed. Regenerate for
another release with ``python -m gpufleet_harness.cluster.gomod KUBERNETES_VERSION ETCD_VERSION`` (network:
the Go module proxy), which reads the release's own go.mod with ``go mod edit -json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

GOMOD_DIR = Path(__file__).resolve().parent / "gomod"
KUBERNETES_MODULE = "k8s.io/kubernetes"
ETCD_MODULE = "go.etcd.io/etcd/server/v3"  # its root package is etcd's main (server/main.go)
# What the test cluster and the lab run, from k8s.io/kubernetes/cmd/<name>; kubectl comes from the same
# release, so its skew is 0.
KUBERNETES_COMMANDS = (
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubelet",
    "kubeadm",
    "kubectl",
)
# kubeadm's DefaultEtcdVersion (cmd/kubeadm/app/constants) for each Kubernetes minor built here: the etcd
# release `kubeadm init` would pull as registry.k8s.io/etcd:<version>-0.
ETCD_FOR_MINOR = {"1.37": "3.7.0"}


class GoModError(RuntimeError):
    """A go command failed or a go.mod is not what was expected; the message names which and why."""


@dataclass(frozen=True)
class ModuleBuild:
    """The committed main modules of one Kubernetes release: ``kubernetes`` and ``etcd`` directories."""

    version: str  # e.g. 1.37.2
    etcd_version: str  # e.g. 3.7.0

    @property
    def kubernetes_dir(self) -> Path:
        return GOMOD_DIR / f"kubernetes-{self.version}"

    @property
    def etcd_dir(self) -> Path:
        return GOMOD_DIR / f"etcd-{self.etcd_version}"

    def complete(self) -> bool:
        return all(
            (d / f).is_file() for d in (self.kubernetes_dir, self.etcd_dir) for f in ("go.mod", "go.sum")
        )


def module_builds() -> dict[str, ModuleBuild]:
    """Kubernetes versions that have committed main modules, e.g. ``{"1.37.2": ModuleBuild(...)}``."""
    found = {}
    for directory in sorted(GOMOD_DIR.glob("kubernetes-*")):
        version = directory.name.removeprefix("kubernetes-")
        etcd = ETCD_FOR_MINOR.get(".".join(version.split(".")[:2]))
        if etcd is not None and ModuleBuild(version, etcd).complete():
            found[version] = ModuleBuild(version, etcd)
    return found


def is_module_version(version: str) -> bool:
    """True for an upstream release (``1.37.2``, ``v1.37.2``) as opposed to a Debian source version."""
    return re.fullmatch(r"v?\d+\.\d+\.\d+", version) is not None


def go_env(cache: Path) -> dict[str, str]:
    """The environment every Go build of the harness shares: one module cache and one build cache under the
    harness's cache root, the toolchain on PATH (never a download: ``GOTOOLCHAIN=local``)."""
    env = dict(os.environ)
    env.update(
        GOCACHE=str(cache / "go-build"),
        GOMODCACHE=str(cache / "go-mod"),
        # writable module cache: `rm -rf` of the cache root works without a chmod first
        GOFLAGS="-modcacherw -buildvcs=false",
        GOTOOLCHAIN="local",
        GOWORK="off",
    )
    env.setdefault("HOME", str(cache))
    return env


# Where the project's machines have the Go toolchain the module builds need (Debian 12's golang-go is 1.19).
GO_CANDIDATES = ("/usr/local/go/bin/go",)


def find_go(minimum: tuple[int, int, int]) -> str | None:
    """A go command of at least ``minimum``: ``$GPUFLEET_GO``, else ``go`` on PATH, else /usr/local/go's;
    None when none is new enough."""
    candidates = [os.environ.get("GPUFLEET_GO") or "", shutil.which("go") or "", *GO_CANDIDATES]
    for go in filter(None, candidates):
        have = go_version(go)
        if have is not None and have >= minimum:
            return go
    return None


def go_version(go: str = "go") -> tuple[int, int, int] | None:
    """The version of ``go`` as a tuple (``go1.26.8`` -> (1, 26, 8)), or None when it is not there."""
    try:
        out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, check=False).stdout
    except FileNotFoundError:
        return None
    match = re.match(r"go(\d+)\.(\d+)(?:\.(\d+))?", out.strip())
    return (int(match[1]), int(match[2]), int(match[3] or 0)) if match else None


def parse_go_version(text: str) -> tuple[int, int, int]:
    """A go.mod ``go`` line (``1.26`` or ``1.26.0``) as a tuple."""
    parts = [int(p) for p in text.split(".")] + [0, 0]
    return (parts[0], parts[1], parts[2])


def read_gomod(path: Path, env: dict[str, str]) -> dict[str, object]:
    """A go.mod as the go command reads it (``go mod edit -json``)."""
    doc: dict[str, object] = json.loads(_go(["mod", "edit", "-json", str(path)], path.parent, env))
    return doc


def _go(args: list[str], cwd: Path, env: dict[str, str]) -> str:
    # the `tool` directive these go.mod files use is Go 1.24's
    go = find_go((1, 24, 0)) or "go"
    proc = subprocess.run([go, *args], cwd=cwd, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise GoModError(f"go {' '.join(args)} (in {cwd}) failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def staging_replacements(kubernetes_gomod: dict[str, object], version: str) -> dict[str, str]:
    """Module -> version for each staging module the release requires: those its go.mod requires at
    ``v0.0.0`` and replaces with a directory of the repository (``./staging/src/k8s.io/...``)."""
    local = {
        r["Old"]["Path"]
        for r in kubernetes_gomod.get("Replace") or []  # type: ignore[attr-defined]
        if str(r["New"]["Path"]).startswith("./staging/")
    }
    major, minor, patch = version.split(".")
    if major != "1":
        raise GoModError(f"kubernetes {version}: staging modules are versioned v0.<minor> only for 1.x")
    pinned = f"v0.{minor}.{patch}"
    return {
        r["Path"]: pinned
        for r in kubernetes_gomod.get("Require") or []  # type: ignore[attr-defined]
        if r["Path"] in local and r["Version"] == "v0.0.0"
    }


def _download_gomod(module: str, version: str, work: Path, env: dict[str, str]) -> Path:
    info = json.loads(_go(["mod", "download", "-json", f"{module}@{version}"], work, env))
    if "Error" in info:
        raise GoModError(f"{module}@{version}: {info['Error']}")
    return Path(info["GoMod"])


def _new_module(directory: Path, name: str, env: dict[str, str]) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    _go(["mod", "init", name], directory, env)


def generate(kubernetes_version: str, etcd_version: str, dest: Path = GOMOD_DIR) -> ModuleBuild:
    """Write (or rewrite) the main modules of one release under ``dest``; needs the Go module proxy."""
    kubernetes_version = kubernetes_version.removeprefix("v")
    etcd_version = etcd_version.removeprefix("v")
    build = ModuleBuild(kubernetes_version, etcd_version)
    with tempfile.TemporaryDirectory(prefix="gpufleet-gomod-") as tmp:
        env = go_env(Path(tmp)) | {"GOMODCACHE": os.environ.get("GOMODCACHE") or str(Path(tmp) / "mod")}
        upstream = read_gomod(
            _download_gomod(KUBERNETES_MODULE, f"v{kubernetes_version}", Path(tmp), env), env
        )
        k8s_dir = dest / build.kubernetes_dir.name
        _new_module(k8s_dir, "gpufleet.invalid/build/kubernetes", env)
        edits = [f"-go={upstream['Go']}", f"-require={KUBERNETES_MODULE}@v{kubernetes_version}"]
        # the release's own GODEBUG defaults: a main module's go.mod decides them for the binaries
        edits += [f"-godebug={d['Key']}={d['Value']}" for d in upstream.get("GoDebug") or []]  # type: ignore[attr-defined]
        edits += [
            f"-replace={m}={m}@{v}"
            for m, v in sorted(staging_replacements(upstream, kubernetes_version).items())
        ]
        edits += [f"-tool={KUBERNETES_MODULE}/cmd/{name}" for name in KUBERNETES_COMMANDS]
        _go(["mod", "edit", *edits], k8s_dir, env)
        _go(["mod", "tidy"], k8s_dir, env)

        etcd_upstream = read_gomod(_download_gomod(ETCD_MODULE, f"v{etcd_version}", Path(tmp), env), env)
        etcd_dir = dest / build.etcd_dir.name
        _new_module(etcd_dir, "gpufleet.invalid/build/etcd", env)
        _go(
            [
                "mod",
                "edit",
                f"-go={etcd_upstream['Go']}",
                f"-require={ETCD_MODULE}@v{etcd_version}",
                f"-tool={ETCD_MODULE}",
            ],
            etcd_dir,
            env,
        )
        _go(["mod", "tidy"], etcd_dir, env)
    return build


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m gpufleet_harness.cluster.gomod",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("kubernetes_version", help="e.g. 1.37.2 (go list -m -versions k8s.io/kubernetes)")
    parser.add_argument("etcd_version", nargs="?", help="default: kubeadm's etcd for that minor")
    parser.add_argument("--dest", type=Path, default=GOMOD_DIR)
    args = parser.parse_args(argv)
    minor = ".".join(args.kubernetes_version.removeprefix("v").split(".")[:2])
    etcd = args.etcd_version or ETCD_FOR_MINOR.get(minor)
    if etcd is None:
        parser.error(f"no etcd version known for Kubernetes {minor}: give one (kubeadm's DefaultEtcdVersion)")
    try:
        build = generate(args.kubernetes_version, etcd, args.dest)
    except GoModError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "kubernetes": str(args.dest / build.kubernetes_dir.name),
                "etcd": str(args.dest / build.etcd_dir.name),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
