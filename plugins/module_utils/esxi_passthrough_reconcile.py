# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""Bring one VM (and its host) to the GPU passthrough configuration that :mod:`esxi_passthrough_plan` decides.

Order: read -> plan -> refuse if the VM is on and changes need it off (unless allowed) -> host
passthrough -> re-read and re-plan (the host may or may not activate devices without a reboot) ->
power off if needed -> reconfigure -> restore power. Check mode stops after the first plan.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_plan import (
    Options,
    Plan,
    describe_state,
    plan,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_vsphere import (
    VmSelector,
    VSphereError,
    enable_passthrough,
    find_vm,
    host_pci,
    power_off,
    wait_for_task,
)

try:
    from pyVmomi import vim, vmodl
except ImportError:  # reported by the module through missing_required_lib
    vim = vmodl = None  # type: ignore[assignment]


class PendingPowerOff(VSphereError):
    """The VM is on and the pending changes need it off; ``changes`` lists them."""

    def __init__(self, message: str, changes: list[str], changed: bool = False) -> None:
        super().__init__(message)
        self.changes = changes
        self.changed = changed


@dataclass(frozen=True)
class Behaviour:
    """How far the loop may go: power handling, timeouts, check mode."""

    allow_power_off: bool = False
    check_mode: bool = False
    shutdown_timeout: float = 300
    task_timeout: float = 600


def _pending(vm: Any, pending: list[str], host_changed: bool) -> PendingPowerOff:
    done = "Host passthrough was enabled; " if host_changed else ""
    return PendingPowerOff(
        f"{done}VM {vm.name!r} is powered on and these changes need it powered off (set allow_power_off "
        f"to let the module shut it down and start it again): {'; '.join(pending)}",
        pending,
        changed=host_changed,
    )


def _result(first: Plan, final: Plan | None, after: dict[str, Any], changed: bool) -> dict[str, Any]:
    shown = final or first
    host_changes = [c.text for c in first.changes if c.on_host]
    vm_changes = [c.text for c in shown.vm_changes]
    return {
        "changed": changed,
        "changes": host_changes + vm_changes,
        "host_reboot_required": shown.host_reboot_required,
        "deferred": shown.deferred,
        "warnings": list(dict.fromkeys(first.warnings + shown.warnings)),
        "total_gpu_memory_gb": shown.total_gpu_memory_gb,
        "mmio_size_gb": shown.mmio_size_gb,
        "required_memory_mb": shown.required_memory_mb,
        "diff": {"before": first.before, "after": after},
    }


def reconcile(
    service_instance: Any,
    selector: VmSelector,
    options: Options,
    behaviour: Behaviour,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Run the loop once; return the module result (without ``failed``).

    Raises :class:`PendingPowerOff`, :class:`VSphereError` or ``PlanError`` when it cannot proceed;
    nothing has been changed when :class:`PendingPowerOff` or ``PlanError`` comes from the first plan.
    """
    try:
        return _reconcile(service_instance, selector, options, behaviour, sleep)
    except vmodl.MethodFault as exc:  # a call refused outright (permissions, invalid state...)
        reason = getattr(exc, "msg", None) or type(exc).__name__
        raise VSphereError(f"vSphere refused the request: {reason}") from None


def _reconcile(
    service_instance: Any,
    selector: VmSelector,
    options: Options,
    behaviour: Behaviour,
    sleep: Callable[[float], None],
) -> dict[str, Any]:
    vm = find_vm(service_instance, selector)
    first = plan(vm.config, host_pci(vm), options)
    powered_on = vm.runtime.powerState == vim.VirtualMachine.PowerState.poweredOn

    if powered_on and first.power_off_required and not behaviour.allow_power_off:
        raise _pending(vm, [c.text for c in first.changes], host_changed=False)
    if behaviour.check_mode or not first.changed:
        result = _result(first, None, first.after, first.changed)
        result["power_cycled"] = False
        return result

    current = first
    if first.host_config:
        enable_passthrough(vm, first.host_config)
        current = plan(vm.config, host_pci(vm), options)
        # The host may have activated passthrough at once, so GPUs can now be attached: that needs
        # the VM off, which the first plan could not foresee.
        if powered_on and current.power_off_required and not behaviour.allow_power_off:
            raise _pending(vm, [c.text for c in current.vm_changes], host_changed=True)

    power_cycled = False
    if current.spec is not None:
        if powered_on and current.power_off_required:
            power_off(vm, behaviour.shutdown_timeout, sleep)
            power_cycled = True
        try:
            task = vm.ReconfigVM_Task(spec=current.spec)
            wait_for_task(task, f"reconfiguring VM {vm.name!r}", behaviour.task_timeout, sleep)
        except VSphereError as exc:
            if power_cycled:
                raise VSphereError(f"{exc} (the VM was powered off for it and is left off)") from None
            raise
        if power_cycled:
            wait_for_task(vm.PowerOnVM_Task(), f"powering on VM {vm.name!r}", behaviour.task_timeout, sleep)

    final_host = host_pci(vm)
    result = _result(first, current, describe_state(vm.config, final_host, options), True)
    result["power_cycled"] = power_cycled
    return result
