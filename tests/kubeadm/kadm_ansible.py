"""ansible-playbook against the hosts of a kubeadm test cluster: the controller (this machine, connection
local) and the cluster's podman hosts through the collection's podman connection plugin
(``gpufleet.nvidia.podman``, one ``podman exec`` per task), from the repository root so that ansible.cfg
applies (collections path, roles path)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from labstack import ANSIBLE_PLAYBOOK, REPO, ensure_collection_link

from gpufleet_harness.lab.kubeadm import KubeadmHost
from gpufleet_harness.testhosts.podman import podman_env


@dataclass
class Run:
    """One ansible-playbook run: exit code, output and every task's result per host, in order."""

    proc: subprocess.CompletedProcess[str]
    tasks: list[tuple[str, dict[str, dict[str, Any]]]]

    @property
    def rc(self) -> int:
        return self.proc.returncode

    @property
    def output(self) -> str:
        return self.proc.stdout[-6000:] + self.proc.stderr[-3000:]

    def result(self, task: str, host: str) -> dict[str, Any]:
        """The result of the (last) task named ``task`` on ``host``."""
        found = [hosts[host] for name, hosts in self.tasks if _named(name, task) and host in hosts]
        assert found, (
            f"no result of task {task!r} on {host}; tasks: {[n for n, _ in self.tasks]}\n{self.output}"
        )
        return found[-1]

    def changed(self, host: str) -> list[str]:
        """Names of the tasks that reported a change on ``host``."""
        return [name for name, hosts in self.tasks if hosts.get(host, {}).get("changed")]

    def failed(self) -> list[str]:
        return [
            f"{name} on {host}: {r.get('msg')}"
            for name, hosts in self.tasks
            for host, r in hosts.items()
            if r.get("failed")
        ]


def inventory(tmp: Path, hosts: Mapping[str, KubeadmHost], groups: Mapping[str, Sequence[str]]) -> Path:
    """An inventory with localhost (this machine, this Python) and each ``hosts`` entry as a podman host."""
    doc: dict[str, Any] = {
        "all": {
            "hosts": {
                "localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable},
                **{
                    name: {
                        "ansible_connection": "gpufleet.nvidia.podman",
                        "ansible_host": host.container,
                        "ansible_python_interpreter": "/usr/bin/python3",
                    }
                    for name, host in hosts.items()
                },
            },
            "children": {group: {"hosts": {name: {} for name in names}} for group, names in groups.items()},
        }
    }
    path = tmp / "inventory.yml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def run_plays(
    plays: Sequence[Mapping[str, Any]],
    inventory_path: Path,
    tmp: Path,
    *,
    args: Sequence[str] = (),
    timeout: float = 900,
) -> Run:
    """ansible-playbook ``plays`` with the JSON callback; each task's per-host results in order."""
    ensure_collection_link()
    path = tmp / f"play-{time.monotonic_ns()}.yml"
    path.write_text(yaml.safe_dump(list(plays), sort_keys=False))
    env = podman_env()
    env.update(
        {
            "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_FORCE_COLOR": "0",
            "ANSIBLE_LOCALHOST_WARNING": "0",
            "ANSIBLE_STDOUT_CALLBACK": "ansible.posix.json",
            "ANSIBLE_ROLES_PATH": str(REPO / "roles"),
        }
    )
    for name in ("KUBECONFIG", "K8S_AUTH_KUBECONFIG"):
        env.pop(name, None)
    proc = subprocess.run(
        [str(ANSIBLE_PLAYBOOK), "-i", str(inventory_path), str(path), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    tasks: list[tuple[str, dict[str, dict[str, Any]]]] = []
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = {"plays": []}
    for play in doc.get("plays", []):
        for task in play.get("tasks", []):
            tasks.append((task.get("task", {}).get("name", ""), task.get("hosts", {})))
    return Run(proc, tasks)


def _named(name: str, task: str) -> bool:
    """A task's name as the JSON callback reports it: a role's tasks carry ``<role> : `` in front."""
    return name == task or name.endswith(" : " + task)
