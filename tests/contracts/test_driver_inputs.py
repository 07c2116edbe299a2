"""nvidia_driver's setup in real Ansible: a play gets the per-distribution defaults contractlib renders, and
bad input (distribution, architecture, open modules on pre-Turing GPUs) fails naming the way out."""

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

PLAY = """
- hosts: all
  gather_facts: false
  connection: local
  tasks:
    - name: Pretend to be the host the inventory describes
      ansible.builtin.set_fact:
        ansible_facts: "{{ fake }}"
    - name: Run the role's setup
      ansible.builtin.include_role:
        name: nvidia_driver
        tasks_from: setup
        public: true
    - name: Report what it settled
      ansible.builtin.debug:
        msg:
          branch: "{{ nvidia_driver_branch }}"
          version: "{{ nvidia_driver_version }}"
          kernel_modules: "{{ nvidia_driver_kernel_modules }}"
          packages: "{{ nvidia_driver_pinned }}"
          dkms_module: "{{ nvidia_driver_module_name }}"
"""
V100 = {"model": "Tesla V100-SXM2-32GB", "compute_capability": "7.0"}
H100 = {"model": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}


def _facts(distro: str, **changes: Any) -> dict[str, Any]:
    return {**contractlib.DISTRIBUTIONS[distro].facts, **changes}


HOSTS: dict[str, dict[str, Any]] = {
    "debian-12": {"fake": _facts("debian-12")},
    "debian-13": {"fake": _facts("debian-13")},
    "ubuntu-22.04": {"fake": _facts("ubuntu-22.04")},
    "ubuntu-24.04": {"fake": _facts("ubuntu-24.04")},
    "power": {"fake": _facts("ubuntu-22.04", architecture="ppc64le")},
    "focal": {"fake": _facts("ubuntu-22.04", distribution_version="20.04", distribution_major_version="20")},
    "v100-open": {"fake": _facts("ubuntu-24.04", gpufleet_gpu={"gpus": [H100, V100]})},
    "v100-proprietary": {
        "fake": _facts("ubuntu-24.04", gpufleet_gpu={"gpus": [V100]}),
        "gpufleet_driver_kernel_modules": "proprietary",
    },
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """host -> the last result of its play (the debug output, or the failure)."""
    work = tmp_path_factory.mktemp("play")
    (work / "play.yml").write_text(PLAY)
    inventory = {
        "all": {
            "hosts": {name: {"ansible_python_interpreter": sys.executable, **v} for name, v in HOSTS.items()}
        }
    }
    (work / "inventory.yml").write_text(yaml.safe_dump(inventory))
    env = {
        **os.environ,
        "ANSIBLE_ROLES_PATH": str(contractlib.ROLES),
        "ANSIBLE_STDOUT_CALLBACK": "json",
        "ANSIBLE_LOCALHOST_WARNING": "false",
    }
    playbook = Path(sys.executable).parent / "ansible-playbook"
    done = subprocess.run(
        [str(playbook), "-i", str(work / "inventory.yml"), str(work / "play.yml")],
        capture_output=True,
        text=True,
        env=env,
        cwd=work,
        check=False,
    )
    report = json.loads(done.stdout[done.stdout.index("{") :])
    last: dict[str, dict[str, Any]] = {}
    for play in report["plays"]:
        for task in play["tasks"]:
            for host, result in task["hosts"].items():
                if not result.get("skipped"):
                    last[host] = result
    return last


@pytest.mark.parametrize("distro", ["debian-12", "debian-13", "ubuntu-22.04", "ubuntu-24.04"])
def test_play_settles_what_the_contracts_check(results: dict[str, dict[str, Any]], distro: str) -> None:
    settled = results[distro]["msg"]
    rv = contractlib.RoleVars("nvidia_driver", contractlib.DISTRIBUTIONS[distro])
    assert settled == {
        "branch": str(rv.get("nvidia_driver_branch")),
        "version": str(rv.get("nvidia_driver_version")),
        "kernel_modules": rv.get("nvidia_driver_kernel_modules"),
        "packages": rv.get("nvidia_driver_os_packages"),
        "dkms_module": rv.get("nvidia_driver_dkms_module"),
    }


def test_unsupported_architecture_names_the_supported_ones(results: dict[str, dict[str, Any]]) -> None:
    assert results["power"].get("failed")
    assert "does not install on ppc64le; supported architectures: x86_64, aarch64" in results["power"]["msg"]


def test_unsupported_release_names_the_supported_ones(results: dict[str, dict[str, Any]]) -> None:
    assert results["focal"].get("failed")
    assert "does not support Ubuntu 20.04; supported: Debian 12/13, Ubuntu 22/24" in results["focal"]["msg"]


def test_open_modules_refused_on_pre_turing_gpus(results: dict[str, dict[str, Any]]) -> None:
    failed = results["v100-open"]
    assert failed.get("failed")
    assert "Tesla V100-SXM2-32GB" in failed["msg"] and "H100" not in failed["msg"]
    assert "to proprietary" in failed["msg"]


def test_proprietary_modules_accepted_on_pre_turing_gpus(results: dict[str, dict[str, Any]]) -> None:
    settled = results["v100-proprietary"]["msg"]
    assert settled["kernel_modules"] == "proprietary"
    assert settled["packages"][0] == "nvidia-dkms-580-server" and settled["dkms_module"] == "nvidia-srv"
