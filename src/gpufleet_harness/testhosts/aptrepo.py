"""A signed APT repository on loopback that stands in for NVIDIA's repositories in tests.

Layout under the repo root, mirroring where NVIDIA publishes (both are *flat* repositories, used as
``deb [signed-by=KEY] URL /``):

    gpgkey                                    the throwaway public key (armored)
    libnvidia-container/stable/deb/amd64/     container toolkit packages, Packages, Release, InRelease
    cuda/repos/debian12/x86_64/               fabric manager + CUDA toolkit, same files
    tesla/<version>/NVIDIA-Linux-x86_64-<version>.run   a driver runfile stand-in (+ .sha256sum)

A new throwaway key is made for every build; it signs Release (InRelease and Release.gpg) and nothing else.
"""

from __future__ import annotations

import email.utils
import gzip
import hashlib
import http.server
import os
import shutil
import socketserver
import subprocess
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gpufleet_harness.testhosts import nvidia_packages
from gpufleet_harness.testhosts.debs import DebPackage, build_deb
from gpufleet_harness.testhosts.workspace import state_dir

TOOLKIT_PATH = "libnvidia-container/stable/deb/amd64"
CUDA_PATH = "cuda/repos/debian12/x86_64"
KEY_FILE = "gpgkey"
KEY_UID = "gpufleet throwaway test repository <test-repo@gpufleet.invalid>"


@dataclass(frozen=True)
class Repo:
    """A built repository: its root directory and the fingerprint of the key that signed it."""

    root: Path
    fingerprint: str

    @property
    def key_path(self) -> Path:
        return self.root / KEY_FILE


def _digest(data: bytes, algo: str) -> str:
    return hashlib.new(algo, data).hexdigest()


def _packages_stanza(deb: Path, package: DebPackage) -> str:
    data = deb.read_bytes()
    return (
        package.control()
        + f"Filename: ./{deb.name}\nSize: {len(data)}\n"
        + f"MD5sum: {_digest(data, 'md5')}\nSHA1: {_digest(data, 'sha1')}\n"
        + f"SHA256: {_digest(data, 'sha256')}\n"
    )


def _release(directory: Path, files: Iterable[str], label: str) -> str:
    lines = [
        "Origin: gpufleet-test",
        f"Label: {label}",
        "Architectures: amd64",
        f"Date: {email.utils.formatdate(usegmt=True)}",
        "Acquire-By-Hash: no",
    ]
    for field_name, algo in (("MD5Sum", "md5"), ("SHA256", "sha256")):
        lines.append(f"{field_name}:")
        for name in files:
            data = (directory / name).read_bytes()
            lines.append(f" {_digest(data, algo)} {len(data):>8} {name}")
    return "\n".join(lines) + "\n"


class _Gpg:
    """A private GNUPGHOME holding one throwaway signing key."""

    def __init__(self, home: Path) -> None:
        self.home = home
        if home.exists():
            self.stop_agent()
            shutil.rmtree(home)
        home.mkdir(mode=0o700, parents=True)

    def stop_agent(self) -> None:
        """gpg starts an agent per home directory; end ours so no daemon outlives the build."""
        subprocess.run(
            ["gpgconf", "--homedir", str(self.home), "--kill", "all"], check=False, capture_output=True
        )

    def run(self, *args: str, input_text: str | None = None) -> str:
        return subprocess.run(
            ["gpg", "--batch", "--quiet", "--homedir", str(self.home), *args],
            check=True,
            capture_output=True,
            text=True,
            input=input_text,
        ).stdout

    def generate(self) -> str:
        self.run(
            "--passphrase",
            "",
            "--pinentry-mode",
            "loopback",
            "--quick-generate-key",
            KEY_UID,
            "ed25519",
            "sign",
            "30d",
        )
        for line in self.run("--with-colons", "--list-secret-keys").splitlines():
            if line.startswith("fpr:"):
                return line.split(":")[9]
        raise RuntimeError("gpg generated no key")

    def sign(self, fingerprint: str, release: Path) -> None:
        base = ["--yes", "--local-user", fingerprint, "--digest-algo", "SHA512"]
        self.run(*base, "--clearsign", "--output", str(release.parent / "InRelease"), str(release))
        self.run(
            *base, "--armor", "--detach-sign", "--output", str(release.parent / "Release.gpg"), str(release)
        )


def _build_flat_repo(directory: Path, packages: list[DebPackage], label: str) -> list[str]:
    directory.mkdir(parents=True, exist_ok=True)
    stanzas = [_packages_stanza(build_deb(pkg, directory), pkg) for pkg in packages]
    text = "\n".join(stanzas).encode()
    (directory / "Packages").write_bytes(text)
    (directory / "Packages.gz").write_bytes(gzip.compress(text, mtime=0))
    (directory / "Release").write_text(_release(directory, ["Packages", "Packages.gz"], label))
    return [pkg.filename for pkg in packages]


def build_repo(root: Path | None = None) -> Repo:
    """Build both stand-in repositories under ``root`` (default: the test-host state dir) and sign them."""
    root = root or state_dir() / "apt-repo"
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    gpg = _Gpg(root.parent / f"{root.name}.gnupg")
    fingerprint = gpg.generate()
    (root / KEY_FILE).write_text(gpg.run("--armor", "--export", fingerprint))
    for path, packages, label in (
        (TOOLKIT_PATH, nvidia_packages.container_toolkit_repo(), "libnvidia-container (gpufleet test)"),
        (CUDA_PATH, nvidia_packages.cuda_repo(), "CUDA debian12 (gpufleet test)"),
    ):
        _build_flat_repo(root / path, packages, label)
        gpg.sign(fingerprint, root / path / "Release")
    gpg.stop_agent()
    relative, text = nvidia_packages.runfile()
    run = root / relative
    run.parent.mkdir(parents=True)
    run.write_text(text)
    run.with_name(run.name + ".sha256sum").write_text(f"{_digest(text.encode(), 'sha256')}  {run.name}\n")
    return Repo(root, fingerprint)


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        if os.environ.get("GPUFLEET_REPO_LOG"):
            super().log_message(format, *args)


class RepoServer:
    """Serve a directory over HTTP on 127.0.0.1 from a background thread (a free port unless given)."""

    def __init__(self, root: Path, port: int = 0, host: str = "127.0.0.1") -> None:
        handler = lambda *a, **kw: _QuietHandler(*a, directory=str(root), **kw)  # noqa: E731
        socketserver.TCPServer.allow_reuse_address = True
        self._server = http.server.ThreadingHTTPServer((host, port), handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="apt-repo", daemon=True)

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def start(self) -> RepoServer:
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._server.serve_forever()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RepoServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
