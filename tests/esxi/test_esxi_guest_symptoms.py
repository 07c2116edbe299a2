"""The guest side agrees with the vSphere side: what gpu_facts tells a misconfigured guest to set is what
esxi_gpu_passthrough would set (same keys, same 64-bit MMIO size rule)."""

from __future__ import annotations

import pytest
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_plan import (
    KEY_MMIO_SIZE,
    KEY_USE_64BIT_MMIO,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_plan import (
    mmio_size_gb as plan_mmio_size_gb,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.gpu.device import Gpu
from ansible_collections.gpufleet.nvidia.plugins.module_utils.gpu.facts import (
    mmio_size_gb,
    vm_config_problems,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.gpu.host import HostInfo

GIB = 1 << 30


def test_the_guest_uses_the_plans_mmio_sizing_rule() -> None:
    assert [mmio_size_gb(total) for total in range(1, 4097)] == [plan_mmio_size_gb(t) for t in range(1, 4097)]


@pytest.mark.parametrize(("memory_gb", "count"), [(11, 1), (16, 1), (32, 2), (24, 2), (80, 1), (80, 8)])
def test_the_fix_names_the_settings_and_size_the_module_would_write(memory_gb: int, count: int) -> None:
    gpus = [
        Gpu(index=i, pci_bus_id=f"0000:{11 + 8 * i:02x}:00.0", model="GPU", device_id=0, memory_total=memory)
        for i, memory in enumerate([memory_gb * GIB] * count)
    ]
    host = HostInfo("6.1.0-31-amd64", False, False, "uefi", False, "vmware", True)
    line = f"NVRM: BAR1 is 0M @ 0x0 (PCI:{gpus[0].pci_bus_id})"
    (problem,) = vm_config_problems([line], gpus, host)
    assert f"{KEY_USE_64BIT_MMIO} = TRUE" in problem.fix
    assert f"{KEY_MMIO_SIZE} = {plan_mmio_size_gb(memory_gb * count)} " in problem.fix
