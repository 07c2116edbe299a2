#!/usr/bin/env python3
"""gpufleet's gpu-feature-discovery labels on a real GPU, against what GFD v0.20.0 wrote on the recorded H200.

Run on the GPU host from a checkout of this repository, as root (Python 3.11+ with pynvml and pyyaml; the
project installed, or its src/ is used from the checkout). Read-only: NVML getters, sysfs and PCI
configuration-space reads, /dev/kmsg read by discovery; nothing is set or reset:

    python3 tests/realgpu/gfd_labels_check.py [--recorded FILE] [--host-root /]

--recorded defaults to h200-580.159.04/gfd-labels.txt beside this script. It produced "PASS: identical" on
the second H200 host on 2026-11-28 (h200-580.159.04-host2/log.txt, section 2; then named
i33-labels-gpucheck.py, the gpufleet.io agreement then checked without sharing or MIG only).

What it does:
1. the device plugin's own discovery (NvmlDeviceSource("/").inventory(): gpufleet.gpu's NVML reader, sysfs,
   the PCI configuration spaces for vGPU, the DMI product name) on the real GPU;
2. gpufleet.deviceplugin.gfd.gfd_labels() with the default configuration (mig.strategy none, no sharing:
   what the recorded GFD ran with) and a diff against gfd-labels.txt, label by label;
3. where the host is not the recorded one, says which differences that explains (another driver or CUDA
   version, a DMI product name where the recorded microVM had none) and exits 0 only if nothing else differs;
4. the vGPU answer both ways (configuration space read as root, and NVML's virtualization mode, which is what
   an unprivileged plugin falls back to);
5. the gpufleet.io labels and their agreement with GFD's on every shared name (issue 33 item 4), without
   sharing, time-sliced (4 replicas, plain and renamed) and under both MIG strategies.

Exit status: 0 when the label set equals the recording (or differs only where the host explains it) and every
shared name agrees, 1 when not, 2 when the check could not run (NVML, imports). A JSON summary is the last
line of output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
RECORDED = HERE / "h200-580.159.04" / "gfd-labels.txt"
SOURCE = HERE.parent.parent / "src"  # the checkout's package, used when gpufleet is not installed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument(
        "--recorded", default=str(RECORDED), help=f"GFD's labels, key=value a line ({RECORDED})"
    )
    parser.add_argument("--host-root", default="/", help="where the host's /sys is (default /)")
    args = parser.parse_args()
    try:
        import gpufleet  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(SOURCE))
    try:
        from gpufleet.deviceplugin.gfd import Sharing, gfd_labels, is_gfd_label
        from gpufleet.deviceplugin.labels import node_labels
        from gpufleet.deviceplugin.rm.model import MIB
        from gpufleet.deviceplugin.rm.nvml_source import NvmlDeviceSource
        from gpufleet.gpu import pci
    except ImportError as exc:
        print(f"cannot import gpufleet (installed, or from {SOURCE}): {exc}")
        return 2
    recorded_path = Path(args.recorded)
    if not recorded_path.is_file():
        print(f"no recorded labels at {recorded_path} (--recorded)")
        return 2
    recorded = dict(line.split("=", 1) for line in recorded_path.read_text().splitlines() if "=" in line)

    root = Path(args.host_root)
    source = NvmlDeviceSource(str(root))
    try:
        inv = source.inventory()
    except Exception as exc:  # NVML unusable: nothing to compare
        print(f"discovery failed: {exc!r}")
        return 2
    finally:
        source.close()
    print(
        f"uid {os.getuid()}; {len(inv.gpus)} GPU(s); driver {inv.driver_version}; "
        f"CUDA {inv.cuda_driver_version}"
    )
    for g in inv.gpus:
        print(
            f"  GPU {g.index} {g.model} {g.uuid} {g.memory_bytes // MIB} MiB cc {g.cc} bus {g.bus_id} "
            f"class 0x{g.pci_class:06x} mig capable/enabled {g.mig_capable}/{g.mig_enabled} "
            f"virtualization mode {g.virtualization_mode} clique {g.clique!r}"
        )
    print(f"  DMI product name: {inv.machine!r}; vGPUs (configuration space or fallback): {inv.vgpu}")
    functions = pci.scan(root)
    from_config = pci.vgpus(root, functions)
    fallback = [g.bus_id for g in inv.gpus if g.virtualization_mode == 2]
    print(f"  vGPU from configuration spaces ({len(functions)} NVIDIA functions): {from_config}")
    print(f"  vGPU from NVML virtualization mode (the unprivileged fallback): {fallback}")

    ours = gfd_labels(inv)
    missing = sorted(set(recorded) - set(ours))
    extra = sorted(set(ours) - set(recorded))
    differ = sorted(k for k in set(ours) & set(recorded) if ours[k] != recorded[k])
    print(f"\ngfd_labels(): {len(ours)} labels; recorded: {len(recorded)}")
    for key in sorted(set(ours) | set(recorded)):
        mark = "  " if ours.get(key) == recorded.get(key) else "!="
        print(f"  {mark} {key}: ours {ours.get(key)!r} recorded {recorded.get(key)!r}")

    # Differences the host explains: another driver / CUDA than the recording's, or DMI where it had none.
    explained = []
    if inv.driver_version != recorded.get("nvidia.com/cuda.driver-version.full"):
        explained += [k for k in differ if k.startswith("nvidia.com/cuda.driver")]
    cuda = f"{inv.cuda_driver_version // 1000}.{inv.cuda_driver_version % 1000 // 10}"
    if cuda != recorded.get("nvidia.com/cuda.runtime-version.full"):
        explained += [k for k in differ if k.startswith("nvidia.com/cuda.runtime")]
    if inv.machine is not None and recorded.get("nvidia.com/gpu.machine") == "unknown":
        explained += [k for k in differ if k == "nvidia.com/gpu.machine"]
    unexplained = sorted(set(missing) | set(extra) | (set(differ) - set(explained)))
    if explained:
        print(f"\nexplained by this host (not the recorded one): {sorted(explained)}")
        # The same host facts as the recording's, to show the rest of the rule agrees.
        as_recorded = replace(inv, machine=None) if "nvidia.com/gpu.machine" in explained else inv
        print(
            f"  with the recording's machine: gpu.machine={gfd_labels(as_recorded)['nvidia.com/gpu.machine']}"
        )

    fleet = node_labels(inv)
    print(f"\ngpufleet.io labels: {json.dumps(fleet, sort_keys=True)}")
    # Issue 33 item 4: a gpufleet.io label under a name GFD writes has GFD's value in every configuration.
    disagree = []
    configurations = {
        "none": ("none", None),
        "time-slicing x4": ("none", Sharing("time-slicing", 4)),
        "time-slicing x4, renamed": ("none", Sharing("time-slicing", 4, renamed=True)),
        "mig single": ("single", None),
        "mig mixed": ("mixed", None),
    }
    for what, (strategy, sharing) in configurations.items():
        mine = node_labels(inv, "gpufleet.io", strategy, sharing)
        theirs = gfd_labels(inv, strategy, sharing)
        shared = sorted(
            k.removeprefix("gpufleet.io/")
            for k in mine
            if is_gfd_label("nvidia.com/" + k.removeprefix("gpufleet.io/"))
        )
        wrong = [n for n in shared if mine[f"gpufleet.io/{n}"] != theirs.get(f"nvidia.com/{n}")]
        disagree += [f"{what}: {n}" for n in wrong]
        print(f"{what}: names shared with GFD's: {shared}; disagreeing: {wrong or 'none'}")

    sliced = gfd_labels(inv, sharing=Sharing("time-slicing", 4))
    print(
        f"\ntime-slicing x4: product {sliced.get('nvidia.com/gpu.product')}, "
        f"replicas {sliced.get('nvidia.com/gpu.replicas')}, "
        f"strategy {sliced.get('nvidia.com/gpu.sharing-strategy')}"
    )
    for strategy in ("single", "mixed"):
        delta = {k: v for k, v in gfd_labels(inv, strategy).items() if ours.get(k) != v}
        print(f"mig.strategy {strategy} (MIG off here): adds {delta}")

    ok = not unexplained and not disagree
    summary = {
        "check": "gfd-labels-check",
        "ok": ok,
        "labels": len(ours),
        "recorded": len(recorded),
        "missing": missing,
        "extra": extra,
        "differ": differ,
        "explained": sorted(explained),
        "gpufleet_disagree": disagree,
        "vgpu_config": None if from_config is None else len(from_config),
        "vgpu_fallback": fallback,
        "machine": inv.machine,
        "uid": os.getuid(),
    }
    print(
        "\n"
        + ("PASS" if ok else "FAIL")
        + ": "
        + (
            "identical"
            if not (missing or extra or differ)
            else f"unexplained differences {unexplained}"
            if unexplained
            else "differences explained by the host"
        )
    )
    print(json.dumps(summary, sort_keys=True))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
