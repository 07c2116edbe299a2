"""`gpufleet gpu facts|topo`: print what discovery finds on this host (or under --host-root)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .device import Gpu
from .facts import GpuFacts, discover
from .host import host_path, read_text
from .topology import Topology

LEGEND = """\
Legend:
  X     the GPU itself
  NV#   # NVLinks between the two GPUs, directly or through the NVSwitch fabric
  PIX   PCIe path through at most one PCIe bridge
  PXB   PCIe path through several PCIe bridges, not through a host bridge
  PHB   PCIe path through a PCIe host bridge (usually the CPU)
  NODE  PCIe path between host bridges of one NUMA node
  SYS   PCIe path across NUMA nodes (the CPUs' SMP interconnect)
"""


def format_topology(topology: Topology, gpus: list[Gpu], online_nodes: str | None = None) -> str:
    """The matrix the way `nvidia-smi topo -m` lays it out: tab-separated, affinity columns last.

    A GPU without a NUMA node (sysfs numa_node -1, as in most VMs) is near every node: its NUMA affinity is
    `online_nodes` (the host's /sys/devices/system/node/online), as NVML's memory affinity and nvidia-smi
    say it (`0` on the recorded one-node H200 VM), else N/A."""
    by_index = {gpu.index: gpu for gpu in gpus}
    labels = [f"GPU{index}" for index in topology.indices]
    lines = ["\t" + "\t".join([*labels, "CPU Affinity", "NUMA Affinity", "GPU NUMA ID"])]
    for label, index, row in zip(labels, topology.indices, topology.matrix, strict=True):
        gpu = by_index[index]
        cells = [f" {cell} " if cell == "X" else cell for cell in row]
        numa = str(gpu.numa_node) if gpu.numa_node is not None else online_nodes or "N/A"
        # GPU NUMA ID names memory a GPU exposes as a NUMA node (coherent Grace systems): never here.
        lines.append("\t".join([label, *cells, gpu.local_cpulist or "N/A", numa, "N/A"]))
    return "\n".join(lines) + "\n\n" + LEGEND


def format_facts(facts: GpuFacts) -> str:
    """A readable summary of `facts`."""
    d = facts.driver
    host = facts.host
    if facts.source == "nvml":
        source = (
            f"nvml (driver {d.userspace_version}, kernel module {d.kernel_module_version}, "
            f"CUDA {d.cuda_driver_version})"
        )
    else:
        source = f"sysfs (NVML unavailable: {facts.nvml_error})" if facts.nvml_error else "sysfs"
    secure = {True: "on", False: "off", None: "unknown"}[host.secure_boot]
    nouveau = "loaded" if host.nouveau_loaded else "not loaded"
    lines = [
        f"host root:   {facts.host_root}",
        f"source:      {source}",
        f"host:        kernel {host.kernel_release}, {host.boot_mode} boot, secure boot {secure}, "
        f"hypervisor {host.hypervisor or 'none'}, nouveau {nouveau}",
    ]
    if d.version_mismatch:
        lines.append("driver:      kernel module and userspace versions differ (reboot or reload the module)")
    lines.append(f"GPUs:        {len(facts.gpus)}")
    for gpu in facts.gpus:
        memory = "?" if gpu.memory_mib is None else f"{gpu.memory_mib} MiB"
        numa = "-" if gpu.numa_node is None else str(gpu.numa_node)
        lost = "  LOST" if gpu.lost else ""
        lines.append(
            f"  GPU {gpu.index:<3} {gpu.model:<26} {memory:>10}  {gpu.pci_bus_id}  NUMA {numa:<2} "
            f"CC {gpu.compute_capability or '?':<4} {gpu.uuid or ''}{lost}"
        )
    fm = " (fabricmanager required)" if facts.fabricmanager_required else ""
    lines.append(f"NVSwitches:  {facts.nvswitch_count}{fm}")
    lines.extend(f"  fabric:    {symptom}" for symptom in facts.fabric_symptoms)
    lines.extend(_kernel_log_lines(facts))
    return "\n".join(lines) + "\n"


SHOWN_KERNEL_LOG_ERRORS = 10


def _kernel_log_lines(facts: GpuFacts) -> list[str]:
    """The kernel log's NVRM errors and, on VMware guests, what they say about the VM's configuration."""
    log = facts.kernel_log
    if log is None:
        return []
    if log.source is None:
        lines = [f"kernel log:  not read ({log.unreadable})"]
    else:
        cut = ", truncated" if log.truncated else ""
        lines = [f"kernel log:  {log.source}{cut}, {len(facts.kernel_log_errors)} NVRM error line(s)"]
        shown = facts.kernel_log_errors[-SHOWN_KERNEL_LOG_ERRORS:]
        if len(shown) < len(facts.kernel_log_errors):
            lines.append(f"  ... {len(facts.kernel_log_errors) - len(shown)} earlier line(s) not shown")
        lines.extend(f"  {line}" for line in shown)
    if facts.host.hypervisor == "vmware" and facts.gpus:
        problems = facts.vm_config_problems
        lines.append(f"VM config:   {len(problems)} problem(s) seen from the guest" if problems else
                     "VM config:   no problem seen from the guest")
        for problem in problems:
            where = f"GPU {problem.gpu}" if problem.gpu else "VM"
            lines += [
                f"  {where}: {problem.symptom}: {problem.evidence}",
                f"    cause: {problem.likely_cause}",
                f"    fix:   {problem.fix}",
            ]
    return lines


def _facts(args: argparse.Namespace) -> int:
    facts = discover(args.host_root, use_nvml=not args.no_nvml)
    if args.json:
        print(json.dumps(facts.to_dict(), indent=2, sort_keys=True))
    else:
        print(format_facts(facts), end="")
    return 0


def _topo(args: argparse.Namespace) -> int:
    facts = discover(args.host_root)
    if facts.topology is None:
        print(f"no topology: NVML is not available ({facts.nvml_error})")
        return 1
    online = read_text(host_path(Path(facts.host_root), "/sys/devices/system/node/online")) or None
    print(format_topology(facts.topology, facts.gpus, online), end="")
    return 0


def register(subparsers: Any) -> None:
    """Add `gpu facts` and `gpu topo` to the top-level parser."""
    gpu = subparsers.add_parser("gpu", help="discover GPUs, NVSwitches, driver and host facts")
    commands = gpu.add_subparsers(dest="gpu_command", metavar="COMMAND")

    def host_root(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            "--host-root",
            help="read /sys, /proc and /dev under this directory (default: $GPUFLEET_HOST_ROOT or /)",
        )

    facts = commands.add_parser("facts", help="GPUs, NVSwitches, driver, host facts")
    host_root(facts)
    facts.add_argument("--json", action="store_true", help="print the facts gpu_facts returns, as JSON")
    facts.add_argument("--no-nvml", action="store_true", help="read sysfs only, even when a driver runs")
    facts.set_defaults(func=_facts)

    topo = commands.add_parser("topo", help="GPU connection matrix, like nvidia-smi topo -m")
    host_root(topo)
    topo.set_defaults(func=_topo)
