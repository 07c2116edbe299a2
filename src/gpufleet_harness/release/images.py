"""The service images (device plugin, scheduler extender) as OCI archives: ``gpufleet release images --out
OUT`` (into OUT/images).

No registry is reachable where gpufleet is built, so nothing is pulled:

1. **Base.** debootstrap makes Debian 12 minbase + python3 (the lab image's cached root filesystem, the same
   key and file), and ``podman build`` of ``deploy/base/Containerfile`` turns it into one layer.
2. **Service.** A build context per service: ``site-packages/`` with gpufleet's own package and the
   distributions the service imports at run time (their closure, copied from this interpreter's environment,
   so the versions are the ones tested here), each ``.py`` with hash-based bytecode compiled here (the
   image's python3 is checked to have this interpreter's major.minor), and ``bin/`` with the service's
   command. ``podman build`` of ``deploy/<service>/Containerfile`` on the base.
3. **Archive.** ``podman save --format oci-archive``, rewritten by :func:`gpufleet.ociarchive.rewrite`
   (sorted, no times or owners; tag and digest names for containerd; docker's ``manifest.json``).

Every build runs with ``--timestamp 0 --pull=never --network=none``: the same inputs give the same digests,
and no step can reach the network. Archives are cached by a key of everything that goes in
(``$GPUFLEET_CACHE/service-images/``): a second build with nothing changed copies the cached archives.
``DIR/images.json`` names each archive with its name, manifest digest and image ID; role gpufleet_images reads
it (``gpufleet_images_dir``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gpufleet
from gpufleet import ociarchive
from gpufleet_harness.cluster import images as labimages
from gpufleet_harness.cluster.k8s_cache import cache_root, file_sha256
from gpufleet_harness.cluster.process import file_lock

REPO = Path(__file__).resolve().parents[3]
REVISION = 2  # bump when the steps change in a way the key does not capture
KEEP = 4  # cached archives kept per service (the newest)
REGISTRY_NAMESPACE = "docker.io/gpufleet"
SITE = "/opt/gpufleet/site-packages"
BASE_CONTAINERFILE = REPO / "deploy" / "base" / "Containerfile"
MANIFEST_NAME = "images.json"


@dataclass(frozen=True)
class Service:
    """One image: its Containerfile, the distributions it imports at run time, its command."""

    name: str
    containerfile: Path
    requirements: tuple[str, ...]
    module: str

    @property
    def image_name(self) -> str:
        return f"{REGISTRY_NAMESPACE}/{self.name}:{gpufleet.__version__}"

    @property
    def archive_name(self) -> str:
        return f"gpufleet-{self.name}-{gpufleet.__version__}.oci.tar"

    def wrapper(self) -> str:
        return f'#!/bin/sh\nexec python3 -m {self.module} "$@"\n'


SERVICES = {
    s.name: s
    for s in (
        # grpc for the kubelet's device plugin API, NVML, the kubernetes client for labels and GPU-memory pods
        Service(
            "device-plugin",
            REPO / "deploy" / "deviceplugin" / "Containerfile",
            ("grpcio", "protobuf", "nvidia-ml-py", "PyYAML", "kubernetes"),
            "gpufleet.deviceplugin",
        ),
        # the extender talks to the API server with urllib3 (gpufleet.extender.kube), set up by the kubernetes
        # client's kubeconfig and service-account loaders (gpufleet.kubeconfig)
        Service(
            "extender",
            REPO / "deploy" / "extender" / "Containerfile",
            ("PyYAML", "urllib3", "kubernetes"),
            "gpufleet.extender",
        ),
    )
}


class BuildError(RuntimeError):
    """A step of the build failed; the message names it."""


def cache_dir() -> Path:
    return cache_root() / "service-images"


def _digest(doc: object) -> str:
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]


def _gpufleet_files() -> list[tuple[Path, str]]:
    package = Path(gpufleet.__file__).resolve().parent
    return [(p, f"gpufleet/{p.relative_to(package)}") for p in labimages._package_files(package)]


def _dist_files(service: Service) -> list[tuple[Path, str]]:
    files = []
    for dist in labimages.runtime_distributions(service.requirements):
        for rel in dist.files or []:
            source = Path(str(dist.locate_file(rel)))
            if "__pycache__" in rel.parts or rel.parts[0] == ".." or not source.is_file():
                continue  # console scripts live outside site-packages; bytecode is compiled here
            files.append((source, str(rel)))
    return files


def service_key(service: Service, base_key: str) -> str:
    """Everything the service's archive is made of: base, distributions, gpufleet's sources, Containerfile."""
    sources = hashlib.sha256()
    for path, rel in _gpufleet_files():
        sources.update(rel.encode() + b"\0" + path.read_bytes())
    # The distributions' files as this venv has them, not only their versions: two venvs of one version
    # differ in files the image carries (RECORD), and a cached archive must be what a build here makes.
    installed = hashlib.sha256()
    for path, rel in sorted(_dist_files(service), key=lambda item: item[1]):
        installed.update(rel.encode() + b"\0" + path.read_bytes())
    dists = [
        f"{d.metadata['Name']}=={d.version}" for d in labimages.runtime_distributions(service.requirements)
    ]
    return _digest(
        {
            "service": service.name,
            "version": gpufleet.__version__,
            "base": base_key,
            "dists": dists,
            "python": sys.implementation.cache_tag,
            "gpufleet": sources.hexdigest(),
            "installed": installed.hexdigest(),
            "containerfile": service.containerfile.read_text(),
            "base_containerfile": BASE_CONTAINERFILE.read_text(),
            "wrapper": service.wrapper(),
            "rev": REVISION,
        }
    )


def _podman(*argv: str, what: str) -> str:
    proc = subprocess.run(["podman", *argv], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-6:])
        raise BuildError(f"{what}: podman {argv[0]} exited {proc.returncode}: {tail}")
    return proc.stdout


def _build(containerfile: Path, context: Path, tag: str, build_args: dict[str, str], what: str) -> None:
    args = [
        "build",
        "--timestamp",
        "0",
        "--pull=never",
        "--network=none",
        "--layers=false",
        "-q",
        "-f",
        str(containerfile),
        "-t",
        tag,
    ]
    for key, value in build_args.items():
        args += ["--build-arg", f"{key}={value}"]
    _podman(*args, str(context), what=what)


def _image_exists(tag: str) -> bool:
    return subprocess.run(["podman", "image", "exists", tag], check=False).returncode == 0


def ensure_base(timings: dict[str, float]) -> tuple[str, str]:
    """The base image's tag (built if missing) and key."""
    spec = labimages.ImageSpec()
    base_key = spec.base_key()
    root = labimages.cache_dir()
    rootfs = root / f"base-{base_key}.tar"
    started = time.monotonic()
    with file_lock(root / f"base-{base_key}.lock"):
        if not rootfs.exists():
            labimages._build_base(spec, rootfs)
            timings["debootstrap"] = round(time.monotonic() - started, 1)
    have, want = labimages._python_version(rootfs), f"{sys.version_info.major}.{sys.version_info.minor}"
    if have != want:
        raise BuildError(
            f"images: {spec.suite}'s python3 is {have}, but the bytecode is compiled by Python {want}"
        )
    # The root filesystem's bytes, not only its recipe: debootstrap is not reproducible (/etc/shadow's dates,
    # its logs), so a rebuilt rootfs must not reuse service archives made on the one before.
    key = _digest(
        {
            "rootfs": base_key,
            "rootfs_sha256": file_sha256(rootfs),
            "containerfile": BASE_CONTAINERFILE.read_text(),
            "rev": REVISION,
        }
    )
    tag = f"localhost/gpufleet/base:{key}"
    with file_lock(cache_dir() / f"base-{key}.lock"):
        if not _image_exists(tag):
            step = time.monotonic()
            with tempfile.TemporaryDirectory(prefix="gpufleet-base-", dir=cache_dir()) as tmp:
                os.link(rootfs, Path(tmp) / "rootfs.tar")
                _build(BASE_CONTAINERFILE, Path(tmp), tag, {}, "base image")
            timings["base image"] = round(time.monotonic() - step, 1)
    return tag, key


