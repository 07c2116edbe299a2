"""End state of nvidia_driver on Ubuntu 22.04 and 24.04: Ubuntu's restricted driver userspace at exactly the
version, held, pinned by its source package; nvidia-smi wired to it (exit 9 without a kernel module).

The package set comes from the scenario's molecule.yml (group_vars all); branch and version are the role's
Ubuntu defaults (roles/nvidia_driver/vars/Ubuntu.yml), which the scenario leaves unset.
"""

import os
from pathlib import Path

import yaml

SCENARIO = Path(os.environ.get("MOLECULE_SCENARIO_DIRECTORY", Path(__file__).resolve().parents[1]))
MOLECULE = yaml.safe_load((SCENARIO / "molecule.yml").read_text())
VARS = MOLECULE["provisioner"]["inventory"]["group_vars"]["all"]
ROLE_VARS = yaml.safe_load((SCENARIO.parents[1] / "roles/nvidia_driver/vars/Ubuntu.yml").read_text())
BRANCH = ROLE_VARS["nvidia_driver_os_default_branch"]
VERSION = ROLE_VARS["nvidia_driver_os_default_version"]
PINNED = tuple(VARS["nvidia_driver_packages"])
# The role's guess of Ubuntu's source package name (vars/Ubuntu.yml: nvidia_driver_apt_pin_sources).
SOURCE = f"nvidia-graphics-drivers-{BRANCH}-server"
PIN_FILE = "/etc/apt/preferences.d/gpufleet-nvidia-driver.pref"
# Each test host's release, by the suite in its image name (localhost/gpufleet-testhost:<suite>).
RELEASES = {"jammy": "22.04", "noble": "24.04"}
SUITES = {p["name"]: p["image"].rsplit(":", 1)[1] for p in MOLECULE["platforms"]}


def test_scenario_covers_both_lts_releases():
    assert sorted(SUITES.values()) == sorted(RELEASES)


def test_host_runs_its_ubuntu_release(host):
    suite = SUITES[host.backend.get_hostname()]
    assert host.system_info.distribution == "ubuntu"
    assert host.system_info.codename == suite
    assert host.system_info.release == RELEASES[suite]


def test_packages_at_exact_version_and_held(host):
    installed = {}
    for pkg in PINNED:
        assert host.package(pkg).is_installed, pkg
        installed[pkg] = host.package(pkg).version
        # Ubuntu's revision names the release: 580.178.04-0ubuntu0.22.04.1, 580.178.04-0ubuntu0.24.04.1
        release = host.system_info.release
        assert installed[pkg].startswith(f"{VERSION}-0ubuntu0.{release}."), (pkg, installed[pkg])
    # One build of the driver (same Ubuntu revision), not a mix of revisions.
    assert len(set(installed.values())) == 1, installed
    held = host.check_output("apt-mark showhold").split()
    assert set(PINNED) <= set(held)


def test_pin_names_the_packages_source_package(host):
    pin = host.file(PIN_FILE).content_string
    assert f"Package: src:{SOURCE}\n" in pin
    assert f"Pin: version {VERSION}-*" in pin
    for pkg in PINNED:
        assert host.check_output(f"dpkg-query -W -f='${{source:Package}}' {pkg}") == SOURCE, pkg
    # apt applies the pin: the installed version's line in the version table carries priority 1001.
    policy = host.check_output(f"apt-cache policy {PINNED[0]}")
    (installed,) = [line.split() for line in policy.splitlines() if line.lstrip().startswith("***")]
    assert installed[1].startswith(f"{VERSION}-") and installed[2] == "1001", policy


def test_nvidia_smi_belongs_to_the_pinned_driver(host):
    # Not a transitional package of another branch pulling in some other branch's nvidia-smi.
    owner = host.check_output("dpkg -S /usr/bin/nvidia-smi").split(":")[0]
    assert owner in PINNED, owner
    assert host.package(owner).version.startswith(f"{VERSION}-")


def test_driver_comes_from_restricted_without_debian_sources(host):
    assert not host.file("/etc/apt/sources.list.d/debian-nonfree-nvidia.sources").exists
    madison = host.check_output(f"apt-cache madison {PINNED[0]}")
    assert "/restricted " in madison, madison


def test_persistenced_enabled_for_boot(host):
    # Enabled for real: linked into multi-user.target.wants. Ubuntu's unit has no [Install] section, so
    # without the role's drop-in `systemctl is-enabled` says "static" (which testinfra's is_enabled accepts).
    assert host.check_output("systemctl is-enabled nvidia-persistenced") == "enabled"
    assert host.file("/etc/systemd/system/multi-user.target.wants/nvidia-persistenced.service").is_symlink
    props = host.check_output("systemctl show -p StopWhenUnneeded -p WantedBy nvidia-persistenced")
    assert "StopWhenUnneeded=no" in props.splitlines(), props
    assert "multi-user.target" in props, props


def test_persistenced_started_during_the_boot_after_the_reboot(host):
    """The side effect rebooted the host; systemd then started the daemon from multi-user.target, with the
    drop-in's command. Without a GPU it gets as far as looking for the devices and exits (the control process
    fails, so systemd records no main PID): the unit left `inactive` during this boot, and the daemon's own
    log of this boot shows it ran as its user, loaded libnvidia-cfg.so.1 and looked for /dev/nvidia*."""
    before = host.file("/var/tmp/gpufleet-boot-before-reboot").content_string.strip()
    assert host.check_output("cut -d' ' -f22 /proc/1/stat") != before, "the host did not reboot"
    # A restarted systemd starts every unit's record from zero: a timestamp means a start job this boot.
    left = host.check_output("systemctl show --value -p InactiveExitTimestampMonotonic nvidia-persistenced")
    assert int(left) > 0, "systemd did not start nvidia-persistenced during this boot"
    daemon = host.check_output("journalctl -b --no-pager -o cat -t nvidia-persistenced")
    assert "Now running with user ID" in daemon, daemon
    assert "Failed to open libnvidia-cfg.so.1" not in daemon, daemon
    assert "Failed to query NVIDIA devices" in daemon, daemon
    unit = host.check_output("journalctl -b --no-pager -o cat -u nvidia-persistenced")
    assert "Starting NVIDIA Persistence Daemon" in unit or "Starting nvidia-persistenced" in unit, unit


def test_persistenced_runs_with_persistence_mode_on(host):
    # Ubuntu's unit passes --no-persistence-mode; the role's drop-in replaces its ExecStart, the unit stays.
    shipped = host.file("/lib/systemd/system/nvidia-persistenced.service").content_string
    assert "--no-persistence-mode" in shipped
    dropin = "/etc/systemd/system/nvidia-persistenced.service.d/gpufleet-persistence-mode.conf"
    assert host.file(dropin).exists
    effective = host.check_output("systemctl show -p ExecStart nvidia-persistenced")
    assert "argv[]=/usr/bin/nvidia-persistenced --user nvidia-persistenced --verbose " in effective, effective
    assert "--no-persistence-mode" not in effective


def test_userspace_reports_driver_not_loaded(host):
    result = host.run("nvidia-smi")
    # exit 9: NVML is installed and wired, no kernel module (GPU-less host with --cap-drop=MKNOD)
    assert result.rc == 9, result.stdout + result.stderr
    assert "couldn't communicate with the NVIDIA driver" in result.stdout + result.stderr
