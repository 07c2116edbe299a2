"""arm64 (aarch64) on Debian and Ubuntu: the packages the roles install exist for arm64, and aarch64 hosts get
the arm64/sbsa repository directories while x86_64 hosts keep exactly the URLs they had.

The facts are in facts/arm64.yaml. The contract probes read amd64 indexes, so this file reads each entry's
`arm64` probe itself: Debian's arm64 Packages indexes (and the arm64 .debs for DKMS names); for Ubuntu, whose
arm64 binaries only ports.ubuntu.com serves, the `Package-List` of archive.ubuntu.com's Sources index, live
when it answers, else fixtures/arm64-ubuntu.json (`python tests/contracts/refresh.py` rewrites it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import contractlib
import pytest
import yaml
from contractlib import REPO, ContractError, Fact, RoleVars, note_reading, real

THIS = "tests/contracts/test_arm64.py"
FIXTURE = contractlib.FIXTURES_DIR / "arm64-ubuntu.json"
FACTS = [f for f in contractlib.load_facts() if f.file == "arm64"]
PROBED = [f for f in FACTS if f.entry.get("probe_in") == THIS]
DEBIAN_FAMILY = ("debian-12", "debian-13", "ubuntu-22.04", "ubuntu-24.04")
TOOLKIT_REPO = "https://nvidia.github.io/libnvidia-container/stable/deb"


# --- the real artifacts ---------------------------------------------------------------------------------


@cache
def _arm64_index(suite: str, component: str) -> list[real.Stanza]:
    return real.packages(real.Archive.debian(), suite, component, "arm64")


def debian_reading(probe: dict[str, str]) -> contractlib.Reading:
    """A Debian arm64 probe: the package at the probe's version exists for arm64 (or its DKMS name)."""
    found = real.versions(_arm64_index(probe["suite"], probe["component"]), probe["package"])
    pinned = [
        s for s in found if "version" not in probe or contractlib.upstream(s.version) == probe["version"]
    ]
    if not pinned:
        offered = ", ".join(s.version for s in found) or "none"
        raise ContractError(
            f"debian {probe['suite']}/{probe['component']} binary-arm64 has no {probe['package']} "
            f"{probe.get('version', '')} (offered: {offered})"
        )
    stanza = pinned[-1]
    if probe["read"] == "dkms":
        # The contract probes' own reading of dkms.conf (cached by the .deb's SHA256).
        value = contractlib._read_inside(stanza, {**probe, "read": "dkms"})
    else:
        value = stanza.package
    return contractlib.Reading(
        value, "debian", stanza.package, stanza.version, stanza.filename, stanza.sha256
    )


@cache
def _sources(suite: str, component: str) -> list[dict[str, str]]:
    return real.sources(real.Archive.ubuntu(), suite, component)


def ubuntu_record(probe: dict[str, str]) -> dict[str, Any]:
    """An Ubuntu arm64 probe read live: the architectures the source package builds the binary for."""
    found = [s for s in _sources(probe["suite"], probe["component"]) if s["Package"] == probe["source"]]
    pinned = [s for s in found if contractlib.upstream(s["Version"]) == probe["version"]]
    if not pinned:
        offered = ", ".join(s["Version"] for s in found) or "none"
        raise ContractError(
            f"ubuntu {probe['suite']}/{probe['component']} has no source {probe['source']} "
            f"{probe['version']} (offered: {offered})"
        )
    stanza = pinned[-1]
    dsc = next(line.split() for line in stanza["Checksums-Sha256"].splitlines() if line.endswith(".dsc"))
    return {
        "probe": probe,
        "value": real.build_architectures(stanza).get(probe["package"], []),
        "archive": "ubuntu",
        "package": probe["package"],
        "version": stanza["Version"],
        "pool": f"{stanza['Directory']}/{dsc[2]}",
        "sha256": dsc[0],
    }


