"""Build ``vcsim-gpu`` (vcsim_gpu.go beside this file) from Debian's govmomi, once per key.

Debian bookworm's ``golang-github-vmware-govmomi-dev`` puts govmomi 0.24 (with its ``simulator``
package) under ``/usr/share/gocode``; Debian's Go builds against it in GOPATH mode. The binary is cached
like the Kubernetes build (:mod:`gpufleet_harness.cluster.k8s_build`), keyed by the govmomi package version
and a hash of our Go source::

    ${GPUFLEET_CACHE:-/var/cache/gpufleet}/vcsim/<govmomi-version>-<source-sha256[:12]>/
        vcsim-gpu       the binary
        build.log
        manifest.json   written last: its presence marks the entry complete
    ${GPUFLEET_CACHE}/go-build   GOCACHE shared with the Kubernetes build
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from gpufleet_harness.cluster.k8s_cache import cache_root
from gpufleet_harness.cluster.process import file_lock

log = logging.getLogger(__name__)

GO_SOURCE = Path(__file__).resolve().parent / "vcsim_gpu.go"
BINARY = "vcsim-gpu"
MANIFEST = "manifest.json"
GOVMOMI_PACKAGE = "golang-github-vmware-govmomi-dev"
GOCODE = Path("/usr/share/gocode")
SIMULATOR_DIR = GOCODE / "src/github.com/vmware/govmomi/simulator"
# Import path of our program inside the temporary GOPATH (GOPATH mode needs one).
IMPORT_PATH = "gpufleet.invalid/vcsimgpu"


class VcsimBuildError(RuntimeError):
    """The simulator cannot be built here; the message names what to install or the failing log."""


def govmomi_version() -> str | None:
    """Installed version of Debian's govmomi source package, or None when it is not installed."""
    try:
        proc = subprocess.run(
            ["dpkg-query", "-W", "-f=${Status}\t${Version}", GOVMOMI_PACKAGE],
            capture_output=True,
            text=True,
            check=False,
        )
    except FileNotFoundError:
        return None
    status, _, version = proc.stdout.partition("\t")
    if proc.returncode != 0 or "install ok installed" not in status or not SIMULATOR_DIR.is_dir():
        return None
    return version.strip()


def missing_requirements() -> list[str]:
    """What a build lacks on this machine, each with the apt package to install (empty: it can run)."""
    missing = []
    if shutil.which("go") is None:
        missing.append("command 'go' (apt-get install golang-go)")
    if govmomi_version() is None:
        missing.append(f"govmomi's simulator in {SIMULATOR_DIR} (apt-get install {GOVMOMI_PACKAGE})")
    return missing


def cache_key(version: str, source: bytes) -> str:
    """``<govmomi version>-<12 hex of the Go source's sha256>``, safe as a directory name."""
    return f"{version.replace(':', '_')}-{hashlib.sha256(source).hexdigest()[:12]}"


def ensure_vcsim(root: str | os.PathLike[str] | None = None, *, niceness: int = 10) -> Path:
    """Return the path of a built ``vcsim-gpu``, building it first when the cache has none for this key.

    Raises :class:`VcsimBuildError` naming the apt packages to install, or the build log's tail.
    """
    missing = missing_requirements()
    if missing:
        raise VcsimBuildError("cannot build the vCenter simulator; missing: " + "; ".join(missing))
    source = GO_SOURCE.read_bytes()
    version = govmomi_version() or ""
    base = cache_root(root)
    entry = base / "vcsim" / cache_key(version, source)
    binary = entry / BINARY
    if (entry / MANIFEST).is_file() and binary.is_file():
        return binary
    with file_lock(base / "vcsim" / f"{entry.name}.lock"):
        if (entry / MANIFEST).is_file() and binary.is_file():  # built by another process meanwhile
            return binary
        entry.mkdir(parents=True, exist_ok=True)
        started = time.monotonic()
        _go_build(source, binary, entry / "build.log", base / "go-build", niceness)
        seconds = round(time.monotonic() - started, 1)
        manifest = {
            "govmomi_package": f"{GOVMOMI_PACKAGE}={version}",
            "source_sha256": hashlib.sha256(source).hexdigest(),
            "go": subprocess.run(
                ["go", "version"], capture_output=True, text=True, check=False
            ).stdout.strip(),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": seconds,
        }
        tmp = entry / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.rename(entry / MANIFEST)
        log.info("vcsim-gpu built in %.1fs into %s", seconds, entry)
        return binary


def _go_build(source: bytes, binary: Path, logfile: Path, gocache: Path, niceness: int) -> None:
    """``go build`` in GOPATH mode: Debian's gocode first, then a temporary GOPATH holding our main."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-vcsim-gopath-") as tmp:
        package_dir = Path(tmp) / "src" / IMPORT_PATH
        package_dir.mkdir(parents=True)
        (package_dir / "main.go").write_bytes(source)
        env = dict(os.environ)
        env.update(
            GO111MODULE="off",
            GOPATH=f"{GOCODE}{os.pathsep}{tmp}",
            GOCACHE=str(gocache),
            GOFLAGS="",
            CGO_ENABLED="0",
            PWD=str(package_dir),
        )
        env.setdefault("HOME", tmp)
        out = binary.with_name(f".{binary.name}.tmp")
        with logfile.open("w") as log_out:
            proc = subprocess.run(
                ["go", "build", "-trimpath", "-o", str(out), "."],
                cwd=package_dir,
                env=env,
                stdout=log_out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=lambda: os.nice(niceness),
                check=False,
            )
        if proc.returncode != 0:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-30:])
            raise VcsimBuildError(
                f"go build of vcsim-gpu failed (exit {proc.returncode}), log {logfile}:\n{tail}"
            )
        out.rename(binary)
