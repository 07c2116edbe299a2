"""esxi_gpu_passthrough and playbooks/esxi.yml against VMware's vCenter simulator (govmomi's vcsim).

The module runs unpatched: pyVmomi over HTTP to a vcsim whose ESXi hosts carry NVIDIA GPUs
(src/gpufleet_harness/vcsim; what we added to govmomi's simulator is listed at the top of vcsim_gpu.go). One
simulator serves the whole module; each test works on its own VMs and GPUs, so the order does not matter.
What vcsim cannot model stays with the stand-in (test_esxi_reconcile.py); docs/esxi.md lists both.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_vsphere import VSphereError, wait_for_task
from ansible_collections.gpufleet.nvidia.plugins.modules import esxi_gpu_passthrough as module
from esxi_lab import module_args
from labstack import ANSIBLE_PLAYBOOK, REPO, ensure_collection_link
from pyVim.connect import Disconnect, SmartConnect
from pyVmomi import vim

from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.vcsim import (
    A100_PCIE_40GB,
    A100_SXM4_80GB,
    DATACENTER,
    T4,
    V100_PCIE_32GB,
    V100_SXM2_16GB,
    Gpu,
    Host,
    Scenario,
    Vcsim,
    Vm,
    missing_requirements,
)

ESXI_1 = "esxi-01.gpu.lab"  # passthrough needs a reboot to become active
ESXI_2 = "esxi-02.gpu.lab"  # activates passthrough at once (ESXi 7+)
ESXI_3 = "esxi-03.gpu.lab"  # the playbook's host: the GPUs of the simulated guest esxi-vm-2x-v100
GUEST_FIXTURE = "esxi-vm-2x-v100"

SCENARIO = Scenario(
    hosts=(
        Host(
            ESXI_1,
            (
                Gpu("0000:3b:00.0", A100_SXM4_80GB, enabled=True, active=True),
                Gpu("0000:5e:00.0", A100_SXM4_80GB, enabled=True, active=True),
                Gpu("0000:18:00.0", A100_SXM4_80GB, enabled=True, active=True),
                Gpu("0000:86:00.0", A100_SXM4_80GB, enabled=True, active=True),
                Gpu("0000:c1:00.0", A100_SXM4_80GB, enabled=True, active=True),
                Gpu("0000:af:00.0", V100_SXM2_16GB, capable=False),
                Gpu("0000:d8:00.0", T4),
            ),
        ),
        Host(
            ESXI_2,
            (Gpu("0000:3b:00.0", A100_PCIE_40GB), Gpu("0000:5e:00.0", A100_PCIE_40GB)),
            activate_without_reboot=True,
        ),
        Host(
            ESXI_3,
            (
                Gpu("0000:0b:00.0", V100_PCIE_32GB, enabled=True, active=True),
                Gpu("0000:13:00.0", V100_PCIE_32GB, enabled=True, active=True),
            ),
        ),
    ),
    vms=(
        Vm("gpu-fixed", ESXI_1, memory_mb=256 * 1024),
        Vm("gpu-running", ESXI_1, memory_mb=128 * 1024, powered_on=True, tools_running=True, folder="gpu"),
        Vm("gpu-reboot", ESXI_1, memory_mb=32 * 1024),
        Vm("gpu-holder", ESXI_1, memory_mb=128 * 1024),
        Vm("gpu-second", ESXI_1, memory_mb=128 * 1024),
        Vm("gpu-dynamic", ESXI_2, memory_mb=64 * 1024),
        Vm("vcsim-probe", ESXI_1, memory_mb=128 * 1024, powered_on=True),
        Vm("gpu-worker-01", ESXI_3, memory_mb=96 * 1024, powered_on=True, tools_running=True),
    ),
)
TWO_A100 = [{"pci_id": "0000:3b:00.0", "memory_gb": 80}, {"pci_id": "0000:5e:00.0", "memory_gb": 80}]
PCI_PASSTHROUGH = vim.vm.device.VirtualPCIPassthrough


@pytest.fixture(scope="module")
def vcsim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vcsim]:
    """The simulator for this module (built from Debian's govmomi on first use, then cached)."""
    missing = missing_requirements()
    if missing:
        pytest.fail("vcsim cannot be built: " + "; ".join(missing), pytrace=False)
    with Vcsim(SCENARIO, tmp_path_factory.mktemp("vcsim")) as sim:
        yield sim


@pytest.fixture(scope="module")
def si(vcsim: Vcsim) -> Iterator[Any]:
    """Our own pyVmomi session, to read back what the module did."""
    service = SmartConnect(
        host=vcsim.host, port=vcsim.port, protocol="http", user=vcsim.username, pwd=vcsim.password
    )
    yield service
    Disconnect(service)


def run(
    vcsim: Vcsim, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], **args: Any
) -> dict[str, Any]:
    """Run the module's ``main()`` against the simulator; the password must show nowhere."""
    full = {
        "hostname": vcsim.host,
        "port": vcsim.port,
        "protocol": "http",
        "username": vcsim.username,
        "password": vcsim.password,
        "datacenter": DATACENTER,
        **args,
    }
    logged: list[str] = []
    monkeypatch.setattr(basic.AnsibleModule, "log", lambda self, msg, log_args=None: logged.append(msg))
    with module_args(full), pytest.raises(SystemExit):
        module.main()
    out = capsys.readouterr()
    for secret in {vcsim.password, full["password"]}:
        assert secret not in out.out + out.err
        assert all(secret not in line for line in logged)
    return json.loads(out.out)  # type: ignore[no-any-return]


