"""End state of a GPU node after prepare.yml, drivers.yml and runtime.yml."""

import pytest


@pytest.fixture()
def name(host):
    return host.backend.get_hostname()


def test_nouveau_blacklisted(host):
    assert host.file("/etc/modprobe.d/blacklist-nouveau.conf").contains("^options nouveau modeset=0$")


def test_driver_userspace_pinned_and_answering(host):
    assert host.package("nvidia-smi").version == "535.261.03-1"
    assert "nvidia-smi" in host.check_output("apt-mark showhold").split()
    assert host.run("nvidia-smi").rc == 9  # no kernel module in a test host


def test_fabricmanager_only_on_the_nvswitch_node(host, name):
    fm = host.package("nvidia-fabricmanager-535")
    if name == "gpufleet-node-dgx":
        assert fm.version == "535.261.03-1"
        assert host.service("nvidia-fabricmanager").is_running
    else:
        assert not fm.is_installed  # gpu_facts found no NVSwitch: nothing installed


def test_toolkit_installed_everywhere(host):
    assert host.package("nvidia-container-toolkit").version == "1.17.8-1"


def test_runtimes_on_the_dgx_node(host, name):
    if name != "gpufleet-node-dgx":
        pytest.skip("runtimes only on the NVSwitch node")
    dump = host.check_output("containerd config dump")
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in dump
    assert 'bin_dir = "/usr/lib/cni"' in dump  # Debian's own CRI setting survived the drop-in
    assert 'default_runtime_name = "nvidia"' in dump
    assert host.service("containerd").is_running


def test_cuda_toolkit_without_driver_change(host, name):
    if name != "gpufleet-node-dgx":
        pytest.skip("CUDA toolkit only on the NVSwitch node")
    assert host.package("cuda-toolkit-12-2").version == "12.2.2-1"
    assert "cuda-toolkit-12-2" in host.check_output("apt-mark showhold").split()
    assert not host.package("cuda-drivers").is_installed
    assert host.package("nvidia-smi").version == "535.261.03-1"
    assert "release 12.2" in host.check_output("bash -lc 'nvcc --version'")


def test_mps_control_daemon_answers(host, name):
    if name != "gpufleet-node-dgx":
        pytest.skip("MPS only on the NVSwitch node")
    assert host.package("nvidia-cuda-mps").version == "535.261.03-1"
    service = host.service("nvidia-mps")
    assert service.is_enabled
    assert service.is_running
    assert host.file("/run/nvidia-mps/control").is_socket
    query = host.run("echo get_server_list | CUDA_MPS_PIPE_DIRECTORY=/run/nvidia-mps nvidia-cuda-mps-control")
    assert query.rc == 0, query.stderr
