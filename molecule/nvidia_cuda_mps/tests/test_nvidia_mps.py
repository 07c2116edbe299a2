"""End state of nvidia_mps: Debian's real MPS control daemon at the driver's version, running, answering."""

import pytest

DRIVER = "535.261.03-1"
PIPE_DIR = "/run/nvidia-mps"
LOG_DIR = "/var/log/nvidia-mps"
CONTROL = f"CUDA_MPS_PIPE_DIRECTORY={PIPE_DIR} CUDA_MPS_LOG_DIRECTORY={LOG_DIR} nvidia-cuda-mps-control"


@pytest.fixture()
def control(host):
    """Send one command to the control daemon; return its answer."""

    def send(command):
        result = host.run(f"echo {command} | {CONTROL}")
        assert result.rc == 0, f"{command}: rc {result.rc} {result.stdout} {result.stderr}"
        return result.stdout.strip()

    return send


def test_mps_package_matches_the_pinned_driver(host):
    assert host.package("nvidia-cuda-mps").version == DRIVER
    assert host.package("nvidia-smi").version == DRIVER
    holds = host.check_output("apt-mark showhold").split()
    assert {"nvidia-smi", "libnvidia-ml1"} <= set(holds)


def test_unit_file(host):
    unit = host.file("/etc/systemd/system/nvidia-mps.service")
    assert (unit.user, unit.group, unit.mode) == ("root", "root", 0o644)
    text = unit.content_string
    assert "ExecStart=/usr/bin/nvidia-cuda-mps-control -d" in text
    assert "RuntimeDirectory=nvidia-mps" in text
    assert "ExecStartPre" not in text  # EXCLUSIVE_PROCESS off: no loaded driver here


def test_daemon_enabled_and_running(host):
    service = host.service("nvidia-mps")
    assert service.is_enabled
    assert service.is_running
    pid = host.check_output("systemctl show -p MainPID --value nvidia-mps")
    assert host.file(f"/proc/{pid}/exe").linked_to == "/usr/bin/nvidia-cuda-mps-control"


def test_pipe_and_log_directories(host):
    for path in (PIPE_DIR, LOG_DIR):
        directory = host.file(path)
        assert directory.is_directory, path
        assert (directory.user, directory.group, directory.mode) == ("root", "root", 0o755), path
    assert host.file(f"{PIPE_DIR}/control").is_socket
    assert host.file(f"{LOG_DIR}/control.log").is_file


def test_daemon_answers(control):
    assert control("get_server_list") == ""  # no client yet, so no server


def test_daemon_has_the_client_default_from_the_unit(host, control):
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=50" in host.check_output(
        "systemctl show -p Environment --value nvidia-mps"
    )
    assert float(control("get_default_active_thread_percentage")) == 50.0
