"""gpufleet: turn bare NVIDIA GPU machines into validated Kubernetes GPU nodes."""

__version__ = "0.1.0"
