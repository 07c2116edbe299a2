"""The pure parts of the kubeadm hosts: containerd's configuration and the kubelet's. No root, no network."""

from __future__ import annotations

import tomllib

import pytest
import yaml

from gpufleet_harness.lab import kubeadm


@pytest.mark.parametrize(
    ("version", "plugin"),
    [("2.1.9", "io.containerd.cri.v1.runtime"), ("1.7.24", "io.containerd.grpc.v1.cri")],
)
def test_containerd_config_is_cri_with_systemd_cgroups(version: str, plugin: str) -> None:
    doc = tomllib.loads(kubeadm.containerd_config(version, "registry.k8s.io/pause:3.10.2"))
    plugins = doc["plugins"]
    if version.startswith("2."):
        assert doc["version"] == 3
        assert (
            plugins["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"]
            == "registry.k8s.io/pause:3.10.2"
        )
        runc = plugins[plugin]["containerd"]["runtimes"]["runc"]
        assert plugins[plugin]["cni"]["bin_dirs"] == ["/usr/lib/cni"]
    else:
        assert doc["version"] == 2
        assert plugins[plugin]["sandbox_image"] == "registry.k8s.io/pause:3.10.2"
        runc = plugins[plugin]["containerd"]["runtimes"]["runc"]
    assert runc["runtime_type"] == "io.containerd.runc.v2"
    assert runc["options"]["SystemdCgroup"] is True
    assert plugins[plugin]["restrict_oom_score_adj"] is True


def test_kubelet_configuration_allows_this_machine() -> None:
    config = kubeadm.KubeadmCluster.kubelet_configuration()
    assert config["cgroupDriver"] == "systemd"
    assert config["failCgroupV1"] is False
    assert yaml.safe_load(yaml.safe_dump(config)) == config
