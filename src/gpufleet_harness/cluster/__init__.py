"""The test cluster: a real Kubernetes control plane (1.20 or 1.37) and kubelet nodes on one machine, for
tests. Not the podman lab of simulated GPU hosts, which is :mod:`gpufleet_harness.lab`."""
