"""gpufleet's test harness: what stands in for the world the product meets, kept out of the product.

``sim`` (the simulated NVML library and nvidia-smi), ``cluster`` (Kubernetes 1.20 built from Debian's source,
a control plane and kubelets: ``gpufleet cluster``), ``lab`` (the simulated GPU fleet of podman hosts:
``gpufleet lab``), ``testhosts`` (molecule's systemd hosts and the stand-in apt repository), ``vcsim``
(govmomi's vSphere simulator with GPUs) and ``memapi`` (an in-memory Kubernetes API for the extender's
tests and benchmarks). It imports the product (``gpufleet``); the product never imports it.
"""
