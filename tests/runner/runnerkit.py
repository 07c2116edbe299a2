"""Helpers for tests/runner: throwaway playbooks and inventories with ``ansible_connection: local`` in
tmp_path, and the CLI's result as operators get it (a child process, its artifacts in tmp_path through
$GPUFLEET_RUNNER_DIR)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from labstack import ensure_collection_link  # noqa: F401 - re-exported; tests/k8s_modules is on sys.path (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
LOCAL = {"ansible_connection": "local", "ansible_python_interpreter": "{{ ansible_playbook_python }}"}


@dataclass
class CliRun:
    proc: subprocess.CompletedProcess[str]

    @property
    def rc(self) -> int:
        return self.proc.returncode

    @property
    def out(self) -> str:
        return self.proc.stdout

    @property
    def err(self) -> str:
        return self.proc.stderr

    def json(self) -> dict[str, Any]:
        return json.loads(self.proc.stdout)  # type: ignore[no-any-return]

    def explain(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.out[-4000:]}\n--- stderr\n{self.err[-4000:]}"


def cli_env(runner_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET_", "ANSIBLE_"))}
    return env | {"GPUFLEET_RUNNER_DIR": str(runner_dir), "COLUMNS": "80"} | extra


def write_inventory(path: Path, hosts: Mapping[str, Mapping[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump({"all": {"hosts": {h: dict(v) for h, v in hosts.items()}}}))
    return path


def write_playbook(path: Path, plays: list[dict[str, Any]]) -> Path:
    path.write_text(yaml.safe_dump(plays, sort_keys=False))
    return path


def play(name: str, tasks: list[dict[str, Any]], hosts: str = "all") -> dict[str, Any]:
    return {"name": name, "hosts": hosts, "gather_facts": False, "tasks": tasks}


def closed_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def visible_lines(text: str) -> list[str]:
    """The lines a terminal ends up showing: each line's text after its last carriage return, with the
    erase-line escape removed."""
    lines = []
    for line in text.replace("\r\n", "\n").split("\n"):
        lines.append(line.rsplit("\r", 1)[-1].replace("\x1b[K", ""))
    return lines
