"""A kubeadm cluster on Kubernetes 1.37 built from its Go modules: the real ``kubeadm init`` in a podman
systemd host on containerd 2.1 (Debian sid's package), a worker joined with ``kubeadm join`` on containerd 1.7
(Debian trixie's), both CRI v1 with systemd cgroups, and pods the real scheduler places on each
(:mod:`gpufleet_harness.lab.kubeadm`, docs/lab-cluster.md). Opt-in (tests/kubeadm/conftest.py).

One cluster for the module (names unique to this run: ``gpufleet-kadm-<id>-*``, never the lab's or
molecule's); the tests build on each other in file order; the fixture removes every container and volume
also when bringing the cluster up failed, and the last test checks that nothing is left.
"""

from __future__ import annotations

import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kadm_kube import new_namespace, running
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.node import BUSYBOX_IMAGE
from gpufleet_harness.cluster.process import ClusterError, wait_for
from gpufleet_harness.lab.hostsetup import HostError
from gpufleet_harness.lab.kubeadm import KUBELET_SYSCTLS, LABEL, KubeadmCluster, KubeadmHost
from gpufleet_harness.testhosts.podman import podman

pytestmark = [pytest.mark.root, pytest.mark.kubeadm]
VERSION = "1.37.2"
CONTROL_PLANE_TAINT = "node-role.kubernetes.io/control-plane"
STATIC_PODS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


def _sysctls() -> dict[str, str]:
    return {key: Path("/proc/sys", key).read_text().strip() for key in KUBELET_SYSCTLS}


@pytest.fixture(scope="module")
def machine_sysctls() -> dict[str, str]:
    """This machine's values of the sysctls the kubelet sets, before any cluster runs."""
    return _sysctls()


@pytest.fixture(scope="module")
def cluster(artifacts: K8sArtifacts, machine_sysctls: dict[str, str]) -> Iterator[KubeadmCluster]:
    with KubeadmCluster(artifacts) as made:
        try:
            made.init("2.1")
        except (HostError, ClusterError) as err:
            pytest.fail(f"kubeadm init: {err}")
        yield made
        hosts = {h.container: h.timings for h in made.hosts}
        print(f"kubeadm cluster timings (s): {made.timings}; per host: {hosts}")


@pytest.fixture(scope="module")
def core(cluster: KubeadmCluster) -> Iterator[k8s.CoreV1Api]:
    api = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield k8s.CoreV1Api(api)
    api.close()


@pytest.fixture(scope="module")
def namespace(core: k8s.CoreV1Api) -> str:
    return new_namespace(core, "kadm")


def _node_ready(core: k8s.CoreV1Api, name: str) -> Any:
    node = core.read_node(name)
    ready = any(c.type == "Ready" and c.status == "True" for c in node.status.conditions or [])
    return node if ready else None


def _pod(name: str, node_selector: dict[str, str] | None = None) -> k8s.V1Pod:
    return k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name),
        spec=k8s.V1PodSpec(
            containers=[
                k8s.V1Container(
                    name="c",
                    image=BUSYBOX_IMAGE,
                    image_pull_policy="Never",
                    command=["sh", "-c", "echo ran on $(hostname); sleep 3600"],
                )
            ],
            tolerations=[k8s.V1Toleration(key=CONTROL_PLANE_TAINT, operator="Exists", effect="NoSchedule")],
            node_selector=node_selector,
            termination_grace_period_seconds=0,
            automount_service_account_token=False,
        ),
    )


