"""The host filesystem view and the host facts that decide how a GPU node is prepared.

Every path is read under a *host root* (`GPUFLEET_HOST_ROOT`, default `/`), so the same code reads a
real machine or a simulated one (`<sim root>/host`). Nothing here needs the NVIDIA driver.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

HOST_ROOT_ENV = "GPUFLEET_HOST_ROOT"

# EFI global-variable GUID; the SecureBoot variable lives under it in efivarfs.
SECURE_BOOT_VAR = "SecureBoot-8be4df61-93ca-11d2-aa0d-00e098032b8c"

# Fragments of "<sys_vendor> <product_name>" (DMI, lower case) → hypervisor. Microsoft needs the product
# too: its vendor string also names physical Surface hardware. Nitro and GCE are KVM underneath.
_HYPERVISORS = (
    ("vmware", "vmware"),
    ("qemu", "qemu"),
    ("kvm", "kvm"),
    ("xen", "xen"),
    ("microsoft corporation virtual machine", "hyperv"),
    ("amazon ec2", "kvm"),
    ("google compute engine", "kvm"),
)


def resolve_root(host_root: str | os.PathLike[str] | None = None) -> Path:
    """The host root to read under: the argument, else `$GPUFLEET_HOST_ROOT`, else `/`."""
    return Path(host_root or os.environ.get(HOST_ROOT_ENV) or "/")


def host_path(root: Path, path: str) -> Path:
    """`path` (absolute, as on a real host) under `root`."""
    return root / path.lstrip("/")


def read_text(path: Path) -> str | None:
    """A small sysfs/procfs file's stripped content, or None when absent or unreadable."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def read_int(path: Path, base: int = 10) -> int | None:
    """A file holding one integer (`0x10de`, `-1`, `3`), or None when absent or malformed."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text, base)
    except ValueError:
        return None


def module_loaded(root: Path, name: str) -> bool:
    """Whether kernel module `name` is loaded (it then has a /sys/module entry)."""
    return host_path(root, f"/sys/module/{name}").is_dir()


_KMOD_VERSION = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def kernel_module_version(root: Path) -> str | None:
    """Version of the loaded nvidia kernel module, or None when it is not loaded."""
    version = read_text(host_path(root, "/sys/module/nvidia/version"))
    if version:
        return version
    # Older or stripped-down kernels lack the sysfs attribute; the proc banner always carries it, e.g.
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  Wed ...".
    banner = read_text(host_path(root, "/proc/driver/nvidia/version")) or ""
    match = _KMOD_VERSION.search(banner)
    return match.group(1) if match else None


def secure_boot(root: Path) -> tuple[str, bool | None]:
    """(boot mode "uefi" or "bios", Secure Boot state; None when UEFI does not expose the variable)."""
    if not host_path(root, "/sys/firmware/efi").is_dir():
        return "bios", False
    try:
        data = host_path(root, f"/sys/firmware/efi/efivars/{SECURE_BOOT_VAR}").read_bytes()
    except OSError:
        return "uefi", None
    # efivarfs prefixes the value with 4 attribute bytes; the variable itself is one byte, 1 = on.
    if len(data) < 5:
        return "uefi", None
    return "uefi", data[4] == 1


def hypervisor(root: Path) -> tuple[str | None, bool]:
    """(hypervisor name or None, whether the CPU reports running virtualized)."""
    vendor = (read_text(host_path(root, "/sys/class/dmi/id/sys_vendor")) or "").lower()
    product = (read_text(host_path(root, "/sys/class/dmi/id/product_name")) or "").lower()
    cpuinfo = read_text(host_path(root, "/proc/cpuinfo")) or ""
    flagged = any(
        line.startswith("flags") and "hypervisor" in line.split(":", 1)[-1].split()
        for line in cpuinfo.splitlines()
    )
    dmi = f"{vendor} {product}"
    for fragment, name in _HYPERVISORS:
        if fragment in dmi:
            return name, True
    return ("unknown" if flagged else None), flagged


def kernel_release(root: Path) -> str:
    """The running kernel's release. A simulated host shares this machine's kernel, hence the fallback."""
    return read_text(host_path(root, "/proc/sys/kernel/osrelease")) or os.uname().release


def device_nodes(root: Path) -> list[str]:
    """Names of the NVIDIA device nodes under /dev (nvidia0, nvidiactl, nvidia-uvm, ...), sorted."""
    try:
        names = [entry.name for entry in host_path(root, "/dev").iterdir()]
    except OSError:
        return []
    return sorted((n for n in names if n.startswith("nvidia")), key=_natural_key)


def _natural_key(name: str) -> tuple[str, int]:
    match = re.match(r"(.*?)(\d+)$", name)
    return (match.group(1), int(match.group(2))) if match else (name, -1)


@dataclass
class HostInfo:
    """Host facts that decide how a GPU node must be prepared."""

    kernel_release: str
    nouveau_loaded: bool
    nvidia_module_loaded: bool
    boot_mode: str
    secure_boot: bool | None
    hypervisor: str | None
    virtualized: bool
    device_nodes: list[str] = field(default_factory=list)


def host_info(root: Path) -> HostInfo:
    """Read every host fact under `root`."""
    mode, secure = secure_boot(root)
    hv, virtual = hypervisor(root)
    return HostInfo(
        kernel_release=kernel_release(root),
        nouveau_loaded=module_loaded(root, "nouveau"),
        nvidia_module_loaded=module_loaded(root, "nvidia"),
        boot_mode=mode,
        secure_boot=secure,
        hypervisor=hv,
        virtualized=virtual or hv is not None,
        device_nodes=device_nodes(root),
    )
