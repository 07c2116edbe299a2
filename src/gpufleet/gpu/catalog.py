"""What a GPU is, from its PCI device ID alone: needed before any driver is installed.

Names are spelled as NVML reports them (`nvmlDeviceGetName`), so facts read from sysfs and from NVML
agree. Device IDs checked against the PCI ID database (pci.ids) where it lists them.
"""

from __future__ import annotations

from dataclasses import dataclass

NVIDIA_VENDOR_ID = 0x10DE

# nvmlDeviceArchitecture_t → name; the same names the model table uses.
ARCHITECTURES = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada",
    9: "Hopper",
    10: "Blackwell",
}


@dataclass(frozen=True)
class GpuModel:
    """A GPU product as identified by its PCI device ID."""

    name: str
    architecture: str
    compute_capability: str
    memory_gib: int  # nominal board memory; NVML reports the exact usable size once a driver runs


GPU_MODELS: dict[int, GpuModel] = {
    0x1DB1: GpuModel("Tesla V100-SXM2-16GB", "Volta", "7.0", 16),
    0x1DB4: GpuModel("Tesla V100-PCIE-16GB", "Volta", "7.0", 16),
    0x1DB5: GpuModel("Tesla V100-SXM2-32GB", "Volta", "7.0", 32),
    0x1DB6: GpuModel("Tesla V100-PCIE-32GB", "Volta", "7.0", 32),
    0x1EB8: GpuModel("Tesla T4", "Turing", "7.5", 16),
    0x20B0: GpuModel("NVIDIA A100-SXM4-40GB", "Ampere", "8.0", 40),
    0x20B2: GpuModel("NVIDIA A100-SXM4-80GB", "Ampere", "8.0", 80),
    0x20B5: GpuModel("NVIDIA A100 80GB PCIe", "Ampere", "8.0", 80),
    0x20B7: GpuModel("NVIDIA A30", "Ampere", "8.0", 24),
    0x20F1: GpuModel("NVIDIA A100-PCIE-40GB", "Ampere", "8.0", 40),
    0x2236: GpuModel("NVIDIA A10", "Ampere", "8.6", 24),
    0x2237: GpuModel("NVIDIA A10G", "Ampere", "8.6", 24),
    0x2330: GpuModel("NVIDIA H100 80GB HBM3", "Hopper", "9.0", 80),
    0x2331: GpuModel("NVIDIA H100 PCIe", "Hopper", "9.0", 80),
    0x2335: GpuModel("NVIDIA H200", "Hopper", "9.0", 141),  # NVML's name on a real H200 (tests/realgpu)
    0x26B5: GpuModel("NVIDIA L40", "Ada", "8.9", 48),
    0x26B9: GpuModel("NVIDIA L40S", "Ada", "8.9", 48),
    0x27B8: GpuModel("NVIDIA L4", "Ada", "8.9", 24),
}


def gpu_model(device_id: int) -> GpuModel | None:
    """The model for a 16-bit PCI device ID, or None when the table does not know it."""
    return GPU_MODELS.get(device_id)


def model_name(device_id: int) -> str:
    """A display name for any NVIDIA GPU device ID, known or not."""
    model = GPU_MODELS.get(device_id)
    return model.name if model else f"NVIDIA device 0x{device_id:04x}"