def find_vm(si: Any, name: str) -> Any:
    content = si.RetrieveContent()
    view = content.viewManager.CreateContainerView(content.rootFolder, [vim.VirtualMachine], True)
    try:
        return next(vm for vm in view.view if vm.name == name)
    finally:
        view.Destroy()


def extra(vm: Any) -> dict[str, str]:
    return {opt.key: opt.value for opt in vm.config.extraConfig}


def passthrough(vm: Any) -> list[Any]:
    return [d for d in vm.config.hardware.device if isinstance(d, PCI_PASSTHROUGH)]


def fixed_ids(vm: Any) -> list[str]:
    return sorted(
        d.backing.id for d in passthrough(vm) if isinstance(d.backing, PCI_PASSTHROUGH.DeviceBackingInfo)
    )


def host_passthru(si: Any, vm_name: str) -> dict[str, tuple[bool, bool]]:
    """``{pci id: (enabled, active)}`` as the VM's host reports it."""
    system = find_vm(si, vm_name).runtime.host.configManager.pciPassthruSystem
    return {p.id: (p.passthruEnabled, p.passthruActive) for p in system.pciPassthruInfo}


def test_fixed_gpus_get_every_vm_setting_and_a_second_run_changes_nothing(
    vcsim, si, monkeypatch, capsys
) -> None:
    args = {"name": "gpu-fixed", "gpus": TWO_A100, "hide_hypervisor": True}
    checked = run(vcsim, monkeypatch, capsys, **args, _ansible_check_mode=True, _ansible_diff=True)
    vm = find_vm(si, "gpu-fixed")
    assert checked["changed"] and vm.config.firmware == "bios" and passthrough(vm) == []
    assert checked["diff"]["before"]["gpus"] == [] and checked["diff"]["before"]["firmware"] == "bios"
    predicted = checked["diff"]["after"]

    result = run(vcsim, monkeypatch, capsys, **args)
    assert result["changed"] and not result["power_cycled"] and not result["host_reboot_required"]
    assert result["diff"]["after"] == predicted
    config = vm.config
    assert config.firmware == "efi" and not config.bootOptions.efiSecureBootEnabled
    assert config.memoryReservationLockedToMax is True
    # 1.5 x 160 GB of GPU memory; the VM's 256 GB is enough, so it is left as it is.
    assert result["required_memory_mb"] == 240 * 1024 and config.hardware.memoryMB == 256 * 1024
    settings = extra(vm)
    assert settings["pciPassthru.use64bitMMIO"] == "TRUE" and settings["pciPassthru.64bitMMIOSizeGB"] == "512"
    assert settings["hypervisor.cpuid.v0"] == "FALSE"
    assert fixed_ids(vm) == ["0000:3b:00.0", "0000:5e:00.0"]
    host_system_id = vm.runtime.host.hardware.systemInfo.uuid
    assert {d.backing.systemId for d in passthrough(vm)} == {host_system_id}
    assert {d.backing.deviceId for d in passthrough(vm)} == {"20b2"}

    again = run(vcsim, monkeypatch, capsys, **args)
    assert not again["changed"] and again["changes"] == []
    checked_again = run(vcsim, monkeypatch, capsys, **args, _ansible_check_mode=True)
    assert not checked_again["changed"]
    by_uuid = run(vcsim, monkeypatch, capsys, uuid=vm.config.uuid, gpus=TWO_A100, hide_hypervisor=True)
    assert not by_uuid["changed"]


