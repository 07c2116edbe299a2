"""End state of nvidia_fabricmanager: NVSwitch host only, at the driver's exact version, held, running."""

import pytest

DRIVER = "535.261.03"


@pytest.fixture()
def name(host):
    return host.backend.get_hostname()


def test_fabricmanager_matches_driver_and_is_held(host, name):
    if name != "gpufleet-fm-nvswitch":
        pytest.skip("NVSwitch host only")
    fm = host.package("nvidia-fabricmanager-535")
    assert fm.is_installed
    assert fm.version.split("-")[0] == host.package("nvidia-smi").version.split("-")[0] == DRIVER
    assert "nvidia-fabricmanager-535" in host.check_output("apt-mark showhold").split()
    assert DRIVER in host.check_output("nv-fabricmanager --version")


def test_fabricmanager_running_on_nvswitch_host(host, name):
    if name != "gpufleet-fm-nvswitch":
        pytest.skip("NVSwitch host only")
    service = host.service("nvidia-fabricmanager")
    assert service.is_enabled
    assert service.is_running
    log = host.file("/var/log/fabricmanager.log").content_string
    assert f"Successfully configured all the available NVSwitches (2) for driver {DRIVER}" in log


def test_fabricmanager_off_on_plain_host(host, name):
    if name != "gpufleet-fm-plain":
        pytest.skip("plain host only")
    service = host.service("nvidia-fabricmanager")
    assert not service.is_enabled
    assert not service.is_running


def test_repository_is_signed_and_keyed(host, name):
    if name != "gpufleet-fm-nvswitch":
        pytest.skip("NVSwitch host only")
    source = host.file("/etc/apt/sources.list.d/nvidia-cuda.sources").content_string
    assert "Signed-By: /etc/apt/keyrings/nvidia-cuda.asc" in source
    assert host.file("/etc/apt/keyrings/nvidia-cuda.asc").contains("BEGIN PGP PUBLIC KEY BLOCK")
