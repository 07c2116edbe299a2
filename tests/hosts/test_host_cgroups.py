"""Privileged systemd test hosts keep to their own cgroups (gpufleet_harness.testhosts.images.INIT_WRAPPER).

On a cgroup v1 machine podman's systemd mode used to hand each host the whole name=systemd hierarchy: the
hosts' systemd instances shared one /system.slice at the machine's root, and stopping one privileged host
removed the others' cgroups (every later ``podman exec`` into them exited 127). Lab hosts and the toolkit
scenario's hosts are privileged, with a private cgroup namespace, as here.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpufleet_harness.cluster.process import wait_for
from gpufleet_harness.testhosts import images
from gpufleet_harness.testhosts.podman import podman
from gpufleet_harness.testhosts.workspace import missing_tools

pytestmark = [pytest.mark.root, pytest.mark.xdist_group("molecule")]


@pytest.fixture(scope="module")
def image() -> str:
    if os.geteuid() != 0 or missing_tools():
        pytest.fail(f"needs root and the test-host tools (missing: {missing_tools()})", pytrace=False)
    return images.build_image(images.ImageSpec("bookworm"))


@pytest.fixture
def hosts(image: str) -> Iterator[list[str]]:
    names = [f"gpufleet-cgt-{uuid.uuid4().hex[:8]}" for _ in range(2)]
    try:
        for name in names:
            podman("run", "-d", "--name", name, "--privileged", "--cgroupns=private", "--systemd=always",
                   "--network=none", image)  # fmt: skip
        for name in names:
            wait_for(f"{name} booted", lambda n=name: _state(n) in ("running", "degraded"), 120, interval=0.5)
        yield names
    finally:
        podman("rm", "-f", "-t", "0", *names, check=False)


def _state(name: str) -> str:
    return podman("exec", name, "systemctl", "is-system-running", check=False).stdout.strip()


def _machine_cgroup(name: str) -> str:
    """PID 1's systemd cgroup of host ``name`` as this machine sees it (name=systemd on v1, else v2)."""
    pid = podman("inspect", "--format", "{{.State.Pid}}", name).stdout.strip()
    paths = dict(line.split(":", 2)[1:] for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines())
    return paths.get("name=systemd", paths.get("", ""))


def test_each_host_runs_systemd_in_its_own_cgroup(hosts: list[str]) -> None:
    for name in hosts:
        full_id = podman("inspect", "--format", "{{.Id}}", name).stdout.strip()
        assert full_id in _machine_cgroup(name), (name, _machine_cgroup(name))
        assert podman("exec", name, "test", "-d", "/sys/fs/cgroup/systemd/system.slice").returncode == 0


def test_stopping_one_host_leaves_the_other_reachable(hosts: list[str]) -> None:
    first, second = hosts
    podman("stop", "-t", "20", first)
    result = podman("exec", second, "systemctl", "is-system-running", check=False)
    assert result.returncode == 0, f"exec into {second} after stopping {first}: {result.stderr.strip()}"
    assert result.stdout.strip() in ("running", "degraded")
