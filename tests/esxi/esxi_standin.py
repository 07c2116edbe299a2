"""A small in-process stand-in for the vSphere calls esxi_gpu_passthrough makes.

Managed objects (service instance, VM, host, folders, tasks) are plain Python classes; every value they
hold or receive is a real pyVmomi data object (``vim.vm.ConfigInfo``, ``vim.vm.ConfigSpec``,
``vim.host.PciDevice``, ``vim.host.PciPassthruInfo``, ``vim.option.OptionValue``...). The stand-in
records each call, applies the specs it receives to its state (so a second run finds nothing to do),
and refuses what vSphere refuses in the cases that matter here: device or firmware changes on a
powered-on VM, DirectPath backings that do not match the host, power-on without full memory
reservation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from pyVmomi import SoapAdapter, vim

MUTATING_CALLS = frozenset(
    {"UpdatePassthruConfig", "ReconfigVM_Task", "PowerOffVM_Task", "PowerOnVM_Task", "ShutdownGuest"}
)
NVIDIA = 0x10DE
HOST_SYSTEM_ID = "5f6e9a1c-2b3d-4c5e-8f70-0123456789ab"


class Task:
    """A finished vSphere task (the stand-in runs everything synchronously)."""

    def __init__(self, result: Any = None, error: Any = None) -> None:
        state = vim.TaskInfo.State.error if error is not None else vim.TaskInfo.State.success
        self.info = SimpleNamespace(state=state, error=error, result=result)


def _fault(message: str) -> Any:
    return vim.fault.InvalidState(msg=message)


def _signed16(value: int) -> int:
    return value - 0x10000 if value >= 0x8000 else value


def pci_device(pci_id: str, device_id: int, name: str, vendor_id: int = NVIDIA) -> Any:
    """A host PCI device as ``host.hardware.pciDevice`` lists it (ids as signed shorts)."""
    bus, slot_function = pci_id.split(":")[1:]
    slot, function = slot_function.split(".")
    return vim.host.PciDevice(
        id=pci_id,
        classId=0x0302,
        bus=int(bus, 16),
        slot=int(slot, 16),
        function=int(function),
        vendorId=_signed16(vendor_id),
        subVendorId=_signed16(vendor_id),
        vendorName="NVIDIA Corporation" if vendor_id == NVIDIA else "Other",
        deviceId=_signed16(device_id),
        subDeviceId=0,
        parentBridge="0000:3a:00.0",
        deviceName=name,
    )


@dataclass
class HostGpu:
    """One PCI device on the stand-in host and its passthrough switches."""

    device: Any
    capable: bool = True
    enabled: bool = False
    active: bool = False


@dataclass
class Recorder:
    """Every call made on the stand-in, in order: ``(method, argument)``."""

    calls: list[tuple[str, Any]] = field(default_factory=list)

    def record(self, method: str, argument: Any = None) -> None:
        self.calls.append((method, argument))

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    def mutating(self) -> list[str]:
        return [name for name in self.names() if name in MUTATING_CALLS]


class PassthruSystem:
    """``host.configManager.pciPassthruSystem``."""

    def __init__(self, host: Host) -> None:
        self._host = host

    @property
    def pciPassthruInfo(self) -> list[Any]:
        return [
            vim.host.PciPassthruInfo(
                id=gpu.device.id,
                dependentDevice=gpu.device.id,
                passthruCapable=gpu.capable,
                passthruEnabled=gpu.enabled,
                passthruActive=gpu.active,
            )
            for gpu in self._host.gpus
        ]

    def UpdatePassthruConfig(self, config: list[Any]) -> None:
        self._host.recorder.record("UpdatePassthruConfig", copy.deepcopy(config))
        for item in config:
            assert isinstance(item, vim.host.PciPassthruConfig)
            gpu = self._host.gpu(item.id)
            if not gpu.capable:
                raise vim.fault.HostConfigFault(msg=f"{item.id} is not passthrough capable")
            gpu.enabled = bool(item.passthruEnabled)
            if self._host.rebind_without_reboot:
                gpu.active = gpu.enabled

    def Refresh(self) -> None:
        self._host.recorder.record("Refresh")


class Host:
    """An ESXi host (``vim.HostSystem``) with some NVIDIA GPUs."""

    def __init__(
        self, name: str, gpus: list[HostGpu], recorder: Recorder, rebind_without_reboot: bool = False
    ) -> None:
        self.name = name
        self.gpus = gpus
        self.recorder = recorder
        self.rebind_without_reboot = rebind_without_reboot
        self.system_id = HOST_SYSTEM_ID
        self.hardware = SimpleNamespace(pciDevice=[g.device for g in gpus])
        self.configManager = SimpleNamespace(pciPassthruSystem=PassthruSystem(self))
        self.vms: list[VM] = []

    def gpu(self, pci_id: str) -> HostGpu:
        for gpu in self.gpus:
            if gpu.device.id == pci_id:
                return gpu
        raise vim.fault.NotFound(msg=f"no PCI device {pci_id}")

    def reboot(self) -> None:
        """Test helper: what an operator's host reboot does to passthrough state."""
        for gpu in self.gpus:
            gpu.active = gpu.enabled


