"""End state of nvidia_cuda_toolkit: the toolkit at exact versions and held, the pinned driver untouched."""

import re

DRIVER = "535.261.03-1"
DRIVER_PACKAGES = ("nvidia-smi", "libnvidia-ml1")
TOOLKIT = {
    "cuda-toolkit-12-2": "12.2.2-1",
    "cuda-nvcc-12-2": "12.2.140-1",
    "cuda-cudart-12-2": "12.2.140-1",
}
# Broader than the role's nvidia_cuda_toolkit_driver_patterns: anything driver-like counts.
DRIVER_LIKE = re.compile(r"^(cuda-drivers|nvidia-|libnvidia-|libcuda|kmod-nvidia|firmware-nvidia)")
DPKG_ACTIONS = ("install", "upgrade", "remove", "purge")


def test_toolkit_packages_at_exact_versions(host):
    for name, version in TOOLKIT.items():
        package = host.package(name)
        assert package.is_installed, name
        assert package.version == version, name


def test_toolkit_held(host):
    assert "cuda-toolkit-12-2" in host.check_output("apt-mark showhold").split()


def test_nvcc_on_login_shells_path(host):
    profile = host.file("/etc/profile.d/cuda.sh")
    assert (profile.user, profile.group, profile.mode) == ("root", "root", 0o644)
    assert host.check_output("bash -lc 'command -v nvcc'") == "/usr/local/cuda-12.2/bin/nvcc"
    assert "Cuda compilation tools, release 12.2, V12.2.140" in host.check_output("bash -lc 'nvcc --version'")


def test_repository_is_signed_and_keyed(host):
    source = host.file("/etc/apt/sources.list.d/nvidia-cuda.sources").content_string
    assert "/cuda/repos/debian12/x86_64" in source
    assert "Signed-By: /etc/apt/keyrings/nvidia-cuda.asc" in source
    assert host.file("/etc/apt/keyrings/nvidia-cuda.asc").contains("BEGIN PGP PUBLIC KEY BLOCK")


def test_pinned_driver_untouched(host):
    holds = host.check_output("apt-mark showhold").split()
    for name in DRIVER_PACKAGES:
        assert host.package(name).version == DRIVER, name
        assert name in holds, name
    for trap in ("cuda-12-2", "cuda-runtime-12-2", "cuda-drivers"):
        assert not host.package(trap).is_installed, trap


def test_toolkit_install_touched_no_driver_package(host):
    """dpkg.log: every action on a driver-like package came before the first CUDA package was unpacked."""
    actions = [
        fields[3].split(":")[0]
        for fields in (line.split() for line in host.file("/var/log/dpkg.log").content_string.splitlines())
        if len(fields) > 3 and fields[2] in DPKG_ACTIONS
    ]
    first_cuda = next(i for i, name in enumerate(actions) if name in TOOLKIT)
    assert any(DRIVER_LIKE.match(name) for name in actions[:first_cuda]), "the driver was installed first"
    assert [name for name in actions[first_cuda:] if DRIVER_LIKE.match(name)] == []
