"""The gpufleet container image for the test cluster and the lab: Debian minbase + python3 + gpufleet and
its runtime deps.

Neither has a registry, so images are tarballs imported into a node's container runtime. One image
serves every in-cluster piece the Ansible modules deploy and the validation suites run:

- ``ENTRYPOINT python3 -m gpufleet.deviceplugin``: the device plugin DaemonSet (args ``--config ...``);
- ``gpufleet-extender`` on PATH: the scheduler extender Deployment (``command: [gpufleet-extender, serve]``);
- ``gpufleet-sim-burn`` on PATH: keeps the pod's GPUs busy while it runs (the simulator's workloads).
- ``nvidia-smi`` on PATH: the GPU simulator's ``gpufleet-sim-smi`` for workload pods. NVML comes from the
  simulated ``libnvidia-ml.so.1`` of a sim root that the pod mounts (hostPath) and names in
  ``LD_LIBRARY_PATH`` / ``GPUFLEET_SIM_ROOT``, as the NVIDIA container toolkit would mount the real driver.
  The wrapper also plays the toolkit's device filtering: it passes ``NVIDIA_VISIBLE_DEVICES`` (set by the
  device plugin's Allocate) to ``-i``, so a pod lists only the GPUs it was given. The device nodes a pod
  sees (``/dev/nvidiaN``) are the kubelet's and the container runtime's real work, not the wrapper's.

Build, cached by content::

    image = ensure_lab_image()            # $GPUFLEET_CACHE/lab-images/<key>/image.tar
    name = load_into(node, image)         # into a KubeletNode's containerd or dockerd (skipped if present)

Three cache levels: the debootstrap base (``base-<key>.tar``: suite, mirror, packages), the Python
packages layer (``deps-<key>.tar``: the runtime distributions copied from this interpreter's
site-packages, with bytecode compiled here), and the image (``<key>/image.tar``: base + deps + gpufleet's
sources + wrappers). Editing gpufleet redoes only the last, cheap step; the newest few images are kept.
The packages are copied rather than downloaded, so the image's python3 (Debian bookworm: 3.11) must have
the same major.minor as the interpreter running the build, which is checked. Bytecode is hash-based and
unchecked: without it each container start compiles the kubernetes client anew (seconds of CPU and more
than the plugin's 128 MiB memory limit).
"""

from __future__ import annotations

import hashlib
import io
import json
import py_compile
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

import gpufleet
import gpufleet_harness
from gpufleet_harness.cluster.k8s_cache import cache_root
from gpufleet_harness.cluster.process import ClusterError, file_lock
from gpufleet_harness.testhosts.images import apt_mirror

if TYPE_CHECKING:
    from gpufleet_harness.cluster.node import KubeletNode

# Bump when the steps below change in a way the keys do not capture (base: debootstrap; builder: the rest).
BASE_REVISION = 1
BUILDER_REVISION = 2
KEEP_IMAGES = 3  # image entries kept in the cache (the newest); bases and deps layers are kept
IMAGE_REPOSITORY = "gpufleet-lab/gpufleet"
SUITE = "bookworm"
BASE_PACKAGES = ("python3",)
# What the in-cluster programs import at run time (not ansible, not testinfra): their closure is copied.
RUNTIME_REQUIREMENTS = ("grpcio", "protobuf", "nvidia-ml-py", "PyYAML", "kubernetes")
SITE_DIR = "/opt/gpufleet/site-packages"
# Trimmed from the base: documentation, locales and apt's state are dead weight in an image.
_TRIM = (
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "var/cache/apt",
    "var/lib/apt/lists",
)

