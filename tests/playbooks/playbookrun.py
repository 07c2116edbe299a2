"""Run one of the project's playbooks with ansible-playbook as an operator would (from the checkout, its
ansible.cfg and collection link), with the json callback, and read what happened (helpers for the tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Played:
    """One ansible-playbook run: its exit code, the json callback's report, and stderr (warnings)."""

    proc: subprocess.CompletedProcess[str]

    @property
    def rc(self) -> int:
        return self.proc.returncode

    @property
    def report(self) -> dict[str, Any]:
        out = self.proc.stdout
        assert "{" in out, f"no json report (rc {self.rc}): {self.proc.stderr[-3000:]}"
        return json.loads(out[out.index("{") :])  # type: ignore[no-any-return]

    def plays(self) -> list[str]:
        """The names of the plays that started, in order (one per batch of a serial play)."""
        return [p["play"]["name"] for p in self.report["plays"]]

    def results(self, task: str) -> dict[str, dict[str, Any]]:
        """host -> result of the first task with that name."""
        for play in self.report["plays"]:
            for entry in play["tasks"]:
                if entry["task"]["name"] == task:
                    return entry["hosts"]  # type: ignore[no-any-return]
        raise AssertionError(f"no task {task!r} ran; plays: {self.plays()}")

    def explain(self) -> str:
        return f"rc {self.rc}\n--- stdout\n{self.proc.stdout[-4000:]}\n--- stderr\n{self.proc.stderr[-2000:]}"


def playbook(playbook: str, inventory: Path | str, *args: str) -> Played:
    """``ansible-playbook -i INVENTORY PLAYBOOK ARGS`` in the checkout."""
    from labstack import ensure_collection_link

    ensure_collection_link()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET_", "ANSIBLE_"))} | {
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_STDOUT_CALLBACK": "json",
        "ANSIBLE_LOCALHOST_WARNING": "false",
    }
    argv = [str(Path(sys.executable).parent / "ansible-playbook"), "-i", str(inventory), playbook, *args]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    return Played(proc)


def local_inventory(directory: Path, hosts: list[str], group_vars: dict[str, Any] | None = None) -> Path:
    """An inventory of local hosts in gpu_nodes (no become: nothing may be changed on this machine)."""
    directory.mkdir(parents=True, exist_ok=True)
    doc = {"gpu_nodes": {
        "hosts": dict.fromkeys(hosts),
        "vars": {"ansible_connection": "local", "ansible_become": False,
                 "ansible_python_interpreter": sys.executable},
    }}  # fmt: skip
    (directory / "hosts.yml").write_text(yaml.safe_dump(doc))
    if group_vars:
        (directory / "group_vars").mkdir(exist_ok=True)
        (directory / "group_vars" / "all.yml").write_text(yaml.safe_dump(group_vars))
    return directory