def test_powered_on_vm_is_left_alone_unless_power_off_is_allowed(vcsim, si, monkeypatch, capsys) -> None:
    args = {"name": "gpu-running", "folder": "gpu", "gpus": [{"pci_id": "0000:18:00.0", "memory_gb": 80}]}
    vm = find_vm(si, "gpu-running")
    refused = run(vcsim, monkeypatch, capsys, **args)
    assert refused["failed"] and "allow_power_off" in refused["msg"]
    assert (
        "firmware bios -> efi" in refused["changes"]
        and "attach GPU 0000:18:00.0 (DirectPath I/O)" in refused["changes"]
    )
    assert vm.runtime.powerState == "poweredOn" and vm.config.firmware == "bios" and passthrough(vm) == []

    result = run(vcsim, monkeypatch, capsys, **args, allow_power_off=True)
    assert result["changed"] and result["power_cycled"]
    assert vm.runtime.powerState == "poweredOn"
    assert vm.config.firmware == "efi" and fixed_ids(vm) == ["0000:18:00.0"]

    again = run(vcsim, monkeypatch, capsys, **args, allow_power_off=True)
    assert not again["changed"] and not again["power_cycled"] and vm.runtime.powerState == "poweredOn"


def test_host_passthrough_is_enabled_the_reboot_reported_and_the_gpu_attached_after_it(
    vcsim, si, monkeypatch, capsys
) -> None:
    args = {"name": "gpu-reboot", "gpus": [{"pci_id": "0000:d8:00.0", "memory_gb": 16}]}
    first = run(vcsim, monkeypatch, capsys, **args)
    assert first["changed"] and first["host_reboot_required"]
    assert f"host {ESXI_1}: enable passthrough for 0000:d8:00.0 (TU104GL [Tesla T4])" in first["changes"]
    assert first["deferred"] == [
        f"attach GPU 0000:d8:00.0 once passthrough is active on host {ESXI_1} (reboot it)"
    ]
    assert host_passthru(si, "gpu-reboot")["0000:d8:00.0"] == (True, False)
    vm = find_vm(si, "gpu-reboot")
    assert vm.config.firmware == "efi" and passthrough(vm) == []  # the rest is done already

    waiting = run(vcsim, monkeypatch, capsys, **args)
    assert not waiting["changed"] and waiting["host_reboot_required"] and waiting["deferred"]

    vcsim.reboot_host(ESXI_1)  # what the operator does, in maintenance mode
    attached = run(vcsim, monkeypatch, capsys, **args)
    assert attached["changed"] and not attached["host_reboot_required"] and attached["deferred"] == []
    assert attached["changes"] == ["attach GPU 0000:d8:00.0 (DirectPath I/O)"]
    assert fixed_ids(vm) == ["0000:d8:00.0"]