class EnvironmentBrowser:
    """``vm.environmentBrowser``: only ``QueryConfigTarget`` is used."""

    def __init__(self, vm: VM) -> None:
        self._vm = vm

    def QueryConfigTarget(self, host: Host) -> Any:
        self._vm.recorder.record("QueryConfigTarget")
        used_elsewhere = {
            dev.backing.id
            for other in host.vms
            if other is not self._vm
            for dev in other.config.hardware.device
            if isinstance(dev.backing, vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo)
        }
        offered = [g for g in host.gpus if g.active and g.device.id not in used_elsewhere]
        return vim.vm.ConfigTarget(
            pciPassthrough=[
                vim.vm.PciPassthroughInfo(
                    name=g.device.deviceName, pciDevice=g.device, systemId=host.system_id
                )
                for g in offered
            ]
        )


def vm_config(
    name: str,
    memory_mb: int,
    firmware: str = "bios",
    secure_boot: bool = False,
    locked: bool = False,
    extra: dict[str, str] | None = None,
    devices: list[Any] | None = None,
    uuid: str = "4213a5e1-0c8e-4b4a-9f6e-2b1d3f5c7a90",
) -> Any:
    """A ``vim.vm.ConfigInfo`` with the fields the module reads."""
    return vim.vm.ConfigInfo(
        name=name,
        uuid=uuid,
        instanceUuid="50" + uuid[2:],
        firmware=firmware,
        bootOptions=vim.vm.BootOptions(efiSecureBootEnabled=secure_boot),
        memoryReservationLockedToMax=locked,
        extraConfig=[vim.option.OptionValue(key=k, value=v) for k, v in (extra or {}).items()],
        hardware=vim.vm.VirtualHardware(numCPU=8, memoryMB=memory_mb, device=list(devices or [])),
    )


def apply_spec(config: Any, spec: Any, next_key: int) -> tuple[Any, int]:
    """Return ``config`` with ``spec`` applied the way vSphere applies a ConfigSpec."""
    new = copy.deepcopy(config)
    if spec.memoryMB is not None:
        new.hardware.memoryMB = spec.memoryMB
    if spec.memoryReservationLockedToMax is not None:
        new.memoryReservationLockedToMax = spec.memoryReservationLockedToMax
    if spec.firmware is not None:
        new.firmware = spec.firmware
    if spec.bootOptions is not None:
        if new.bootOptions is None:
            new.bootOptions = vim.vm.BootOptions()
        if spec.bootOptions.efiSecureBootEnabled is not None:
            new.bootOptions.efiSecureBootEnabled = spec.bootOptions.efiSecureBootEnabled
    if spec.extraConfig:
        options = {opt.key: opt.value for opt in new.extraConfig or []}
        for opt in spec.extraConfig:
            if opt.value in (None, ""):
                options.pop(opt.key, None)  # an empty value deletes the key
            else:
                options[opt.key] = opt.value
        new.extraConfig = [vim.option.OptionValue(key=k, value=v) for k, v in options.items()]
    devices = list(new.hardware.device or [])
    for change in spec.deviceChange or []:
        if change.operation == vim.vm.device.VirtualDeviceSpec.Operation.add:
            device = copy.deepcopy(change.device)
            device.key = next_key
            next_key += 1
            devices.append(device)
        elif change.operation == vim.vm.device.VirtualDeviceSpec.Operation.remove:
            devices = [d for d in devices if d.key != change.device.key]
        else:
            raise AssertionError(f"unexpected device operation {change.operation}")
    new.hardware.device = devices
    return new, next_key


