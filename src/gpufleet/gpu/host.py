"""The host filesystem view and the host facts that decide how a GPU node is prepared, and its kernel log.

Every path is read under a *host root* (`GPUFLEET_HOST_ROOT`, default `/`), so the same code reads a
real machine or a simulated one (`<sim root>/host`). Nothing here needs the NVIDIA driver.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections import deque
from collections.abc import Callable
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


KMOD_VERSION = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def kernel_module_version(root: Path) -> str | None:
    """Version of the loaded nvidia kernel module, or None when it is not loaded."""
    version = read_text(host_path(root, "/sys/module/nvidia/version"))
    if version:
        return version
    # Older or stripped-down kernels lack the sysfs attribute; the proc banner always carries it, e.g.
    # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  Wed ...".
    banner = read_text(host_path(root, "/proc/driver/nvidia/version")) or ""
    match = KMOD_VERSION.search(banner)
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


def dmi_product_name(root: Path) -> str | None:
    """The machine's DMI product name ("DGX H100", "PowerEdge XE9680"); None where the platform has no DMI."""
    return read_text(host_path(root, "/sys/class/dmi/id/product_name"))


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


# ---------------------------------------------------------------------------------------------- kernel log

KMSG = "/dev/kmsg"
KERN_LOG = "/var/log/kern.log"
# Bounds for one read of the kernel log: bytes read (from the end of kern.log), wall time, lines kept.
# The kernel's ring buffer is far smaller by default; kern.log can be any size, only its tail is read.
KERNEL_LOG_MAX_BYTES = 16 << 20
KERNEL_LOG_DEADLINE_S = 2.0
KERNEL_LOG_MAX_LINES = 5000
# /dev/kmsg hands out one record per read() and fails with EINVAL when the buffer is smaller than the record;
# records are at most 8 KiB (the kernel's CONSOLE_EXT_LOG_MAX). A regular file (a simulated host) is simply
# read in chunks of this size.
_READ_SIZE = 16384

# A /dev/kmsg record: "<prio>,<seq>,<usec>,<flags>[,<more>];<text>" (Documentation/ABI/testing/dev-kmsg);
# the lines after it that start with a space are the record's KEY=value dictionary.
_KMSG_RECORD = re.compile(r"^\d+,\d+,\d+,[^;]*;(.*)$")
_KMSG_DICT = re.compile(r"^ [A-Z_]+=")
# /dev/kmsg writes non-printable bytes (a message's own newlines among them) as \xNN.
_KMSG_ESCAPE = re.compile(r"\\x([0-9a-fA-F]{2})")
# A syslog line (kern.log): everything up to "kernel: " is the syslog header.
_SYSLOG_KERNEL = re.compile(r"^.*?\bkernel: ?(.*)$")
# The printk time stamp dmesg and syslog put in front of the message.
_PRINTK_TIME = re.compile(r"^\[\s*\d+\.\d+\]\s?")
# The first line the kernel logs at boot (init/main.c prints linux_banner): "Linux version 6.1.0-31 ...".
_BOOT_BANNER = "Linux version "


@dataclass
class KernelLog:
    """The kernel's messages of the current boot, as far as they could be read."""

    source: str | None  # KMSG or KERN_LOG (as on the host, without the host root); None when neither was read
    unreadable: str | None = None  # why nothing was read, per path tried; None when `source` is set
    lines: list[str] = field(default_factory=list)  # messages kept, oldest first, without time stamps
    truncated: bool = False  # lines may be missing: size, time or line limit hit, or kmsg records overwritten


def kernel_messages(raw: str) -> list[str]:
    """The kernel messages in one line of /dev/kmsg or kern.log (several when the message had newlines).

    Returns [] for /dev/kmsg's dictionary lines. rsyslog writes a message's newlines as "#012" (its default
    control-character escape); /dev/kmsg as "\\x0a".
    """
    record = _KMSG_RECORD.match(raw)
    if record:
        text = _KMSG_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), record.group(1))
    elif _KMSG_DICT.match(raw):
        return []
    else:
        syslog = _SYSLOG_KERNEL.match(raw)
        text = (syslog.group(1) if syslog else raw).replace("#012", "\n")
    out = []
    for line in text.split("\n"):
        line = _PRINTK_TIME.sub("", line.strip())
        if line:
            out.append(line)
    return out