def test_dynamic_directpath_gpus_are_enabled_and_attached_by_model(vcsim, si, monkeypatch, capsys) -> None:
    gpus = [{"device_id": "20f1", "memory_gb": 40}, {"device_id": "20f1", "memory_gb": 40}]
    too_small = run(vcsim, monkeypatch, capsys, name="gpu-dynamic", gpus=gpus)
    assert too_small["failed"] and "needs at least 122880 MB" in too_small["msg"]
    assert host_passthru(si, "gpu-dynamic") == {
        "0000:3b:00.0": (False, False),
        "0000:5e:00.0": (False, False),
    }

    result = run(vcsim, monkeypatch, capsys, name="gpu-dynamic", gpus=gpus, adjust_memory=True)
    assert result["changed"] and not result["host_reboot_required"] and result["mmio_size_gb"] == 256
    assert host_passthru(si, "gpu-dynamic") == {"0000:3b:00.0": (True, True), "0000:5e:00.0": (True, True)}
    vm = find_vm(si, "gpu-dynamic")
    assert vm.config.hardware.memoryMB == 122880
    backings = [d.backing for d in passthrough(vm)]
    assert len(backings) == 2 and all(isinstance(b, PCI_PASSTHROUGH.DynamicBackingInfo) for b in backings)
    assert {(a.vendorId & 0xFFFF, a.deviceId & 0xFFFF) for b in backings for a in b.allowedDevice} == {
        (0x10DE, 0x20F1)
    }
    assert not run(vcsim, monkeypatch, capsys, name="gpu-dynamic", gpus=gpus, adjust_memory=True)["changed"]


def test_gpu_attached_to_another_vm_is_refused(vcsim, si, monkeypatch, capsys) -> None:
    gpus = [{"pci_id": "0000:86:00.0", "memory_gb": 80}]
    assert run(vcsim, monkeypatch, capsys, name="gpu-holder", gpus=gpus)["changed"]
    taken = run(vcsim, monkeypatch, capsys, name="gpu-second", gpus=gpus)
    assert taken["failed"] and "does not offer it to this VM (is another VM using it?)" in taken["msg"]
    assert fixed_ids(find_vm(si, "gpu-holder")) == ["0000:86:00.0"]
    assert find_vm(si, "gpu-second").config.firmware == "bios"  # refused before any change


def test_gpu_not_capable_of_passthrough_fails_before_any_change(vcsim, si, monkeypatch, capsys) -> None:
    result = run(
        vcsim, monkeypatch, capsys, name="gpu-second", gpus=[{"pci_id": "0000:af:00.0", "memory_gb": 16}]
    )
    assert (
        result["failed"] and f"0000:af:00.0 on host {ESXI_1} is not capable of passthrough" in result["msg"]
    )
    assert find_vm(si, "gpu-second").config.firmware == "bios"


def test_unknown_vm_fails(vcsim, monkeypatch, capsys) -> None:
    result = run(vcsim, monkeypatch, capsys, name="no-such-vm", gpus=TWO_A100)
    assert result["failed"] and result["msg"] == "no VM named 'no-such-vm'"


def test_bad_credentials_fail_without_either_password(vcsim, monkeypatch, capsys) -> None:
    wrong = "Wr0ng-" + vcsim.password[::-1]
    result = run(vcsim, monkeypatch, capsys, name="gpu-fixed", gpus=TWO_A100, password=wrong)
    assert result["failed"]
    assert result["msg"] == f"cannot log in to {vcsim.host} as {vcsim.username}: invalid login"


def test_vcsim_refuses_what_vsphere_refuses_for_passthrough_vms(si) -> None:
    """The harness itself: our additions to the simulator refuse what the module must never send."""
    vm = find_vm(si, "vcsim-probe")
    target = vm.environmentBrowser.QueryConfigTarget(host=vm.runtime.host)
    offered = next(t for t in target.pciPassthrough if t.pciDevice.id == "0000:c1:00.0")
    assert {(d.vendorId & 0xFFFF, d.deviceId & 0xFFFF) for d in target.dynamicPassthrough} >= {
        (0x10DE, 0x20B2)
    }

    def attach(system_id: str) -> Any:
        backing = PCI_PASSTHROUGH.DeviceBackingInfo(
            id="0000:c1:00.0", deviceId="20b2", systemId=system_id, vendorId=0x10DE, deviceName=""
        )
        add = vim.vm.device.VirtualDeviceSpec(
            operation="add", device=PCI_PASSTHROUGH(key=-1, backing=backing)
        )
        return vm.ReconfigVM_Task(spec=vim.vm.ConfigSpec(deviceChange=[add]))

    def refused(task: Any) -> str:
        with pytest.raises(VSphereError) as failure:
            wait_for_task(task, "probe", timeout=30)
        return str(failure.value)

    assert "current state (Powered on)" in refused(attach(offered.systemId))
    wait_for_task(vm.PowerOffVM_Task(), "power off", timeout=30)
    assert "is not the host's" in refused(attach("not-this-host"))
    wait_for_task(attach(offered.systemId), "attach", timeout=30)
    assert "memory reservation" in refused(vm.PowerOnVM_Task())
    spec = vim.vm.ConfigSpec(memoryReservationLockedToMax=True)
    wait_for_task(vm.ReconfigVM_Task(spec=spec), "lock memory", timeout=30)
    wait_for_task(vm.PowerOnVM_Task(), "power on", timeout=30)
    assert vm.runtime.powerState == "poweredOn"


