"""End state of gpu_host_prep + nvidia_driver on Ubuntu 22.04 with a real DKMS build: Ubuntu's
nvidia-dkms-<branch>-server compiled its module (nvidia-srv) for a real Ubuntu kernel whose headers the
archive offers today, and installed the .ko files for that kernel, although the host runs another kernel.

The target kernel is found again here the way the converge found it (what linux-headers-generic depends on
in the host's package index); branch and version are the role's Ubuntu defaults (vars/Ubuntu.yml).
"""

import os
import re
from pathlib import Path

import pytest
import yaml

SCENARIO = Path(os.environ.get("MOLECULE_SCENARIO_DIRECTORY", Path(__file__).resolve().parents[1]))
ROLE_VARS = yaml.safe_load((SCENARIO.parents[1] / "roles/nvidia_driver/vars/Ubuntu.yml").read_text())
BRANCH = ROLE_VARS["nvidia_driver_os_default_branch"]
VERSION = ROLE_VARS["nvidia_driver_os_default_version"]
# The proprietary -server flavour's DKMS package and the module name its dkms.conf registers.
DKMS_PACKAGE = f"nvidia-dkms-{BRANCH}-server"
MODULE = ROLE_VARS["nvidia_driver_dkms_modules"]["proprietary"]


@pytest.fixture()
def kernel(host):
    depends = host.check_output("apt-cache depends linux-headers-generic")
    (release,) = re.findall(r"Depends: linux-headers-(\S+-generic)", depends)
    return release


@pytest.fixture()
def built_modules(host):
    """BUILT_MODULE_NAME[...] of the module's dkms.conf, as shipped in the package."""
    conf = host.file(f"/usr/src/{MODULE}-{VERSION}/dkms.conf").content_string
    names = re.findall(r'^BUILT_MODULE_NAME\[\d+\]="?([\w-]+)"?', conf, re.MULTILINE)
    assert names, conf
    return names


def test_target_kernel_is_ubuntus_not_the_running_one(host, kernel):
    assert host.system_info.codename == "jammy"
    assert host.package(f"linux-headers-{kernel}").is_installed
    assert host.file(f"/lib/modules/{kernel}/build/Makefile").exists
    assert host.check_output("uname -r") != kernel


def test_dkms_package_at_exact_version_and_held(host):
    assert host.package(DKMS_PACKAGE).version.startswith(f"{VERSION}-0ubuntu0.22.04."), DKMS_PACKAGE
    assert DKMS_PACKAGE in host.check_output("apt-mark showhold").split()
    conf = host.file(f"/usr/src/{MODULE}-{VERSION}/dkms.conf").content_string
    assert f'PACKAGE_NAME="{MODULE}"' in conf


def test_dkms_reports_the_module_installed_for_that_kernel(host, kernel):
    status = host.check_output(f"dkms status -m {MODULE} -k {kernel}")
    lines = [line for line in status.splitlines() if line.strip()]
    assert len(lines) == 1, status
    assert MODULE in lines[0] and VERSION in lines[0] and kernel in lines[0], status
    assert lines[0].endswith(": installed"), status


def test_built_modules_are_installed_for_that_kernel(host, kernel, built_modules):
    for name in built_modules:
        path = f"/lib/modules/{kernel}/updates/dkms/{name}.ko"
        assert host.file(path).exists, path
        # Compiled against that kernel's headers, from this driver's sources.
        assert host.check_output(f"modinfo -F vermagic {path}").split()[0] == kernel, path
    nvidia = f"/lib/modules/{kernel}/updates/dkms/nvidia.ko"
    assert host.check_output(f"modinfo -F version {nvidia}") == VERSION


def test_userspace_reports_driver_not_loaded(host):
    # A module built for another kernel cannot load here (nor any module): nvidia-smi exit 9.
    result = host.run("nvidia-smi")
    assert result.rc == 9, result.stdout + result.stderr