def ubuntu_records() -> list[dict[str, Any]]:
    """Every Ubuntu arm64 probe read live: what refresh.py writes to fixtures/arm64-ubuntu.json."""
    probes = {contractlib.probe_key(f.arm64): f.arm64 for f in PROBED if f.arm64["archive"] == "ubuntu"}
    return [ubuntu_record(probes[key]) for key in sorted(probes)]


def recorded(probe: dict[str, str]) -> dict[str, Any] | None:
    records = json.loads(FIXTURE.read_text())["facts"] if FIXTURE.exists() else []
    return next((r for r in records if r["probe"] == probe), None)


def reading_for(fact: Fact) -> tuple[contractlib.Reading, str]:
    probe = fact.arm64
    if probe["archive"] == "debian":
        return debian_reading(probe), "downloaded"
    if contractlib.ubuntu_live():
        return contractlib.Reading.from_record(ubuntu_record(probe)), "live"
    record = recorded(probe)
    if record is None:
        raise ContractError(f"{fact.id}: the Ubuntu archive does not answer and {FIXTURE.name} lacks {probe}")
    return contractlib.Reading.from_record(record), "fixture"


@pytest.mark.parametrize("fact", PROBED, ids=lambda f: f.id)
def test_the_arm64_package_exists(fact: Fact) -> None:
    reading, how = reading_for(fact)
    note_reading(how)
    if fact.arm64["read"] == "build-architectures":
        assert "arm64" in reading.value, (
            f"{fact.id}: {reading.where} builds {reading.package} for {reading.value}"
        )
    elif fact.arm64["read"] == "dkms":
        assert reading.value == fact.value, f"{fact.id}: {reading.where} registers {reading.value!r}"
    else:
        assert reading.package == fact.arm64["package"] and reading.pool.endswith("_arm64.deb"), reading
    source_package = reading.pool.rsplit("/", 1)[-1].split("_")[0]
    assert str(fact.source).startswith(f"{reading.archive}:") and f"/{source_package}_" in str(fact.source), (
        f"{fact.id}: source {fact.source!r} does not name what was read ({reading.where})"
    )


def test_every_arm64_fact_says_how_it_is_read() -> None:
    """A downloaded or fixture fact of this file is read here (probe_in), with an arm64 probe."""
    for fact in FACTS:
        if fact.checked == "documented":
            assert "arm64" not in fact.entry, fact.id
            continue
        assert fact.entry.get("probe_in") == THIS and "probe" not in fact.entry, fact.id
        assert set(fact.arm64) >= {"archive", "suite", "component", "package", "read"}, fact.id
        archive = fact.arm64["archive"]
        assert (fact.checked, archive) in (("downloaded", "debian"), ("fixture", "ubuntu")), fact.id
        assert fact.arm64["suite"] in contractlib.DISTRIBUTIONS[fact.distribution].suites, fact.id


def test_ubuntu_fixture_records_every_ubuntu_arm64_probe() -> None:
    """CI without the Ubuntu archive reads these; each names the source package read and its digest."""
    ubuntu = [f for f in PROBED if f.arm64["archive"] == "ubuntu"]
    assert ubuntu, "facts/arm64.yaml has no Ubuntu entries"
    for fact in ubuntu:
        record = recorded(fact.arm64)
        assert record is not None, f"{fact.id}: {FIXTURE.name} lacks {fact.arm64}: run refresh.py"
        assert (
            "arm64" in record["value"] and record["pool"].startswith("pool/") and len(record["sha256"]) == 64
        )


# --- the roles ------------------------------------------------------------------------------------------


def on(distribution: str, architecture: str) -> contractlib.Distribution:
    distro = contractlib.DISTRIBUTIONS[distribution]
    return replace(distro, facts={**distro.facts, "architecture": architecture})


@pytest.mark.parametrize("distribution", DEBIAN_FAMILY)
def test_toolkit_apt_repository_follows_the_architecture(distribution: str) -> None:
    def url(architecture: str) -> str:
        return str(
            RoleVars("nvidia_container_toolkit", on(distribution, architecture)).get(
                "nvidia_container_toolkit_apt_repo_url"
            )
        )

    assert url("x86_64") == f"{TOOLKIT_REPO}/amd64", "x86_64 hosts keep the URL they had"
    assert url("aarch64") == f"{TOOLKIT_REPO}/arm64"
    assert url("ppc64le") == f"{TOOLKIT_REPO}/", "no directory: install-Debian.yml refuses it first"


