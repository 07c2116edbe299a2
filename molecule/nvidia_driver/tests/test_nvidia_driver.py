"""End state of nvidia_driver: packages pinned and held, runfile installed with its flags, removal clean.

Each host's groups and expected driver version come from the scenario's molecule.yml (platform groups and
the provisioner's group_vars: bookworm 535.309.01 from bookworm-security, trixie 550.163.01, the runfile
host the stand-in runfile's 535.261.03), not from constants here.
"""

import os
from pathlib import Path

import pytest
import yaml

SCENARIO = Path(os.environ.get("MOLECULE_SCENARIO_DIRECTORY", Path(__file__).resolve().parents[1]))
MOLECULE = yaml.safe_load((SCENARIO / "molecule.yml").read_text())
RELEASES = {"bookworm": "12", "trixie": "13"}
PINNED = ("nvidia-smi", "libnvidia-ml1")
# apt preferences pin of the driver's source package (role nvidia_driver, Debian family)
PIN_FILE = "/etc/apt/preferences.d/gpufleet-nvidia-driver.pref"


def _host_groups() -> dict[str, list[str]]:
    return {p["name"]: list(p.get("groups") or []) for p in MOLECULE["platforms"]}


def _host_vars(name: str) -> dict:
    group_vars = MOLECULE["provisioner"]["inventory"]["group_vars"]
    merged = dict(group_vars.get("all") or {})
    for group in _host_groups()[name]:
        merged.update(group_vars.get(group) or {})
    return merged


@pytest.fixture()
def name(host):
    return host.backend.get_hostname()


@pytest.fixture()
def groups(name):
    return _host_groups()[name]


@pytest.fixture()
def version(name):
    return _host_vars(name)["gpufleet_driver_version"]


def _package_host(groups):
    return "package" in groups and "removed" not in groups


def test_host_runs_its_release(host, groups):
    (release,) = [group for group in groups if group in RELEASES]
    assert host.system_info.distribution == "debian"
    assert host.system_info.codename == release
    assert host.system_info.release.split(".")[0] == RELEASES[release]


def test_package_host_has_exact_versions_held(host, groups, version):
    if not _package_host(groups):
        pytest.skip("package hosts only")
    installed = {}
    for pkg in PINNED:
        assert host.package(pkg).is_installed, pkg
        installed[pkg] = host.package(pkg).version
        assert installed[pkg].rpartition("-")[0] == version, (pkg, installed[pkg])
    # One build of the driver (same Debian revision), not a mix of revisions.
    assert len(set(installed.values())) == 1, installed
    held = host.check_output("apt-mark showhold").split()
    assert set(PINNED) <= set(held)
    pin = host.file(PIN_FILE).content_string
    assert "Package: src:nvidia-graphics-drivers" in pin
    assert f"Pin: version {version}-*" in pin


def test_package_host_nonfree_source_and_persistenced(host, groups):
    if not _package_host(groups):
        pytest.skip("package hosts only")
    source = host.file("/etc/apt/sources.list.d/debian-nonfree-nvidia.sources")
    fields = dict(line.split(":", 1) for line in source.content_string.splitlines() if ":" in line)
    assert "non-free" in fields["Components"].split()
    assert host.system_info.codename in fields["Suites"].split()
    assert host.service("nvidia-persistenced").is_enabled


def test_package_host_gets_debians_security_updates_of_the_driver(host, groups, version):
    """The driver's security updates are in <release>-security's non-free, which a stock host lacks."""
    if not _package_host(groups):
        pytest.skip("package hosts only")
    source = host.file("/etc/apt/sources.list.d/debian-security-nonfree-nvidia.sources")
    lines = [line.split(":", 1) for line in source.content_string.splitlines() if ":" in line]
    fields = {key.strip(): value.strip() for key, value in lines}
    assert fields["URIs"] == "http://deb.debian.org/debian-security"
    assert fields["Suites"].split() == [f"{host.system_info.codename}-security"]
    assert {"contrib", "non-free", "non-free-firmware"} <= set(fields["Components"].split())
    if host.system_info.codename == "bookworm":
        # The installed build is the one bookworm-security serves (the role's default), pinned at 1001.
        policy = host.check_output("apt-cache policy nvidia-smi")
        assert "deb.debian.org/debian-security bookworm-security/non-free" in policy, policy
        (installed,) = [line.split() for line in policy.splitlines() if line.lstrip().startswith("***")]
        assert installed[1] == f"{version}-0+deb12u1" and installed[2] == "1001", policy


def test_userspace_reports_driver_not_loaded(host, groups):
    if "removed" in groups:
        pytest.skip("driver removed there")
    result = host.run("nvidia-smi")
    # exit 9: NVML is installed and wired, no kernel module (GPU-less host with --cap-drop=MKNOD)
    assert result.rc == 9
    assert "couldn't communicate with the NVIDIA driver" in result.stdout + result.stderr


def test_runfile_installed_with_required_flags(host, groups, version):
    if "runfile" not in groups:
        pytest.skip("runfile host only")
    assert version in host.check_output("nvidia-installer --version")
    log = host.file("/var/log/nvidia-installer.log").content_string.splitlines()
    installs = [line for line in log if ".run " in line]
    assert len(installs) == 1, "the runfile ran more than once: not idempotent"
    for flag in ("--silent", "--dkms", "--no-x-check", "--no-nouveau-check", "--no-opengl-files"):
        assert flag in installs[0]
    assert host.file(f"/var/cache/gpufleet/NVIDIA-Linux-x86_64-{version}.run").exists
    assert host.service("nvidia-persistenced").is_enabled


def test_removed_host_has_no_driver_and_no_holds(host, groups):
    if "removed" not in groups:
        pytest.skip("removal host only")
    for pkg in PINNED:
        assert not host.package(pkg).is_installed, pkg
    assert host.check_output("apt-mark showhold").strip() == ""
    assert host.run("command -v nvidia-smi").rc != 0
    assert not host.file(PIN_FILE).exists, "the apt pin of the removed driver is left behind"