def _read_lines(path: Path, deadline: float, max_bytes: int, sink: Callable[[str], None]) -> bool:
    """Pass each line of `path` to `sink`; True when the content was cut. Never blocks (O_NONBLOCK, deadline).

    Of a regular file larger than `max_bytes` only the last `max_bytes` are read.
    """
    fd = os.open(str(path), os.O_RDONLY | os.O_NONBLOCK)
    truncated = skip_first = False
    pending = b""
    total = 0
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_size > max_bytes:
            os.lseek(fd, st.st_size - max_bytes, os.SEEK_SET)
            truncated = skip_first = True  # the first line read is the end of a cut one
        while True:
            if total >= max_bytes or time.monotonic() > deadline:
                truncated = True
                break
            try:
                chunk = os.read(fd, _READ_SIZE)
            except BlockingIOError:  # /dev/kmsg: no further record (EAGAIN)
                break
            except BrokenPipeError:  # /dev/kmsg: the next record was overwritten while we read (EPIPE)
                truncated = True
                continue
            except OSError as exc:
                if exc.errno != errno.EINVAL:  # EINVAL: a /dev/kmsg record longer than the buffer
                    raise
                truncated = True
                break
            if not chunk:
                break
            total += len(chunk)
            *complete, pending = (pending + chunk).split(b"\n")
            for line in complete:
                if skip_first:
                    skip_first = False
                    continue
                sink(line.decode("utf-8", errors="replace"))
    finally:
        os.close(fd)
    if pending and not skip_first:
        sink(pending.decode("utf-8", errors="replace"))
    return truncated


class _Collector:
    """Keeps the last `max_lines` wanted messages of the current boot."""

    def __init__(self, keep: Callable[[str], bool] | None, max_lines: int) -> None:
        self.keep = keep
        self.kept: deque[str] = deque(maxlen=max_lines)
        self.seen = 0  # wanted messages since the last boot banner, kept or not

    def __call__(self, line: str) -> None:
        for message in kernel_messages(line):
            if message.startswith(_BOOT_BANNER):  # kern.log spans boots: keep the last one only
                self.kept.clear()
                self.seen = 0
            if self.keep is None or self.keep(message):
                self.kept.append(message)
                self.seen += 1


def read_kernel_log(
    root: Path,
    keep: Callable[[str], bool] | None = None,
    *,
    max_bytes: int = KERNEL_LOG_MAX_BYTES,
    deadline_s: float = KERNEL_LOG_DEADLINE_S,
    max_lines: int = KERNEL_LOG_MAX_LINES,
) -> KernelLog:
    """The current boot's kernel messages for which `keep` is true (all by default), the last `max_lines`.

    Reads `<root>/dev/kmsg` (non-blocking, record by record), else `<root>/var/log/kern.log` (its tail, from
    the last boot banner on), else nothing, and then says why in `unreadable`. Never blocks, never raises for
    a missing or unreadable log. Reading /dev/kmsg needs CAP_SYSLOG where kernel.dmesg_restrict is 1.
    """
    deadline = time.monotonic() + deadline_s
    reasons = []
    for name in (KMSG, KERN_LOG):
        path = host_path(root, name)
        collect = _Collector(keep, max_lines)
        try:
            truncated = _read_lines(path, deadline, max_bytes, collect)
        except FileNotFoundError:
            reasons.append(f"{name}: absent")
            continue
        except OSError as exc:
            reasons.append(f"{name}: {exc.strerror or exc}")
            continue
        truncated = truncated or collect.seen > max_lines
        return KernelLog(source=name, lines=list(collect.kept), truncated=truncated)
    return KernelLog(source=None, unreadable="; ".join(reasons))
