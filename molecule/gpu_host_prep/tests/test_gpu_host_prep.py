"""End state of gpu_host_prep on Debian test hosts (a real Debian kernel image installed in prepare)."""

import pytest


@pytest.fixture(scope="module")
def kernel(host):
    releases = host.check_output("ls /lib/modules").split()
    assert len(releases) == 1, releases
    return releases[0]


def test_nouveau_blacklisted(host):
    conf = host.file("/etc/modprobe.d/blacklist-nouveau.conf")
    assert conf.is_file
    assert conf.mode == 0o644
    lines = [line.strip() for line in conf.content_string.splitlines() if not line.startswith("#")]
    assert "blacklist nouveau" in lines
    assert "options nouveau modeset=0" in lines


def test_initramfs_carries_the_blacklist(host, kernel):
    listing = host.check_output(f"lsinitramfs /boot/initrd.img-{kernel}")
    assert "etc/modprobe.d/blacklist-nouveau.conf" in listing.split()


def test_build_tools_and_headers_for_the_kernel(host, kernel):
    for name in ("build-essential", "dkms", f"linux-headers-{kernel}"):
        assert host.package(name).is_installed, name
    assert host.file(f"/lib/modules/{kernel}/build").exists
    assert host.run("gcc --version").rc == 0


def test_kernel_held(host, kernel):
    held = host.check_output("apt-mark showhold").split()
    assert f"linux-image-{kernel}" in held
    assert f"linux-headers-{kernel}" in held


def test_no_reboot_left_pending_by_the_role(host):
    assert host.run("systemctl is-system-running").stdout.strip() in ("running", "degraded")
