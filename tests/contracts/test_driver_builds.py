"""The driver-side roles' default versions are the newest build of their branch that the distribution
publishes in any suite the role installs from, the security suite included.

The roles pin the driver's packages at exactly that version (apt priority 1001, which also moves a package
down): a default older than a build the host can get would move every host that took the distribution's
update back to the older build. Debian 12 was such a case: bookworm-security carries 535.309.01-0+deb12u1 of
every src:nvidia-graphics-drivers package while the default was bookworm's 535.261.03.

Suites per distribution, as a host of it installs from them:
- Debian: the role's own sources, nvidia_driver_debian_suites of Debian's mirror and
  nvidia_driver_debian_security_suites of Debian's security archive (deb.debian.org/debian-security), with
  nvidia_driver_debian_components; each index verified by gpgv and its SHA256 chain.
- Ubuntu: the stock server's sources, which the role leaves alone: <release>, -updates and -security,
  restricted and multiverse. Read live when Ubuntu's archive answers, else from
  fixtures/driver-builds-ubuntu.json
  (`python tests/contracts/refresh.py` rewrites it).

NVIDIA's own repositories (the fabric manager on Debian, EL) are not readable here and are not covered.
"""

from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

import contractlib
import pytest
from contractlib import ContractError, note_reading, real, role_vars, upstream

THIS = "tests/contracts/test_driver_builds.py"
FIXTURE = contractlib.FIXTURES_DIR / "driver-builds-ubuntu.json"
DEBIAN_FAMILY = ("debian-12", "debian-13", "ubuntu-22.04", "ubuntu-24.04")
UBUNTU_COMPONENTS = ("restricted", "multiverse")
# A package whose newest build of the branch is older than the default, on purpose, and what the role does
# about it. Debian builds the open kernel modules from their own source package (nvidia-open-gpu-kernel-
# modules), which took no part in bookworm's security update: the role refuses the open flavour at the default
# version (tasks/repo-Debian.yml says why and what to set) rather than install a mixed set whose kernel module
# does not match the userspace. When Debian publishes a newer open build this test fails: drop the entry and
# the docs' sentence about it (roles/nvidia_driver/README.md, docs/roles.md).
KNOWN_LAGS = {("debian-12", "nvidia-open-kernel-dkms"): "535.261.03"}
OPEN_LAG_REFUSAL = "the open kernel modules have no build of"


def _key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version))


def _branch_builds(versions: list[str], branch: str) -> list[str]:
    return sorted({upstream(v) for v in versions if upstream(v).split(".")[0] == branch}, key=_key)


# --- where each distribution installs from --------------------------------------------------------------


def sources(distro: str) -> list[tuple[str, str, str]]:
    """(archive, suite, component) of every index a host of the distribution installs the driver from."""
    rv = role_vars("nvidia_driver", distro)
    if contractlib.DISTRIBUTIONS[distro].archive == "ubuntu":
        release = contractlib.DISTRIBUTIONS[distro].facts["distribution_release"]
        suites = [release, f"{release}-updates", f"{release}-security"]
        return [("ubuntu", s, c) for s in suites for c in UBUNTU_COMPONENTS]
    components = [str(c) for c in rv.get("nvidia_driver_debian_components")]
    found = [("debian", str(s), c) for s in rv.get("nvidia_driver_debian_suites") for c in components]
    if rv.get("nvidia_driver_debian_security_mirror"):
        found += [
            ("debian-security", str(s), c)
            for s in rv.get("nvidia_driver_debian_security_suites")
            for c in components
        ]
    return found


@cache
def _live_versions(archive: str, suite: str, component: str, package: str) -> tuple[str, ...]:
    return tuple(s.version for s in contractlib.stanzas(archive, suite, component, package))


@cache
def _recorded() -> dict[str, list[str]]:
    if not FIXTURE.exists():
        return {}
    return {_record_key(r): r["versions"] for r in json.loads(FIXTURE.read_text())["facts"]}


def _record_key(record: dict[str, Any]) -> str:
    return f"{record['suite']}/{record['component']}/{record['package']}"


def versions(archive: str, suite: str, component: str, package: str) -> list[str]:
    """Every version of the package in one index (Ubuntu: live when it answers, else recorded)."""
    if archive != "ubuntu":
        note_reading("downloaded")
        return list(_live_versions(archive, suite, component, package))
    if contractlib.ubuntu_live():
        note_reading("live")
        return list(_live_versions(archive, suite, component, package))
    key = f"{suite}/{component}/{package}"
    if key not in _recorded():
        raise ContractError(
            f"the Ubuntu archive does not answer and {FIXTURE.relative_to(contractlib.REPO)} has no "
            f"recording of {key}: run `python tests/contracts/refresh.py` where it answers"
        )
    note_reading("fixture")
    return _recorded()[key]


# --- what each role pins ---------------------------------------------------------------------------------


def pinned(distro: str) -> list[tuple[str, str, str, list[str]]]:
    """(role, the role's version variable, its default, the packages it installs at that version)."""
    sets = []
    for flavour in ("proprietary", "open"):
        rv = role_vars("nvidia_driver", distro, nvidia_driver_kernel_modules=flavour)
        packages = [str(p) for p in rv.get("nvidia_driver_os_packages")]
        version = str(rv.get("nvidia_driver_version"))
        sets.append((f"nvidia_driver ({flavour})", "nvidia_driver_version", version, packages))
    mps = role_vars("nvidia_mps", distro)
    sets.append(("nvidia_mps", "nvidia_mps_driver_version", str(mps.get("nvidia_mps_driver_version")),
                 [str(mps.get("nvidia_mps_package"))]))  # fmt: skip
    if contractlib.DISTRIBUTIONS[distro].archive == "ubuntu":
        fm = role_vars("nvidia_fabricmanager", distro)
        version = str(fm.get("nvidia_fabricmanager_version"))
        package = str(fm.get("nvidia_fabricmanager_package"))
        sets.append(("nvidia_fabricmanager", "nvidia_fabricmanager_version", version, [package]))
    return sets


