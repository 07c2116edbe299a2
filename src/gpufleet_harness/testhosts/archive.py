"""Read real Debian and Ubuntu archives: signed indexes, package stanzas, and files inside real .debs.

The contract tests (tests/contracts) use this to check every name the roles assume against the packages
the distributions really ship. Trust runs down one chain, as apt's does: the suite's `InRelease` is checked
with `gpgv` against the archive's keyring, each `Packages` index against the SHA256 that `InRelease` lists,
and each `.deb` against the SHA256 its stanza lists. Everything fetched is cached under
`<state dir>/archives`, keyed by what it was checked against, so a second run reads no network.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import lzma
import os
import re
import subprocess
import tarfile
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpufleet_harness.testhosts.images import (
    ARCHIVE_TIMEOUT,
    ImageSpec,
    apt_mirror,
    ubuntu_keyring,
    ubuntu_mirror,
)
from gpufleet_harness.testhosts.workspace import state_dir

DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
# Debian's security updates (<release>-security) are served from their own archive, signed by keys that
# Debian's archive keyring also holds. GPUFLEET_DEBIAN_SECURITY_MIRROR overrides it.
DEBIAN_SECURITY_MIRROR = "http://deb.debian.org/debian-security"
# Large enough for the biggest index or package the contracts read (a driver's .deb is ~30 MiB).
DOWNLOAD_TIMEOUT = 180.0


class ArchiveError(RuntimeError):
    """An archive did not answer, or what it served did not verify."""


@dataclass(frozen=True)
class Archive:
    """One distribution's archive: where it is served and which keyring signs its suites."""

    name: str  # "debian", "debian-security" or "ubuntu": how fixtures and tables name it
    mirror: str

    @classmethod
    def debian(cls) -> Archive:
        return cls("debian", apt_mirror())

    @classmethod
    def debian_security(cls) -> Archive:
        mirror = os.environ.get("GPUFLEET_DEBIAN_SECURITY_MIRROR") or DEBIAN_SECURITY_MIRROR
        return cls("debian-security", mirror.rstrip("/"))

    @classmethod
    def ubuntu(cls) -> Archive:
        return cls("ubuntu", ubuntu_mirror())

    def keyring(self) -> Path:
        if self.name == "ubuntu":
            return ubuntu_keyring(ImageSpec("jammy", mirror=self.mirror))
        return DEBIAN_KEYRING

    def url(self, path: str) -> str:
        return f"{self.mirror}/{path.lstrip('/')}"


@dataclass(frozen=True)
class Stanza:
    """One binary package entry of a `Packages` index."""

    archive: Archive
    suite: str
    component: str
    fields: dict[str, str]

    @property
    def package(self) -> str:
        return self.fields["Package"]

    @property
    def version(self) -> str:
        return self.fields["Version"]

    @property
    def filename(self) -> str:
        return self.fields["Filename"]

    @property
    def sha256(self) -> str:
        return self.fields["SHA256"]

    @property
    def source(self) -> str:
        """The source package's name (a `Source:` field may carry a version in brackets)."""
        return self.fields.get("Source", self.package).split(" ")[0]

    def depends(self) -> list[str]:
        """Every package name in Depends and Pre-Depends (alternatives flattened, versions dropped)."""
        names = []
        for key in ("Pre-Depends", "Depends"):
            for part in re.split(r"[,|]", self.fields.get(key, "")):
                name = part.strip().split(" ")[0].split(":")[0]
                if name:
                    names.append(name)
        return names

    def where(self) -> str:
        """How a fixture names this package: archive, pool path and the checked digest."""
        return f"{self.archive.name}:{self.filename} sha256:{self.sha256}"


def _fetch(url: str, timeout: float = DOWNLOAD_TIMEOUT) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bytes(response.read())
    except (OSError, ValueError) as err:
        raise ArchiveError(f"{url}: {err}") from err


def _cache_dir() -> Path:
    path = state_dir() / "archives"
    path.mkdir(parents=True, exist_ok=True)
    return path


