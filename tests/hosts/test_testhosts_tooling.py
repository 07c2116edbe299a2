"""The test-host tooling without podman: containers.conf, image keys, the signed stand-in repository."""

from __future__ import annotations

import gzip
import hashlib
import os
import resource
import shutil
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from gpufleet_harness.testhosts import aptrepo, images, molecule, nvidia_packages, podman


@pytest.fixture
def _repo_tools() -> None:
    if not (shutil.which("gpg") and shutil.which("dpkg-deb") and shutil.which("gpgv")):
        pytest.fail("gpg, gpgv and dpkg-deb are needed (scripts/bootstrap installs gnupg and dpkg-dev)")


needs_repo_tools = pytest.mark.usefixtures("_repo_tools")


_FAILING_PLAY = """\
- hosts: localhost
  gather_facts: false
  tasks:
    - name: A failure the play ignores
      ansible.builtin.fail: {msg: "ignored on purpose"}
      ignore_errors: true
    - name: A task that passes
      ansible.builtin.debug: {msg: "fine"}
    - name: Fail when the control daemon does not answer
      ansible.builtin.fail:
        msg: "the MPS control daemon does not answer (rc 1):\\n\\nCannot find MPS control daemon process"
"""


def test_scenario_failure_message_names_the_failed_task(tmp_path: Path) -> None:
    """molecule's log ends with its recap and clean-up; the failure message must still carry the failed
    task and its message (CI keeps only what the test prints). Real ansible-playbook output, YAML results."""
    play = tmp_path / "play.yml"
    play.write_text(_FAILING_PLAY)
    log = tmp_path / "scenario.log"
    env = {
        "ANSIBLE_CALLBACK_RESULT_FORMAT": "yaml",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
    }
    playbook = Path(sys.executable).parent / "ansible-playbook"
    with log.open("w") as out:
        argv = [playbook, "-i", "localhost,", "-c", "local", play]
        run = subprocess.run(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, check=False
        )
    with log.open("a") as out:
        out.write("\n".join(f"molecule clean-up line {n}" for n in range(80)) + "\n")
    assert run.returncode == 2
    message = molecule.log_tail(log)
    failed, _, end = message.partition("\n\nthe log's end:\n")
    assert failed.startswith("failed tasks:\n"), message
    assert "TASK [Fail when the control daemon does not answer]" in failed
    assert "Cannot find MPS control daemon process" in failed  # the message, past its blank lines
    assert "ignored on purpose" not in failed and "A task that passes" not in failed
    assert end.splitlines()[-1] == "molecule clean-up line 79"
    clean = tmp_path / "clean.log"
    clean.write_text("PLAY RECAP\nlocalhost : ok=3 failed=0\n")
    assert molecule.log_tail(clean) == "PLAY RECAP\nlocalhost : ok=3 failed=0"


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


def test_debian_image_keys_unchanged_by_ubuntu_support() -> None:
    # The keys the cached bookworm/trixie images carry: a change here rebuilds every image.
    assert images.ImageSpec("bookworm", mirror="http://mirror.invalid/debian").key() == "3e3c41672ea12da3"
    assert images.ImageSpec("trixie", mirror="http://mirror.invalid/debian").key() == "36dca277a58666bd"
    assert images.ImageSpec("bookworm", mirror="http://mirror.invalid/debian").sources_list() == ""


def test_ubuntu_image_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_UBUNTU_MIRROR", raising=False)
    jammy = images.ImageSpec("jammy")
    assert jammy.ubuntu and jammy.mirror == "http://archive.ubuntu.com/ubuntu"
    assert jammy.name == "localhost/gpufleet-testhost:jammy"
    assert "deb http://archive.ubuntu.com/ubuntu jammy-updates main restricted universe multiverse\n" in (
        jammy.sources_list()
    )
    monkeypatch.setenv("GPUFLEET_UBUNTU_MIRROR", "http://mirror.invalid/ubuntu/")
    moved = images.ImageSpec("jammy")
    assert moved.mirror == "http://mirror.invalid/ubuntu" and moved.key() != jammy.key()


def _scenario(project: Path, name: str, *suites: str) -> None:
    (project / "molecule" / name).mkdir(parents=True)
    platforms = "".join(
        f"  - name: {name}-{suite}\n    image: {images.IMAGE_REPOSITORY}:{suite}\n" for suite in suites
    )
    (project / "molecule" / name / "molecule.yml").write_text(f"---\nplatforms:\n{platforms}")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ubuntu_scenarios_are_in_the_default_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _scenario(tmp_path, "debian_one", "bookworm")
    _scenario(tmp_path, "debian_two", "bookworm", "trixie")
    _scenario(tmp_path, "on_ubuntu", "jammy")
    _scenario(tmp_path, "mixed", "bookworm", "jammy")
    monkeypatch.delenv("GPUFLEET_MOLECULE_SCENARIOS", raising=False)
    everything = ["debian_one", "debian_two", "mixed", "on_ubuntu"]
    assert molecule.all_scenarios(tmp_path) == everything
    assert molecule.scenarios(tmp_path) == everything
    assert molecule.opt_in_scenarios(tmp_path) == []
    assert molecule.selected_scenarios(tmp_path) == everything
    assert molecule.named_scenarios() == []
    monkeypatch.setenv("GPUFLEET_MOLECULE_SCENARIOS", "on_ubuntu")
    assert molecule.selected_scenarios(tmp_path) == ["on_ubuntu"]
    monkeypatch.setenv("GPUFLEET_MOLECULE_SCENARIOS", "debian_two,on_ubuntu")
    assert molecule.selected_scenarios(tmp_path) == ["debian_two", "on_ubuntu"]


