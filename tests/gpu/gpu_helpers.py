"""Helpers for GPU discovery tests: hand-built host trees and NVML consumers run in sim child processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpufleet_harness.sim import machine as simmachine

FIXTURES = simmachine.fixture_names()
# The fixtures whose NVIDIA driver is loaded, so NVML answers (esxi-vm-small-mmio's failed to load).
HEALTHY = [f for f in FIXTURES if simmachine.expand(f)["host"]["driver_loaded"]]


class FakeHost:
    """A host tree (sysfs, procfs, dev) written by hand under a temporary directory."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def write(self, path: str, content: str | bytes) -> Path:
        """Write `content` at absolute host path `path`."""
        target = self.root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            target.write_bytes(content)
        else:
            target.write_text(content)
        return target

    def pci(
        self,
        bus_id: str,
        device: int,
        klass: int = 0x030200,
        vendor: int = 0x10DE,
        numa: int = 0,
        driver: str | None = None,
    ) -> None:
        """A PCI function; `driver` binds it the way sysfs shows it (a `driver` symlink)."""
        base = f"/sys/bus/pci/devices/{bus_id}"
        self.write(f"{base}/vendor", f"0x{vendor:04x}\n")
        self.write(f"{base}/device", f"0x{device:04x}\n")
        self.write(f"{base}/class", f"0x{klass:06x}\n")
        self.write(f"{base}/subsystem_vendor", "0x10de\n")
        self.write(f"{base}/subsystem_device", "0x1463\n")
        self.write(f"{base}/numa_node", f"{numa}\n")
        if driver:
            drivers = self.root / "sys/bus/pci/drivers" / driver
            drivers.mkdir(parents=True, exist_ok=True)
            (self.root / base.lstrip("/") / "driver").symlink_to(f"../../../bus/pci/drivers/{driver}")


def run_in_sim(root: Path, argv: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run `argv` (after the Python interpreter) in a child pointed at sim root `root`."""
    env = {**os.environ, **simmachine.sim_env(root)}
    return subprocess.run(
        [sys.executable, *argv], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def facts_in_sim(root: Path) -> dict[str, Any]:
    """`gpufleet gpu facts --json` run against `root`: discovery through NVML in a child process."""
    proc = run_in_sim(root, ["-m", "gpufleet.cli", "gpu", "facts", "--json"])
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def smi(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """gpufleet-sim-smi with `args` against `root`."""
    return run_in_sim(root, ["-m", "gpufleet_harness.sim.smi", *args])
