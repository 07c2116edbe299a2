"""Start and stop ``vcsim-gpu``: a vCenter simulator whose ESXi hosts carry the NVIDIA GPUs a scenario names.

The scenario (hosts, their GPUs and passthrough switches, the VMs) is written as JSON for the Go program;
the program binds a free port on 127.0.0.1 itself (no race between choosing and binding) and prints its URL
once its inventory is built, which is when :meth:`Vcsim.start` returns.
"""

from __future__ import annotations

import json
import secrets
import urllib.parse
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from gpufleet_harness.cluster.process import ClusterError, Daemon, wait_for
from gpufleet_harness.vcsim.build import ensure_vcsim

START_TIMEOUT = 60.0
DEFAULT_USER = "gpufleet@vsphere.local"
DATACENTER = "DC0"  # the simulator's datacenter; VMs live in its VM folder (or a folder under it)


@dataclass(frozen=True)
class GpuModel:
    """A GPU model as ESXi lists it in ``hardware.pciDevice`` (names as in the pci.ids database)."""

    device_id: int
    name: str
    memory_gb: int


A100_SXM4_80GB = GpuModel(0x20B2, "GA100 [A100 SXM4 80GB]", 80)
A100_PCIE_80GB = GpuModel(0x20B5, "GA100 [A100 PCIe 80GB]", 80)
A100_PCIE_40GB = GpuModel(0x20F1, "GA100 [A100 PCIe 40GB]", 40)
V100_SXM2_16GB = GpuModel(0x1DB1, "GV100GL [Tesla V100 SXM2 16GB]", 16)
V100_PCIE_32GB = GpuModel(0x1DB6, "GV100GL [Tesla V100 PCIe 32GB]", 32)
T4 = GpuModel(0x1EB8, "TU104GL [Tesla T4]", 16)


@dataclass(frozen=True)
class Gpu:
    """One GPU on a host and its passthrough switches (``enabled`` but not ``active``: reboot pending)."""

    pci_id: str
    model: GpuModel
    capable: bool = True
    enabled: bool = False
    active: bool = False


@dataclass(frozen=True)
class Host:
    """A standalone ESXi host. ``activate_without_reboot``: newly enabled passthrough is active at once."""

    name: str
    gpus: tuple[Gpu, ...]
    activate_without_reboot: bool = False


@dataclass(frozen=True)
class Vm:
    """A VM created on ``host`` (BIOS firmware, nothing reserved: as a fresh vSphere VM)."""

    name: str
    host: str
    memory_mb: int = 4096
    cpus: int = 4
    powered_on: bool = False
    tools_running: bool = False
    folder: str = ""


@dataclass(frozen=True)
class Scenario:
    """Everything the simulator serves beyond its own empty datacenter."""

    hosts: tuple[Host, ...]
    vms: tuple[Vm, ...] = field(default_factory=tuple)

    def to_json(self) -> str:
        """The JSON document vcsim_gpu.go reads (``-scenario``)."""
        hosts = [
            {
                "name": h.name,
                "activate_without_reboot": h.activate_without_reboot,
                "gpus": [
                    {
                        "id": g.pci_id,
                        "device_id": g.model.device_id,
                        "name": g.model.name,
                        "capable": g.capable,
                        "enabled": g.enabled,
                        "active": g.active,
                    }
                    for g in h.gpus
                ],
            }
            for h in self.hosts
        ]
        return json.dumps({"hosts": hosts, "vms": [asdict(vm) for vm in self.vms]}, indent=2)


class Vcsim:
    """One running simulator; use as a context manager, or :meth:`start` and :meth:`stop` (always)."""

    def __init__(
        self,
        scenario: Scenario,
        workdir: Path,
        *,
        username: str = DEFAULT_USER,
        password: str | None = None,
        binary: Path | None = None,
    ) -> None:
        self.scenario = scenario
        self.workdir = workdir
        self.username = username
        self.password = password or secrets.token_urlsafe(16)
        self.binary = binary
        self.url = ""
        self.control = ""
        self._daemon: Daemon | None = None

    @property
    def host(self) -> str:
        """Address to give pyVmomi / the module as ``hostname``."""
        return urllib.parse.urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        """Port to give pyVmomi / the module (plain HTTP)."""
        return urllib.parse.urlsplit(self.url).port or 0

    @property
    def log_path(self) -> Path:
        return self.workdir / "vcsim.log"

    def start(self) -> Vcsim:
        """Build if needed, start, and wait until the simulator has printed its URL."""
        binary = self.binary or ensure_vcsim()
        self.workdir.mkdir(parents=True, exist_ok=True)
        scenario_path = self.workdir / "scenario.json"
        scenario_path.write_text(self.scenario.to_json())
        self._daemon = Daemon(
            "vcsim-gpu",
            [binary, "-listen", "127.0.0.1:0", "-scenario", scenario_path, "-username", self.username],
            self.log_path,
            env={
                "PATH": "/usr/bin:/bin",
                "GPUFLEET_VCSIM_PASSWORD": self.password,
                "TMPDIR": str(self.workdir),
            },
        )
        try:
            ready = wait_for(
                "vcsim-gpu to print its URL", self._ready, START_TIMEOUT, alive=self._daemon.check
            )
        except ClusterError:
            self.stop()
            raise
        self.url, self.control = ready["url"], ready["control"]
        return self

    def _ready(self) -> dict[str, Any] | None:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return None
        for line in lines:
            if line.startswith("{"):
                doc = json.loads(line)
                if "url" in doc:
                    return doc  # type: ignore[no-any-return]
        return None

    def reboot_host(self, name: str) -> None:
        """What an operator's host reboot does to passthrough: every enabled device becomes active."""
        query = urllib.parse.urlencode({"host": name})
        request = urllib.request.Request(f"{self.control}/reboot?{query}", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()

    def stop(self) -> None:
        """Stop the simulator (idempotent); its datastore temp dirs live in the workdir."""
        if self._daemon is not None:
            self._daemon.stop()
            self._daemon = None

    def __enter__(self) -> Vcsim:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