# Compiles every module of a build context in one fresh interpreter with a fixed hash seed: marshal writes
# a frozenset constant (``x in {"a", "b"}``) in its iteration order, which follows string hashes, and marks
# objects by their reference counts in the compiling process, so bytecode compiled in a long-running process
# (a test worker, the lab) differed from the same file compiled elsewhere (found by CI: the extender's
# archive from the cache and a rebuild differed in 7 .pyc files).
_COMPILE_ALL = """
import json, py_compile, sys
for source, cfile, dfile in json.load(sys.stdin):
    try:
        py_compile.compile(source, cfile=cfile, dfile=dfile, doraise=True,
                           invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    except py_compile.PyCompileError:
        pass  # e.g. Python 2 leftovers in a distribution: never imported
"""


def _compile_all(jobs: list[tuple[Path, Path, str]]) -> None:
    """Hash-based, never re-checked bytecode next to each ``dest`` (what the image's python3 looks for):
    ``jobs`` are (source, dest, name in the image)."""
    todo = []
    for source, dest, arcname in jobs:
        cache = dest.parent / "__pycache__" / f"{dest.stem}.{sys.implementation.cache_tag}.pyc"
        todo.append((str(source), str(cache), arcname))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONHASHSEED": "0"}
    subprocess.run(
        [sys.executable, "-c", _COMPILE_ALL], input=json.dumps(todo), text=True, env=env, check=True
    )
    for _, cache, _ in todo:
        if os.path.exists(cache):
            os.chmod(cache, 0o644)


