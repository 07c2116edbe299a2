"""The lab: a simulated GPU fleet on one machine (``gpufleet lab up | status | down``).

Podman containers with systemd play the GPU hosts, each with a simulated machine installed where a real
driver's files would be; a real Kubernetes control plane runs on this machine and a real kubelet in every
host. See docs/lab.md.
"""
