"""The reconcile loop against the in-process vSphere stand-in."""

from __future__ import annotations

from typing import Any

import pytest
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_plan import (
    KEY_HIDE_HYPERVISOR,
    KEY_MMIO_SIZE,
    KEY_USE_64BIT_MMIO,
    GpuRequest,
    Options,
    PlanError,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_reconcile import (
    Behaviour,
    PendingPowerOff,
    reconcile,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_vsphere import VmSelector, VSphereError
from esxi_lab import RTX_2080_TI, Lab, make_lab
from esxi_standin import VM, Task, vm_config
from pyVmomi import vim

BY_NAME = VmSelector(name="gpu-worker-01")
TWO_A100 = Options(
    gpus=(GpuRequest(memory_gb=80, pci_id="0000:3b:00.0"), GpuRequest(memory_gb=80, pci_id="0000:5e:00.0"))
)


def run(
    lab: Lab, options: Options = TWO_A100, selector: VmSelector = BY_NAME, **behaviour: Any
) -> dict[str, Any]:
    """Run the loop once, recording only this run's calls."""
    lab.recorder.calls.clear()
    return reconcile(lab.si, selector, options, Behaviour(**behaviour), sleep=lambda _seconds: None)


def extra(vm: VM) -> dict[str, str]:
    return {opt.key: opt.value for opt in vm.config.extraConfig}


def gpu_ids(vm: VM) -> list[str]:
    return sorted(
        d.backing.id
        for d in vm.config.hardware.device
        if isinstance(d.backing, vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo)
    )


def test_fresh_vm_gets_everything_and_a_second_run_changes_nothing() -> None:
    lab = make_lab()
    result = run(lab)
    assert result["changed"] and not result["power_cycled"] and not result["host_reboot_required"]
    assert lab.recorder.mutating() == ["ReconfigVM_Task"]
    config = lab.vm.config
    assert config.firmware == "efi" and config.bootOptions.efiSecureBootEnabled is False
    assert config.memoryReservationLockedToMax is True
    assert extra(lab.vm) == {KEY_USE_64BIT_MMIO: "TRUE", KEY_MMIO_SIZE: "512"}
    assert gpu_ids(lab.vm) == ["0000:3b:00.0", "0000:5e:00.0"]
    assert result["mmio_size_gb"] == 512 and result["total_gpu_memory_gb"] == 160
    assert result["diff"]["after"]["gpus"] == ["0000:3b:00.0", "0000:5e:00.0"]

    again = run(lab)
    assert not again["changed"] and again["changes"] == []
    assert lab.recorder.mutating() == []
    assert again["diff"]["before"] == again["diff"]["after"] == result["diff"]["after"]


def test_already_configured_vm_is_left_alone() -> None:
    lab = make_lab()
    run(lab)
    lab.vm.runtime.powerState = vim.VirtualMachine.PowerState.poweredOn
    result = run(lab)
    assert not result["changed"] and lab.recorder.mutating() == []


def test_powered_on_vm_fails_listing_pending_changes_and_changes_nothing() -> None:
    lab = make_lab(powered_on=True)
    with pytest.raises(PendingPowerOff) as err:
        run(lab)
    assert "allow_power_off" in str(err.value)
    assert "attach GPU 0000:3b:00.0 (DirectPath I/O)" in err.value.changes
    assert "firmware bios -> efi" in err.value.changes
    assert lab.recorder.mutating() == []
    assert lab.vm.powered_on and lab.vm.config.firmware == "bios"


@pytest.mark.parametrize(("tools", "off_call"), [(True, "ShutdownGuest"), (False, "PowerOffVM_Task")])
def test_allow_power_off_shuts_down_reconfigures_and_starts_again(tools: bool, off_call: str) -> None:
    lab = make_lab(powered_on=True, tools_running=tools)
    result = run(lab, allow_power_off=True)
    assert result["changed"] and result["power_cycled"]
    assert lab.recorder.mutating() == [off_call, "ReconfigVM_Task", "PowerOnVM_Task"]
    assert lab.vm.powered_on and gpu_ids(lab.vm) == ["0000:3b:00.0", "0000:5e:00.0"]
    assert not run(lab, allow_power_off=True)["changed"]


def test_a_change_that_works_online_is_applied_without_power_off() -> None:
    lab = make_lab()
    run(lab)
    lab.vm.config.memoryReservationLockedToMax = False
    lab.vm.runtime.powerState = vim.VirtualMachine.PowerState.poweredOn
    result = run(lab)
    assert result["changes"] == ["reserve all guest memory (locked to max)"]
    assert lab.recorder.mutating() == ["ReconfigVM_Task"] and not result["power_cycled"]
    assert lab.vm.powered_on and lab.vm.config.memoryReservationLockedToMax


def test_host_passthrough_off_is_enabled_reboot_reported_and_never_done() -> None:
    lab = make_lab(enabled=False)
    result = run(lab)
    assert result["changed"] and result["host_reboot_required"]
    assert lab.recorder.mutating() == ["UpdatePassthruConfig", "ReconfigVM_Task"]
    sent = lab.recorder.calls[lab.recorder.names().index("UpdatePassthruConfig")][1]
    assert [(c.id, c.passthruEnabled) for c in sent] == [("0000:3b:00.0", True), ("0000:5e:00.0", True)]
    assert "Refresh" in lab.recorder.names()
    assert not any("Reboot" in name or "Maintenance" in name for name in lab.recorder.names())
    assert gpu_ids(lab.vm) == [] and len(result["deferred"]) == 2
    assert lab.vm.config.firmware == "efi"  # what does not wait for the reboot is done

    waiting = run(lab)
    assert not waiting["changed"] and waiting["host_reboot_required"] and lab.recorder.mutating() == []

    lab.host.reboot()  # the operator reboots the host
    attached = run(lab)
    assert attached["changed"] and not attached["host_reboot_required"] and attached["deferred"] == []
    assert gpu_ids(lab.vm) == ["0000:3b:00.0", "0000:5e:00.0"]
    assert not run(lab)["changed"]


def test_host_that_rebinds_without_reboot_gets_gpus_in_one_run() -> None:
    lab = make_lab(enabled=False, rebind_without_reboot=True)
    result = run(lab)
    assert not result["host_reboot_required"] and result["deferred"] == []
    assert gpu_ids(lab.vm) == ["0000:3b:00.0", "0000:5e:00.0"]
    assert result["changes"][:2] == [
        "host esxi-01.example.com: enable passthrough for 0000:3b:00.0 (NVIDIA A100 80GB PCIe)",
        "host esxi-01.example.com: enable passthrough for 0000:5e:00.0 (NVIDIA A100 80GB PCIe)",
    ]
    assert not run(lab)["changed"]


def test_running_vm_is_not_powered_off_when_the_host_activates_passthrough_at_once() -> None:
    lab = make_lab(enabled=False, rebind_without_reboot=True, firmware="efi", locked=True, powered_on=True)
    lab.vm.config.extraConfig = [
        vim.option.OptionValue(key=KEY_USE_64BIT_MMIO, value="TRUE"),
        vim.option.OptionValue(key=KEY_MMIO_SIZE, value="512"),
    ]
    with pytest.raises(PendingPowerOff) as err:
        run(lab)
    assert err.value.changed and str(err.value).startswith("Host passthrough was enabled")
    assert err.value.changes == [
        "attach GPU 0000:3b:00.0 (DirectPath I/O)",
        "attach GPU 0000:5e:00.0 (DirectPath I/O)",
    ]
    assert lab.recorder.mutating() == ["UpdatePassthruConfig"] and lab.vm.powered_on
    result = run(lab, allow_power_off=True)
    assert result["power_cycled"] and gpu_ids(lab.vm) == ["0000:3b:00.0", "0000:5e:00.0"]


def test_memory_too_small_is_a_clear_error_before_any_change() -> None:
    lab = make_lab(memory_mb=64 * 1024, enabled=False)
    with pytest.raises(PlanError, match="needs at least 245760 MB"):
        run(lab)
    assert lab.recorder.mutating() == []


def test_adjust_memory_raises_the_vm_memory() -> None:
    lab = make_lab(memory_mb=64 * 1024)
    run(lab, options=Options(gpus=TWO_A100.gpus, adjust_memory=True))
    assert lab.vm.config.hardware.memoryMB == 245760


@pytest.mark.parametrize("hide", [False, True])
def test_consumer_gpu_gets_cpuid_flag_only_when_asked(hide: bool) -> None:
    lab = make_lab(device_id=RTX_2080_TI, name="GeForce RTX 2080 Ti", gpu_count=1, memory_mb=32 * 1024)
    options = Options(gpus=(GpuRequest(memory_gb=11, pci_id="0000:3b:00.0"),), hide_hypervisor=hide)
    run(lab, options=options)
    assert (KEY_HIDE_HYPERVISOR in extra(lab.vm)) == hide
    if hide:
        assert extra(lab.vm)[KEY_HIDE_HYPERVISOR] == "FALSE"
    assert extra(lab.vm)[KEY_MMIO_SIZE] == "32"
    assert not run(lab, options=options)["changed"]


def test_dynamic_directpath_attaches_by_model_and_converges() -> None:
    lab = make_lab(enabled=False, rebind_without_reboot=True)
    options = Options(gpus=tuple(GpuRequest(memory_gb=80, device_id=0x20B5) for _ in range(2)))
    result = run(lab, options=options)
    assert result["diff"]["after"]["gpus"] == ["dynamic:10de:20b5", "dynamic:10de:20b5"]
    backings = [d.backing for d in lab.vm.config.hardware.device]
    assert all(isinstance(b, vim.vm.device.VirtualPCIPassthrough.DynamicBackingInfo) for b in backings)
    assert not run(lab, options=options)["changed"]


@pytest.mark.parametrize("scenario", ["fresh", "powered_on", "host_off", "dynamic", "memory"])
def test_check_mode_calls_nothing_that_changes_state_and_predicts_the_real_run(scenario: str) -> None:
    settings: dict[str, Any] = {
        "fresh": {},
        "powered_on": {"powered_on": True},
        "host_off": {"enabled": False},
        "dynamic": {},
        "memory": {"memory_mb": 64 * 1024},
    }[scenario]
    options = {
        "dynamic": Options(gpus=(GpuRequest(memory_gb=80, device_id=0x20B5),)),
        "memory": Options(gpus=TWO_A100.gpus, adjust_memory=True),
    }.get(scenario, TWO_A100)
    checked_lab, real_lab = make_lab(**settings), make_lab(**settings)
    predicted = run(checked_lab, options=options, check_mode=True, allow_power_off=True)
    assert predicted["changed"]
    assert checked_lab.recorder.mutating() == []
    assert set(checked_lab.recorder.names()) <= {"QueryConfigTarget"}
    real = run(real_lab, options=options, allow_power_off=True)
    assert predicted["diff"] == real["diff"]
    assert predicted["changes"] == real["changes"]


def test_vm_can_be_found_by_uuid_instance_uuid_folder_and_datacenter() -> None:
    lab = make_lab()
    for selector in (
        VmSelector(uuid=lab.vm.config.uuid),
        VmSelector(uuid=lab.vm.config.instanceUuid),
        VmSelector(name="gpu-worker-01", datacenter="DC1"),
        VmSelector(name="gpu-worker-01", datacenter="DC1", folder="gpu"),
        VmSelector(name="gpu-worker-01", folder="/DC1/vm/gpu"),
    ):
        assert run(lab, selector=selector)["total_gpu_memory_gb"] == 160


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        (VmSelector(name="nope"), "no VM named 'nope'"),
        (VmSelector(uuid="00000000-0000-0000-0000-000000000000"), "no VM with UUID"),
        (VmSelector(name="gpu-worker-01", datacenter="DC9"), "datacenter 'DC9' not found"),
        (VmSelector(name="gpu-worker-01", datacenter="DC1", folder="cpu"), "folder 'cpu' not found"),
    ],
)
def test_lookup_failures_say_what_was_missing(selector: VmSelector, message: str) -> None:
    with pytest.raises(VSphereError, match=message):
        run(make_lab(), selector=selector)


