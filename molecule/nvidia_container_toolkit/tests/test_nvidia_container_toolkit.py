"""End state of nvidia_container_toolkit on hosts that already ran docker and containerd."""

import json

import pytest

VERSION = "1.17.7-1"
PACKAGES = (
    "nvidia-container-toolkit",
    "nvidia-container-toolkit-base",
    "libnvidia-container-tools",
    "libnvidia-container1",
)


def test_packages_pinned_and_held(host):
    held = set(host.check_output("apt-mark showhold").split())
    for name in PACKAGES:
        package = host.package(name)
        assert package.is_installed, name
        assert package.version == VERSION, name
        assert name in held, name


def test_repository_signed(host):
    source = host.file("/etc/apt/sources.list.d/nvidia-container-toolkit.sources").content_string
    assert "Signed-By: /etc/apt/keyrings/nvidia-container-toolkit.asc" in source


@pytest.fixture(scope="module")
def containerd_dump(host):
    return host.check_output("containerd config dump")


def test_containerd_has_nvidia_runtime_as_default(containerd_dump):
    assert '[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]' in containerd_dump
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in containerd_dump
    assert 'default_runtime_name = "nvidia"' in containerd_dump


def test_containerd_keeps_site_settings(containerd_dump):
    # containerd 1.x replaces a whole plugin section on import: these survive only because the drop-in
    # carries the CRI section of config.toml.
    assert 'sandbox_image = "registry.example.internal/pause:3.9"' in containerd_dump
    assert 'bin_dir = "/usr/lib/cni"' in containerd_dump
    runc = containerd_dump.split("containerd.runtimes.runc.options]", 1)[1].split("[", 1)[0]
    assert "SystemdCgroup = true" in runc
    nvidia = containerd_dump.split("containerd.runtimes.nvidia.options]", 1)[1].split("[", 1)[0]
    assert "SystemdCgroup = true" in nvidia


def test_containerd_main_config_only_gains_the_import(host):
    config = host.file("/etc/containerd/config.toml").content_string
    assert config.startswith("# site config: written by the operator, not by gpufleet\nversion = 2\n")
    assert 'imports = ["/etc/containerd/conf.d/99-nvidia.toml"]' in config
    assert 'sandbox_image = "registry.example.internal/pause:3.9"' in config
    assert host.service("containerd").is_running


def test_daemon_json_merged_with_existing_keys(host):
    daemon = json.loads(host.file("/etc/docker/daemon.json").content_string)
    assert daemon["log-driver"] == "json-file"
    assert daemon["log-opts"] == {"max-size": "10m"}
    assert daemon["debug"] is True  # added by hand after the first run (drift), kept on repair
    assert daemon["runtimes"]["site-runc"] == {"path": "/usr/sbin/runc"}
    assert daemon["runtimes"]["nvidia"]["path"] == "/usr/bin/nvidia-container-runtime"
    assert daemon["default-runtime"] == "nvidia"


def test_backups_kept(host):
    backups = host.check_output("ls /etc/docker /etc/containerd").split()
    assert any(name.startswith("daemon.json.") and name.endswith("~") for name in backups)
    assert any(name.startswith("config.toml.") and name.endswith("~") for name in backups)


def test_docker_runs_containers_through_the_nvidia_runtime(host):
    info = json.loads(host.check_output("docker info --format '{{json .}}'"))
    assert "nvidia" in info["Runtimes"]
    assert info["DefaultRuntime"] == "nvidia"
    host.run("truncate -s 0 /var/log/nvidia-container-runtime.log")
    result = host.run("docker run --rm gpufleet/busybox:test /bin/busybox echo hello-from-nvidia-runtime")
    assert result.rc == 0, result.stderr
    assert "hello-from-nvidia-runtime" in result.stdout
    assert " create " in host.file("/var/log/nvidia-container-runtime.log").content_string
