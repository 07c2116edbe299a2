"""Everything gpufleet knows about a GPU host, from NVML when a driver runs and from sysfs before."""

from __future__ import annotations

import os
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import pci
from .device import REMOTE_NVSWITCH, Gpu, gpu_from_pci
from .errors import NvmlDriverLibraryMismatch, NvmlError
from .host import (
    KMOD_VERSION,
    HostInfo,
    KernelLog,
    host_info,
    kernel_module_version,
    read_kernel_log,
    resolve_root,
)
from .nvml import nvml_session
from .topology import Topology, build, from_nvidia_smi

SOURCE_NVML = "nvml"
SOURCE_SYSFS = "sysfs"
TOPOLOGY_SMI = "nvidia-smi"  # topology_source when `nvidia-smi topo -m` gave the matrix


@dataclass
class DriverInfo:
    """The NVIDIA driver as loaded: kernel module and userspace library can differ after an upgrade."""

    loaded: bool = False
    kernel_module_version: str | None = None  # from /sys/module/nvidia or /proc/driver/nvidia
    userspace_version: str | None = None  # from NVML, i.e. libnvidia-ml
    cuda_driver_version: str | None = None  # "12.2"
    nvml_version: str | None = None
    version_mismatch: bool = False  # NVML refused to start, or the two versions differ