def test_two_vms_with_one_name_need_a_narrower_selector() -> None:
    lab = make_lab()
    twin = VM(vm_config("gpu-worker-01", 256 * 1024, uuid="4213a5e1-0000-4b4a-9f6e-2b1d3f5c7a90"), lab.host)
    lab.si.content.rootFolder.childEntity[0].vmFolder.childEntity.append(twin)
    with pytest.raises(VSphereError, match="2 VMs are named"):
        run(lab)


def test_failed_reconfigure_after_power_off_says_the_vm_is_left_off() -> None:
    lab = make_lab(powered_on=True)
    fault = vim.fault.InvalidDeviceSpec(msg="device spec rejected")
    lab.vm.ReconfigVM_Task = lambda spec: Task(error=fault)
    with pytest.raises(VSphereError, match=r"device spec rejected.*left off"):
        run(lab, allow_power_off=True)
    assert not lab.vm.powered_on


def test_host_refusing_the_passthrough_change_is_reported() -> None:
    lab = make_lab(enabled=False)

    def refuse(config: list[Any]) -> None:
        raise vim.fault.HostConfigFault(msg="permission denied")

    lab.host.configManager.pciPassthruSystem.UpdatePassthruConfig = refuse
    with pytest.raises(VSphereError, match=r"passthrough on host esxi-01\.example\.com failed: permission"):
        run(lab)
    assert lab.recorder.mutating() == []


def test_vsphere_faults_raised_by_a_call_become_clean_errors() -> None:
    lab = make_lab()

    def no_permission(spec: Any) -> None:
        raise vim.fault.NoPermission(msg="Permission to perform this operation was denied.")

    lab.vm.ReconfigVM_Task = no_permission
    with pytest.raises(VSphereError, match="vSphere refused the request: Permission to perform"):
        run(lab)
