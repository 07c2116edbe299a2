"""OCI image archives: how gpufleet ships its service images to clusters without a registry.

An archive is an OCI image layout in a tar (``oci-layout``, ``index.json``, ``blobs/sha256/...``), as
``podman save --format oci-archive`` writes it, plus a docker ``manifest.json`` naming the same blobs, so that
both ``ctr images import`` (containerd) and ``docker load`` read it. ``index.json`` names the one image twice,
in the annotation containerd's importer reads (``io.containerd.image.name``): by tag
(``docker.io/gpufleet/device-plugin:0.1.0``) and by digest (``docker.io/gpufleet/device-plugin@sha256:...``),
so that a pod naming the image by digest finds it in containerd's ``k8s.io`` namespace.

Two digests identify an image: the **manifest digest** (what a registry serves ``name@sha256:...`` by) and the
**image ID**, the digest of the image's configuration, which names every layer by the digest of its content.
Docker computes the same ID for a loaded image; kubelets on containerd (CRI) and docker (dockershim) both
find a local image by it. :func:`read` checks every blob against its digest, so an archive whose content does
not match what its index says is refused. Only the standard library is used: the collection's modules ship
this file as ``module_utils/ociarchive.py``.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from dataclasses import dataclass, field
from typing import Any

CONTAINERD_NAME = "io.containerd.image.name"
REF_NAME = "org.opencontainers.image.ref.name"
MANIFEST_TYPES = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
)
CHUNK = 1 << 20


class ArchiveError(Exception):
    """The archive is missing, unreadable, or its content does not match its digests."""


@dataclass(frozen=True)
class ArchiveImage:
    """The image an archive holds."""

    path: str
    name: str  # repository:tag, fully qualified (docker.io/gpufleet/device-plugin:0.1.0)
    digest: str  # the manifest's digest
    image_id: str  # the configuration's digest
    manifest: dict[str, Any] = field(repr=False)
    manifest_bytes: bytes = field(repr=False)
    config_bytes: bytes = field(repr=False)
    layers: tuple[dict[str, Any], ...] = field(repr=False)

    @property
    def repository(self) -> str:
        return repository(self.name)

    @property
    def digest_ref(self) -> str:
        return f"{self.repository}@{self.digest}"


def repository(name: str) -> str:
    """``name`` without its tag or digest."""
    base = name.split("@", 1)[0]
    slash = base.rfind("/")
    colon = base.rfind(":")
    return base[:colon] if colon > slash else base


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_path(digest: str) -> str:
    algorithm, _sep, hexdigest = digest.partition(":")
    if algorithm != "sha256" or len(hexdigest) != 64:
        raise ArchiveError(f"unsupported digest {digest!r} (expected sha256:<64 hex digits>)")
    return f"blobs/sha256/{hexdigest}"


def _member(tar: tarfile.TarFile, names: dict[str, tarfile.TarInfo], name: str, path: str) -> tarfile.TarInfo:
    member = names.get(name)
    if member is None or not member.isfile():
        raise ArchiveError(f"{path}: no {name} in the archive (not an OCI image archive)")
    return member


def _read(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(member)
    if handle is None:
        raise ArchiveError(f"cannot read {member.name}")
    return handle.read()


def _hash_member(tar: tarfile.TarFile, member: tarfile.TarInfo) -> str:
    handle = tar.extractfile(member)
    if handle is None:
        raise ArchiveError(f"cannot read {member.name}")
    digest = hashlib.sha256()
    for chunk in iter(lambda: handle.read(CHUNK), b""):
        digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def read(path: str, *, verify: bool = True) -> ArchiveImage:
    """The image of the archive at ``path``; with ``verify``, every blob is checked against its digest.

    Raises ArchiveError naming what is wrong."""
    try:
        tar = tarfile.open(path)  # noqa: SIM115 - closed by the with below, after the errors are told apart
    except FileNotFoundError:
        raise ArchiveError(f"{path} does not exist") from None
    except (OSError, tarfile.TarError) as exc:
        raise ArchiveError(f"{path}: not a readable tar archive ({exc})") from None
    with tar:
        names = {m.name.removeprefix("./"): m for m in tar.getmembers()}
        try:
            index = json.loads(_read(tar, _member(tar, names, "index.json", path)))
        except ValueError as exc:
            raise ArchiveError(f"{path}: index.json is not JSON ({exc})") from None
        entries = [m for m in index.get("manifests") or [] if m.get("mediaType") in MANIFEST_TYPES]
        digests = {m.get("digest") for m in entries}
        if len(digests) != 1:
            raise ArchiveError(
                f"{path}: index.json names {len(digests)} images; a gpufleet archive holds one"
            )
        (digest,) = digests
        tagged = [
            n
            for m in entries
            for n in [
                (m.get("annotations") or {}).get(CONTAINERD_NAME)
                or (m.get("annotations") or {}).get(REF_NAME)
                or ""
            ]
            if n and "@" not in n
        ]
        if not tagged:
            raise ArchiveError(f"{path}: index.json gives the image no name ({CONTAINERD_NAME})")
        manifest_bytes = _read(tar, _member(tar, names, blob_path(digest), path))
        if verify and sha256_of(manifest_bytes) != digest:
            raise ArchiveError(f"{path}: the manifest's content does not match its digest {digest}")
        manifest = json.loads(manifest_bytes)
        config = manifest.get("config") or {}
        config_bytes = _read(tar, _member(tar, names, blob_path(config.get("digest", "")), path))
        if verify and sha256_of(config_bytes) != config.get("digest"):
            raise ArchiveError(
                f"{path}: the image configuration does not match its digest {config.get('digest')}"
            )
        layers = tuple(manifest.get("layers") or [])
        for layer in layers:
            member = _member(tar, names, blob_path(layer.get("digest", "")), path)
            if verify and _hash_member(tar, member) != layer["digest"]:
                raise ArchiveError(f"{path}: layer {layer['digest']} does not match its digest")
        return ArchiveImage(
            path, tagged[0], digest, config["digest"], manifest, manifest_bytes, config_bytes, layers
        )


def _add(
    tar: tarfile.TarFile,
    name: str,
    data: bytes | None = None,
    *,
    source: io.BufferedReader | None = None,
    size: int = 0,
) -> None:
    info = tarfile.TarInfo(name)
    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
    if data is not None:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        info.size = size
        tar.addfile(info, source)


def rewrite(source: str, dest: str, name: str) -> ArchiveImage:
    """Write the image of the OCI archive ``source`` to ``dest`` as a gpufleet archive named ``name``
    (``registry/repository:tag``): byte for byte the same for the same image (sorted entries, no times, no
    owners), with the tag and digest names in index.json and a docker manifest.json beside it."""
    image = read(source)
    digest_name = f"{repository(name)}@{image.digest}"
    descriptor = {
        "mediaType": image.manifest.get("mediaType", MANIFEST_TYPES[0]),
        "digest": image.digest,
        "size": len(image.manifest_bytes),
    }
    index = {
        "schemaVersion": 2,
        "manifests": [
            {**descriptor, "annotations": {CONTAINERD_NAME: name, REF_NAME: name}},
            {**descriptor, "annotations": {CONTAINERD_NAME: digest_name}},
        ],
    }
    docker = [
        {
            "Config": blob_path(image.image_id),
            "RepoTags": [name.removeprefix("docker.io/")],
            "Layers": [blob_path(layer["digest"]) for layer in image.layers],
        }
    ]
    with tarfile.open(source) as src, tarfile.open(dest, "w", format=tarfile.PAX_FORMAT) as out:
        members = {m.name.removeprefix("./"): m for m in src.getmembers()}
        _add(out, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        _add(out, "index.json", json.dumps(index, sort_keys=True).encode())
        _add(out, "manifest.json", json.dumps(docker, sort_keys=True).encode())
        blobs = {
            image.digest: None,
            image.image_id: None,
            **{layer["digest"]: None for layer in image.layers},
        }
        for digest in sorted(blobs):
            member = members[blob_path(digest)]
            _add(out, blob_path(digest), source=src.extractfile(member), size=member.size)  # type: ignore[arg-type]
    return read(dest)