def playbook(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """ansible-playbook from the repository root (ansible.cfg applies), with ``env`` added."""
    ensure_collection_link()
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET_", "VMWARE_"))}
    environ.update(ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", **env)
    return subprocess.run(
        [str(ANSIBLE_PLAYBOOK), *args],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def recap(output: str, host: str) -> dict[str, int]:
    match = re.search(rf"^{re.escape(host)}\s+:\s+(.*)$", output, re.M)
    assert match, output[-3000:]
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", match.group(1))}


def test_esxi_playbook_end_to_end_changes_then_reports_no_change(vcsim, si, tmp_path: Path) -> None:
    """playbooks/esxi.yml: play 1 against vcsim, play 2 in the simulated guest that has those two GPUs."""
    guest = tmp_path / GUEST_FIXTURE
    simmachine.materialize(GUEST_FIXTURE, guest, library=simbuild.build_library())
    inventory = tmp_path / "hosts.yml"
    guest_vars = {
        "ansible_connection": "local",
        "ansible_python_interpreter": "{{ ansible_playbook_python }}",
        "gpufleet_env": {
            "GPUFLEET_SIM_ROOT": str(guest),
            "GPUFLEET_HOST_ROOT": str(guest / "host"),
            "LD_LIBRARY_PATH": str(guest / "lib"),
        },
        "esxi_validate_certs": False,
        "esxi_datacenter": DATACENTER,
        "esxi_allow_power_off": True,
        "esxi_gpus": [
            {"pci_id": "0000:0b:00.0", "memory_gb": 32},
            {"pci_id": "0000:13:00.0", "memory_gb": 32},
        ],
    }
    inventory.write_text(yaml.safe_dump({"esxi_gpu_vms": {"hosts": {"gpu-worker-01": guest_vars}}}))
    # Credentials (and the simulator's port and protocol) come from the environment, as on a controller.
    env = {
        "VMWARE_HOST": vcsim.host,
        "VMWARE_PORT": str(vcsim.port),
        "VMWARE_PROTOCOL": "http",
        "VMWARE_USER": vcsim.username,
        "VMWARE_PASSWORD": vcsim.password,
    }
    vm = find_vm(si, "gpu-worker-01")
    runs = {}
    for name, extra_args in (("check", ("--check", "--diff")), ("first", ()), ("second", ())):
        proc = playbook("-i", str(inventory), "playbooks/esxi.yml", *extra_args, env=env)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{name} run:\n{output[-4000:]}"
        assert vcsim.password not in output
        runs[name] = (recap(output, "gpu-worker-01"), output)
        if name == "check":
            assert vm.config.firmware == "bios" and passthrough(vm) == []  # check mode changed nothing

    check, check_output = runs["check"]
    assert check["changed"] == 1 and check["failed"] == 0
    assert '-    "firmware": "bios",' in check_output and '+    "firmware": "efi",' in check_output
    assert runs["first"][0]["changed"] == 1 and runs["first"][0]["failed"] == 0
    assert runs["second"][0]["changed"] == 0 and runs["second"][0]["failed"] == 0

    assert vm.runtime.powerState == "poweredOn" and vm.config.firmware == "efi"
    assert fixed_ids(vm) == ["0000:0b:00.0", "0000:13:00.0"]
    assert extra(vm)["pciPassthru.64bitMMIOSizeGB"] == "128"
