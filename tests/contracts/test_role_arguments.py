"""Each role's argument check passes with nothing but its defaults, on every distribution it supports.

ansible-core renders every default the role's argument spec names before the role's first task, and so
before the per-OS vars files (vars/Debian.yml ...) load: a default built from a variable defined only there
fails every run that does not override it. The molecule scenarios and the lab override the repository URLs
(they use stand-in repositories), so only this test sees what a real fleet's first run would see.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import contractlib
import pytest
import yaml

ROLES = [
    "gpu_host_prep",
    "nvidia_driver",
    "nvidia_fabricmanager",
    "nvidia_container_toolkit",
    "nvidia_cuda_toolkit",
    "nvidia_mps",
]
# Every distribution the contracts know ("all" is not one: it stands for facts that hold everywhere).
DISTROS = sorted(name for name in contractlib.DISTRIBUTIONS if name != "all")
# With an unknown tag only tasks tagged `always` run: the argument checks ansible-core puts first in a role.
PLAY = """
- hosts: all
  gather_facts: false
  connection: local
  tasks:
    - name: Pretend to be the host the inventory describes
      ansible.builtin.set_fact:
        ansible_facts: "{{ fake }}"
      tags: [always]
    - name: Check each role's arguments with its defaults
      ansible.builtin.include_role:
        name: "{{ item }}"
      loop: ROLES
      tags: [always]
""".replace("ROLES", json.dumps(ROLES))


@pytest.fixture(scope="module")
def checked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """host (a distribution) -> role -> the result of its argument check."""
    work = tmp_path_factory.mktemp("arguments")
    (work / "play.yml").write_text(PLAY)
    hosts = {
        name: {"ansible_python_interpreter": sys.executable, "fake": contractlib.DISTRIBUTIONS[name].facts}
        for name in DISTROS
    }
    (work / "inventory.yml").write_text(yaml.safe_dump({"all": {"hosts": hosts}}))
    env = {
        **os.environ,
        "ANSIBLE_ROLES_PATH": str(contractlib.ROLES),
        "ANSIBLE_STDOUT_CALLBACK": "json",
        "ANSIBLE_LOCALHOST_WARNING": "false",
    }
    playbook = Path(sys.executable).parent / "ansible-playbook"
    done = subprocess.run(
        [str(playbook), "-i", str(work / "inventory.yml"), str(work / "play.yml"), "--check", "--tags=none"],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        check=False,
    )
    assert "{" in done.stdout, f"no report (rc {done.returncode}): {done.stderr[-3000:]}"
    report = json.loads(done.stdout[done.stdout.index("{") :])
    results: dict[str, dict[str, Any]] = {host: {} for host in hosts}
    for play in report["plays"]:
        for task in play["tasks"]:
            name = task["task"]["name"]
            if "Validating arguments" not in name:
                continue
            role = name.split(" : ")[0].strip()
            for host, result in task["hosts"].items():
                results[host][role] = result
    return results


@pytest.mark.parametrize("distro", DISTROS)
def test_every_role_accepts_its_own_defaults(checked: dict[str, dict[str, Any]], distro: str) -> None:
    results = checked[distro]
    failed = {role: r.get("msg") for role, r in results.items() if r.get("failed")}
    assert not failed, f"on {distro}, with nothing set in the inventory: {failed}"
    assert sorted(results) == sorted(ROLES), f"argument checks that ran on {distro}: {sorted(results)}"