def make_context(service: Service, context: Path) -> None:
    """``site-packages/`` and ``bin/`` of the service's build context (modes normalised: 0644, 0755)."""
    site = context / "site-packages"
    jobs: list[tuple[Path, Path, str]] = []
    for source, rel in [*_dist_files(service), *_gpufleet_files()]:
        dest = site / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, dest)
        dest.chmod(0o755 if os.access(source, os.X_OK) and source.suffix != ".py" else 0o644)
        if source.suffix == ".py":
            jobs.append((source, dest, f"{SITE}/{rel}"))
    _compile_all(jobs)
    for directory in [site, *site.rglob("*")]:
        if directory.is_dir():
            directory.chmod(0o755)
    (context / "bin").mkdir(mode=0o755)
    command = context / "bin" / f"gpufleet-{service.name}"
    command.write_text(service.wrapper())
    command.chmod(0o755)


def build_archive(service: Service, base_tag: str, dest: Path, timings: dict[str, float], tag: str) -> None:
    """Build the service's image on ``base_tag`` as ``tag`` and write its archive to ``dest`` (no cache)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix=f"gpufleet-{service.name}-", dir=cache_dir()) as tmp:
        context = Path(tmp) / "context"
        context.mkdir()
        make_context(service, context)
        timings[f"{service.name}: context"] = round(time.monotonic() - started, 1)
        step = time.monotonic()
        try:
            _build(service.containerfile, context, tag, {"BASE": base_tag}, f"{service.name} image")
            timings[f"{service.name}: podman build"] = round(time.monotonic() - step, 1)
            step = time.monotonic()
            saved = Path(tmp) / "saved.tar"
            _podman(
                "save", "-q", "--format", "oci-archive", "-o", str(saved), tag, what=f"{service.name} image"
            )
        finally:
            subprocess.run(["podman", "rmi", "-f", tag], capture_output=True, check=False)
        partial = dest.with_suffix(".partial")
        ociarchive.rewrite(str(saved), str(partial), service.image_name)
        partial.rename(dest)
        timings[f"{service.name}: archive"] = round(time.monotonic() - step, 1)


def ensure_archive(service: Service, base: tuple[str, str], timings: dict[str, float]) -> Path:
    """The service's archive in the cache (built when missing)."""
    tag, base_key = base
    key = service_key(service, base_key)
    archive = cache_dir() / f"{service.name}-{key}.oci.tar"
    with file_lock(cache_dir() / f"{service.name}-{key}.lock"):
        if not archive.exists():
            build_archive(service, tag, archive, timings, f"localhost/gpufleet/{service.name}:{key}")
            _prune(service, keep=archive)
        return archive


def _prune(service: Service, keep: Path) -> None:
    old = sorted(
        (p for p in cache_dir().glob(f"{service.name}-*.oci.tar") if p != keep),
        key=lambda p: p.stat().st_mtime,
        reverse=True,
    )
    for path in old[KEEP - 1 :]:
        path.unlink(missing_ok=True)
        path.with_name(path.name.removesuffix(".oci.tar") + ".lock").unlink(missing_ok=True)


def build(dest: Path, names: tuple[str, ...] = tuple(SERVICES)) -> dict[str, object]:
    """Build (or take from the cache) each service's archive into ``dest`` and write ``dest/images.json``."""
    if not shutil.which("podman"):
        raise BuildError("images: podman is missing (apt-get install podman)")
    unknown = sorted(set(names) - set(SERVICES))
    if unknown:
        raise BuildError(f"images: unknown {', '.join(unknown)}; known: {', '.join(SERVICES)}")
    started = time.monotonic()
    timings: dict[str, float] = {}
    cache_dir().mkdir(parents=True, exist_ok=True)
    base = ensure_base(timings)
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / MANIFEST_NAME
    entries: dict[str, object] = {}
    if manifest_path.is_file():  # a build of some of the services keeps the others' entries of this version
        old = json.loads(manifest_path.read_text())
        if old.get("version") == gpufleet.__version__:
            entries.update(old.get("images") or {})
    for name in names:
        service = SERVICES[name]
        cached = ensure_archive(service, base, timings)
        target = dest / service.archive_name
        partial = target.with_suffix(".partial")
        shutil.copyfile(cached, partial)
        partial.rename(target)
        image = ociarchive.read(str(target))
        entries[name] = {
            "archive": service.archive_name,
            "name": image.name,
            "digest": image.digest,
            "id": image.image_id,
            "size": target.stat().st_size,
        }
    doc = {"version": gpufleet.__version__, "images": entries}
    manifest_path.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return {**doc, "dir": str(dest), "timings": timings, "seconds": round(time.monotonic() - started, 1)}
