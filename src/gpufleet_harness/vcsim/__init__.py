"""VMware's vCenter simulator (govmomi's vcsim) with ESXi hosts that carry NVIDIA GPUs: a test harness.

Used by tests/esxi to run ``esxi_gpu_passthrough`` and ``playbooks/esxi.yml`` against the vSphere API as
govmomi models it, not only against our own in-process stand-in. :mod:`.build` compiles ``vcsim_gpu.go``
from Debian's govmomi package into a cache; :mod:`.server` starts it with a :class:`Scenario`.
What the Go program adds to govmomi 0.24's simulator is listed at the top of ``vcsim_gpu.go``.
"""

from gpufleet_harness.vcsim.build import VcsimBuildError, ensure_vcsim, missing_requirements
from gpufleet_harness.vcsim.server import (
    A100_PCIE_40GB,
    A100_PCIE_80GB,
    A100_SXM4_80GB,
    DATACENTER,
    T4,
    V100_PCIE_32GB,
    V100_SXM2_16GB,
    Gpu,
    GpuModel,
    Host,
    Scenario,
    Vcsim,
    Vm,
)

__all__ = [
    "A100_PCIE_40GB",
    "A100_PCIE_80GB",
    "A100_SXM4_80GB",
    "DATACENTER",
    "T4",
    "V100_PCIE_32GB",
    "V100_SXM2_16GB",
    "Gpu",
    "GpuModel",
    "Host",
    "Scenario",
    "Vcsim",
    "VcsimBuildError",
    "Vm",
    "ensure_vcsim",
    "missing_requirements",
]
