"""gpufleet.ociarchive on archives made here: what read() takes from index.json, that rewrite() is byte-stable
and names the image by tag and by digest, and that damaged or ambiguous archives are refused by name."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path

import pytest

from gpufleet import ociarchive


def _blob(data: bytes) -> tuple[str, bytes]:
    return ociarchive.sha256_of(data), data


def _layer() -> bytes:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w") as tar:
        info = tarfile.TarInfo("hello")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"hi\n"))
    return gzip.compress(raw.getvalue(), mtime=0)


def make_oci_archive(
    path: Path, *, names: tuple[str, ...] = ("localhost/x:1",), extra_image: bool = False
) -> Path:
    """An OCI archive as podman save writes one: oci-layout, index.json, blobs."""
    layer_digest, layer = _blob(_layer())
    config = {
        "architecture": "amd64",
        "os": "linux",
        "rootfs": {"type": "layers", "diff_ids": ["sha256:" + "0" * 64]},
    }
    config_digest, config_bytes = _blob(json.dumps(config).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_bytes),
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                "digest": layer_digest,
                "size": len(layer),
            }
        ],
    }
    manifest_digest, manifest_bytes = _blob(json.dumps(manifest).encode())
    blobs = {manifest_digest: manifest_bytes, config_digest: config_bytes, layer_digest: layer}
    entries = [
        {
            "mediaType": manifest["mediaType"],
            "digest": manifest_digest,
            "size": len(manifest_bytes),
            "annotations": {ociarchive.REF_NAME: n},
        }
        for n in names
    ]
    if extra_image:
        other_digest, other = _blob(manifest_bytes + b" ")
        blobs[other_digest] = other
        entries.append({**entries[0], "digest": other_digest})
    files = {
        "oci-layout": b'{"imageLayoutVersion":"1.0.0"}',
        "index.json": json.dumps({"manifests": entries}).encode(),
    }
    files |= {ociarchive.blob_path(d): data for d, data in blobs.items()}
    with tarfile.open(path, "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_rewrite_names_the_image_by_tag_and_digest_for_containerd_and_docker(tmp_path: Path) -> None:
    source = make_oci_archive(tmp_path / "saved.tar")
    first = ociarchive.rewrite(str(source), str(tmp_path / "a.tar"), "docker.io/gpufleet/x:0.1.0")
    again = ociarchive.rewrite(str(source), str(tmp_path / "b.tar"), "docker.io/gpufleet/x:0.1.0")
    assert (tmp_path / "a.tar").read_bytes() == (tmp_path / "b.tar").read_bytes()  # byte-stable
    assert first.name == "docker.io/gpufleet/x:0.1.0" and first.repository == "docker.io/gpufleet/x"
    assert first.digest == ociarchive.read(str(source)).digest and again.digest == first.digest
    with tarfile.open(tmp_path / "a.tar") as tar:
        assert all(m.mtime == 0 and m.uid == 0 for m in tar.getmembers())
        index = json.load(tar.extractfile("index.json"))  # type: ignore[arg-type]
        docker = json.load(tar.extractfile("manifest.json"))  # type: ignore[arg-type]
    names = [e["annotations"][ociarchive.CONTAINERD_NAME] for e in index["manifests"]]
    assert names == ["docker.io/gpufleet/x:0.1.0", f"docker.io/gpufleet/x@{first.digest}"]
    assert docker == [
        {
            "Config": ociarchive.blob_path(first.image_id),
            "RepoTags": ["gpufleet/x:0.1.0"],
            "Layers": [ociarchive.blob_path(first.layers[0]["digest"])],
        }
    ]


def test_a_damaged_blob_is_refused_naming_it(tmp_path: Path) -> None:
    good = ociarchive.rewrite(
        str(make_oci_archive(tmp_path / "s.tar")), str(tmp_path / "g.tar"), "docker.io/g/x:1"
    )
    layer = ociarchive.blob_path(good.layers[0]["digest"])
    damaged = tmp_path / "damaged.tar"
    with tarfile.open(tmp_path / "g.tar") as src, tarfile.open(damaged, "w") as out:
        for member in src.getmembers():
            data = src.extractfile(member).read()  # type: ignore[union-attr]
            if member.name == layer:
                data = data[:-1] + bytes([data[-1] ^ 1])
            out.addfile(member, io.BytesIO(data))
    with pytest.raises(ociarchive.ArchiveError, match=f"layer {good.layers[0]['digest']} does not match"):
        ociarchive.read(str(damaged))
    assert ociarchive.read(str(damaged), verify=False).digest == good.digest


def test_missing_unreadable_and_ambiguous_archives_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ociarchive.ArchiveError, match=r"nowhere\.tar does not exist"):
        ociarchive.read(str(tmp_path / "nowhere.tar"))
    (tmp_path / "junk.tar").write_bytes(b"not a tar")
    with pytest.raises(ociarchive.ArchiveError, match="not a readable tar archive"):
        ociarchive.read(str(tmp_path / "junk.tar"))
    with pytest.raises(ociarchive.ArchiveError, match="names 2 images; a gpufleet archive holds one"):
        ociarchive.read(str(make_oci_archive(tmp_path / "two.tar", extra_image=True)))
    with pytest.raises(ociarchive.ArchiveError, match="gives the image no name"):
        ociarchive.read(str(make_oci_archive(tmp_path / "anon.tar", names=("",))))


@pytest.mark.parametrize(
    ("name", "repository"),
    [
        ("docker.io/gpufleet/x:0.1.0", "docker.io/gpufleet/x"),
        ("registry:5000/a/b", "registry:5000/a/b"),
        ("registry:5000/a/b:1@sha256:" + "1" * 64, "registry:5000/a/b"),
    ],
)
def test_repository_drops_tag_and_digest_but_not_a_port(name: str, repository: str) -> None:
    assert ociarchive.repository(name) == repository
