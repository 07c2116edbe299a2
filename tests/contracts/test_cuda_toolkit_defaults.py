"""nvidia_cuda_toolkit's default per distribution is a series NVIDIA's CUDA repository for it carries.

NVIDIA's repositories are not reachable from the build machines. What they carry is recorded, with its
source and date, in fixtures/nvidia-cuda-repos.json: directory listings (each repository's first file dates,
the CUDA releases' dates) and NVIDIA's images built from them. Two checks hold each default to it: the default
series has positive evidence for the distribution's repository, and the default version is not older than the
repository (NVIDIA adds a distribution's repository with the CUDA release current then and adds no older
ones: debian12's starts at 12.3.0, ubuntu2404's in May 2024; the old default cuda-toolkit-12-2 fails both).
"""

from __future__ import annotations

import json
from typing import Any

import contractlib
import pytest
from contractlib import role_vars

RECORD = contractlib.FIXTURES_DIR / "nvidia-cuda-repos.json"
SUPPORTED = ("debian-12", "ubuntu-22.04", "ubuntu-24.04", "el8", "el9")


def record() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(RECORD.read_text())
    return data


def default(distro: str) -> tuple[str, str, str, str]:
    """(repository directory, series, version, package) the role installs with nothing set."""
    rv = role_vars("nvidia_cuda_toolkit", distro)
    names = ("repo_distro", "series", "version", "package")
    repo, series, version, package = (str(rv.get(f"nvidia_cuda_toolkit_{name}")) for name in names)
    return repo, series, version, package


@pytest.mark.parametrize("distro", SUPPORTED)
def test_default_series_is_documented_in_the_distributions_repository(distro: str) -> None:
    repo, series, version, package = default(distro)
    repos = record()["repositories"]
    assert repo in repos, f"{RECORD.name} has no record of NVIDIA's {repo} repository"
    documented = repos[repo]["series"]
    assert series in documented, (
        f"{distro}: the default {package} ({series}) has no evidence in NVIDIA's {repo} repository; "
        f"documented there: {', '.join(sorted(documented))}"
    )
    assert package == f"cuda-toolkit-{series}"
    assert version.startswith(series.replace("-", ".") + "."), (
        f"{distro}: version {version} is not of {series}"
    )


@pytest.mark.parametrize("distro", SUPPORTED)
def test_default_version_is_not_older_than_the_repository(distro: str) -> None:
    repo, _, version, package = default(distro)
    data = record()
    assert version in data["releases"], (
        f"{RECORD.name} has no release date of {version}: add its listing line"
    )
    released, created = data["releases"][version]["date"], data["repositories"][repo]["created"]
    assert released >= created, (
        f"{distro}: {package} {version} was released {released}, before NVIDIA created its {repo} repository "
        f"({created}: {data['repositories'][repo]['created_source']}), which therefore does not carry it"
    )


@pytest.mark.parametrize("distro", ("debian-12", "ubuntu-22.04", "ubuntu-24.04"))
def test_facts_say_what_the_record_says(distro: str) -> None:
    _, _, version, package = default(distro)
    facts = {(f.variable, str(f.value)) for f in contractlib.load_facts()
             if f.role == "nvidia_cuda_toolkit" and f.distribution == distro}  # fmt: skip
    assert ("nvidia_cuda_toolkit_package", package) in facts and (
        "nvidia_cuda_toolkit_version",
        version,
    ) in facts


def test_every_recorded_fact_names_its_source_and_date() -> None:
    data = record()
    for version, release in data["releases"].items():
        assert release["date"] and "https://developer.download.nvidia.com/" in release["source"], version
    for repo, entry in data["repositories"].items():
        assert entry["created"] and entry["created_source"].startswith("listing of https://"), repo
        assert entry["series"] and all(entry["series"].values()), repo
