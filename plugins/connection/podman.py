# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Run tasks in a local podman container with one ``podman exec`` per task (pipelining)."""

from __future__ import annotations

DOCUMENTATION = r"""
name: podman
short_description: Run tasks in local podman containers, one podman exec per task
description:
  - Runs each task in a running container of this machine's podman with C(podman exec).
  - Pipelines by default (option O(pipelining)), so the module reaches the container's interpreter on
    stdin and a task costs one podman exec. Without it (or for modules that cannot pipeline) Ansible's usual temporary directory, copy and cleanup steps each
    cost one podman process.
  - Files are copied with C(podman cp); nothing is mounted.
  - Written for gpufleet's lab and test hosts (podman containers running systemd). Each podman process costs
    a fraction of a CPU second, which dominates a play against containers on a small machine.
author: gpufleet contributors (@gpufleet)
version_added: 0.1.0
options:
  remote_addr:
    description: The container's name or ID.
    default: inventory_hostname
    type: str
    vars:
      - name: inventory_hostname
      - name: ansible_host
      - name: ansible_podman_host
  remote_user:
    description: User to run as inside the container (C(podman exec --user)); the container's default if unset.
    type: str
    vars:
      - name: ansible_user
      - name: ansible_podman_user
  podman_executable:
    description: The podman command.
    default: podman
    type: str
    vars:
      - name: ansible_podman_executable
    env:
      - name: ANSIBLE_PODMAN_EXECUTABLE
  pipelining:
    type: boolean
    default: true
    description:
      - Feed modules to the interpreter on stdin (one podman exec per task).
      - On by default, unlike most connections, since C(podman exec) passes stdin through and no sudo
        C(requiretty) stands in the way; C(false) gives Ansible's usual copy-then-run steps.
    env:
      - name: ANSIBLE_PIPELINING
    ini:
      - section: connection
        key: pipelining
      - section: defaults
        key: pipelining
    vars:
      - name: ansible_pipelining
"""

EXAMPLES = r"""
# inventory group_vars for hosts that are podman containers on the control machine
ansible_connection: gpufleet.nvidia.podman
ansible_python_interpreter: /usr/bin/python3
"""

import shlex
import subprocess

from ansible.errors import AnsibleConnectionFailure, AnsibleError, AnsibleFileNotFound
from ansible.module_utils.common.process import get_bin_path
from ansible.module_utils.common.text.converters import to_bytes, to_text
from ansible.plugins.connection import ConnectionBase
from ansible.utils.display import Display

display = Display()


class Connection(ConnectionBase):
    """``podman exec`` per command, ``podman cp`` per file."""

    transport = "gpufleet.nvidia.podman"
    has_pipelining = True
    has_tty = False

    def _podman(self, args: list[str], in_data: bytes | None = None) -> tuple[int, bytes, bytes]:
        executable = self.get_option("podman_executable")
        try:
            podman = get_bin_path(executable)
        except ValueError as err:
            raise AnsibleError(f"{executable} not found in PATH") from err
        command = [podman, *args]
        display.vvv(f"RUN {command}", host=self._container())
        proc = subprocess.run(
            [to_bytes(part, errors="surrogate_or_strict") for part in command],
            input=in_data,
            stdin=None if in_data is not None else subprocess.DEVNULL,
            capture_output=True,
            check=False,
        )
        return proc.returncode, proc.stdout, proc.stderr

    def _container(self) -> str:
        return self.get_option("remote_addr")

    def _connect(self) -> Connection:
        super()._connect()
        self._connected = True
        return self

    def exec_command(
        self, cmd: str, in_data: bytes | None = None, sudoable: bool = True
    ) -> tuple[int, bytes, bytes]:
        super().exec_command(cmd, in_data=in_data, sudoable=sudoable)
        args = ["exec"]
        if in_data is not None:
            args.append("--interactive")  # without it podman does not pass stdin on
        user = self.get_option("remote_user")
        if user:
            args += ["--user", user]
        args += [self._container(), *shlex.split(to_text(cmd, errors="surrogate_or_strict"))]
        rc, stdout, stderr = self._podman(args, in_data)
        # 125 with podman's "Error: ..." is podman's own failure (no such container, not running), not the
        # command's: the host is unreachable (the reboot action and wait_for_connection expect that)
        if rc == 125 and not stdout and stderr.startswith(b"Error: "):
            raise AnsibleConnectionFailure(
                f"podman exec in {self._container()} failed: {to_text(stderr).strip()}"
            )
        return rc, stdout, stderr

    def put_file(self, in_path: str, out_path: str) -> None:
        super().put_file(in_path, out_path)
        rc, _out, stderr = self._podman(["cp", in_path, f"{self._container()}:{out_path}"])
        if rc != 0:
            raise AnsibleError(
                f"podman cp of {in_path} to {self._container()}:{out_path} failed: {to_text(stderr).strip()}"
            )
        user = self.get_option("remote_user")
        if user and user != "root":  # podman cp writes as root; the module must be the user's
            rc, _out, stderr = self._podman(["exec", self._container(), "chown", user, out_path])
            if rc != 0:
                raise AnsibleError(f"chown {user} {out_path} failed: {to_text(stderr).strip()}")

    def fetch_file(self, in_path: str, out_path: str) -> None:
        super().fetch_file(in_path, out_path)
        rc, _out, stderr = self._podman(["cp", f"{self._container()}:{in_path}", out_path])
        if rc != 0:
            message = to_text(stderr).strip()
            if "no such file" in message.lower() or "does not exist" in message.lower():
                raise AnsibleFileNotFound(f"{in_path} not found in {self._container()}: {message}")
            raise AnsibleError(f"podman cp of {self._container()}:{in_path} failed: {message}")

    def close(self) -> None:
        self._connected = False