def reachable(archive: Archive, suite: str, timeout: float = ARCHIVE_TIMEOUT) -> bool:
    """Whether the archive answers for `suite` right now (a HEAD of its InRelease)."""
    request = urllib.request.Request(archive.url(f"dists/{suite}/InRelease"), method="HEAD")
    try:
        with urllib.request.urlopen(request, timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _verified_release(archive: Archive, suite: str) -> str:
    """The suite's InRelease text after gpgv accepted its signature."""
    signed = _fetch(archive.url(f"dists/{suite}/InRelease"), timeout=60)
    result = subprocess.run(
        ["gpgv", "--keyring", str(archive.keyring()), "--output", "-", "-"],
        input=signed,
        capture_output=True,
        check=False,
    )
    if result.returncode != 0:
        raise ArchiveError(
            f"{archive.name} {suite}: InRelease does not verify against {archive.keyring()}: "
            f"{result.stderr.decode(errors='replace').strip()}"
        )
    return result.stdout.decode()


def _release_sha256(release: str) -> dict[str, str]:
    """path → sha256 from the SHA256 section of a Release file."""
    section = re.search(r"^SHA256:\n((?:[ \t].*\n?)+)", release, re.MULTILINE)
    if not section:
        return {}
    digests = {}
    for line in section.group(1).splitlines():
        parts = line.split()
        if len(parts) == 3:
            digests[parts[2]] = parts[0]
    return digests


def _parse_index(text: str) -> Iterator[dict[str, str]]:
    for block in text.split("\n\n"):
        fields: dict[str, str] = {}
        key = ""
        for line in block.splitlines():
            if line[:1] in (" ", "\t") and key:
                fields[key] += "\n" + line.strip()
            elif ":" in line:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "Package" in fields:
            yield fields


def packages(archive: Archive, suite: str, component: str, arch: str = "amd64") -> list[Stanza]:
    """Every binary package stanza of one suite/component/architecture, from its verified index."""
    text = _verified_index(archive, suite, f"{component}/binary-{arch}/Packages", "idx")
    return [Stanza(archive, suite, component, f) for f in _parse_index(text)]


def _verified_index(archive: Archive, suite: str, stem: str, kind: str) -> str:
    """The text of the index ``stem`` (``.xz`` or ``.gz``) of a suite, checked against the SHA256 its
    gpgv-verified InRelease gives, and cached by that SHA256 (``kind``: the cache file's suffix)."""
    digests = _release_sha256(_verified_release(archive, suite))
    for ext, decompress in ((".xz", lzma.decompress), (".gz", gzip.decompress)):
        path = stem + ext
        if path not in digests:
            continue
        cached = _cache_dir() / f"{archive.name}-{digests[path]}.{kind}"
        if cached.exists():
            return cached.read_text()
        raw = _fetch(archive.url(f"dists/{suite}/{path}"))
        if hashlib.sha256(raw).hexdigest() != digests[path]:
            raise ArchiveError(f"{archive.name} {suite}/{path}: SHA256 differs from InRelease's")
        text = decompress(raw).decode(errors="replace")
        cached.write_text(text)
        return text
    raise ArchiveError(f"{archive.name} {suite}: InRelease lists no {stem} index")


def versions(stanzas: list[Stanza], package: str) -> list[Stanza]:
    """The stanzas of `package`, newest last (by dpkg's version order)."""
    found = [s for s in stanzas if s.package == package]
    return sorted(found, key=_VersionKey)


class _VersionKey:
    """Orders stanzas by `dpkg --compare-versions` (exact, and rare enough to shell out for)."""

    def __init__(self, stanza: Stanza) -> None:
        self.version = stanza.version

    def __lt__(self, other: _VersionKey) -> bool:
        return (
            subprocess.run(["dpkg", "--compare-versions", self.version, "lt", other.version], check=False)
            .returncode
            == 0
        )


def download(stanza: Stanza) -> Path:
    """The .deb of a stanza, checked against the index's SHA256 (cached by that digest)."""
    cached = _cache_dir() / f"{stanza.sha256}.deb"
    if cached.exists():
        return cached
    raw = _fetch(stanza.archive.url(stanza.filename))
    if hashlib.sha256(raw).hexdigest() != stanza.sha256:
        raise ArchiveError(f"{stanza.where()}: the download's SHA256 differs from the index's")
    partial = cached.with_suffix(".partial")
    partial.write_bytes(raw)
    partial.replace(cached)
    return cached


def deb_members(deb: Path) -> dict[str, tarfile.TarInfo]:
    """The files, links and directories a .deb installs, by absolute path."""
    with _data_tar(deb) as tar:
        return {"/" + m.name.lstrip("./"): m for m in tar.getmembers()}


def deb_file(deb: Path, path: str) -> bytes:
    """The content of one file a .deb installs (symlinks inside the package are followed once)."""
    with _data_tar(deb) as tar:
        members = {"/" + m.name.lstrip("./"): m for m in tar.getmembers()}
        member = members.get(path)
        if member is not None and member.issym():
            target = member.linkname
            target = target if target.startswith("/") else str(Path(path).parent / target)
            member = members.get(target)
        if member is None or not member.isfile():
            raise ArchiveError(f"{deb.name} installs no file {path}")
        extracted = tar.extractfile(member)
        assert extracted is not None
        return extracted.read()


def _data_tar(deb: Path) -> tarfile.TarFile:
    result = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=False)
    if result.returncode != 0:
        raise ArchiveError(f"{deb}: dpkg-deb: {result.stderr.decode(errors='replace').strip()}")
    return tarfile.open(fileobj=io.BytesIO(result.stdout))


def index_sha256(archive: Archive, suite: str, component: str, arch: str = "amd64") -> str:
    """The SHA256 the suite's verified InRelease lists for one Packages index (what `packages` caches by):
    callers key their own caches of what they read from that index with it."""
    digests = _release_sha256(_verified_release(archive, suite))
    for ext in (".xz", ".gz"):
        path = f"{component}/binary-{arch}/Packages{ext}"
        if path in digests:
            return digests[path]
    raise ArchiveError(f"{archive.name} {suite}: InRelease lists no {component}/binary-{arch}/Packages index")


# --- source indexes -------------------------------------------------------------------------------------
# Which architectures a source package builds each binary for is in its `Package-List`: read from the
# primary archive, it tells what a ports archive (Ubuntu's arm64: ports.ubuntu.com) serves when only the
# primary answers.


def sources(archive: Archive, suite: str, component: str) -> list[dict[str, str]]:
    """Every source package stanza of one suite/component, from its `Sources` index checked against the
    suite's gpgv-verified InRelease (cached by that SHA256, as `packages` caches)."""
    return list(_parse_index(_verified_index(archive, suite, f"{component}/source/Sources", "src")))


def build_architectures(source: dict[str, str]) -> dict[str, list[str]]:
    """binary package → the architectures its source stanza builds it for (`Package-List`'s arch=)."""
    built: dict[str, list[str]] = {}
    for line in source.get("Package-List", "").splitlines():
        words = line.split()
        if words:
            arches = [w.split("=", 1)[1] for w in words if w.startswith("arch=")]
            built[words[0]] = arches[0].split(",") if arches else []
    return built