def test_a_scenario_marked_slow_is_opt_in_with_its_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scenario(tmp_path, "quick", "bookworm")
    _scenario(tmp_path, "slow", "bookworm")
    _scenario(tmp_path, "mentions", "bookworm")
    slow = tmp_path / "molecule/slow/molecule.yml"
    marked = "---\n# gpufleet-opt-in: two hosts rebooted for real\n"
    slow.write_text(marked + slow.read_text().removeprefix("---\n"))
    mentions = tmp_path / "molecule/mentions/molecule.yml"
    mentions.write_text(mentions.read_text() + "    # not a gpufleet-opt-in: line at the start\n")
    monkeypatch.delenv("GPUFLEET_MOLECULE_SCENARIOS", raising=False)
    assert molecule.opt_in_reason("slow", tmp_path) == "two hosts rebooted for real"
    assert molecule.opt_in_reason("quick", tmp_path) is None
    assert molecule.selected_scenarios(tmp_path) == ["mentions", "quick"]
    assert molecule.opt_in_scenarios(tmp_path) == ["slow"]
    monkeypatch.setenv("GPUFLEET_MOLECULE_SCENARIOS", "slow")
    assert molecule.selected_scenarios(tmp_path) == ["slow"]


def test_named_ubuntu_scenario_fails_naming_the_archive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scenario(tmp_path, "debian_one", "bookworm")
    _scenario(tmp_path, "on_ubuntu", "jammy")
    mirror = f"http://127.0.0.1:{_closed_port()}/ubuntu"
    monkeypatch.setenv("GPUFLEET_UBUNTU_MIRROR", mirror)
    molecule.require_archives(["debian_one"], tmp_path)  # Debian archives are not checked
    with pytest.raises(images.ArchiveUnreachableError) as failure:
        molecule.require_archives(["debian_one", "on_ubuntu"], tmp_path)
    message = str(failure.value)
    assert f"the Ubuntu archive {mirror} does not answer" in message
    assert "scenario on_ubuntu: its Ubuntu jammy test hosts need an archive that does not answer" in message
    # prepare_images checks before it builds anything.
    monkeypatch.setattr(molecule, "build_image", lambda spec: pytest.fail(f"built {spec.name}"))
    with pytest.raises(images.ArchiveUnreachableError):
        molecule.prepare_images(["on_ubuntu"], tmp_path)


def test_default_set_skips_ubuntu_scenarios_while_the_archive_does_not_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scenario(tmp_path, "debian_one", "bookworm")
    _scenario(tmp_path, "on_ubuntu", "jammy")
    _scenario(tmp_path, "on_noble", "noble")
    mirror = f"http://127.0.0.1:{_closed_port()}/ubuntu"
    monkeypatch.setenv("GPUFLEET_UBUNTU_MIRROR", mirror)
    built: list[str] = []
    monkeypatch.setattr(molecule, "build_image", lambda spec: built.append(spec.suite))
    skipped = molecule.prepare_images(["debian_one", "on_ubuntu", "on_noble"], tmp_path, required=False)
    assert sorted(skipped) == ["on_noble", "on_ubuntu"]
    assert f"the Ubuntu archive {mirror} does not answer" in skipped["on_ubuntu"]
    assert built == ["bookworm"]  # nothing built for the skipped ones


def test_default_set_skips_an_ubuntu_scenario_whose_archive_stops_answering_during_its_image_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _scenario(tmp_path, "debian_one", "bookworm")
    _scenario(tmp_path, "on_ubuntu", "jammy")
    answers = iter([True, False])  # the first probe answers, the one after the failed build does not

    def probe(spec: images.ImageSpec) -> None:
        if not next(answers):
            raise images.ArchiveUnreachableError(f"the Ubuntu archive {spec.mirror} does not answer")

    def build(spec: images.ImageSpec) -> None:
        if spec.ubuntu:
            raise RuntimeError("debootstrap: Failed getting release file")

    monkeypatch.setattr(molecule, "require_archive", probe)
    monkeypatch.setattr(molecule, "build_image", build)
    skipped = molecule.prepare_images(["debian_one", "on_ubuntu"], tmp_path, required=False)
    assert list(skipped) == ["on_ubuntu"]
    # the archive answering, a failed build is a failure
    monkeypatch.setattr(molecule, "require_archive", lambda spec: None)
    with pytest.raises(RuntimeError, match="debootstrap"):
        molecule.prepare_images(["debian_one", "on_ubuntu"], tmp_path, required=False)
    # and a Debian image's failure is never a skip
    monkeypatch.setattr(
        molecule, "build_image", lambda spec: (_ for _ in ()).throw(RuntimeError("mmdebstrap"))
    )
    with pytest.raises(RuntimeError, match="mmdebstrap"):
        molecule.prepare_images(["debian_one"], tmp_path, required=False)


def test_project_default_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFLEET_MOLECULE_SCENARIOS", raising=False)
    assert "nvidia_driver" in molecule.selected_scenarios()
    # Ubuntu's package path runs whenever Ubuntu's archive answers (skipped, named, when it does not)
    assert "nvidia_driver_ubuntu" in molecule.selected_scenarios()
    assert "nvidia_driver_ubuntu" not in molecule.opt_in_scenarios()
    # the DKMS compile is too slow for every run; docs/roles.md records its last run
    assert "nvidia_driver_ubuntu_dkms" in molecule.opt_in_scenarios()
    # too slow for every run; docs/roles.md records its last run
    assert "nvidia_driver_upgrade" in molecule.opt_in_scenarios()
    assert molecule.opt_in_reason("nvidia_driver_upgrade")


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