@dataclass
class GpuFacts:
    """The result of `discover()`."""

    source: str  # SOURCE_NVML or SOURCE_SYSFS
    host_root: str
    gpus: list[Gpu]
    nvswitch_bus_ids: list[str]
    driver: DriverInfo
    host: HostInfo
    topology: Topology | None = None  # None when neither NVML nor nvidia-smi gave it
    nvml_error: str | None = None  # why NVML was not used, when it was not
    topology_source: str | None = None  # SOURCE_NVML, TOPOLOGY_SMI, or None
    topology_error: str | None = None  # why nvidia-smi gave no matrix, when it was asked
    fabric_symptoms: list[str] = field(default_factory=list)
    kernel_log: KernelLog | None = None  # None when not read (discover(with_kernel_log=False))
    kernel_log_errors: list[str] = field(default_factory=list)  # NVRM lines reporting failures, and Xids
    vm_config_problems: list[VmConfigProblem] = field(default_factory=list)  # VMware guests only

    @property
    def nvswitch_count(self) -> int:
        """NVSwitches seen on the PCI bus or at the far end of an NVLink."""
        linked = {
            link.remote_bus_id
            for gpu in self.gpus
            for link in gpu.nvlinks
            if link.remote == REMOTE_NVSWITCH and link.remote_bus_id
        }
        return max(len(self.nvswitch_bus_ids), len(linked))

    @property
    def fabricmanager_required(self) -> bool:
        """NVSwitch systems route NVLink traffic only once nvidia-fabricmanager has set the fabric up."""
        return self.nvswitch_count > 0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form; this is what the gpu_facts module returns as `gpufleet_gpu`."""
        return {
            "source": self.source,
            "nvml_error": self.nvml_error,
            "host_root": self.host_root,
            "gpu_count": len(self.gpus),
            "gpu_models": dict(Counter(gpu.model for gpu in self.gpus)),
            "gpus": [_gpu_dict(gpu) for gpu in self.gpus],
            "nvswitch_count": self.nvswitch_count,
            "fabricmanager_required": self.fabricmanager_required,
            "fabric_symptoms": list(self.fabric_symptoms),
            "kernel_log_source": self.kernel_log.source if self.kernel_log else None,
            "kernel_log_unreadable": _unreadable(self.kernel_log),
            "kernel_log_truncated": bool(self.kernel_log and self.kernel_log.truncated),
            "kernel_log_errors": list(self.kernel_log_errors),
            "vm_config_problems": [problem.to_dict() for problem in self.vm_config_problems],
            "driver_loaded": self.driver.loaded,
            "driver_version_kernel": self.driver.kernel_module_version,
            "driver_version_userspace": self.driver.userspace_version,
            "driver_version_mismatch": self.driver.version_mismatch,
            "cuda_driver_version": self.driver.cuda_driver_version,
            "nvml_version": self.driver.nvml_version,
            "nouveau_loaded": self.host.nouveau_loaded,
            "boot_mode": self.host.boot_mode,
            "secure_boot": self.host.secure_boot,
            "hypervisor": self.host.hypervisor,
            "virtualized": self.host.virtualized,
            "kernel_release": self.host.kernel_release,
            "device_nodes": list(self.host.device_nodes),
            "topology": None
            if self.topology is None
            else {"gpus": list(self.topology.indices), "matrix": [list(r) for r in self.topology.matrix]},
            "topology_source": self.topology_source,
            "topology_error": self.topology_error,
        }


def _unreadable(log: KernelLog | None) -> str | None:
    if log is None:
        return "not read"
    return log.unreadable


def _gpu_dict(gpu: Gpu) -> dict[str, Any]:
    return {
        "index": gpu.index,
        "uuid": gpu.uuid,
        "model": gpu.model,
        "memory_mib": gpu.memory_mib,
        "pci_bus_id": gpu.pci_bus_id,
        "pci_device_id": f"0x{gpu.device_id:04x}",
        "numa_node": gpu.numa_node,
        "compute_capability": gpu.compute_capability,
        "architecture": gpu.architecture,
        "kernel_driver": gpu.kernel_driver,
        "minor": gpu.minor,
        "persistence_mode": gpu.persistence_mode,
        "mig_mode": None if gpu.mig is None else {"current": gpu.mig.current, "pending": gpu.mig.pending},
        "nvlinks": len(gpu.nvlinks),
        "nvlinks_active": len(gpu.active_nvlinks),
        "fabric_state": gpu.fabric.state if gpu.fabric else None,
        "lost": gpu.lost,
    }


def fabric_symptoms(gpus: list[Gpu], nvswitch_count: int) -> list[str]:
    """What an NVSwitch host shows when nvidia-fabricmanager is not running (or failed)."""
    if not nvswitch_count:
        return []
    symptoms = []
    for gpu in gpus:
        # An inactive link may not report its far end; on a switch system treat those as switch links.
        to_switch = [link for link in gpu.nvlinks if link.remote in (REMOTE_NVSWITCH, "unknown")]
        down = [link for link in to_switch if not link.active]
        if down:
            symptoms.append(
                f"GPU {gpu.index}: {len(down)} of {len(to_switch)} NVLinks to NVSwitches inactive"
            )
        if gpu.fabric and gpu.fabric.state != "completed":
            symptoms.append(f"GPU {gpu.index}: fabric state {gpu.fabric.state}")
        elif gpu.fabric and gpu.fabric.status != 0:
            symptoms.append(f"GPU {gpu.index}: fabric registration failed (NVML error {gpu.fabric.status})")
    return symptoms


def discover(
    host_root: str | os.PathLike[str] | None = None,
    *,
    use_nvml: bool = True,
    with_topology: bool = True,
    with_kernel_log: bool = True,
) -> GpuFacts:
    """Discover GPUs, NVSwitches, driver and host facts under `host_root` (default $GPUFLEET_HOST_ROOT or /).

    NVML is used when pynvml, libnvidia-ml and the driver all answer; otherwise the facts come from
    sysfs alone and `nvml_error` says why, and the topology from `nvidia-smi topo -m` when the driver's
    nvidia-smi answers (a node whose Python lacks pynvml). Never raises for a missing driver or library. With
    `with_kernel_log`, the kernel log of the current boot gives `kernel_log_errors` and, on VMware guests,
    `vm_config_problems`.
    """
    root = resolve_root(host_root)
    devices = pci.scan(root)
    host = host_info(root)
    driver = DriverInfo(loaded=host.nvidia_module_loaded, kernel_module_version=kernel_module_version(root))
    gpus: list[Gpu] | None = None
    topology = None
    error = None
    source = SOURCE_SYSFS
    if use_nvml:
        try:
            with nvml_session() as nv:
                found = nv.gpus(devices)
                driver.userspace_version = nv.driver_version()
                driver.cuda_driver_version = nv.cuda_driver_version()
                driver.nvml_version = nv.nvml_version()
                topology = build(found, nv.topology_level) if with_topology else None
            gpus, source = found, SOURCE_NVML
            driver.loaded = True
        except NvmlDriverLibraryMismatch as exc:
            driver.version_mismatch = True
            error = str(exc)
        except NvmlError as exc:
            error = str(exc)
    topology_error = None
    if gpus is None:
        gpus = [gpu_from_pci(index, dev) for index, dev in enumerate(pci.gpus(devices))]
        if use_nvml and with_topology and gpus:
            try:
                topology = from_nvidia_smi()
            except ValueError as exc:
                topology_error = str(exc)
    if driver.kernel_module_version and driver.userspace_version:
        driver.version_mismatch = driver.kernel_module_version != driver.userspace_version
    facts = GpuFacts(
        source=source,
        host_root=str(root),
        gpus=gpus,
        nvswitch_bus_ids=[dev.bus_id for dev in pci.nvswitches(devices)],
        driver=driver,
        host=host,
        topology=topology,
        nvml_error=error,
        topology_source=None if topology is None else (TOPOLOGY_SMI if source == SOURCE_SYSFS else source),
        topology_error=topology_error,
    )
    facts.fabric_symptoms = fabric_symptoms(facts.gpus, facts.nvswitch_count)
    if with_kernel_log:
        log = read_kernel_log(root, interesting_kernel_line)
        facts.kernel_log = log
        facts.kernel_log_errors = kernel_log_errors(log.lines)
        facts.vm_config_problems = vm_config_problems(
            log.lines, facts.gpus, host, driver.kernel_module_version or driver.userspace_version
        )
    return facts


# ---------------------------------------------------------------------------------------------- kernel log
#
# What the NVIDIA driver and the kernel log when a GPU does not come up, and what that means in a VMware
# guest. The message texts are the drivers' and the kernel's own; each pattern names where it comes from.
# Verified only against the simulator (gpufleet_harness.sim fixture esxi-vm-small-mmio) and these public
# texts.

VMWARE = "vmware"
MAX_KERNEL_LOG_ERRORS = 100  # kernel_log_errors keeps the last this many distinct lines

# NVIDIA, open-gpu-kernel-modules kernel-open/nvidia/nv-pci.c (nv_pci_validate_bars): one printk, two lines:
#   "NVRM: This PCI I/O region assigned to your NVIDIA device is invalid:"
#   "NVRM: BAR%d is %lluM @ 0x%llx (PCI:%04x:%02x:%02x.%x)"   (in logs of 2006-2009: "(PCI:bb:dd.f)")
_BAR_INVALID_HEAD = "This PCI I/O region assigned to your NVIDIA device is invalid"
_BAR_INVALID = re.compile(r"NVRM: BAR(\d+) is (\d+)M @ 0x[0-9a-fA-F]+ \(PCI:([0-9a-fA-F:.]+)\)")
# Linux, drivers/pci/setup-res.c (pci_assign_resource): "BAR 1: failed to assign [mem size 0x800000000 64bit
# pref]" in older kernels, "BAR 1 [mem size 0x800000000 64bit pref]: failed to assign" in newer ones; "...:
# assigned" when a later pass (pci=realloc) found room after all.
_PCI_BAR = re.compile(
    r"^\S+ ([0-9a-fA-F]{4}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]): BAR (\d+)(?: \[[^\]]*\])?: "
    r"(failed to assign|assigned)"
)
# NVIDIA, src/nvidia/arch/nvalloc/unix/src/osinit.c (RmInitAdapter), prefixed "NVRM: GPU 0000:0b:00.0: " by
# NV_DEV_PRINTF: "RmInitAdapter failed! (0x%x:0x%x:%d)" (init status, RM status, source line).
_RM_INIT_FAILED = re.compile(r"RmInitAdapter failed! \((0x[0-9a-fA-F]+):(0x[0-9a-fA-F]+):(\d+)\)")
# NVIDIA: "NVRM: Xid (PCI:0000:2b:00): 79, GPU has fallen off the bus." then "NVRM: GPU 0000:2b:00.0: GPU has
# fallen off the bus." (older drivers: "NVRM: GPU at 0000:01:00.0 has fallen off the bus."); at probe time
# "NVRM: The NVIDIA GPU 0000:01:00.0 (PCI ID: 10de:2204) installed in this system has" / "NVRM: fallen off
# the bus and is not responding to commands." Xid 79: NVIDIA's Xid catalog, docs.nvidia.com/deploy/xid-errors.
_FALLEN_OFF = "fallen off the bus"
# NVIDIA, kernel-open/nvidia/nv.c: the GPU has no MSI/MSI-X vector and no legacy IRQ line.
_NO_INTERRUPTS = "No interrupts of any type are available"
# Linux, drivers/iommu/intel/dmar.c (dmar_fault_do_one): "DMAR: [DMA Read NO_PASID] Request device [0b:00.0]
# fault addr 0x... [fault reason 0x06] PTE Read access is not set" (before 5.14: "[DMA Read] Request device
# [0b:00.0] PASID ffffffff fault addr ..."; 5.14: "[0x0b:0x00.0]"), "[INTR-REMAP] ..." for interrupts;
# drivers/iommu/amd: "AMD-Vi: Event logged [IO_PAGE_FAULT device=0b:00.0 domain=... address=... flags=...]".
_DMAR_FAULT = re.compile(
    r"DMAR: \[(DMA Read|DMA Write|INTR-REMAP)[^\]]*\] Request device "
    r"\[(?:0x)?([0-9a-fA-F]{2}):(?:0x)?([0-9a-fA-F]{2})\.([0-7])\]"
)
_AMDVI_FAULT = re.compile(
    r"AMD-Vi: Event logged \[([A-Z_]+) device="
    r"(?:([0-9a-fA-F]{4}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])"
)
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?[0-9a-fA-F:.]+\): \d+")
_PCI_ADDRESS = re.compile(r"\b([0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2})(\.[0-7])?\b")
# Words of NVRM lines that report a failure (the driver logs its informational lines under the same level).
_FAILURE_WORDS = (
    "fail", "invalid", "error", "fallen off", "cannot", "can't", "unable", "not supported", "no interrupts",
    "not responding", "mismatch", "none of the nvidia", "timeout", "timed out",
)
# NVIDIA allowed GeForce GPUs in virtual machines from the R465 drivers on (NVIDIA's GeForce passthrough FAQ,
# April 2021, as quoted by TechPowerUp and linuxiac.com); older drivers refuse them under a hypervisor.
_GEFORCE_PASSTHROUGH_BRANCH = 465


def interesting_kernel_line(message: str) -> bool:
    """Whether discovery keeps a kernel message: the NVIDIA driver's, PCI BAR assignment and IOMMU faults."""
    return (
        "NVRM" in message
        or "nvidia" in message
        or ("BAR " in message and "assign" in message)
        or "DMAR:" in message
        or "AMD-Vi:" in message
    )


