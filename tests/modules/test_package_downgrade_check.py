"""package_downgrade_check run as Ansible runs it, against dpkg's own database format read by the real
dpkg-query (`--admindir` pointing at a status file shaped as a Debian 12 host's after the security update).

The packages, versions and source names are those of Debian's archive: bookworm carries 535.261.03-1 of
src:nvidia-graphics-drivers, bookworm-security 535.309.01-0+deb12u1, src:nvidia-open-gpu-kernel-modules only
535.261.03-1 (tests/contracts/test_driver_builds.py reads them from the archive itself).
"""

from __future__ import annotations

import shutil
import subprocess
import textwrap
from pathlib import Path
from typing import Any

import pytest
from modrun import run_module

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "plugins/modules/package_downgrade_check.py"
SECURITY = "535.309.01-0+deb12u1"
BOOKWORM = "535.261.03-1"

pytestmark = pytest.mark.skipif(
    shutil.which("dpkg-query") is None, reason="needs dpkg-query (Debian or Ubuntu)"
)


def stanza(
    package: str, version: str, source: str | None = None, status: str = "install ok installed"
) -> str:
    lines = [f"Package: {package}", f"Status: {status}", "Architecture: amd64", f"Version: {version}"]
    if source:
        lines.insert(3, f"Source: {source}")
    return "\n".join(lines) + "\n"


def admindir(tmp_path: Path, *stanzas: str) -> Path:
    root = tmp_path / "dpkg"
    (root / "info").mkdir(parents=True)
    (root / "updates").mkdir()
    (root / "status").write_text("\n".join(stanzas))
    return root


def run(tmp_path: Path, **args: Any) -> dict[str, Any]:
    return run_module(MODULE, tmp_path, **args)


DRIVER_ARGS = {
    "branch": "535",
    "packages": ["nvidia-kernel-dkms", "nvidia-smi", "libnvidia-ml1"],
    "sources": ["nvidia-graphics-drivers", "nvidia-open-gpu-kernel-modules"],
    "allow_variable": "nvidia_driver_allow_downgrade (gpufleet_driver_allow_downgrade)",
    "version_variable": "nvidia_driver_version (gpufleet_driver_version)",
}


def security_host(tmp_path: Path) -> Path:
    """A Debian 12 host that took bookworm-security's driver update (nvidia-smi held, as the role holds)."""
    return admindir(
        tmp_path,
        stanza("nvidia-smi", SECURITY, "nvidia-graphics-drivers", status="hold ok installed"),
        stanza("libnvidia-ml1", SECURITY, "nvidia-graphics-drivers"),
        stanza("nvidia-alternative", SECURITY, "nvidia-graphics-drivers"),
        # Its own source package and version: not part of the check.
        stanza("nvidia-persistenced", "535.171.04-1~deb12u1"),
        stanza("dpkg", "1.21.22"),
    )


def test_security_build_is_not_moved_back_and_the_failure_names_both_versions_and_the_variable(
    tmp_path: Path,
) -> None:
    result = run(tmp_path, version="535.261.03", admindir=str(security_host(tmp_path)), **DRIVER_ARGS)
    assert result.get("failed"), result
    msg = result["msg"]
    assert f"libnvidia-ml1, nvidia-alternative, nvidia-smi at {SECURITY}" in msg, msg
    assert "than 535.261.03, the version nvidia_driver_version (gpufleet_driver_version) asks for" in msg, msg
    assert "Nothing was changed" in msg
    assert "nvidia_driver_allow_downgrade (gpufleet_driver_allow_downgrade): true" in msg, msg
    assert "Set nvidia_driver_version (gpufleet_driver_version) to 535.309.01" in msg, msg
    assert [n["package"] for n in result["newer"]] == ["libnvidia-ml1", "nvidia-alternative", "nvidia-smi"]
    assert "nvidia-persistenced" not in result["checked"] and "dpkg" not in result["checked"]


def test_operator_may_move_back_on_purpose(tmp_path: Path) -> None:
    result = run(
        tmp_path, version="535.261.03", allow=True, admindir=str(security_host(tmp_path)), **DRIVER_ARGS
    )
    assert not result.get("failed"), result
    assert len(result["newer"]) == 3 and "as asked (nvidia_driver_allow_downgrade" in result["msg"]


