"""End state of nvidia_driver: packages pinned and held, runfile installed with its flags, removal clean."""

import pytest

VERSION = "535.261.03"


@pytest.fixture()
def name(host):
    return host.backend.get_hostname()


def test_package_host_has_exact_versions_held(host, name):
    if name != "gpufleet-drv-package":
        pytest.skip("package host only")
    for pkg in ("nvidia-smi", "libnvidia-ml1"):
        assert host.package(pkg).is_installed, pkg
        assert host.package(pkg).version == f"{VERSION}-1", pkg
    held = host.check_output("apt-mark showhold").split()
    assert {"nvidia-smi", "libnvidia-ml1"} <= set(held)


def test_package_host_nonfree_source_and_persistenced(host, name):
    if name != "gpufleet-drv-package":
        pytest.skip("package host only")
    source = host.file("/etc/apt/sources.list.d/debian-nonfree-nvidia.sources")
    assert source.contains("non-free")
    assert host.service("nvidia-persistenced").is_enabled


def test_userspace_reports_driver_not_loaded(host, name):
    if name == "gpufleet-drv-removed":
        pytest.skip("driver removed there")
    result = host.run("nvidia-smi")
    # exit 9: NVML is installed and wired, no kernel module (GPU-less host with --cap-drop=MKNOD)
    assert result.rc == 9
    assert "couldn't communicate with the NVIDIA driver" in result.stdout + result.stderr


def test_runfile_installed_with_required_flags(host, name):
    if name != "gpufleet-drv-runfile":
        pytest.skip("runfile host only")
    assert VERSION in host.check_output("nvidia-installer --version")
    log = host.file("/var/log/nvidia-installer.log").content_string.splitlines()
    installs = [line for line in log if ".run " in line]
    assert len(installs) == 1, "the runfile ran more than once: not idempotent"
    for flag in ("--silent", "--dkms", "--no-x-check", "--no-nouveau-check", "--no-opengl-files"):
        assert flag in installs[0]
    assert host.file(f"/var/cache/gpufleet/NVIDIA-Linux-x86_64-{VERSION}.run").exists
    assert host.service("nvidia-persistenced").is_enabled


def test_removed_host_has_no_driver_and_no_holds(host, name):
    if name != "gpufleet-drv-removed":
        pytest.skip("removal host only")
    for pkg in ("nvidia-smi", "libnvidia-ml1"):
        assert not host.package(pkg).is_installed, pkg
    assert host.check_output("apt-mark showhold").strip() == ""
    assert host.run("command -v nvidia-smi").rc != 0