def kernel_log_errors(lines: list[str]) -> list[str]:
    """NVRM lines reporting a failure (Xid events among them): distinct, the last MAX_KERNEL_LOG_ERRORS."""
    found: dict[str, None] = {}
    for line in lines:
        if "NVRM:" not in line:
            continue
        lower = line.lower()
        if _XID.search(line) or _BAR_INVALID.search(line) or any(word in lower for word in _FAILURE_WORDS):
            found[line] = None
    return list(found)[-MAX_KERNEL_LOG_ERRORS:]


@dataclass
class VmConfigProblem:
    """A guest-visible sign that the VMware VM around this host is configured wrong for its GPUs."""

    symptom: str  # one of the SYMPTOM_* ids
    gpu: str | None  # PCI address of the GPU concerned (sysfs form), None when the evidence names none
    evidence: str  # the kernel message (or host fact) that shows it
    likely_cause: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "symptom": self.symptom,
            "gpu": self.gpu,
            "evidence": self.evidence,
            "likely_cause": self.likely_cause,
            "fix": self.fix,
        }


SYMPTOM_BAR_UNASSIGNED = "gpu_bar_unassigned"
SYMPTOM_BIOS_FIRMWARE = "bios_firmware"
SYMPTOM_INIT_FAILED = "gpu_init_failed"
SYMPTOM_FELL_OFF_BUS = "gpu_fell_off_bus"
SYMPTOM_NO_INTERRUPTS = "gpu_no_interrupts"
SYMPTOM_IOMMU_FAULT = "iommu_fault"