@pytest.mark.parametrize(
    ("version", "why"),
    [
        ("535.309.01", "the installed build itself"),
        ("535.309.01-0+deb12u1", "a full Debian version of it"),
        ("535.999.01", "an upgrade"),
    ],
)
def test_the_same_or_a_newer_build_passes(tmp_path: Path, version: str, why: str) -> None:
    result = run(tmp_path, version=version, admindir=str(security_host(tmp_path)), **DRIVER_ARGS)
    assert not result.get("failed"), (why, result)
    assert result["newer"] == [] and result["newest"] == "535.309.01"


def test_another_branch_installed_is_a_branch_change_not_a_downgrade(tmp_path: Path) -> None:
    """Debian 13's 550 on the host and 535 asked for: the role's branch move, not this check's business."""
    host = admindir(tmp_path, stanza("nvidia-smi", "550.163.01-2", "nvidia-graphics-drivers"))
    result = run(tmp_path, version="535.261.03", admindir=str(host), **DRIVER_ARGS)
    assert not result.get("failed") and result["checked"] == {}, result


def test_another_debian_revision_of_the_same_upstream_version_is_no_downgrade(tmp_path: Path) -> None:
    """trixie-backports' 550.163.01-4~bpo13+1 and the pin 550.163.01-*: the same driver build."""
    host = admindir(tmp_path, stanza("nvidia-smi", "550.163.01-4~bpo13+1", "nvidia-graphics-drivers"))
    result = run(tmp_path, version="550.163.01", admindir=str(host), **{**DRIVER_ARGS, "branch": "550"})
    assert not result.get("failed") and result["newer"] == [], result


def test_packages_removed_but_configured_do_not_count(tmp_path: Path) -> None:
    """`apt remove` leaves conffiles (dpkg state config-files, "rc"): no build of them is on disk."""
    host = admindir(
        tmp_path, stanza("nvidia-smi", SECURITY, "nvidia-graphics-drivers", "deinstall ok config-files")
    )
    result = run(tmp_path, version="535.261.03", admindir=str(host), **DRIVER_ARGS)
    assert not result.get("failed") and result["checked"] == {}, result


def test_a_fresh_host_passes(tmp_path: Path) -> None:
    result = run(tmp_path, version="535.309.01", admindir=str(admindir(tmp_path, stanza("dpkg", "1.21.22"))),
                 **DRIVER_ARGS)  # fmt: skip
    assert not result.get("failed") and "none installed" in result["msg"], result


def test_open_modules_behind_the_userspace_are_refused_by_the_userspace(tmp_path: Path) -> None:
    """The proprietary set took 535.309.01; the open flavour's newest Debian 12 build is 535.261.03."""
    host = admindir(
        tmp_path,
        stanza("nvidia-kernel-dkms", SECURITY, "nvidia-graphics-drivers"),
        stanza("nvidia-smi", SECURITY, "nvidia-graphics-drivers"),
    )
    args = {**DRIVER_ARGS, "packages": ["nvidia-open-kernel-dkms", "nvidia-smi", "libnvidia-ml1"]}
    result = run(tmp_path, version="535.261.03", admindir=str(host), **args)
    assert result.get("failed") and "nvidia-kernel-dkms, nvidia-smi at 535.309.01-0+deb12u1" in result["msg"]


def test_a_runfile_driver_is_checked_from_the_version_given(tmp_path: Path) -> None:
    result = run(tmp_path, version="535.261.03", installed={"nvidia-installer": "535.309.01"}, **DRIVER_ARGS)
    assert result.get("failed") and "nvidia-installer at 535.309.01" in result["msg"], result


def test_an_unreadable_database_is_reported(tmp_path: Path) -> None:
    result = run(tmp_path, version="535.261.03", admindir=str(tmp_path / "missing"), **DRIVER_ARGS)
    assert result.get("failed") and "dpkg-query could not read the package database" in result["msg"], result


def test_status_file_is_what_dpkg_itself_reads(tmp_path: Path) -> None:
    """The fixture is dpkg's format, not a stand-in: dpkg-query lists the held package as dpkg would."""
    out = subprocess.run(
        ["dpkg-query", f"--admindir={security_host(tmp_path)}", "-W", "-f=${db:Status-Abbrev}${Package}\n",
         "nvidia-smi"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    assert textwrap.dedent(out).strip() == "hi nvidia-smi"
