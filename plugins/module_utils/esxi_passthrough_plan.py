# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""Decide what an ESXi VM and its host need for GPU passthrough.

Everything here is pure: it reads pyVmomi data objects (the VM's ``vim.vm.ConfigInfo``, the host's
``vim.host.PciDevice`` / ``vim.host.PciPassthruInfo`` lists and the VM's config target) and returns a
:class:`Plan` holding the ``vim.vm.ConfigSpec`` and ``vim.host.PciPassthruConfig`` objects to send.
Nothing here talks to vSphere, so every rule is tested without an endpoint.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

try:
    from pyVmomi import vim

    HAS_PYVMOMI = True
except ImportError:  # reported by the module through missing_required_lib
    vim = None  # type: ignore[assignment]
    HAS_PYVMOMI = False

NVIDIA_VENDOR_ID = 0x10DE

# Guest memory must be at least 1.5 x the GPUs' total memory: the ESXi passthrough walkthrough this
# project started from recommends it, since the guest driver maps and pins host memory per GPU.
MEMORY_FACTOR_NUM, MEMORY_FACTOR_DEN = 3, 2

KEY_USE_64BIT_MMIO = "pciPassthru.use64bitMMIO"
KEY_MMIO_SIZE = "pciPassthru.64bitMMIOSizeGB"
KEY_HIDE_HYPERVISOR = "hypervisor.cpuid.v0"

_PCI_ID = re.compile(r"^(?:([0-9a-f]{4}):)?([0-9a-f]{2}):([0-9a-f]{2})\.([0-7])$")


class PlanError(ValueError):
    """The requested configuration cannot be reached; the message tells the operator why."""


@dataclass(frozen=True)
class GpuRequest:
    """One GPU to give the VM: DirectPath I/O by host PCI address, or Dynamic DirectPath by model."""

    memory_gb: int
    pci_id: str | None = None
    vendor_id: int = NVIDIA_VENDOR_ID
    device_id: int | None = None

    @property
    def dynamic(self) -> bool:
        """True for Dynamic DirectPath (vendor/device id), False for DirectPath I/O (PCI address)."""
        return self.pci_id is None

    @property
    def model(self) -> tuple[int, int]:
        """(vendor id, device id) of a Dynamic DirectPath request."""
        if self.device_id is None:
            raise PlanError("a Dynamic DirectPath GPU needs device_id")
        return (self.vendor_id, self.device_id)

    def describe(self) -> str:
        """Short human-readable name used in change lists."""
        if self.pci_id is not None:
            return f"GPU {self.pci_id}"
        return f"Dynamic DirectPath GPU {model_name(*self.model)}"


@dataclass(frozen=True)
class Options:
    """What the operator asked for (the module's options, validated)."""

    gpus: tuple[GpuRequest, ...]
    secure_boot: bool = False
    hide_hypervisor: bool = False
    mmio_size_gb: int | None = None
    adjust_memory: bool = False
    exclusive: bool = False


@dataclass(frozen=True)
class HostPci:
    """The host's PCI picture as seen through the vSphere API."""

    name: str
    devices: Sequence[Any]  # vim.host.PciDevice
    passthru: Sequence[Any]  # vim.host.PciPassthruInfo
    targets: Sequence[Any] = ()  # vim.vm.PciPassthroughInfo from the VM's config target on this host


@dataclass(frozen=True)
class Change:
    """One pending change, as the operator reads it."""

    text: str
    needs_power_off: bool
    on_host: bool = False


@dataclass
class Plan:
    """The outcome of :func:`plan`: what to send and what it means."""

    spec: Any  # vim.vm.ConfigSpec, or None when the VM needs nothing
    host_config: list[Any]  # vim.host.PciPassthruConfig
    changes: list[Change]
    host_reboot_required: bool
    deferred: list[str]
    warnings: list[str]
    before: dict[str, Any]
    after: dict[str, Any]
    total_gpu_memory_gb: int
    mmio_size_gb: int
    required_memory_mb: int
    vm_changes: list[Change] = field(init=False)

    def __post_init__(self) -> None:
        self.vm_changes = [c for c in self.changes if not c.on_host]

    @property
    def changed(self) -> bool:
        """True when anything on the VM or the host would change."""
        return bool(self.changes)

    @property
    def power_off_required(self) -> bool:
        """True when a VM change only takes effect (or is only accepted) with the VM powered off."""
        return any(c.needs_power_off for c in self.vm_changes)


def mmio_size_gb(total_gpu_memory_gb: int) -> int:
    """The smallest power of two (GB) that is at least twice the GPUs' total memory.

    VMware's guidance for ``pciPassthru.64bitMMIOSizeGB`` ("Using GPUs with Virtual Machines on
    vSphere - Part 2: VMDirectPath I/O"): add up the memory of every GPU given to the VM and round up
    to a power of two, leaving room for the BARs; its worked example (two 16 GB GPUs -> 64) and the
    community restatements (one 16 GB GPU -> 32, two 24 GB GPUs -> 128) all equal this rule.
    """
    if total_gpu_memory_gb < 1:
        raise PlanError("the GPUs' total memory must be at least 1 GB")
    need = 2 * total_gpu_memory_gb
    return 1 << (need - 1).bit_length()


def required_memory_mb(total_gpu_memory_gb: int) -> int:
    """Minimum guest memory in MB: 1.5 x the GPUs' memory, rounded up to a whole GB."""
    gb = -(-total_gpu_memory_gb * MEMORY_FACTOR_NUM // MEMORY_FACTOR_DEN)
    return gb * 1024


def normalize_pci_id(value: str) -> str:
    """Return ``value`` as ESXi spells PCI addresses (``0000:3b:00.0``); accept ``3b:00.0`` too."""
    match = _PCI_ID.match(value.strip().lower())
    if not match:
        raise PlanError(f"{value!r} is not a PCI address like 0000:3b:00.0")
    domain, bus, slot, function = match.groups()
    return f"{domain or '0000'}:{bus}:{slot}.{function}"


def unsigned16(value: int) -> int:
    """vSphere reports PCI vendor/device ids as signed 16-bit numbers; return the real id."""
    return value & 0xFFFF


def signed16(value: int) -> int:
    """The inverse of :func:`unsigned16`, for fields typed ``short`` in the API."""
    value &= 0xFFFF
    return value - 0x10000 if value >= 0x8000 else value


def model_name(vendor_id: int, device_id: int) -> str:
    """``10de:20b5`` style name of a PCI model."""
    return f"{unsigned16(vendor_id):04x}:{unsigned16(device_id):04x}"


def _extra_config(config: Any) -> dict[str, str]:
    return {opt.key: "" if opt.value is None else str(opt.value) for opt in (config.extraConfig or [])}


def _passthrough_devices(config: Any) -> list[Any]:
    hardware = config.hardware
    devices = hardware.device if hardware is not None and hardware.device else []
    return [
        dev
        for dev in devices
        if isinstance(dev, vim.vm.device.VirtualPCIPassthrough)
        and isinstance(
            dev.backing,
            (
                vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo,
                vim.vm.device.VirtualPCIPassthrough.DynamicBackingInfo,
            ),
        )
    ]


def _device_label(dev: Any) -> str:
    backing = dev.backing
    if isinstance(backing, vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo):
        return normalize_pci_id(backing.id)
    models = ",".join(model_name(a.vendorId, a.deviceId) for a in backing.allowedDevice or [])
    return f"dynamic:{models}"


def _allows(dev: Any, model: tuple[int, int]) -> bool:
    backing = dev.backing
    if not isinstance(backing, vim.vm.device.VirtualPCIPassthrough.DynamicBackingInfo):
        return False
    return any((unsigned16(a.vendorId), unsigned16(a.deviceId)) == model for a in backing.allowedDevice or [])


def _bool_value(value: str | None) -> bool | None:
    if value is None or value == "":
        return None
    return value.strip().lower() in ("true", "1", "yes")


def describe_state(config: Any, host: HostPci, options: Options) -> dict[str, Any]:
    """The settings this module manages, as a plain dict (used for diff before/after)."""
    extra = _extra_config(config)
    keys = [KEY_USE_64BIT_MMIO, KEY_MMIO_SIZE]
    if options.hide_hypervisor or KEY_HIDE_HYPERVISOR in extra:
        keys.append(KEY_HIDE_HYPERVISOR)
    boot = config.bootOptions
    wanted_ids = _host_ids_of_interest(host, options)
    passthru = {normalize_pci_id(p.id): p for p in host.passthru}
    return {
        "firmware": config.firmware,
        "secure_boot": bool(boot is not None and boot.efiSecureBootEnabled),
        "memory_mb": config.hardware.memoryMB if config.hardware is not None else None,
        "memory_reservation_locked_to_max": bool(config.memoryReservationLockedToMax),
        "extra_config": {key: extra.get(key) for key in keys},
        "gpus": sorted(_device_label(d) for d in _passthrough_devices(config)),
        "host_passthrough_enabled": sorted(
            pid for pid in wanted_ids if pid in passthru and passthru[pid].passthruEnabled
        ),
    }


def _host_ids_of_interest(host: HostPci, options: Options) -> list[str]:
    ids = [normalize_pci_id(g.pci_id) for g in options.gpus if g.pci_id is not None]
    models = {g.model for g in options.gpus if g.dynamic}
    for dev in host.devices:
        if (unsigned16(dev.vendorId), unsigned16(dev.deviceId)) in models:
            ids.append(normalize_pci_id(dev.id))
    return sorted(set(ids))


def _validate(options: Options) -> None:
    if not options.gpus:
        raise PlanError("gpus is empty: list at least one GPU to pass through")
    seen: set[str] = set()
    for gpu in options.gpus:
        if gpu.memory_gb < 1:
            raise PlanError(f"{gpu.describe()}: memory_gb must be a positive number of GB")
        if gpu.pci_id is not None and gpu.device_id is not None:
            raise PlanError(f"{gpu.describe()}: give either pci_id or device_id, not both")
        if gpu.pci_id is not None:
            pid = normalize_pci_id(gpu.pci_id)
            if pid in seen:
                raise PlanError(f"GPU {pid} is listed twice")
            seen.add(pid)
        else:
            gpu.model  # noqa: B018 - raises PlanError when device_id is missing
    if options.mmio_size_gb is not None and options.mmio_size_gb < 1:
        raise PlanError("mmio_size_gb must be a positive number of GB")


@dataclass
class _HostDecision:
    config: list[Any]
    changes: list[Change]
    reboot_required: bool
    active_ids: set[str]


def _plan_host(host: HostPci, options: Options) -> _HostDecision:
    devices = {normalize_pci_id(d.id): d for d in host.devices}
    passthru = {normalize_pci_id(p.id): p for p in host.passthru}
    to_enable: list[str] = []
    reboot = False
    active: set[str] = set()

    def status(pid: str) -> Any:
        info = passthru.get(pid)
        if info is None or not info.passthruCapable:
            raise PlanError(
                f"PCI device {pid} on host {host.name} is not capable of passthrough: enable VT-d "
                "(or AMD-Vi/IOMMU) and Above 4G decoding in the host BIOS"
            )
        return info

    for gpu in options.gpus:
        if gpu.pci_id is None:
            continue
        pid = normalize_pci_id(gpu.pci_id)
        if pid not in devices:
            nvidia = sorted(i for i, d in devices.items() if unsigned16(d.vendorId) == NVIDIA_VENDOR_ID)
            raise PlanError(
                f"PCI device {pid} not found on host {host.name}; NVIDIA devices there: "
                f"{', '.join(nvidia) or 'none'}"
            )
        info = status(pid)
        if not info.passthruEnabled:
            to_enable.append(pid)
            reboot = True
        elif info.passthruActive:
            active.add(pid)
        else:
            reboot = True

    wanted: dict[tuple[int, int], int] = {}
    for gpu in options.gpus:
        if gpu.dynamic:
            wanted[gpu.model] = wanted.get(gpu.model, 0) + 1
    for model, count in sorted(wanted.items()):
        matching = sorted(
            pid
            for pid, d in devices.items()
            if (unsigned16(d.vendorId), unsigned16(d.deviceId)) == model
            and pid in passthru
            and passthru[pid].passthruCapable
        )
        if len(matching) < count:
            raise PlanError(
                f"{count} Dynamic DirectPath GPU(s) {model_name(*model)} requested but host {host.name} "
                f"has {len(matching)} passthrough-capable device(s) of that model"
            )
        enabled = [pid for pid in matching if passthru[pid].passthruEnabled]
        extra = [pid for pid in matching if not passthru[pid].passthruEnabled][: max(0, count - len(enabled))]
        to_enable.extend(extra)
        if sum(1 for pid in enabled if passthru[pid].passthruActive) < count:
            reboot = True

    config = [vim.host.PciPassthruConfig(id=pid, passthruEnabled=True) for pid in to_enable]
    changes = [
        Change(
            f"host {host.name}: enable passthrough for {pid} ({devices[pid].deviceName})",
            needs_power_off=False,
            on_host=True,
        )
        for pid in to_enable
    ]
    return _HostDecision(config, changes, reboot, active)


def _directpath_device(target: Any, key: int) -> Any:
    pci = target.pciDevice
    backing = vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo(
        id=pci.id,
        deviceId=format(unsigned16(pci.deviceId), "x"),
        systemId=target.systemId,
        vendorId=signed16(pci.vendorId),
        deviceName=pci.deviceName or "",
    )
    return vim.vm.device.VirtualPCIPassthrough(key=key, backing=backing)


def _dynamic_device(model: tuple[int, int], key: int) -> Any:
    allowed = vim.vm.device.VirtualPCIPassthrough.AllowedDevice(vendorId=model[0], deviceId=model[1])
    backing = vim.vm.device.VirtualPCIPassthrough.DynamicBackingInfo(allowedDevice=[allowed], deviceName="")
    return vim.vm.device.VirtualPCIPassthrough(key=key, backing=backing)


def _plan_devices(
    config: Any, host: HostPci, options: Options, active: set[str], warnings: list[str]
) -> tuple[list[Any], list[Change], list[str]]:
    existing = _passthrough_devices(config)
    used: set[int] = set()
    targets = {normalize_pci_id(t.pciDevice.id): t for t in host.targets}
    specs: list[Any] = []
    changes: list[Change] = []
    deferred: list[str] = []
    next_key = -100

    for gpu in options.gpus:
        if gpu.pci_id is None:
            continue
        pid = normalize_pci_id(gpu.pci_id)
        match = next(
            (
                d
                for d in existing
                if d.key not in used
                and isinstance(d.backing, vim.vm.device.VirtualPCIPassthrough.DeviceBackingInfo)
                and normalize_pci_id(d.backing.id) == pid
            ),
            None,
        )
        if match is not None:
            used.add(match.key)
            continue
        if pid not in active:
            deferred.append(
                f"attach {gpu.describe()} once passthrough is active on host {host.name} (reboot it)"
            )
            continue
        if pid not in targets:
            raise PlanError(
                f"{gpu.describe()} is active for passthrough on host {host.name} but the host does not offer "
                "it to this VM (is another VM using it?)"
            )
        specs.append(
            vim.vm.device.VirtualDeviceSpec(
                operation=vim.vm.device.VirtualDeviceSpec.Operation.add,
                device=_directpath_device(targets[pid], next_key),
            )
        )
        changes.append(Change(f"attach {gpu.describe()} (DirectPath I/O)", needs_power_off=True))
        next_key -= 1

    for gpu in options.gpus:
        if not gpu.dynamic:
            continue
        match = next((d for d in existing if d.key not in used and _allows(d, gpu.model)), None)
        if match is not None:
            used.add(match.key)
            continue
        specs.append(
            vim.vm.device.VirtualDeviceSpec(
                operation=vim.vm.device.VirtualDeviceSpec.Operation.add,
                device=_dynamic_device(gpu.model, next_key),
            )
        )
        changes.append(Change(f"attach {gpu.describe()}", needs_power_off=True))
        next_key -= 1

    unlisted = [d for d in existing if d.key not in used]
    if unlisted and options.exclusive:
        for dev in unlisted:
            specs.append(
                vim.vm.device.VirtualDeviceSpec(
                    operation=vim.vm.device.VirtualDeviceSpec.Operation.remove, device=dev
                )
            )
            changes.append(
                Change(f"remove unlisted passthrough device {_device_label(dev)}", needs_power_off=True)
            )
    elif unlisted:
        warnings.append(
            "the VM has passthrough devices not listed in gpus (kept; set exclusive to remove them): "
            + ", ".join(_device_label(d) for d in unlisted)
        )
    return specs, changes, deferred


def plan(config: Any, host: HostPci, options: Options) -> Plan:
    """Compare the VM's ``config`` and its ``host`` with ``options``; return what must change.

    Raises :class:`PlanError` when the request cannot be met (unknown or incapable device, too little
    guest memory without ``adjust_memory``...). Never calls vSphere.
    """
    _validate(options)
    total = sum(g.memory_gb for g in options.gpus)
    rule_mmio = mmio_size_gb(total)
    mmio = options.mmio_size_gb or rule_mmio
    min_memory = required_memory_mb(total)
    warnings: list[str] = []
    if options.mmio_size_gb is not None and options.mmio_size_gb < rule_mmio:
        warnings.append(
            f"mmio_size_gb={options.mmio_size_gb} is below the {rule_mmio} GB the sizing rule gives for "
            f"{total} GB of GPU memory; the VM may fail to power on"
        )

    host_decision = _plan_host(host, options)
    spec: Any = vim.vm.ConfigSpec()
    vm_changes: list[Change] = []

    device_specs, device_changes, deferred = _plan_devices(
        config, host, options, host_decision.active_ids, warnings
    )
    if device_specs:
        spec.deviceChange = device_specs
        vm_changes.extend(device_changes)

    if config.firmware != "efi":
        spec.firmware = "efi"
        vm_changes.append(Change(f"firmware {config.firmware} -> efi", needs_power_off=True))
        warnings.append(
            "switching firmware to EFI: a guest OS installed in BIOS mode will not boot until reinstalled "
            "in EFI mode"
        )

    boot = config.bootOptions
    secure_now = bool(boot is not None and boot.efiSecureBootEnabled)
    if secure_now != options.secure_boot:
        spec.bootOptions = vim.vm.BootOptions(efiSecureBootEnabled=options.secure_boot)
        state = "on" if options.secure_boot else "off"
        vm_changes.append(Change(f"EFI Secure Boot {state}", needs_power_off=True))

    memory_now = config.hardware.memoryMB
    if memory_now < min_memory:
        if not options.adjust_memory:
            raise PlanError(
                f"VM memory is {memory_now} MB but GPU passthrough needs at least {min_memory} MB "
                f"(1.5 x {total} GB of GPU memory); give the VM more memory or set adjust_memory"
            )
        spec.memoryMB = min_memory
        vm_changes.append(Change(f"memory {memory_now} MB -> {min_memory} MB", needs_power_off=True))

    if not config.memoryReservationLockedToMax:
        spec.memoryReservationLockedToMax = True
        vm_changes.append(Change("reserve all guest memory (locked to max)", needs_power_off=False))

    extra = _extra_config(config)
    desired_extra = {KEY_USE_64BIT_MMIO: "TRUE", KEY_MMIO_SIZE: str(mmio)}
    if options.hide_hypervisor:
        desired_extra[KEY_HIDE_HYPERVISOR] = "FALSE"
    options_to_set = []
    for key, value in desired_extra.items():
        current = extra.get(key)
        same = (
            current is not None and current.strip().isdigit() and int(current) == int(value)
            if key == KEY_MMIO_SIZE
            else _bool_value(current) == _bool_value(value)
        )
        if not same:
            options_to_set.append(vim.option.OptionValue(key=key, value=value))
            vm_changes.append(Change(f"{key} = {value} (was {current!r})", needs_power_off=True))
    if options_to_set:
        spec.extraConfig = options_to_set

    before = describe_state(config, host, options)
    after = _predict(before, host_decision, spec, options)
    return Plan(
        spec=spec if vm_changes else None,
        host_config=host_decision.config,
        changes=host_decision.changes + vm_changes,
        host_reboot_required=host_decision.reboot_required,
        deferred=deferred,
        warnings=warnings,
        before=before,
        after=after,
        total_gpu_memory_gb=total,
        mmio_size_gb=mmio,
        required_memory_mb=min_memory,
    )


def _predict(
    before: dict[str, Any], host_decision: _HostDecision, spec: Any, options: Options
) -> dict[str, Any]:
    after = {**before, "extra_config": dict(before["extra_config"])}
    after["firmware"] = spec.firmware or before["firmware"]
    after["secure_boot"] = options.secure_boot
    after["memory_mb"] = spec.memoryMB or before["memory_mb"]
    after["memory_reservation_locked_to_max"] = True
    for opt in spec.extraConfig or []:
        after["extra_config"][opt.key] = opt.value
    gpus = list(before["gpus"])
    for dev_spec in spec.deviceChange or []:
        label = _device_label(dev_spec.device)
        if dev_spec.operation == vim.vm.device.VirtualDeviceSpec.Operation.add:
            gpus.append(label)
        else:
            gpus.remove(label)
    after["gpus"] = sorted(gpus)
    enabled = set(before["host_passthrough_enabled"]) | {c.id for c in host_decision.config}
    after["host_passthrough_enabled"] = sorted(enabled)
    return after