def builds(distro: str, package: str, branch: str) -> dict[str, list[str]]:
    """The package's builds of the branch (upstream versions) per suite, across every source of the distro."""
    found: dict[str, list[str]] = {}
    for archive, suite, component in sources(distro):
        ups = _branch_builds(versions(archive, suite, component, package), branch)
        if ups:
            found.setdefault(suite, [])
            found[suite] = sorted(set(found[suite]) | set(ups), key=_key)
    return found


CASES = [
    (d, role, var, package) for d in DEBIAN_FAMILY for role, var, _, pkgs in pinned(d) for package in pkgs
]


@pytest.mark.parametrize(("distro", "role", "variable", "package"), CASES, ids=lambda v: str(v))
def test_no_newer_build_of_the_branch_than_the_default(
    distro: str, role: str, variable: str, package: str
) -> None:
    default = next(v for r, var, v, _ in pinned(distro) if r == role and var == variable)
    branch = default.split(".")[0]
    per_suite = builds(distro, package, branch)
    assert per_suite, (
        f"{distro}: no suite the role installs from ({sources(distro)}) has {package} of branch {branch}"
    )
    newest_suite, newest = max(((s, v[-1]) for s, v in per_suite.items()), key=lambda sv: _key(sv[1]))
    lag = KNOWN_LAGS.get((distro, package))
    if lag is not None:
        assert newest == lag, (
            f"{distro}: {package}'s newest build of {branch} is now {newest} ({newest_suite}), not {lag}: "
            "drop it from KNOWN_LAGS, and the docs' sentence on the open flavour lagging the security update"
        )
        assert _key(newest) < _key(default)
        return
    assert _key(newest) <= _key(default), (
        f"{distro}: {package} has {newest} in {newest_suite}, newer than {role}'s default {variable} "
        f"{default}: a host that takes that update would be moved back by the role's pin. Raise the default "
        "to the newest build (vars/ of nvidia_driver, nvidia_fabricmanager and nvidia_mps together) and its "
        "facts"
    )
    assert newest == default, (
        f"{distro}: {package}'s newest build of {branch} is {newest}, the default {default}"
    )


def test_the_role_refuses_the_open_flavour_where_it_lags() -> None:
    """Where the open modules lag, the role says so and installs no mixed set (see KNOWN_LAGS)."""
    repo_tasks = (contractlib.ROLES / "nvidia_driver" / "tasks" / "repo-Debian.yml").read_text()
    assert OPEN_LAG_REFUSAL in repo_tasks
    for (distro, package), lag in KNOWN_LAGS.items():
        rv = role_vars("nvidia_driver", distro, nvidia_driver_kernel_modules="open")
        assert rv.get("nvidia_driver_os_packages")[0] == package
        assert str(rv.get("nvidia_driver_version")) != lag


@pytest.mark.parametrize("distro", ("debian-12", "debian-13"))
def test_debian_security_suites_the_role_enables_exist_with_its_components(distro: str) -> None:
    """The role's security source (nvidia_driver_debian_security_*): the archive signs each of its suites and
    lists an index for every component the role enables there."""
    rv = role_vars("nvidia_driver", distro)
    mirror = str(rv.get("nvidia_driver_debian_security_mirror"))
    assert mirror == real.DEBIAN_SECURITY_MIRROR, f"{distro}: security mirror {mirror}"
    suites = [str(s) for s in rv.get("nvidia_driver_debian_security_suites")]
    release = contractlib.DISTRIBUTIONS[distro].facts["distribution_release"]
    assert suites == [f"{release}-security"]
    for suite in suites:
        for component in rv.get("nvidia_driver_debian_components"):
            assert real.index_sha256(real.Archive.debian_security(), suite, str(component))
            note_reading("downloaded")


def test_security_facts_are_read_here() -> None:
    facts = [f for f in contractlib.load_facts() if f.entry.get("probe_in") == THIS]
    assert {f.distribution for f in facts} >= {"debian-12", "debian-13"}, facts
    for fact in facts:
        assert contractlib.role_says(fact)[0], fact.id


# --- the Ubuntu recording --------------------------------------------------------------------------------


def ubuntu_records() -> list[dict[str, Any]]:
    """Every Ubuntu index this file reads, read live: what refresh.py writes to the fixture."""
    records = []
    for distro in DEBIAN_FAMILY:
        if contractlib.DISTRIBUTIONS[distro].archive != "ubuntu":
            continue
        packages = sorted({p for _, _, _, pkgs in pinned(distro) for p in pkgs})
        for archive, suite, component in sources(distro):
            digest = contractlib._index_digest(archive, suite, component)
            for package in packages:
                records.append({
                    "archive": archive, "suite": suite, "component": component, "package": package,
                    "versions": list(_live_versions(archive, suite, component, package)),
                    "index_sha256": digest,
                })  # fmt: skip
    return sorted(records, key=_record_key)


def test_ubuntu_fixture_records_every_index_read() -> None:
    missing = []
    for distro in DEBIAN_FAMILY:
        if contractlib.DISTRIBUTIONS[distro].archive != "ubuntu":
            continue
        for _, _, _, pkgs in pinned(distro):
            for _, suite, component in sources(distro):
                missing += [
                    f"{suite}/{component}/{p}" for p in pkgs if f"{suite}/{component}/{p}" not in _recorded()
                ]
    assert not missing, f"{FIXTURE.name} lacks {missing}: run `python tests/contracts/refresh.py`"
