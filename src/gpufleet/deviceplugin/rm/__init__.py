"""Resource manager: which devices exist, whether they are healthy, and how requests map onto GPUs.

The gRPC server never talks to NVML; it asks the resource manager, which learns about GPUs through a
`DeviceSource` (the NVML-backed one wraps `gpufleet.gpu`; tests can substitute their own).
"""