class VM:
    """A ``vim.VirtualMachine`` whose ``config`` is a real ``vim.vm.ConfigInfo``."""

    def __init__(self, config: Any, host: Host, powered_on: bool = False, tools_running: bool = True) -> None:
        self.config = config
        self.name = config.name
        self.recorder = host.recorder
        self.runtime = SimpleNamespace(
            host=host,
            powerState=vim.VirtualMachine.PowerState.poweredOn
            if powered_on
            else vim.VirtualMachine.PowerState.poweredOff,
        )
        self.guest = SimpleNamespace(
            toolsRunningStatus="guestToolsRunning" if tools_running else "guestToolsNotRunning"
        )
        self.environmentBrowser = EnvironmentBrowser(self)
        self.specs: list[Any] = []
        self._next_key = 13000
        host.vms.append(self)

    @property
    def powered_on(self) -> bool:
        return self.runtime.powerState == vim.VirtualMachine.PowerState.poweredOn

    def _check_backing(self, device: Any) -> str | None:
        backing = device.backing
        if not isinstance(backing, vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo):
            return None
        host = self.runtime.host
        gpu = host.gpu(backing.id)
        if not gpu.active:
            return f"{backing.id} is not active for passthrough"
        if backing.systemId != host.system_id:
            return f"{backing.id}: systemId {backing.systemId!r} is not the host's"
        if backing.deviceId != format(gpu.device.deviceId & 0xFFFF, "x"):
            return f"{backing.id}: deviceId {backing.deviceId!r} does not match the host device"
        if backing.vendorId != gpu.device.vendorId:
            return f"{backing.id}: vendorId {backing.vendorId!r} does not match the host device"
        return None

    def ReconfigVM_Task(self, spec: Any) -> Task:
        self.recorder.record("ReconfigVM_Task", spec)
        self.specs.append(spec)
        SoapAdapter.Serialize(spec)  # what the SOAP layer would do with it
        offline_only = spec.deviceChange or spec.firmware or spec.bootOptions or spec.memoryMB
        if self.powered_on and offline_only:
            return Task(error=_fault("The operation is not allowed in the current state (powered on)."))
        for change in spec.deviceChange or []:
            if change.operation == vim.vm.device.VirtualDeviceSpec.Operation.add:
                problem = self._check_backing(change.device)
                if problem:
                    return Task(error=vim.fault.InvalidDeviceSpec(msg=problem))
        self.config, self._next_key = apply_spec(self.config, spec, self._next_key)
        return Task()

    def ShutdownGuest(self) -> None:
        self.recorder.record("ShutdownGuest")
        self.runtime.powerState = vim.VirtualMachine.PowerState.poweredOff

    def PowerOffVM_Task(self) -> Task:
        self.recorder.record("PowerOffVM_Task")
        self.runtime.powerState = vim.VirtualMachine.PowerState.poweredOff
        return Task()

    def PowerOnVM_Task(self) -> Task:
        self.recorder.record("PowerOnVM_Task")
        passthrough = [
            d for d in self.config.hardware.device if isinstance(d, vim.vm.device.VirtualPCIPassthrough)
        ]
        if passthrough and not self.config.memoryReservationLockedToMax:
            return Task(error=_fault("Invalid memory setting: memory reservation must equal memory size."))
        self.runtime.powerState = vim.VirtualMachine.PowerState.poweredOn
        return Task()


class Folder:
    """A VM folder (``vim.Folder``)."""

    def __init__(self, name: str, children: list[Any] | None = None) -> None:
        self.name = name
        self.childEntity = list(children or [])

    def walk(self) -> list[Any]:
        found: list[Any] = []
        for child in self.childEntity:
            found.append(child)
            if isinstance(child, Folder):
                found.extend(child.walk())
        return found


class Datacenter:
    """A datacenter (``vim.Datacenter``) with its VM folder."""

    def __init__(self, name: str, vm_folder: Folder) -> None:
        self.name = name
        self.vmFolder = vm_folder


class ContainerView:
    def __init__(self, objects: list[Any]) -> None:
        self.view = objects

    def Destroy(self) -> None:
        pass


class ServiceInstance:
    """The service instance ``SmartConnect`` would return, over one or more datacenters."""

    def __init__(self, datacenters: list[Datacenter], recorder: Recorder) -> None:
        self.recorder = recorder
        root = Folder("Datacenters", datacenters)
        self.content = SimpleNamespace(
            rootFolder=root,
            searchIndex=SimpleNamespace(
                FindByUuid=self._find_by_uuid, FindByInventoryPath=self._find_by_path
            ),
            viewManager=SimpleNamespace(CreateContainerView=self._container_view),
        )

    def RetrieveContent(self) -> Any:
        return self.content

    def _vms(self, container: Any) -> list[VM]:
        if isinstance(container, Datacenter):
            container = container.vmFolder
        if container is self.content.rootFolder:
            return [vm for dc in container.childEntity for vm in self._vms(dc)]
        return [obj for obj in container.walk() if isinstance(obj, VM)]

    def _container_view(self, container: Any, types: list[Any], recursive: bool) -> ContainerView:
        assert types == [vim.VirtualMachine] and recursive
        return ContainerView(self._vms(container))

    def _find_by_uuid(self, datacenter: Any, uuid: str, vm_search: bool, instance_uuid: bool) -> VM | None:
        assert vm_search
        scope = datacenter if datacenter is not None else self.content.rootFolder
        for vm in self._vms(scope):
            if (vm.config.instanceUuid if instance_uuid else vm.config.uuid) == uuid:
                return vm
        return None

    def _find_by_path(self, path: str) -> Any:
        parts = path.split("/")
        for dc in self.content.rootFolder.childEntity:
            if dc.name != parts[0]:
                continue
            if len(parts) < 2 or parts[1] != "vm":
                return None
            node: Any = dc.vmFolder
            for part in parts[2:]:
                node = next((c for c in node.childEntity if isinstance(c, Folder) and c.name == part), None)
                if node is None:
                    return None
            return node
        return None