_MODULE = "gpufleet.nvidia.esxi_gpu_passthrough"


def mmio_size_gb(total_gpu_memory_gb: int) -> int:
    """`pciPassthru.64bitMMIOSizeGB` for GPUs of this much memory: the smallest power of two >= 2 x total.

    The same rule as esxi_passthrough_plan.mmio_size_gb (see docs/esxi.md for its sources).
    """
    size = 1
    while size < 2 * total_gpu_memory_gb:
        size *= 2
    return size


def _bus(text: str | None) -> str | None:
    """The sysfs form of a PCI address in a log line, or None (NVRM's Xid lines leave out the function)."""
    if not text:
        return None
    match = _PCI_ADDRESS.search(text)
    if not match:
        return None
    try:
        return pci.normalize_bus_id(match.group(1) + (match.group(2) or ".0"))
    except ValueError:
        return None


# Causes and fixes in ESXi terms. The MMIO settings, the EFI guest and the host BIOS's "memory mapped I/O
# above 4 GB": VMware's "Using GPUs with Virtual Machines on vSphere - Part 2: VMDirectPath I/O" (2018) and
# Dell KB 000199172 (both for GPUs whose BARs total more than 16 GB). That a failed BAR0 comes from the same
# MMIO shortage is our reading; so are the "likely" in every cause and the order of the fixes.
class _Advisor:
    """Words the causes and fixes for one host: its boot mode, its GPUs' memory, its driver."""

    def __init__(self, gpus: list[Gpu], host: HostInfo, driver_version: str | None) -> None:
        self.gpus = {gpu.pci_bus_id: gpu for gpu in gpus}
        self.bios = host.boot_mode == "bios"
        self.driver_version = driver_version
        sizes = [gpu.memory_mib for gpu in gpus]
        self.total_gb = sum(-(-mib // 1024) for mib in sizes if mib) if gpus and all(sizes) else None

    def mmio_settings(self) -> str:
        if self.total_gb:
            size = (
                f"pciPassthru.64bitMMIOSizeGB = {mmio_size_gb(self.total_gb)} (the smallest power of two at "
                f"least twice the VM's {self.total_gb} GB of GPU memory)"
            )
        else:
            size = (
                "pciPassthru.64bitMMIOSizeGB = the smallest power of two at least twice the GPUs' total "
                "memory in GB"
            )
        return f"firmware EFI, pciPassthru.use64bitMMIO = TRUE, {size}"

    def unassigned_bar(self, bar_no: int | None) -> tuple[str, str]:
        which = "a memory window (BAR)" if bar_no is None else f"BAR{bar_no}"
        if self.bios:
            cause = (
                f"The GPU's {which} got no address because this VM boots with BIOS firmware: VMware maps "
                "GPU memory windows this large only for guests that boot with EFI."
            )
        elif bar_no == 0:
            cause = (
                "The GPU's register window (BAR0, below 4 GB) got no address: the VM's PCI memory space ran "
                "out, typically because 64-bit MMIO is off or too small and the large windows crowd the "
                "space below 4 GB."
            )
        else:
            cause = (
                f"The GPU's {which} (its large, 64-bit memory aperture) does not fit the VM's 64-bit MMIO "
                "window: pciPassthru.use64bitMMIO is not TRUE or pciPassthru.64bitMMIOSizeGB is smaller than "
                "the GPUs of this VM need."
            )
        fix = (
            f"Power the VM off and set: {self.mmio_settings()}; {_MODULE} sets all three. If they are set, "
            "check the ESXi host's BIOS: Above 4G decoding on."
        )
        if self.bios:
            fix += " A guest installed in BIOS mode does not boot after switching to EFI (see bios_firmware)."
        return cause, fix

    def bios_firmware(self) -> tuple[str, str]:
        cause = (
            "This VM boots with BIOS firmware. GPUs whose memory windows total more than 16 GB need a guest "
            "that boots with EFI and 64-bit MMIO (Dell KB 000199172; VMware, 'Using GPUs with Virtual "
            "Machines on vSphere - Part 2: VMDirectPath I/O')."
        )
        fix = (
            "Recreate the VM (or reinstall the guest) with EFI firmware, as a guest installed in BIOS mode "
            f"does not boot after the switch; then set: {self.mmio_settings()}; {_MODULE} sets them."
        )
        return cause, fix

    def init_failed(self, gpu: str | None) -> tuple[str, str]:
        cause = (
            "The driver found the GPU but could not initialise it. In a VM this follows the GPU's memory "
            "windows not being mapped (gpu_bar_unassigned); otherwise the NVRM lines just before it say why."
        )
        fix = "Fix the other problems listed for this GPU first; else see kernel_log_errors."
        major = _driver_branch(self.driver_version)
        model = self.gpus[gpu].model if gpu in self.gpus else ""
        maybe_geforce = "GeForce" in model or model.startswith("NVIDIA device 0x") or not model
        if major is not None and major < _GEFORCE_PASSTHROUGH_BRANCH and maybe_geforce:
            fix += (
                f" Driver {self.driver_version} predates R{_GEFORCE_PASSTHROUGH_BRANCH}, the first that "
                "supports GeForce GPUs in a VM: for a GeForce card install a newer driver, or set "
                f'hypervisor.cpuid.v0 = "FALSE" ({_MODULE} hide_hypervisor: true).'
            )
        return cause, fix


def _driver_branch(version: str | None) -> int | None:
    try:
        return int(str(version).split(".", maxsplit=1)[0])
    except ValueError:
        return None


_FELL_OFF = (
    "The GPU stopped answering on the PCI bus (Xid 79). Not a VM setting as such: the GPU, its PCIe link, "
    "power or cooling, or a GPU left in a bad state by an earlier VM (our reading; no source ties Xid 79 to "
    "a VMware setting)."
)
_FELL_OFF_FIX = (
    "Restart the VM; if the GPU stays lost, power-cycle the ESXi host (maintenance mode) and check the "
    "host's vmkernel.log, the GPU's power cabling and cooling. If it recurs, have the GPU inspected."
)
# NVIDIA KB 4135 ("VMware vDGA / GPU Passthrough Requires That MSI is Disabled on VMs"): MSI translation on
# ESXi 5.1/5.5, pciPassthruN.msiEnabled = FALSE there; not seen on ESXi 6.0 and later.
_NO_IRQ = "The guest has neither an MSI/MSI-X vector nor a legacy interrupt line for the GPU."
_NO_IRQ_FIX = (
    "Check the VM's advanced settings for the device (pciPassthruN.msiEnabled; NVIDIA's KB 4135 asks for "
    "FALSE only on ESXi 5.1/5.5) and the guest kernel's command line (pci=nomsi, IOMMU options)."
)
# A guest that logs DMAR (VT-d) or AMD-Vi faults has an IOMMU, on ESXi a virtual one. VMware's note on virtual
# IOMMU with vGPU, read in a mirror (findbugzero.com, VMware defect 88161): VMs with more than 127 vCPUs must
# use IOMMU interrupt remapping; the Linux guest's IOMMU goes in passthrough mode with iommu=pt.
_IOMMU = (
    "The VM exposes a virtual IOMMU to the guest (VM options: 'Expose IOMMU to the guest OS', "
    "vvtd.enable = TRUE) and the guest's IOMMU blocked the GPU's {what}."
)
_IOMMU_FIX = (
    "Turn 'Expose IOMMU to the guest OS' off unless the VM needs it (VMware requires IOMMU interrupt "
    "remapping for VMs with more than 127 vCPUs); otherwise boot the guest with iommu=pt."
)


def vm_config_problems(
    lines: list[str], gpus: list[Gpu], host: HostInfo, driver_version: str | None = None
) -> list[VmConfigProblem]:
    """What a VMware guest's kernel log and boot mode say about its VM configuration ([] on other hosts).

    One entry per symptom and GPU, in the order first seen; the evidence is the first matching line, an
    NVRM line where there is one. `lines` are kernel messages, oldest first (read_kernel_log).
    """
    if host.hypervisor != VMWARE or not gpus:
        return []
    advisor = _Advisor(gpus, host, driver_version or _driver_version_in(lines))
    known = set(advisor.gpus)
    found: dict[tuple[str, str | None, int | None], VmConfigProblem] = {}
    pci_bars: dict[tuple[str, int], str | None] = {}  # (gpu, BAR) → the failure line, None once assigned
    head = None  # the first line of NVRM's two-line BAR message

    def add(symptom: str, gpu: str | None, bar_no: int | None, line: str, words: tuple[str, str]) -> None:
        key = (symptom, gpu, bar_no)
        if key not in found:
            found[key] = VmConfigProblem(symptom, gpu, line, *words)

    if advisor.bios and (advisor.total_gb is None or advisor.total_gb > 16):
        memory = f", {advisor.total_gb} GB of GPU memory" if advisor.total_gb else ""
        evidence = f"boot_mode: bios (no /sys/firmware/efi){memory}"
        add(SYMPTOM_BIOS_FIRMWARE, None, None, evidence, advisor.bios_firmware())
    for line in lines:
        match = _BAR_INVALID.search(line)
        if match:
            gpu, bar_no = _bus(match.group(3)), int(match.group(1))
            add(SYMPTOM_BAR_UNASSIGNED, gpu, bar_no, line, advisor.unassigned_bar(bar_no))
            continue
        if _BAR_INVALID_HEAD in line:
            head = head or line  # the line after it names the BAR and the GPU; this one only if that is lost
            continue
        match = _PCI_BAR.search(line)
        if match and match.group(1).lower() in known:
            pci_bars[(match.group(1).lower(), int(match.group(2)))] = (
                line if match.group(3) == "failed to assign" else None
            )
            continue
        match = _RM_INIT_FAILED.search(line)
        if match:
            gpu = _bus(line.split("RmInitAdapter")[0])
            add(SYMPTOM_INIT_FAILED, gpu, None, line, advisor.init_failed(gpu))
            continue
        if _FALLEN_OFF in line and "NVRM" in line:
            add(SYMPTOM_FELL_OFF_BUS, _bus(line), None, line, (_FELL_OFF, _FELL_OFF_FIX))
            continue
        if _NO_INTERRUPTS in line:
            add(SYMPTOM_NO_INTERRUPTS, _bus(line), None, line, (_NO_IRQ, _NO_IRQ_FIX))
            continue
        fault = _iommu_fault(line)
        if fault and fault[0] in known:
            add(SYMPTOM_IOMMU_FAULT, fault[0], None, line, (_IOMMU.format(what=fault[1]), _IOMMU_FIX))
    if head and not any(key[0] == SYMPTOM_BAR_UNASSIGNED for key in found):
        add(SYMPTOM_BAR_UNASSIGNED, None, None, head, advisor.unassigned_bar(None))
    # The kernel's own BAR failures back up (and precede) NVRM's; keep them only where NVRM said nothing.
    for (gpu, bar_no), failure in pci_bars.items():
        if failure and (SYMPTOM_BAR_UNASSIGNED, gpu, bar_no) not in found:
            add(SYMPTOM_BAR_UNASSIGNED, gpu, bar_no, failure, advisor.unassigned_bar(bar_no))
    # A symptom seen for a named GPU makes its anonymous lines (the first of a two-line message) redundant.
    named = {key[0] for key in found if key[1]}
    return [p for key, p in found.items() if key[1] or key[0] not in named]


def _iommu_fault(line: str) -> tuple[str, str] | None:
    """(GPU address, what was blocked) of an IOMMU fault line; the address as sysfs spells it."""
    match = _DMAR_FAULT.search(line)
    if match:
        kind, bus, slot, func = match.groups()
        what = "interrupts" if kind == "INTR-REMAP" else "DMA"
        return f"0000:{bus.lower()}:{slot.lower()}.{func}", what
    match = _AMDVI_FAULT.search(line)
    if match:
        domain, bus, slot, func = match.groups()[1:]
        return f"{(domain or '0000').lower()}:{bus.lower()}:{slot.lower()}.{func}", "DMA"
    return None


def _driver_version_in(lines: list[str]) -> str | None:
    """The driver version of "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  535.261.03 ..." lines."""
    for line in reversed(lines):
        match = KMOD_VERSION.search(line)
        if match and "NVRM" in line:
            return match.group(1)
    return None
