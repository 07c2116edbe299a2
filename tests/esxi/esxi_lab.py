"""The ESXi passthrough tests' lab: the collection on sys.path, a stand-in vSphere to build labs in, and
:func:`module_args` for running the module's ``main()`` in process (stand-in and vcsim tests alike).

The stand-in is built on pyVmomi's own data objects (pyvmomi is a project dependency). Test modules import
from here, not from conftest: every test folder has a conftest, and when several folders run in one pytest
session the module name ``conftest`` means only one of them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _collection_root() -> Path:
    """A directory holding ``ansible_collections/gpufleet/nvidia`` -> this repository."""
    root = Path(tempfile.mkdtemp(prefix="gpufleet-collections-"))
    atexit.register(shutil.rmtree, root, True)
    link = root / "ansible_collections" / "gpufleet" / "nvidia"
    link.parent.mkdir(parents=True)
    link.symlink_to(REPO, target_is_directory=True)
    return root


COLLECTIONS_ROOT = _collection_root()
sys.path.insert(0, str(COLLECTIONS_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

A100_80GB = 0x20B5
RTX_2080_TI = 0x1E07


@dataclass
class Lab:
    """One stand-in vCenter: a datacenter, a host with GPUs, a VM on it."""

    si: Any  # esxi_standin.ServiceInstance
    host: Any  # esxi_standin.Host
    vm: Any  # esxi_standin.VM
    recorder: Any  # esxi_standin.Recorder


def make_lab(
    *,
    memory_mb: int = 256 * 1024,
    powered_on: bool = False,
    enabled: bool = True,
    active: bool = True,
    rebind_without_reboot: bool = False,
    device_id: int = A100_80GB,
    name: str = "NVIDIA A100 80GB PCIe",
    gpu_count: int = 2,
    tools_running: bool = True,
    **config: Any,
) -> Lab:
    """Build a lab whose host has ``gpu_count`` identical GPUs at 0000:3b:00.0, 0000:5e:00.0..."""
    from esxi_standin import (
        VM,
        Datacenter,
        Folder,
        Host,
        HostGpu,
        Recorder,
        ServiceInstance,
        pci_device,
        vm_config,
    )

    recorder = Recorder()
    buses = ["3b", "5e", "af", "d8"][:gpu_count]
    gpus = [
        HostGpu(pci_device(f"0000:{bus}:00.0", device_id, name), enabled=enabled, active=enabled and active)
        for bus in buses
    ]
    host = Host("esxi-01.example.com", gpus, recorder, rebind_without_reboot=rebind_without_reboot)
    vm = VM(
        vm_config("gpu-worker-01", memory_mb, **config),
        host,
        powered_on=powered_on,
        tools_running=tools_running,
    )
    folder = Folder("gpu", [vm])
    si = ServiceInstance([Datacenter("DC1", Folder("vm", [folder]))], recorder)
    return Lab(si=si, host=host, vm=vm, recorder=recorder)


@contextlib.contextmanager
def module_args(args: dict[str, Any]) -> Iterator[None]:
    """Expose ``args`` to AnsibleModule the way ansible-core's own unit tests do."""
    import pytest
    from ansible.module_utils import basic

    try:
        from ansible.module_utils.testing import patch_module_args
    except ImportError:  # ansible-core < 2.19
        payload = json.dumps({"ANSIBLE_MODULE_ARGS": args}).encode()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(basic, "_ANSIBLE_ARGS", payload)
            yield
        return
    with patch_module_args(args):
        yield
