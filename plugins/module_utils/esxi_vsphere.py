# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""The few vSphere calls gpufleet makes: log in, find a VM, read its host's PCI state, run tasks.

Kept apart from the decision logic so that tests can hand the reconcile loop a stand-in service
instance built on pyVmomi's data objects.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

try:
    from pyVim import connect as _connect
    from pyVmomi import vim, vmodl
except ImportError:  # reported by the module through missing_required_lib
    _connect = None  # type: ignore[assignment]
    vim = vmodl = None  # type: ignore[assignment]

from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_plan import HostPci

TASK_POLL_SECONDS = 0.5


class VSphereError(RuntimeError):
    """A vSphere call failed or an object was not found; the message is safe to show."""


@dataclass(frozen=True)
class Credentials:
    """Where and how to log in. ``password`` never appears in messages or repr."""

    hostname: str
    username: str
    password: str
    port: int = 443
    protocol: str = "https"
    validate_certs: bool = True

    def __repr__(self) -> str:
        return (
            f"Credentials(hostname={self.hostname!r}, username={self.username!r}, port={self.port}, "
            f"protocol={self.protocol!r})"
        )


@dataclass(frozen=True)
class VmSelector:
    """How to find the VM: by name (optionally within a datacenter/folder) or by UUID."""

    name: str | None = None
    uuid: str | None = None
    datacenter: str | None = None
    folder: str | None = None


def connect(creds: Credentials) -> Any:
    """Log in to vCenter or a standalone ESXi host and return the service instance."""
    try:
        return _connect.SmartConnect(
            host=creds.hostname,
            user=creds.username,
            pwd=creds.password,
            port=creds.port,
            protocol=creds.protocol,
            disableSslCertValidation=not creds.validate_certs,
        )
    except vim.fault.InvalidLogin:
        raise VSphereError(f"cannot log in to {creds.hostname} as {creds.username}: invalid login") from None
    except (OSError, vmodl.MethodFault) as exc:
        # Only the exception's class and text: neither carries the password.
        reason = getattr(exc, "msg", None) or str(exc) or type(exc).__name__
        raise VSphereError(f"cannot connect to {creds.hostname}:{creds.port}: {reason}") from None


def disconnect(service_instance: Any) -> None:
    """Log out, ignoring errors (the session is finished either way)."""
    # Logging out must not mask the real result.
    with contextlib.suppress(Exception):
        _connect.Disconnect(service_instance)


def _datacenter(content: Any, name: str) -> Any:
    for entity in content.rootFolder.childEntity:
        # Folders sit next to datacenters in the root folder; only datacenters have a vmFolder.
        if hasattr(entity, "vmFolder") and entity.name == name:
            return entity
    raise VSphereError(f"datacenter {name!r} not found")


def _folder(content: Any, datacenter: Any | None, path: str) -> Any:
    full = path
    if not path.startswith("/") and datacenter is not None:
        full = f"{datacenter.name}/vm/{path}"
    folder = content.searchIndex.FindByInventoryPath(full.strip("/"))
    if folder is None:
        raise VSphereError(f"folder {path!r} not found (looked up as {full.strip('/')!r})")
    return folder


def find_vm(service_instance: Any, selector: VmSelector) -> Any:
    """Return the one VM the selector names; fail when none or several match."""
    content = service_instance.RetrieveContent()
    datacenter = _datacenter(content, selector.datacenter) if selector.datacenter else None
    if selector.uuid:
        for instance_uuid in (False, True):
            vm = content.searchIndex.FindByUuid(datacenter, selector.uuid, True, instance_uuid)
            if vm is not None:
                return vm
        raise VSphereError(f"no VM with UUID {selector.uuid}")
    if selector.folder:
        container = _folder(content, datacenter, selector.folder)
    else:
        container = datacenter.vmFolder if datacenter is not None else content.rootFolder
    view = content.viewManager.CreateContainerView(container, [vim.VirtualMachine], True)
    try:
        found = [vm for vm in view.view if vm.name == selector.name]
    finally:
        view.Destroy()
    if not found:
        raise VSphereError(f"no VM named {selector.name!r}")
    if len(found) > 1:
        raise VSphereError(f"{len(found)} VMs are named {selector.name!r}: give uuid, datacenter or folder")
    return found[0]


def host_pci(vm: Any) -> HostPci:
    """Read the PCI devices and passthrough state of the VM's host, and what it offers this VM."""
    host = vm.runtime.host
    if host is None:
        raise VSphereError(f"VM {vm.name!r} is not registered on a host")
    target = vm.environmentBrowser.QueryConfigTarget(host=host)
    return HostPci(
        name=host.name,
        devices=list(host.hardware.pciDevice or []),
        passthru=list(host.configManager.pciPassthruSystem.pciPassthruInfo or []),
        targets=list(target.pciPassthrough or []) if target is not None else [],
    )


def wait_for_task(task: Any, what: str, timeout: float, sleep: Callable[[float], None] = time.sleep) -> Any:
    """Wait for a vSphere task; return its result or raise :class:`VSphereError` with its fault."""
    waited = 0.0
    while task.info.state not in (vim.TaskInfo.State.success, vim.TaskInfo.State.error):
        if waited >= timeout:
            raise VSphereError(f"{what}: still running after {timeout:g} s")
        sleep(TASK_POLL_SECONDS)
        waited += TASK_POLL_SECONDS
    if task.info.state == vim.TaskInfo.State.error:
        fault = task.info.error
        raise VSphereError(f"{what} failed: {getattr(fault, 'msg', None) or fault}")
    return task.info.result


def enable_passthrough(vm: Any, config: list[Any]) -> None:
    """Send the host's passthrough changes and refresh its view of them."""
    system = vm.runtime.host.configManager.pciPassthruSystem
    try:
        system.UpdatePassthruConfig(config=config)
        system.Refresh()
    except vmodl.MethodFault as exc:
        reason = getattr(exc, "msg", None) or exc
        raise VSphereError(f"enabling passthrough on host {vm.runtime.host.name} failed: {reason}") from None


def power_off(vm: Any, timeout: float, sleep: Callable[[float], None] = time.sleep) -> str:
    """Shut the guest down cleanly when VMware Tools runs, else power off; return how it went off."""
    if vm.guest is not None and vm.guest.toolsRunningStatus == "guestToolsRunning":
        vm.ShutdownGuest()
        waited = 0.0
        while waited < timeout:
            if vm.runtime.powerState == vim.VirtualMachine.PowerState.poweredOff:
                return "guest shutdown"
            sleep(TASK_POLL_SECONDS)
            waited += TASK_POLL_SECONDS
    wait_for_task(vm.PowerOffVM_Task(), f"powering off VM {vm.name!r}", timeout, sleep)
    return "power off"
