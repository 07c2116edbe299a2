"""The Ansible module: arguments, docs, check mode, secrets, and a real ansible-playbook run."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.gpufleet.nvidia.plugins.module_utils import esxi_vsphere
from ansible_collections.gpufleet.nvidia.plugins.modules import esxi_gpu_passthrough as module
from esxi_lab import COLLECTIONS_ROOT, Lab, make_lab, module_args
from pyVmomi import vim

PASSWORD = "Pa55-do-not-print-7f3a"
BASE_ARGS = {
    "hostname": "vcenter.example.com",
    "username": "automation@vsphere.local",
    "password": PASSWORD,
    "name": "gpu-worker-01",
    "gpus": [{"pci_id": "0000:3b:00.0", "memory_gb": 80}, {"pci_id": "0000:5e:00.0", "memory_gb": 80}],
}


def run_module(
    args: dict[str, Any], lab: Lab | None, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[dict[str, Any], list[str], list[Any]]:
    """Run ``main()`` with the stand-in as vSphere; return the result, syslog lines and logins."""
    logins: list[Any] = []
    logged: list[str] = []

    def fake_smart_connect(**kwargs: Any) -> Any:
        logins.append(kwargs)
        if lab is None:
            raise vim.fault.InvalidLogin(
                msg="Cannot complete login due to an incorrect user name or password."
            )
        return lab.si

    monkeypatch.setattr(esxi_vsphere._connect, "SmartConnect", fake_smart_connect)
    monkeypatch.setattr(esxi_vsphere._connect, "Disconnect", lambda si: None)
    monkeypatch.setattr(basic.AnsibleModule, "log", lambda self, msg, log_args=None: logged.append(msg))
    with module_args(args), pytest.raises(SystemExit):
        module.main()
    out = capsys.readouterr()
    assert PASSWORD not in out.out + out.err
    return json.loads(out.out), logged, logins


def test_module_configures_the_vm_then_reports_no_change(monkeypatch, capsys) -> None:
    lab = make_lab()
    first, logged, logins = run_module(BASE_ARGS, lab, monkeypatch, capsys)
    assert first["changed"] and first["mmio_size_gb"] == 512 and not first.get("failed")
    assert logins[0]["pwd"] == PASSWORD and logins[0]["disableSslCertValidation"] is False
    assert all(PASSWORD not in line for line in logged)
    second, _, _ = run_module(BASE_ARGS, lab, monkeypatch, capsys)
    assert not second["changed"] and second["changes"] == []


def test_module_check_mode_makes_no_state_changing_calls(monkeypatch, capsys) -> None:
    lab = make_lab(enabled=False)
    result, _, _ = run_module({**BASE_ARGS, "_ansible_check_mode": True}, lab, monkeypatch, capsys)
    assert result["changed"] and result["host_reboot_required"]
    assert lab.recorder.mutating() == []
    assert result["diff"]["before"]["firmware"] == "bios" and result["diff"]["after"]["firmware"] == "efi"


def test_module_fails_listing_changes_when_the_vm_is_on(monkeypatch, capsys) -> None:
    lab = make_lab(powered_on=True)
    result, _, _ = run_module(BASE_ARGS, lab, monkeypatch, capsys)
    assert result["failed"] and "allow_power_off" in result["msg"]
    assert "firmware bios -> efi" in result["changes"]
    assert lab.recorder.mutating() == []


def test_module_reports_plan_errors_as_failures(monkeypatch, capsys) -> None:
    result, _, _ = run_module(BASE_ARGS, make_lab(memory_mb=8192), monkeypatch, capsys)
    assert result["failed"] and "needs at least 245760 MB" in result["msg"]


def test_module_reads_credentials_from_the_environment(monkeypatch, capsys) -> None:
    monkeypatch.setenv("VMWARE_HOST", "esxi-01.example.com")
    monkeypatch.setenv("VMWARE_USER", "root")
    monkeypatch.setenv("VMWARE_PASSWORD", PASSWORD)
    monkeypatch.setenv("VMWARE_VALIDATE_CERTS", "false")
    args = {k: v for k, v in BASE_ARGS.items() if k not in ("hostname", "username", "password")}
    result, _, logins = run_module(args, make_lab(), monkeypatch, capsys)
    assert result["changed"]
    assert logins[0]["host"] == "esxi-01.example.com" and logins[0]["user"] == "root"
    assert logins[0]["pwd"] == PASSWORD and logins[0]["disableSslCertValidation"] is True


def test_bad_login_fails_without_the_password(monkeypatch, capsys) -> None:
    result, logged, _ = run_module(BASE_ARGS, None, monkeypatch, capsys)
    assert result["failed"]
    assert result["msg"] == "cannot log in to vcenter.example.com as automation@vsphere.local: invalid login"
    assert all(PASSWORD not in line for line in logged)


@pytest.mark.parametrize(
    ("gpu", "expected"),
    [
        ({"device_id": "20b5", "memory_gb": 80}, (0x10DE, 0x20B5)),
        ({"device_id": "0x20B5", "vendor_id": "0x10de", "memory_gb": 80}, (0x10DE, 0x20B5)),
        ({"device_id": 0x20B5, "vendor_id": 0x10DE, "memory_gb": 80}, (0x10DE, 0x20B5)),
    ],
)
def test_pci_ids_are_read_as_hex_strings_or_integers(gpu: dict[str, Any], expected: tuple[int, int]) -> None:
    params = {"gpus": [{"pci_id": None, "vendor_id": "10de", **gpu}]}
    params.update(
        secure_boot=False, hide_hypervisor=False, mmio_size_gb=None, adjust_memory=False, exclusive=False
    )
    assert module.options_from_params(params).gpus[0].model == expected


@pytest.mark.parametrize(
    ("gpu", "message"),
    [
        ({"device_id": "zz", "memory_gb": 8}, "not a hexadecimal"),
        ({"device_id": 0x10000, "memory_gb": 8}, "outside"),
    ],
)
def test_bad_pci_ids_fail_cleanly(gpu: dict[str, Any], message: str, monkeypatch, capsys) -> None:
    result, _, _ = run_module({**BASE_ARGS, "gpus": [gpu]}, make_lab(), monkeypatch, capsys)
    assert result["failed"] and message in result["msg"]


def test_pci_id_and_device_id_are_mutually_exclusive(monkeypatch, capsys) -> None:
    gpus = [{"pci_id": "0000:3b:00.0", "device_id": "20b5", "memory_gb": 80}]
    result, _, _ = run_module({**BASE_ARGS, "gpus": gpus}, make_lab(), monkeypatch, capsys)
    assert result["failed"] and "mutually exclusive" in result["msg"]


def test_missing_pyvmomi_is_reported_with_missing_required_lib(monkeypatch, capsys) -> None:
    monkeypatch.setattr(module, "HAS_PYVMOMI", False)
    result, _, _ = run_module(BASE_ARGS, make_lab(), monkeypatch, capsys)
    assert result["failed"] and "pyvmomi" in result["msg"] and "Failed to import" in result["msg"]


def _doc_options(options: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "type": spec.get("type", "str"),
            "required": spec.get("required", False),
            "default": spec.get("default"),
            "options": _doc_options(spec["suboptions"]) if "suboptions" in spec else None,
        }
        for name, spec in options.items()
    }


def _spec_options(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        name: {
            "type": item.get("type", "str"),
            "required": item.get("required", False),
            "default": item.get("default"),
            "options": _spec_options(item["options"]) if "options" in item else None,
        }
        for name, item in spec.items()
    }


def test_documentation_matches_the_argument_spec() -> None:
    doc = yaml.safe_load(module.DOCUMENTATION)
    assert _doc_options(doc["options"]) == _spec_options(module.ARGUMENT_SPEC)
    assert "not against a live vCenter" in module.DOCUMENTATION
    yaml.safe_load(module.EXAMPLES)
    returned = yaml.safe_load(module.RETURN)
    assert set(returned) == {
        "changes",
        "host_reboot_required",
        "deferred",
        "power_cycled",
        "total_gpu_memory_gb",
        "mmio_size_gb",
        "required_memory_mb",
        "diff",
    }


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(
    shutil.which("ansible-playbook", path=str(Path(sys.executable).parent)) is None, reason="no ansible"
)
def test_ansible_playbook_runs_the_module_and_keeps_the_password_out(tmp_path: Path) -> None:
    """Packaging (AnsiballZ + module_utils imports), argument parsing and no_log, via ansible-playbook.

    No stand-in here (nothing is injected into the module process): the module talks to a closed
    port and must fail cleanly, even at -vvv, without printing the password.
    """
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        textwrap.dedent(
            f"""
            - name: Run esxi_gpu_passthrough against nothing
              hosts: localhost
              gather_facts: false
              tasks:
                - name: Ensure GPUs are passed through
                  gpufleet.nvidia.esxi_gpu_passthrough:
                    hostname: 127.0.0.1
                    port: {_closed_port()}
                    username: root
                    password: "{PASSWORD}"
                    validate_certs: false
                    name: gpu-worker-01
                    gpus:
                      - pci_id: "0000:3b:00.0"
                        memory_gb: 80
            """
        )
    )
    env = {
        **os.environ,
        "ANSIBLE_COLLECTIONS_PATH": str(COLLECTIONS_ROOT),
        "ANSIBLE_PYTHON_INTERPRETER": sys.executable,
        "ANSIBLE_LOCAL_TEMP": str(tmp_path / "tmp"),
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CONFIG": str(tmp_path / "none.cfg"),
    }
    proc = subprocess.run(
        [
            str(Path(sys.executable).parent / "ansible-playbook"),
            "-vvv",
            "-c",
            "local",
            "-i",
            "localhost,",
            str(playbook),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "cannot connect to 127.0.0.1" in output
    assert PASSWORD not in output