def test_kubeadm_wrote_its_layout(cluster: KubeadmCluster) -> None:
    """Static pod manifests, kubeconfigs and PKI where kubeadm puts them, each manifest on the image
    kubeadm names for 1.37.2 and each component on its kubeconfig."""
    cp = cluster.control_plane
    assert cp is not None
    listed = set(cp.sh("cd /etc/kubernetes && find . -type f | sort").split())
    for path in (
        "admin.conf",
        "super-admin.conf",
        "scheduler.conf",
        "controller-manager.conf",
        "kubelet.conf",
        "pki/ca.crt",
        "pki/ca.key",
        "pki/apiserver.crt",
        "pki/apiserver-kubelet-client.crt",
        "pki/front-proxy-ca.crt",
        "pki/sa.key",
        "pki/sa.pub",
        "pki/etcd/ca.crt",
        "pki/etcd/server.crt",
        *(f"manifests/{pod}.yaml" for pod in STATIC_PODS),
    ):
        assert f"./{path}" in listed, f"/etc/kubernetes/{path} missing; kubeadm wrote {sorted(listed)}"
    images = set(cluster.artifacts.kubeadm_images)
    for pod in STATIC_PODS:
        manifest = yaml.safe_load(cp.sh(f"cat /etc/kubernetes/manifests/{pod}.yaml"))
        container = manifest["spec"]["containers"][0]
        assert container["image"] in images, f"{pod}: {container['image']} is not one of {sorted(images)}"
        assert container["command"][0] == pod
    scheduler = yaml.safe_load(cp.sh("cat /etc/kubernetes/manifests/kube-scheduler.yaml"))
    command = scheduler["spec"]["containers"][0]["command"]
    assert "--kubeconfig=/etc/kubernetes/scheduler.conf" in command, command
    assert scheduler["spec"]["containers"][0]["image"] == f"registry.k8s.io/kube-scheduler:v{VERSION}"
    # the apiserver certificate names the addresses the nodes and this machine dial
    certificate = cp.sh("cat /etc/kubernetes/pki/apiserver.crt")
    sans = subprocess.run(
        ["openssl", "x509", "-noout", "-ext", "subjectAltName"],
        input=certificate,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for address in ("10.0.2.2", "127.0.0.1", "10.96.0.1"):
        assert f"IP Address:{address}" in sans, sans


def _check_containerd_dump(host: KubeadmHost, artifacts: K8sArtifacts) -> None:
    """containerd ignores keys it does not know: its own dump shows that ours are the ones it uses."""
    dump = tomllib.loads(host.sh("containerd config dump"))
    if dump["version"] == 3:  # containerd 2
        images = dump["plugins"]["io.containerd.cri.v1.images"]
        runtime = dump["plugins"]["io.containerd.cri.v1.runtime"]
        sandbox, cni_dirs = images["pinned_images"]["sandbox"], runtime["cni"]["bin_dirs"]
    else:  # containerd 1.x: one CRI plugin
        runtime = dump["plugins"]["io.containerd.grpc.v1.cri"]
        sandbox, cni_dirs = runtime["sandbox_image"], [runtime["cni"]["bin_dir"]]
    assert sandbox in artifacts.kubeadm_images, sandbox
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert runtime["restrict_oom_score_adj"] is True
    assert "/usr/lib/cni" in cni_dirs


def test_containerd_2_took_the_configuration(cluster: KubeadmCluster) -> None:
    assert cluster.control_plane is not None
    _check_containerd_dump(cluster.control_plane, cluster.artifacts)
    assert tomllib.loads(cluster.control_plane.sh("containerd config dump"))["version"] == 3


def test_control_plane_runs_as_mirror_pods_on_containerd_2(
    cluster: KubeadmCluster, core: k8s.CoreV1Api
) -> None:
    cp = cluster.control_plane
    assert cp is not None
    node = wait_for(f"node {cp.hostname} Ready", lambda: _node_ready(core, cp.hostname), 180, interval=1)
    info = node.status.node_info
    assert info.kubelet_version == f"v{VERSION}"
    assert info.container_runtime_version.startswith("containerd://2.1."), info.container_runtime_version
    assert CONTROL_PLANE_TAINT in {t.key for t in node.spec.taints or []}
    version = k8s.VersionApi(core.api_client).get_code()
    assert version.git_version == f"v{VERSION}"

    def all_running() -> Any:
        pods = {p.metadata.name: p for p in core.list_namespaced_pod("kube-system").items}
        wanted = [pods.get(f"{name}-{cp.hostname}") for name in STATIC_PODS]
        return wanted if all(p is not None and p.status.phase == "Running" for p in wanted) else None

    pods = wait_for("the control plane's static pods Running", all_running, 180, interval=1)
    for pod in pods:
        # a mirror pod: the kubelet runs it from /etc/kubernetes/manifests, the API server only shows it
        assert "kubernetes.io/config.mirror" in (pod.metadata.annotations or {}), pod.metadata.name
    # the kubelet and containerd use systemd cgroups: the pods' cgroups are systemd slices
    assert "cgroupDriver: systemd" in cp.sh("cat /var/lib/kubelet/config.yaml")
    slices = cp.sh("systemctl list-units --type=slice --no-legend --plain | awk '{print $1}'")
    assert "kubepods.slice" in slices.split(), slices


def test_scheduler_places_a_pod_on_the_control_plane(
    cluster: KubeadmCluster, core: k8s.CoreV1Api, namespace: str
) -> None:
    cp = cluster.control_plane
    assert cp is not None
    core.create_namespaced_pod(namespace, _pod("on-cp"))
    pod = running(core, namespace, "on-cp")
    assert pod.spec.node_name == cp.hostname
    scheduled = [c for c in pod.status.conditions if c.type == "PodScheduled"]
    assert scheduled and scheduled[0].status == "True"
    events = core.list_namespaced_event(namespace, field_selector="involvedObject.name=on-cp").items
    assert any(e.reason == "Scheduled" and e.reporting_component == "default-scheduler" for e in events), [
        (e.reason, e.reporting_component) for e in events
    ]


def test_worker_joins_on_containerd_1_7_and_runs_a_pod(
    cluster: KubeadmCluster, core: k8s.CoreV1Api, namespace: str
) -> None:
    try:
        worker = cluster.join("w1", "1.7")
    except (HostError, ClusterError) as err:
        pytest.fail(f"kubeadm join: {err}")
    node = wait_for(
        f"node {worker.hostname} Ready", lambda: _node_ready(core, worker.hostname), 180, interval=1
    )
    info = node.status.node_info
    assert info.kubelet_version == f"v{VERSION}"
    assert info.container_runtime_version.startswith("containerd://1.7."), info.container_runtime_version
    core.create_namespaced_pod(namespace, _pod("on-w1", {"kubernetes.io/hostname": worker.hostname}))
    pod = running(core, namespace, "on-w1")
    assert pod.spec.node_name == worker.hostname
    assert "cgroupDriver: systemd" in worker.sh("cat /var/lib/kubelet/config.yaml")
    _check_containerd_dump(worker, cluster.artifacts)


def test_machine_sysctls_unchanged(cluster: KubeadmCluster, machine_sysctls: dict[str, str]) -> None:
    """The kubelets set these in their hosts; none may reach this machine."""
    assert _sysctls() == machine_sysctls


def test_teardown_leaves_nothing(cluster: KubeadmCluster) -> None:
    cluster.close()
    left = podman("ps", "-a", "-q", "--filter", f"label={LABEL}={cluster.id}").stdout.split()
    volumes = podman("volume", "ls", "-q", "--filter", f"label={LABEL}={cluster.id}").stdout.split()
    assert not left and not volumes, (left, volumes)
    assert not cluster.dir.exists()
    cluster.close()  # the fixture closes it again at module end: harmless
