"""The test-host tooling without podman: containers.conf, image keys, the signed stand-in repository."""

from __future__ import annotations

import gzip
import hashlib
import resource
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from gpufleet.testhosts import aptrepo, images, nvidia_packages, podman


@pytest.fixture
def _repo_tools() -> None:
    if not (shutil.which("gpg") and shutil.which("dpkg-deb") and shutil.which("gpgv")):
        pytest.fail("gpg, gpgv and dpkg-deb are needed (scripts/bootstrap installs gnupg and dpkg-dev)")


needs_repo_tools = pytest.mark.usefixtures("_repo_tools")


def test_containers_conf_stays_within_hard_limits() -> None:
    text = podman.render_containers_conf()
    nofile_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    value = int(text.split('"nofile=')[1].split(":")[0])
    assert value <= nofile_hard or nofile_hard == resource.RLIM_INFINITY
    assert 'runtime = "runc"' in text


def test_image_key_follows_content() -> None:
    base = images.ImageSpec("bookworm", mirror="http://mirror.invalid/debian")
    assert base.key() == images.ImageSpec("bookworm", mirror="http://mirror.invalid/debian").key()
    assert base.key() != images.ImageSpec("trixie", mirror="http://mirror.invalid/debian").key()
    assert base.key() != images.ImageSpec("bookworm", mirror="http://other.invalid/debian").key()
    assert base.name == "localhost/gpufleet-testhost:bookworm"


def test_apt_mirror_read_from_deb822_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_DEBIAN_MIRROR", raising=False)
    (tmp_path / "a.sources").write_text("Types: deb\nURIs: https://secure.invalid/x\n")
    (tmp_path / "b.sources").write_text("Types: deb\nURIs: http://mirror.invalid/debian/\nSuites: bookworm\n")
    assert images.apt_mirror(tmp_path) == "http://mirror.invalid/debian"


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> aptrepo.Repo:
    if not (shutil.which("gpg") and shutil.which("dpkg-deb")):
        pytest.fail("gpg and dpkg-deb are needed (scripts/bootstrap installs gnupg and dpkg-dev)")
    return aptrepo.build_repo(tmp_path_factory.mktemp("repo") / "apt-repo")


@needs_repo_tools
@pytest.mark.parametrize("path", [aptrepo.TOOLKIT_PATH, aptrepo.CUDA_PATH])
def test_release_is_signed_by_the_served_key(repo: aptrepo.Repo, path: str, tmp_path: Path) -> None:
    keyring = tmp_path / "key.gpg"
    subprocess.run(["gpg", "--batch", "--dearmor", "--output", str(keyring), str(repo.key_path)], check=True)
    subprocess.run(
        ["gpgv", "--keyring", str(keyring), str(repo.root / path / "InRelease")],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            "gpgv",
            "--keyring",
            str(keyring),
            str(repo.root / path / "Release.gpg"),
            str(repo.root / path / "Release"),
        ],
        check=True,
        capture_output=True,
    )


@needs_repo_tools
def test_index_matches_the_packages(repo: aptrepo.Repo) -> None:
    directory = repo.root / aptrepo.CUDA_PATH
    index = (directory / "Packages").read_text()
    assert gzip.decompress((directory / "Packages.gz").read_bytes()).decode() == index
    release = (directory / "Release").read_text()
    assert hashlib.sha256(index.encode()).hexdigest() in release
    for stanza in index.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line)
        deb = directory / fields["Filename"]
        assert hashlib.sha256(deb.read_bytes()).hexdigest() == fields["SHA256"]
        control = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Package", "Version"], capture_output=True, text=True, check=True
        ).stdout
        assert f"Package: {fields['Package']}" in control and f"Version: {fields['Version']}" in control


@needs_repo_tools
def test_fabricmanager_builds_carry_the_unit_and_versions(repo: aptrepo.Repo) -> None:
    for version in nvidia_packages.FABRICMANAGER_VERSIONS:
        deb = repo.root / aptrepo.CUDA_PATH / f"nvidia-fabricmanager-535_{version}_amd64.deb"
        listing = subprocess.run(
            ["dpkg-deb", "-c", str(deb)], capture_output=True, text=True, check=True
        ).stdout
        assert "./lib/systemd/system/nvidia-fabricmanager.service" in listing
        assert "./usr/bin/nv-fabricmanager" in listing


def test_fabricmanager_standin_refuses_hosts_without_nvswitch(tmp_path: Path) -> None:
    script = tmp_path / "nv-fabricmanager"
    script.write_text(nvidia_packages._fmt(nvidia_packages._FABRICMANAGER, "535.261.03-1"))
    sim = tmp_path / "sim"
    sim.mkdir()
    env = {
        "GPUFLEET_SIM_ROOT": str(sim),
        "GPUFLEET_FABRICMANAGER_LOG": str(tmp_path / "fm.log"),
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(["python3", str(script)], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 1 and "NV_WARN_NOTHING_TO_DO" in result.stderr
    (sim / "machine.json").write_text('{"driver_version": "535.216.03", "nvswitches": [{"bus_id": "x"}]}')
    result = subprocess.run(["python3", str(script)], env=env, capture_output=True, text=True, check=False)
    assert result.returncode == 1 and "does not match the NVIDIA driver version 535.216.03" in result.stderr


@needs_repo_tools
def test_server_serves_the_repo_on_loopback(repo: aptrepo.Repo) -> None:
    with aptrepo.RepoServer(repo.root) as server:
        url = f"http://127.0.0.1:{server.port}/{aptrepo.TOOLKIT_PATH}/InRelease"
        with urllib.request.urlopen(url, timeout=10) as response:
            assert b"BEGIN PGP SIGNED MESSAGE" in response.read()
