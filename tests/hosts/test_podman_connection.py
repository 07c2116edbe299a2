"""The collection's podman connection (plugins/connection/podman.py) against a real test-host container.

The lab's hosts (``gpufleet.nvidia.podman``) and every molecule scenario (the plain name ``podman``, from the
path each molecule.yml puts first) use it: one ``podman exec`` per task instead of containers.podman's five or
six podman processes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from labstack import ensure_collection_link

from gpufleet_harness.testhosts import images
from gpufleet_harness.testhosts.podman import podman
from gpufleet_harness.testhosts.workspace import missing_tools

pytestmark = [pytest.mark.root, pytest.mark.xdist_group("molecule")]

REPO = Path(__file__).resolve().parents[2]
PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"


@pytest.fixture(scope="module")
def host() -> Iterator[str]:
    if os.geteuid() != 0 or missing_tools():
        pytest.fail(f"needs root and the test-host tools (missing: {missing_tools()})", pytrace=False)
    with images.scratch_host("gpufleet-conn", "--network=none", command=("sleep", "infinity")) as name:
        yield name


def _play(
    tmp_path: Path, host: str, tasks: list[dict], *extra: str, **hostvars: str
) -> subprocess.CompletedProcess:
    inventory = tmp_path / "inventory.yml"
    inventory.write_text(
        yaml.safe_dump(
            {"all": {"hosts": {host: {"ansible_python_interpreter": "/usr/bin/python3", **hostvars}}}}
        )
    )
    play = tmp_path / "play.yml"
    play.write_text(
        yaml.safe_dump([{"hosts": "all", "gather_facts": False, "tasks": tasks}], sort_keys=False)
    )
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(ensure_collection_link()),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_STDOUT_CALLBACK": "default",
        "ANSIBLE_CONNECTION_PLUGINS": str(REPO / "plugins/connection"),
    }
    env.pop("ANSIBLE_PIPELINING", None)
    return subprocess.run(
        [str(PLAYBOOK), "-vvv", "-i", str(inventory), str(play), *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
        check=False,
    )


def _podman_runs(out: str) -> list[str]:
    return re.findall(r"RUN \[(.*)\]", out)


TASKS = [
    {
        "name": "module",
        "ansible.builtin.command": "cat /etc/debian_version",
        "register": "version",
        "changed_when": False,
    },
    {
        "name": "file in",
        "ansible.builtin.copy": {"dest": "/tmp/gpufleet-conn", "content": "hello\n", "mode": "0600"},
    },
    {
        "name": "file out",
        "ansible.builtin.fetch": {"src": "/tmp/gpufleet-conn", "dest": "fetched/", "flat": True},
    },
    {"name": "show", "ansible.builtin.debug": {"msg": "{{ version.stdout }}"}},
]


@pytest.mark.parametrize("connection", ["gpufleet.nvidia.podman", "podman"])
def test_one_podman_exec_per_module_and_files_both_ways(host: str, tmp_path: Path, connection: str) -> None:
    run = _play(tmp_path, host, TASKS, ansible_connection=connection)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    runs = _podman_runs(run.stdout)
    assert runs, "no podman command logged: another connection plugin ran"
    # the command task: a single exec, the module on stdin (pipelining, on by default)
    command_runs = [r for r in runs if "'/usr/bin/python3 && sleep 0'" in r]
    assert command_runs and all("'--interactive'" in r for r in command_runs), runs
    assert not any("'mount'" in r for r in runs), "the container's filesystem was mounted"
    assert (tmp_path / "fetched" / "gpufleet-conn").read_text() == "hello\n"
    assert re.search(r"ok: \[[^\]]+\] => \{\s*\"msg\": \"12\.", run.stdout), run.stdout[-2000:]
    mode = podman("exec", host, "stat", "-c", "%a", "/tmp/gpufleet-conn").stdout.strip()
    assert mode == "600"


def test_without_pipelining_the_usual_copy_then_run_steps_work(host: str, tmp_path: Path) -> None:
    run = _play(
        tmp_path, host, TASKS[:1], ansible_connection="gpufleet.nvidia.podman", ansible_pipelining="false"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    runs = _podman_runs(run.stdout)
    assert any("'cp'" in r for r in runs) and not any("'--interactive'" in r for r in runs), runs


def test_a_missing_container_is_unreachable_naming_it(tmp_path: Path) -> None:
    gone = f"gpufleet-conn-gone-{uuid.uuid4().hex[:8]}"
    run = _play(tmp_path, gone, TASKS[:1], ansible_connection="gpufleet.nvidia.podman")
    assert run.returncode == 4, run.stdout[-2000:]
    assert f"podman exec in {gone} failed" in run.stdout and "no such container" in run.stdout


def test_check_mode_and_json_output_round_trip(host: str, tmp_path: Path) -> None:
    """A module's JSON reply (large, non-ASCII) comes back intact through the pipe."""
    tasks = [
        {
            "name": "big",
            "ansible.builtin.shell": "python3 -c \"print('é' * 200000)\"",
            "register": "big",
            "changed_when": False,
            "check_mode": False,
        },
        {
            "name": "size",
            "ansible.builtin.copy": {"dest": "/tmp/gpufleet-size", "content": "{{ big.stdout | length }}"},
        },
    ]
    run = _play(tmp_path, host, tasks, "--check", "--diff", ansible_connection="gpufleet.nvidia.podman")
    assert run.returncode == 0, run.stdout[-3000:]
    assert "+200000" in run.stdout, run.stdout[-2000:]
    assert podman("exec", host, "test", "-e", "/tmp/gpufleet-size", check=False).returncode == 1