NVIDIA_SMI_WRAPPER = """#!/bin/sh
# gpufleet lab image: nvidia-smi is the GPU simulator's stand-in (gpufleet-sim-smi). In place of the
# NVIDIA container toolkit, which would show a container only its GPUs, pass NVIDIA_VISIBLE_DEVICES
# (from the device plugin's Allocate) on as -i. `topo` takes no -i; the caller filters the matrix.
# Under CDI the specification sets NVIDIA_VISIBLE_DEVICES=void and gives the container its GPUs' device
# nodes (and the driver's libraries through its ldcache hook): as the driver does, the container then sees
# the GPUs whose /dev/nvidia<minor> it has, and NVML is the simulated machine's library.
case "${NVIDIA_VISIBLE_DEVICES:-all}" in
  all|"") exec python3 -m gpufleet_harness.sim.smi "$@" ;;
  none|void)
    : "${GPUFLEET_SIM_ROOT:=/etc/gpufleet-sim}"
    : "${LD_LIBRARY_PATH:=$GPUFLEET_SIM_ROOT/lib}"
    : "${GPUFLEET_HOST_ROOT:=$GPUFLEET_SIM_ROOT/host}"
    export GPUFLEET_SIM_ROOT LD_LIBRARY_PATH GPUFLEET_HOST_ROOT
    NVIDIA_VISIBLE_DEVICES=$(python3 -c 'if True:
        import glob, json, os
        minors = {int(p[11:]) for p in glob.glob("/dev/nvidia[0-9]*") if p[11:].isdigit()}
        try:
            with open(os.path.join(os.environ["GPUFLEET_SIM_ROOT"], "machine.json")) as fh:
                gpus = json.load(fh)["gpus"]
        except (OSError, ValueError, KeyError):
            gpus = []
        print(",".join(g["uuid"] for g in gpus if g.get("minor") in minors))' 2>/dev/null)
    [ -n "$NVIDIA_VISIBLE_DEVICES" ] || { echo "No devices were found"; exit 6; } ;;
esac
case "$1" in
  topo) exec python3 -m gpufleet_harness.sim.smi "$@" ;;
  *) exec python3 -m gpufleet_harness.sim.smi -i "$NVIDIA_VISIBLE_DEVICES" "$@" ;;
esac
"""


def cache_dir() -> Path:
    """Where lab images are cached: ``lab-images/`` in the lab's cache (``$GPUFLEET_CACHE``)."""
    return cache_root() / "lab-images"


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


# -- what goes in ----------------------------------------------------------------------------------
def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def runtime_distributions(roots: Iterable[str] = RUNTIME_REQUIREMENTS) -> list[metadata.Distribution]:
    """Installed distributions ``roots`` need at run time (their closure; extras and markers evaluated)."""
    from packaging.requirements import Requirement

    found: dict[str, metadata.Distribution] = {}
    pending = list(roots)
    while pending:
        name = _canonical(pending.pop())
        if name in found:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            raise ClusterError(f"lab image: {name} is not installed in {sys.prefix}") from None
        found[name] = dist
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            pending.append(req.name)
    return sorted(found.values(), key=lambda d: _canonical(d.metadata["Name"]))


def _package_files(root: Path) -> list[Path]:
    return sorted(
        p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )


def _image_sources() -> list[tuple[Path, str]]:
    """The files the image carries with their paths below site-packages: the product package, and of the
    harness the simulator's nvidia-smi stand-in (the node's NVML is the simulator)."""
    product = Path(gpufleet.__file__).parent
    harness = Path(gpufleet_harness.__file__).parent
    files = [(path, f"gpufleet/{path.relative_to(product)}") for path in _package_files(product)]
    files.append((harness / "__init__.py", "gpufleet_harness/__init__.py"))
    for path in _package_files(harness / "sim"):
        files.append((path, f"gpufleet_harness/{path.relative_to(harness)}"))
    return files


@dataclass(frozen=True)
class ImageSpec:
    """What the image is built from; ``key`` names it, ``base_key`` names the debootstrap step."""

    suite: str = SUITE
    mirror: str = field(default_factory=apt_mirror)
    packages: tuple[str, ...] = BASE_PACKAGES
    requirements: tuple[str, ...] = RUNTIME_REQUIREMENTS

    def base_key(self) -> str:
        """Key of the debootstrap base."""
        return _digest(
            {
                "suite": self.suite,
                "mirror": self.mirror,
                "packages": sorted(self.packages),
                "rev": BASE_REVISION,
            }
        )

    def deps_key(self) -> str:
        """Key of the Python packages layer (names and versions, and the interpreter that compiles them)."""
        dists = [f"{d.metadata['Name']}=={d.version}" for d in runtime_distributions(self.requirements)]
        return _digest({"dists": dists, "python": sys.implementation.cache_tag, "rev": BUILDER_REVISION})

    def key(self) -> str:
        """Key of the whole image: base, Python distributions, gpufleet's sources, the wrappers."""
        sources = hashlib.sha256()
        for path, rel in _image_sources():
            sources.update(rel.encode() + b"\0" + path.read_bytes())
        return _digest(
            {
                "base": self.base_key(),
                "deps": self.deps_key(),
                "gpufleet": sources.hexdigest(),
                "wrapper": NVIDIA_SMI_WRAPPER,
            }
        )


