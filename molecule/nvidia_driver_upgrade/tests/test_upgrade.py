"""End state of playbooks/upgrade_driver.yml, then two rollouts that must fail and stop where they should.

The tests run in file order: the last two run the playbook again against the same hosts.
"""

import datetime
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import testinfra

OLD, NEW = "535.216.03", "535.261.03"
NVSWITCH, PLAIN = "gpufleet-upg-nvswitch", "gpufleet-upg-plain"
PLAYBOOK = Path(os.environ.get("MOLECULE_PROJECT_DIRECTORY", ".")) / "playbooks" / "upgrade_driver.yml"
BOOT = "cut -d' ' -f22 /proc/1/stat"


def _host(name):
    return testinfra.get_host(f"podman://{name}")


def _boot(host):
    return host.check_output(BOOT).strip()


def _upgrade_time(host, version):
    """When apt last moved nvidia-smi to the version (its history log, the host's local time)."""
    moved = re.compile(r"nvidia-smi:amd64 \((?:[^,)]+, )?" + re.escape(version))
    start, found = None, None
    for line in host.file("/var/log/apt/history.log").content_string.splitlines():
        if line.startswith("Start-Date:"):
            start = line.split(":", 1)[1].strip()
        elif moved.search(line):
            found = start
    assert found, f"apt's history has no move of nvidia-smi to {version}"
    return datetime.datetime.strptime(" ".join(found.split()), "%Y-%m-%d %H:%M:%S")


def _playbook(version, tmp_path):
    """Run upgrade_driver.yml against this scenario's inventory; returns the finished process."""
    log = tmp_path / "upgrade.log"
    run = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-playbook"), "-i", os.environ["MOLECULE_INVENTORY_FILE"],
         str(PLAYBOOK), "-e", f"gpufleet_driver_version={version}"],
        capture_output=True, text=True, timeout=1500, check=False,
    )  # fmt: skip
    log.write_text(run.stdout + run.stderr)
    run.output = run.stdout + run.stderr  # ansible-core writes task errors to stderr
    return run


@pytest.fixture()
def name(host):
    return host.backend.get_hostname()


def test_driver_is_at_the_new_version_pinned_and_held(host):
    for pkg in ("nvidia-smi", "libnvidia-ml1"):
        assert host.package(pkg).version == f"{NEW}-1", pkg
    assert {"nvidia-smi", "libnvidia-ml1"} <= set(host.check_output("apt-mark showhold").split())
    pin = host.file("/etc/apt/preferences.d/gpufleet-nvidia-driver.pref").content_string
    assert "Package: src:nvidia-graphics-drivers" in pin
    assert f"Pin: version {NEW}-*" in pin
    assert OLD not in pin


def test_each_host_rebooted_once_into_the_new_module(host):
    before = host.file("/var/tmp/gpufleet-boot-before-upgrade").content_string.strip()
    assert _boot(host) != before, "the host did not restart during the upgrade"
    desc = host.file("/etc/gpufleet-sim/machine.json").content_string
    assert f'"driver_version": "{NEW}"' in desc, desc
    assert host.service("gpufleet-sim-load-driver").is_enabled


def test_fabricmanager_moved_with_the_driver_on_the_nvswitch_host_only(host, name):
    if name == NVSWITCH:
        assert host.package("nvidia-fabricmanager-535").version == f"{NEW}-1"
        assert host.service("nvidia-fabricmanager").is_running
        assert "nvidia-fabricmanager-535" in host.check_output("apt-mark showhold").split()
        log = host.file("/var/log/fabricmanager.log").content_string
        assert f"for driver {NEW}" in log.splitlines()[-1], log[-400:]
    else:
        assert not host.package("nvidia-fabricmanager-535").is_installed


def test_hosts_went_one_at_a_time():
    """serial 1: the plain host's packages moved only after the NVSwitch host had rebooted and its fabric
    manager was running again."""
    nvswitch, plain = _host(NVSWITCH), _host(PLAIN)
    fm_up = nvswitch.check_output("systemctl show nvidia-fabricmanager -p ActiveEnterTimestamp --value")
    fm_up_at = datetime.datetime.strptime(" ".join(fm_up.split()[1:3]), "%Y-%m-%d %H:%M:%S")
    assert _upgrade_time(plain, NEW) >= fm_up_at, (fm_up, _upgrade_time(plain, NEW))


def test_version_no_repository_offers_stops_before_any_host_is_touched(tmp_path):
    hosts = [_host(NVSWITCH), _host(PLAIN)]
    boots = [_boot(h) for h in hosts]
    run = _playbook("535.999.99", tmp_path)
    assert run.returncode != 0, run.output[-2000:]
    assert "535.999.99 is not offered" in run.output, run.output[-3000:]
    assert [_boot(h) for h in hosts] == boots, "a host restarted although the preflight failed"
    for h in hosts:
        assert h.package("nvidia-smi").version == f"{NEW}-1"
    assert hosts[0].service("nvidia-fabricmanager").is_running, "the preflight stopped the fabric manager"


def test_failed_host_stops_the_rollout(tmp_path):
    """The first host's new module does not load after its reboot (the DKMS build "failed"): its fabric
    manager cannot start, the play fails there, and the second host is never touched."""
    nvswitch, plain = _host(NVSWITCH), _host(PLAIN)
    nvswitch.run_expect([0], "touch /etc/gpufleet-sim/dkms-fails")
    plain_boot = _boot(plain)
    run = _playbook(OLD, tmp_path)
    assert run.returncode != 0, run.output[-2000:]
    assert re.search(r"nvidia-fabricmanager is \w+ on gpufleet-upg-nvswitch", run.output), run.output[-3000:]
    assert nvswitch.package("nvidia-smi").version.startswith(f"{OLD}-")
    assert "driver is not loaded" in nvswitch.file("/var/log/fabricmanager.log").content_string
    assert _boot(plain) == plain_boot, "the second host restarted: the rollout did not stop"
    assert plain.package("nvidia-smi").version == f"{NEW}-1"