@pytest.mark.parametrize("distribution", ["ubuntu-22.04", "ubuntu-24.04"])
@pytest.mark.parametrize("role", ["nvidia_cuda_toolkit", "nvidia_fabricmanager"])
def test_cuda_repository_is_sbsa_on_aarch64(role: str, distribution: str) -> None:
    release = distribution.split("-")[1].replace(".", "")
    base = f"https://developer.download.nvidia.com/compute/cuda/repos/ubuntu{release}"
    assert RoleVars(role, on(distribution, "x86_64")).get(f"{role}_repo_url").strip() == f"{base}/x86_64"
    assert RoleVars(role, on(distribution, "aarch64")).get(f"{role}_repo_url").strip() == f"{base}/sbsa"


@pytest.mark.parametrize("distribution", DEBIAN_FAMILY)
def test_driver_installs_on_x86_64_and_aarch64(distribution: str) -> None:
    supported = RoleVars("nvidia_driver", contractlib.DISTRIBUTIONS[distribution]).get(
        "nvidia_driver_supported_architectures"
    )
    assert supported == ["x86_64", "aarch64"]


# --- refusals, through ansible-playbook -------------------------------------------------------------------


def play(tmp_path: Path, facts: dict[str, str], role: str, tasks_from: str, **variables: Any) -> str:
    """One role task file run on localhost with the given ansible_facts; its output (it must fail)."""
    playbook = tmp_path / "play.yml"
    tasks = [
        {"ansible.builtin.set_fact": {"ansible_facts": facts}},
        {"ansible.builtin.include_role": {"name": role, "tasks_from": tasks_from}, "vars": variables},
    ]
    playbook.write_text(
        yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "connection": "local", "tasks": tasks}])
    )
    # The task files call gpufleet.nvidia modules: this checkout is that collection.
    collection = tmp_path / "collections/ansible_collections/gpufleet/nvidia"
    collection.parent.mkdir(parents=True)
    collection.symlink_to(REPO, target_is_directory=True)
    collections = {"ANSIBLE_COLLECTIONS_PATH": str(tmp_path / "collections")}
    proc = contractlib.run_play(playbook, tmp_path, collections)
    assert proc.returncode != 0, proc.stdout[-2000:]
    return proc.stdout


def debian_facts(architecture: str) -> dict[str, str]:
    return {**contractlib.DISTRIBUTIONS["debian-12"].facts, "architecture": architecture}


def test_driver_refuses_another_architecture_naming_the_supported_ones(tmp_path: Path) -> None:
    out = play(tmp_path, debian_facts("ppc64le"), "nvidia_driver", "setup.yml")
    assert "nvidia_driver does not install on ppc64le; supported architectures: x86_64, aarch64" in out, out


def test_toolkit_refuses_another_architecture_naming_the_supported_ones(tmp_path: Path) -> None:
    out = play(tmp_path, debian_facts("ppc64le"), "nvidia_container_toolkit", "install-Debian.yml")
    assert (
        "has no packages for the CPU architecture ppc64le" in out and "supported: x86_64, aarch64" in out
    ), out


def test_toolkit_refuses_an_amd64_mirror_on_an_aarch64_host(tmp_path: Path) -> None:
    mirror = "http://mirror.internal/libnvidia-container/stable/deb/amd64"
    out = play(
        tmp_path,
        debian_facts("aarch64"),
        "nvidia_container_toolkit",
        "install-Debian.yml",
        nvidia_container_toolkit_apt_repo_url=mirror,
    )
    assert f"nvidia_container_toolkit_apt_repo_url is {mirror}, the directory for another architecture" in out
    assert "whose directory is arm64" in out, out
