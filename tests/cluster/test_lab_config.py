"""The lab's pure decisions (no root, no cluster): versions, scheduler config, node networks, runc wrapper."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from gpufleet_harness.cluster import cluster, k8s_build, node, oci_runtime
from gpufleet_harness.cluster.cluster import scheduler_config
from gpufleet_harness.cluster.k8s_build import upstream_version
from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.process import ClusterError

EXTENDER = {"urlPrefix": "http://127.0.0.1:8888", "filterVerb": "filter"}


@pytest.mark.parametrize(
    ("debian", "upstream"),
    [("1.20.5+really1.20.2-1.1+deb12u1", "1.20.2"), ("1:1.28.4-2", "1.28.4"), ("1.20.2~rc1-1", "1.20.2")],
)
def test_upstream_version_follows_really_and_drops_epoch_and_revision(debian: str, upstream: str) -> None:
    assert upstream_version(debian) == upstream


def test_scheduler_config_is_v1_with_health_on_the_secure_port_only() -> None:
    config = scheduler_config([EXTENDER], kubeconfig=Path("/k"))
    assert config == {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": "/k"},
        "leaderElection": {"leaderElect": False},
        "extenders": [EXTENDER],
    }


def test_scheduler_config_for_1_20_binds_plain_http_health_to_loopback() -> None:
    config = scheduler_config([EXTENDER], kubeconfig=Path("/k"), health_port=1234)
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1beta1"
    assert config["extenders"] == [EXTENDER]
    assert config["healthzBindAddress"] == config["metricsBindAddress"] == "127.0.0.1:1234"
    assert config["clientConnection"] == {"kubeconfig": "/k"}
    assert "profiles" not in config


def test_scheduler_config_takes_only_shared_fields_of_a_v1beta1_file(tmp_path: Path) -> None:
    handed = {
        "apiVersion": "kubescheduler.config.k8s.io/v1beta1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": "/elsewhere"},
        "healthzBindAddress": "0.0.0.0:10251",
        "extenders": [EXTENDER],
        "percentageOfNodesToScore": 50,
    }
    path = tmp_path / "sched.yaml"
    path.write_text(yaml.safe_dump(handed))
    config = scheduler_config(path, kubeconfig=Path("/k"), scheduler_name="gpu")
    assert config["apiVersion"].endswith("/v1")
    assert "healthzBindAddress" not in config
    assert config["clientConnection"] == {"kubeconfig": "/k"}
    assert config["extenders"] == [EXTENDER]
    assert config["percentageOfNodesToScore"] == 50
    assert config["profiles"] == [{"schedulerName": "gpu"}]


def test_scheduler_config_rejects_extender_without_url() -> None:
    with pytest.raises(ValueError, match="urlPrefix"):
        scheduler_config({"extenders": [{"filterVerb": "filter"}]}, kubeconfig=Path("/k"), health_port=1)


def test_node_network_skips_every_overlapping_block(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = [ipaddress.ip_network("198.51.100.0/29"), ipaddress.ip_network("10.0.0.0/8")]
    monkeypatch.setattr(node, "machine_networks", lambda: taken)
    assert node.pick_node_network() == ipaddress.ip_network("198.51.100.8/30")


def test_node_network_refuses_when_all_documentation_ranges_are_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    taken = [ipaddress.ip_network(block) for block in node.NODE_NETWORKS]
    monkeypatch.setattr(node, "machine_networks", lambda: taken)
    with pytest.raises(ClusterError, match="overlaps"):
        node.pick_node_network()


def test_veth_names_fit_ifnamsiz() -> None:
    host, peer = node.veth_names("abcd_123", 9)
    assert len(host) <= 15 and len(peer) <= 15 and host != peer


@pytest.mark.parametrize(
    "args",
    [
        ["create", "--bundle", "/b", "id"],
        ["--root", "/r", "create", "--bundle=/b", "id"],
        ["run", "-b", "/b", "x"],
    ],
)
def test_oci_wrapper_finds_bundle(args: list[str]) -> None:
    assert oci_runtime.bundle_of(args) == Path("/b")


def test_oci_wrapper_clamps_only_negative_oom_score_adj(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"process": {"oomScoreAdj": -998, "args": ["/pause"]}}))
    assert oci_runtime.clamp_oom_score_adj(config)
    assert json.loads(config.read_text())["process"] == {"oomScoreAdj": 0, "args": ["/pause"]}
    config.write_text(json.dumps({"process": {"oomScoreAdj": 500}}))
    assert not oci_runtime.clamp_oom_score_adj(config)
    assert json.loads(config.read_text())["process"]["oomScoreAdj"] == 500


def test_the_default_kubernetes_is_the_module_build_and_1_20_is_debians(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("GPUFLEET_K8S_VERSION", raising=False)
    monkeypatch.setattr(k8s_build, "available_source_version", lambda: "1.20.5+really1.20.2-1.1+deb12u1")
    assert k8s_build.resolve_version() == k8s_build.DEFAULT_K8S_VERSION == k8s_build.NEWEST_K8S_VERSION
    assert k8s_build.DEFAULT_K8S_VERSION == "1.37.2"
    assert k8s_build.resolve_version("1.20") == "1.20.5+really1.20.2-1.1+deb12u1"
    monkeypatch.setenv("GPUFLEET_K8S_VERSION", "1.20")
    assert k8s_build.resolve_version() == "1.20.5+really1.20.2-1.1+deb12u1"
    assert k8s_build.resolve_version("1.37.2") == "1.37.2"


@pytest.mark.parametrize(("git_version", "minor", "legacy"), [("v1.37.2", 37, False), ("v1.20.2", 20, True)])
def test_a_builds_minor_decides_the_legacy_flags(git_version: str, minor: int, legacy: bool) -> None:
    artifacts = K8sArtifacts("x", Path("/x"), {"git_version": git_version})
    assert artifacts.minor == minor
    assert cluster.legacy(artifacts) is legacy


def test_a_docker_node_is_refused_on_a_current_kubelet_before_anything_starts(tmp_path: Path) -> None:
    artifacts = K8sArtifacts("1.37.2", tmp_path, {"git_version": "v1.37.2"})
    lab = SimpleNamespace(artifacts=artifacts, dir=tmp_path, id="x", logs=tmp_path)
    cp = SimpleNamespace(legacy=cluster.legacy(artifacts))
    refused = r"dockershim, removed in Kubernetes 1\.24; this cluster runs v1\.37\.2"
    with pytest.raises(ClusterError, match=refused):
        node.KubeletNode(lab, cp, "n", runtime="docker")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