@dataclass
class LabImage:
    """A built image tarball: ``name`` is what pods reference (``imagePullPolicy: Never``)."""

    key: str
    tarball: Path
    timings: dict[str, float]

    @property
    def name(self) -> str:
        return f"{IMAGE_REPOSITORY}:{self.key[:12]}"


# -- build -----------------------------------------------------------------------------------------
def _build_base(spec: ImageSpec, out: Path) -> None:
    """debootstrap minbase + the packages, trimmed, as an uncompressed tarball at ``out``."""
    if not shutil.which("debootstrap"):
        raise ClusterError("lab image: debootstrap is missing (apt-get install debootstrap)")
    with tempfile.TemporaryDirectory(prefix="gpufleet-image-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        proc = subprocess.run(
            [
                "debootstrap",
                "--variant=minbase",
                f"--include={','.join(spec.packages)}",
                spec.suite,
                str(rootfs),
                spec.mirror,
            ],
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
            raise ClusterError(f"lab image: debootstrap {spec.suite} failed: {' | '.join(tail)}")
        for rel in _TRIM:
            shutil.rmtree(rootfs / rel, ignore_errors=True)
        (rootfs / "etc" / "machine-id").write_text("")
        partial = out.with_suffix(".partial")
        with tarfile.open(partial, "w") as tar:
            tar.add(rootfs, arcname=".")
        partial.rename(out)


def _python_version(base_tar: Path) -> str:
    """major.minor of the python3 in the base (from its /usr/lib/python3.X directory)."""
    with tarfile.open(base_tar) as tar:
        for member in tar:
            match = re.fullmatch(r"\./usr/lib/python(3\.\d+)/os\.py", member.name)
            if match:
                return match.group(1)
    raise ClusterError(f"lab image: no python3 standard library in {base_tar}")


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, int(time.time())
    tar.addfile(info, io.BytesIO(data))


def _compiled(source: Path, arcname: str) -> bytes:
    """Bytecode of ``source`` as the image's python3 will look for it (hash-based, never re-checked): without
    it every container start would compile the kubernetes client again, which costs seconds and memory."""
    with tempfile.NamedTemporaryFile(suffix=".pyc") as out:
        py_compile.compile(
            str(source),
            cfile=out.name,
            dfile="/" + arcname.lstrip("./"),
            doraise=True,
            invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH,
        )
        return Path(out.name).read_bytes()


def _add_python_file(tar: tarfile.TarFile, source: Path, arcname: str) -> None:
    """A file, plus its __pycache__ entry when it is Python source."""
    tar.add(source, arcname=arcname)
    if source.suffix == ".py":
        try:
            code = _compiled(source, arcname)
        except py_compile.PyCompileError:
            return  # e.g. Python 2 leftovers in a distribution: never imported
        tag = sys.implementation.cache_tag
        directory, name = arcname.rsplit("/", 1)
        _add_bytes(tar, f"{directory}/__pycache__/{name[:-3]}.{tag}.pyc", code)


def _build_deps_layer(spec: ImageSpec, out: Path) -> None:
    """The runtime distributions (files and bytecode) as a tarball to append to the base."""
    site = SITE_DIR.lstrip("/")
    partial = out.with_suffix(".partial")
    with tarfile.open(partial, "w") as tar:
        for dist in runtime_distributions(spec.requirements):
            for rel in dist.files or []:
                source = Path(str(dist.locate_file(rel)))
                if "__pycache__" in rel.parts or rel.parts[0] == ".." or not source.is_file():
                    continue  # console scripts live outside site-packages; bytecode is made here
                _add_python_file(tar, source, f"./{site}/{rel}")
    partial.rename(out)


def _add_overlay(tar: tarfile.TarFile, deps: Path) -> None:
    """The deps layer, gpufleet itself and the command wrappers, appended to the base."""
    with tarfile.open(deps) as layer:
        for member in layer:
            tar.addfile(member, layer.extractfile(member) if member.isfile() else None)
    site = SITE_DIR.lstrip("/")
    for path, rel in _image_sources():
        _add_python_file(tar, path, f"./{site}/{rel}")
    wrappers = {
        "nvidia-smi": NVIDIA_SMI_WRAPPER,
        "gpufleet-extender": '#!/bin/sh\nexec python3 -m gpufleet.extender "$@"\n',
        "gpufleet-device-plugin": '#!/bin/sh\nexec python3 -m gpufleet.deviceplugin "$@"\n',
        "gpufleet-sim-smi": '#!/bin/sh\nexec python3 -m gpufleet_harness.sim.smi "$@"\n',
        # a GPU burner for test pods: their GPUs show busy while it runs (docs/simulator.md, "Workloads")
        "gpufleet-sim-burn": '#!/bin/sh\nexec python3 -m gpufleet_harness.sim.burn "$@"\n',
    }
    for name, text in wrappers.items():
        _add_bytes(tar, f"./usr/local/bin/{name}", text.encode(), 0o755)


def ensure_lab_image(spec: ImageSpec | None = None, *, build: bool = True) -> LabImage:
    """The image tarball for ``spec``, built (and cached by key) if missing; ``build=False`` never builds."""
    spec = spec or ImageSpec()
    key, base_key = spec.key(), spec.base_key()
    root = cache_dir()
    entry = root / key
    manifest = entry / "manifest.json"
    with file_lock(root / f"{key}.lock"):
        if manifest.exists():
            return LabImage(key, entry / "image.tar", json.loads(manifest.read_text())["timings"])
        if not build:
            raise ClusterError(
                f"lab image {key} is not built (run gpufleet_harness.cluster.images.ensure_lab_image())"
            )
        timings: dict[str, float] = {}
        base = root / f"base-{base_key}.tar"
        started = time.monotonic()
        with file_lock(root / f"base-{base_key}.lock"):
            if not base.exists():
                _build_base(spec, base)
                timings["debootstrap"] = round(time.monotonic() - started, 1)
        have, want = _python_version(base), f"{sys.version_info.major}.{sys.version_info.minor}"
        if have != want:
            raise ClusterError(
                f"lab image: {spec.suite}'s python3 is {have} but the packages come from Python {want}"
            )
        step = time.monotonic()
        deps = root / f"deps-{spec.deps_key()}.tar"
        with file_lock(root / f"deps-{spec.deps_key()}.lock"):
            if not deps.exists():
                _build_deps_layer(spec, deps)
                timings["python packages + bytecode"] = round(time.monotonic() - step, 1)
        step = time.monotonic()
        entry.mkdir(parents=True, exist_ok=True)
        partial = entry / "image.tar.partial"
        shutil.copyfile(base, partial)
        with tarfile.open(partial, "a") as tar:
            _add_overlay(tar, deps)
        partial.rename(entry / "image.tar")
        timings["overlay"] = round(time.monotonic() - step, 1)
        timings["total"] = round(time.monotonic() - started, 1)
        manifest.write_text(
            json.dumps({"key": key, "base_key": base_key, "suite": spec.suite, "timings": timings}, indent=1)
        )
        _prune(root, keep=key)
        return LabImage(key, entry / "image.tar", timings)


def _prune(root: Path, keep: str) -> None:
    """Remove all but the newest KEEP_IMAGES image entries (never ``keep``)."""
    entries = sorted(
        (p for p in root.iterdir() if p.is_dir() and (p / "manifest.json").exists() and p.name != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for old in entries[KEEP_IMAGES - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
        (root / f"{old.name}.lock").unlink(missing_ok=True)


# `docker import --change` arguments that make the tarball a runnable image.
IMPORT_CHANGES = (
    "-c", f"ENV PYTHONPATH={SITE_DIR} PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1",
    "-c", "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "-c", 'ENTRYPOINT ["python3", "-m", "gpufleet.deviceplugin"]',
)  # fmt: skip


def load_into(node: KubeletNode, image: LabImage) -> str:
    """Import the image into ``node``'s container runtime unless it is there; return the image name."""
    if not node.has_image(image.name):
        node.load_image(image.name, image.tarball, IMPORT_CHANGES)
    return image.name


def main() -> int:
    """``python -m gpufleet_harness.cluster.images``: build (or find) the image and print its name, path and
    timings."""
    started = time.monotonic()
    image = ensure_lab_image()
    print(
        json.dumps(
            {
                "name": image.name,
                "tarball": str(image.tarball),
                "build_timings": image.timings,
                "seconds": round(time.monotonic() - started, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
