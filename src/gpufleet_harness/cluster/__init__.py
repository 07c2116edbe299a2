"""The lab: a real Kubernetes 1.20 control plane and kubelet node on one machine, for tests."""
