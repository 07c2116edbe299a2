"""gpufleet's kubelet device plugin for NVIDIA GPUs (API v1beta1): whole GPUs, time-slicing, GPU memory.

Rooms: `api/` (the protocol), `rm/` (devices, health, allocation policy), `plugin/` (gRPC server and the
kubelet dance), `gpumem/` (the extender hand-off), `labels` (node labels), `config`, `app` (wiring).
"""
