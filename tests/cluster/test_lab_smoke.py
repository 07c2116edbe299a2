"""Smoke tests of the lab cluster: the API quirks and kubelet behaviours the project's tests rely on."""

from __future__ import annotations

import contextlib
import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes.client.rest import ApiException
from kubernetes.stream import stream
from lab_deviceplugin import FakeDevicePlugin, load_api
from lab_extender import PassThroughExtender

from gpufleet_harness.cluster.cluster import ControlPlane, Scheduler, TestCluster, wait_for_pod_phase
from gpufleet_harness.cluster.k8s_build import DEFAULT_K8S_VERSION
from gpufleet_harness.cluster.node import BUSYBOX_IMAGE, PAUSE_IMAGE, KubeletNode
from gpufleet_harness.cluster.process import ClusterError, wait_for

pytestmark = pytest.mark.cluster
# The build the session runs: DEFAULT_K8S_VERSION unless GPUFLEET_K8S_VERSION picks another (1.20: Debian's).
_ASKED = os.environ.get("GPUFLEET_K8S_VERSION") or DEFAULT_K8S_VERSION
EXPECTED_VERSION = "v1.20.2" if _ASKED.startswith("1.20") else f"v{_ASKED.removeprefix('v')}"


def _pod(
    name: str,
    image: str = PAUSE_IMAGE,
    *,
    limits: dict[str, str] | None = None,
    command: list[str] | None = None,
    mounts: dict[str, str] | None = None,
    **spec: Any,
) -> k8s.V1Pod:
    container = k8s.V1Container(
        name="c",
        image=image,
        image_pull_policy="Never",  # no registry: images are imported into the node's runtime
        command=command,
        resources=k8s.V1ResourceRequirements(limits=limits) if limits else None,
        volume_mounts=[k8s.V1VolumeMount(mount_path=p, name=v) for p, v in (mounts or {}).items()] or None,
    )
    return k8s.V1Pod(metadata=k8s.V1ObjectMeta(name=name), spec=k8s.V1PodSpec(containers=[container], **spec))


def _plain(obj: Any) -> Any:
    """A client model as the API's JSON (camelCase dicts): assertions read the wire format."""
    return k8s.ApiClient().sanitize_for_serialization(obj)


def _node_allocatable(core: k8s.CoreV1Api, node: str, resource: str) -> str | None:
    allocatable = _plain(core.read_node(node))["status"].get("allocatable", {})
    return allocatable.get(resource)  # type: ignore[no-any-return]


def _pod_node(core: k8s.CoreV1Api, pod: str, namespace: str) -> str | None:
    return _plain(core.read_namespaced_pod(pod, namespace))["spec"].get("nodeName")  # type: ignore[no-any-return]


# -- control plane ----------------------------------------------------------------------------------------


def test_control_plane_reports_built_version(control_plane: ControlPlane) -> None:
    version = k8s.VersionApi(control_plane.api_client()).get_code()
    assert version.git_version == control_plane.cluster.artifacts.git_version == EXPECTED_VERSION


def test_fake_node_status_patch_sets_capacity_ready_and_no_taint(
    core: k8s.CoreV1Api, fake_node: Callable[..., k8s.V1Node]
) -> None:
    fake_node("fake-gpu-a", {"nvidia.com/gpu": 2, "example.com/gpu-mem": 32}, labels={"gpu": "true"},
              annotations={"gpufleet.io/gpus": "[]"})  # fmt: skip
    node = _plain(core.read_node("fake-gpu-a"))
    assert node["status"]["capacity"]["nvidia.com/gpu"] == "2"
    assert node["status"]["allocatable"]["example.com/gpu-mem"] == "32"
    assert [(c["type"], c["status"]) for c in node["status"]["conditions"]] == [("Ready", "True")]
    assert not node["spec"].get("taints")
    assert node["metadata"]["labels"]["gpu"] == "true"
    assert node["metadata"]["annotations"]["gpufleet.io/gpus"] == "[]"


def test_the_extenders_node_reads_get_metadata_only(
    core: k8s.CoreV1Api, control_plane: ControlPlane, fake_node: Callable[..., k8s.V1Node]
) -> None:
    """KubeCluster lists and watches Nodes with an Accept asking for PartialObjectMetadata (its fallback,
    plain JSON, would work too and hide a server that ignores the ask): 1.37 (as 1.20) serves the list as
    PartialObjectMetadataList and watch events as PartialObjectMetadata, annotations in, status out."""
    from gpufleet.extender.kube import NODE_LIST_ACCEPT, NODE_WATCH_ACCEPT, KubeCluster

    fake_node("fake-meta", {"nvidia.com/gpu": 1}, annotations={"gpufleet.io/gpus": "[]"})
    source = KubeCluster(control_plane.api_client())
    listed = source._request("list", "GET", "/api/v1/nodes", accept=NODE_LIST_ACCEPT)
    assert (listed["kind"], listed["apiVersion"]) == ("PartialObjectMetadataList", "meta.k8s.io/v1")
    item = next(i for i in listed["items"] if i["metadata"]["name"] == "fake-meta")
    assert set(item) == {"kind", "apiVersion", "metadata"}
    assert item["metadata"]["annotations"]["gpufleet.io/gpus"] == "[]"
    version = listed["metadata"]["resourceVersion"]
    core.patch_node("fake-meta", {"metadata": {"annotations": {"gpufleet.io/probe": "1"}}})
    query = {"watch": "true", "resourceVersion": version, "timeoutSeconds": 5}
    watch = source._request("watch", "GET", "/api/v1/nodes", query, accept=NODE_WATCH_ACCEPT, stream=True)
    try:
        events = [json.loads(line) for line in watch if line.strip()]
    finally:
        watch.release_conn()
    ours = [e["object"] for e in events if e["object"]["metadata"]["name"] == "fake-meta"]
    assert ours and all(o["kind"] == "PartialObjectMetadata" and "status" not in o for o in ours)
    assert ours[-1]["metadata"]["annotations"]["gpufleet.io/probe"] == "1"


def test_pod_binding_needs_preload_content_false(
    core: k8s.CoreV1Api, fake_node: Callable[..., k8s.V1Node], namespace: str
) -> None:
    fake_node("fake-bind", {"nvidia.com/gpu": 2})
    for name in ("bind-raw", "bind-model"):
        # a scheduler nobody runs keeps the pods Pending for a manual binding
        core.create_namespaced_pod(
            namespace, _pod(name, limits={"nvidia.com/gpu": "1"}, scheduler_name="nobody")
        )

    def binding(pod: str) -> k8s.V1Binding:
        target = k8s.V1ObjectReference(api_version="v1", kind="Node", name="fake-bind")
        return k8s.V1Binding(metadata=k8s.V1ObjectMeta(name=pod), target=target)

    reply: Any = core.create_namespaced_pod_binding(
        "bind-raw", namespace, binding("bind-raw"), _preload_content=False
    )
    assert reply.status == 201
    assert json.loads(reply.data)["status"] == "Success"
    assert _pod_node(core, "bind-raw", namespace) == "fake-bind"
    # The quirk itself: deserialising the Status reply as a V1Binding fails although the binding happened.
    with pytest.raises(ValueError, match="target"):
        core.create_namespaced_pod_binding("bind-model", namespace, binding("bind-model"))
    assert _pod_node(core, "bind-model", namespace) == "fake-bind"


def test_controller_manager_creates_replicaset_pods(control_plane: ControlPlane, namespace: str) -> None:
    apps = k8s.AppsV1Api(control_plane.api_client())
    labels = {"app": "web"}
    template = k8s.V1PodTemplateSpec(
        metadata=k8s.V1ObjectMeta(labels=labels),
        spec=k8s.V1PodSpec(
            containers=[k8s.V1Container(name="web", image=PAUSE_IMAGE)], scheduler_name="nobody"
        ),
    )
    spec = k8s.V1DeploymentSpec(
        replicas=2, selector=k8s.V1LabelSelector(match_labels=labels), template=template
    )
    apps.create_namespaced_deployment(
        namespace, k8s.V1Deployment(metadata=k8s.V1ObjectMeta(name="web"), spec=spec)
    )
    core = control_plane.core_v1()
    pods = wait_for(
        "2 pods from the Deployment",
        lambda: len(core.list_namespaced_pod(namespace, label_selector="app=web").items) == 2,
        30,
        interval=0.2,
    )
    assert pods


def test_least_privilege_service_account_can_patch_node_status_only(
    control_plane: ControlPlane, fake_node: Callable[..., k8s.V1Node], namespace: str
) -> None:
    fake_node("fake-rbac", {"nvidia.com/gpu": 1})
    admin = control_plane.api_client()
    core, rbac = k8s.CoreV1Api(admin), k8s.RbacAuthorizationV1Api(admin)
    core.create_namespaced_service_account(
        namespace, k8s.V1ServiceAccount(metadata=k8s.V1ObjectMeta(name="plugin"))
    )
    role = f"{namespace}-node-status"
    rule = k8s.V1PolicyRule(api_groups=[""], resources=["nodes", "nodes/status"], verbs=["get", "patch"])
    rbac.create_cluster_role(k8s.V1ClusterRole(metadata=k8s.V1ObjectMeta(name=role), rules=[rule]))
    rbac.create_cluster_role_binding(k8s.V1ClusterRoleBinding(
        metadata=k8s.V1ObjectMeta(name=role),
        role_ref=k8s.V1RoleRef(api_group="rbac.authorization.k8s.io", kind="ClusterRole", name=role),
        subjects=[k8s.RbacV1Subject(kind="ServiceAccount", name="plugin", namespace=namespace)],
    ))  # fmt: skip
    try:
        token = control_plane.service_account_token(namespace, "plugin")
        as_plugin = k8s.CoreV1Api(control_plane.api_client(token=token))
        patch = [{"op": "add", "path": "/status/capacity/example.com~1gpu-mem", "value": "16"}]
        patched = _plain(as_plugin.patch_node_status("fake-rbac", patch))
        assert patched["status"]["capacity"]["example.com/gpu-mem"] == "16"
        with pytest.raises(ApiException) as denied:
            as_plugin.list_namespaced_pod("kube-system")
        assert denied.value.status == 403
        with pytest.raises(ApiException) as denied:
            as_plugin.delete_node("fake-rbac")
        assert denied.value.status == 403
    finally:
        rbac.delete_cluster_role_binding(role)
        rbac.delete_cluster_role(role)


# -- scheduler + extender ---------------------------------------------------------------------------------


def test_extender_sees_filter_calls_only_for_pods_with_managed_resource(
    core: k8s.CoreV1Api,
    fake_node: Callable[..., k8s.V1Node],
    scheduler_factory: Callable[..., Scheduler],
    namespace: str,
) -> None:
    pool = {"gpufleet.io/test-pool": namespace}
    fake_node("fake-ext-1", {"example.com/gpu-mem": 32}, labels=pool)
    fake_node("fake-ext-2", {"example.com/gpu-mem": 32}, labels=pool)
    extender = PassThroughExtender(("example.com/gpu-mem",)).start()
    try:
        scheduler_factory(extender.config())
        # 64 > any node's 32: only schedulable because the extender owns the resource (ignoredByScheduler)
        core.create_namespaced_pod(
            namespace, _pod("gpumem", limits={"example.com/gpu-mem": "64"}, node_selector=pool)
        )
        core.create_namespaced_pod(namespace, _pod("plain", node_selector=pool))

        for pod in ("gpumem", "plain"):
            node = wait_for(f"{pod} bound", functools.partial(_pod_node, core, pod, namespace), 30)
            assert node in ("fake-ext-1", "fake-ext-2")
        calls = extender.calls_for("gpumem")
        assert calls, f"extender never called for gpumem; calls: {extender.calls}"
        assert set(calls[0].nodes) == {"fake-ext-1", "fake-ext-2"}
        assert calls[0].namespace == namespace
        assert not extender.calls_for("plain"), "extender called for a pod without a managed resource"
    finally:
        extender.stop()


# -- real kubelet node ------------------------------------------------------------------------------------


def test_kubelet_node_is_ready_on_its_veth_address(core: k8s.CoreV1Api, kubelet_node: KubeletNode) -> None:
    node = _plain(core.read_node(kubelet_node.name))
    assert [c["status"] for c in node["status"]["conditions"] if c["type"] == "Ready"] == ["True"]
    addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
    assert addresses["InternalIP"] == kubelet_node.node_ip
    assert node["status"]["nodeInfo"]["kubeletVersion"] == EXPECTED_VERSION
    # containerd (Debian 12's 1.6) through CRI: v1, the only CRI a kubelet speaks from 1.26
    assert node["status"]["nodeInfo"]["containerRuntimeVersion"].startswith("containerd://1.6")
    assert not [t for t in node["spec"].get("taints", []) if t["key"] == "node.kubernetes.io/not-ready"]
    assert node["metadata"]["labels"]["gpufleet.io/lab-node"] == "true"
    assert kubelet_node.kubelet_socket.is_socket()


def _busybox_runs_and_exec_works(core: k8s.CoreV1Api, node: KubeletNode, namespace: str, name: str) -> None:
    """A pod's log and ``kubectl exec`` (the kubelet proxies the runtime's streaming server) on ``node``."""
    command = ["/bin/sh", "-c", "echo started-$((6*7)); exec sleep 3600"]
    core.create_namespaced_pod(
        namespace, _pod(name, BUSYBOX_IMAGE, command=command, node_name=node.name,
                        termination_grace_period_seconds=0),
    )  # fmt: skip
    wait_for_pod_phase(core, name, namespace, {"Running"}, 90)
    logs = wait_for("pod log", lambda: core.read_namespaced_pod_log(name, namespace), 30, interval=0.2)
    assert "started-42" in logs
    out = stream(core.connect_get_namespaced_pod_exec, name, namespace,
                 command=["sh", "-c", "echo exec-$((7*6)) $(cat /proc/1/comm)"],
                 stdout=True, stderr=True, stdin=False, tty=False)  # fmt: skip
    assert out.strip() == "exec-42 sleep"


def test_busybox_pod_runs_and_exec_works(
    core: k8s.CoreV1Api, kubelet_node: KubeletNode, namespace: str
) -> None:
    _busybox_runs_and_exec_works(core, kubelet_node, namespace, "bb")
    pod = _plain(core.read_namespaced_pod("bb", namespace))
    # the pod network is containerd's CNI bridge (cri.CNI_CONFLIST), not the node's address
    assert pod["status"]["podIP"].startswith("10.88."), pod["status"]
    assert pod["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")


def test_dockershim_only_with_1_20(core: k8s.CoreV1Api, lab: TestCluster, namespace: str) -> None:
    """dockershim left the kubelet in 1.24: the harness refuses a docker node on a current build, naming
    why, before it starts anything. With the opt-in 1.20 build it is still a choice (``runtime="docker"``)
    and a short-lived node runs a pod."""
    assert lab.control_plane is not None
    if not lab.control_plane.legacy:
        with pytest.raises(ClusterError, match=r"dockershim, removed in Kubernetes 1\.24"):
            lab.start_kubelet_node("lab-dockershim", runtime="docker")
        assert not [n for n in lab.nodes if n.name == "lab-dockershim"]
        with pytest.raises(ApiException) as absent:
            core.read_node("lab-dockershim")
        assert absent.value.status == 404
        return
    node = lab.start_kubelet_node("lab-dockershim", runtime="docker")
    try:
        info = _plain(core.read_node(node.name))["status"]["nodeInfo"]
        assert info["containerRuntimeVersion"].startswith("docker://20.10"), info
        _busybox_runs_and_exec_works(core, node, namespace, "bb-docker")
        pod = _plain(core.read_namespaced_pod("bb-docker", namespace))
        assert pod["status"]["containerStatuses"][0]["containerID"].startswith("docker://")
    finally:
        with contextlib.suppress(ApiException):
            core.delete_namespaced_pod("bb-docker", namespace, grace_period_seconds=0)
        node.stop()
        # no kubelet keeps it any more: DaemonSets of later tests must not target it
        core.delete_node(node.name)


def test_device_plugin_registers_capacity_and_allocates(
    core: k8s.CoreV1Api, kubelet_node: KubeletNode, namespace: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    api = load_api()
    plugin = FakeDevicePlugin(api, kubelet_node.device_plugin_dir, "example.com/lab-gpu", 3).start()
    try:
        capacity = wait_for(
            "example.com/lab-gpu on the node",
            lambda: _node_allocatable(core, kubelet_node.name, "example.com/lab-gpu"),
            30,
            interval=0.25,
        )
        assert capacity == "3"
        command = ["/bin/sh", "-c", "echo devices=$LAB_VISIBLE_DEVICES; exec sleep 3600"]
        core.create_namespaced_pod(
            namespace, _pod("dp", BUSYBOX_IMAGE, command=command, node_name=kubelet_node.name,
                            limits={"example.com/lab-gpu": "2"}, termination_grace_period_seconds=0),
        )  # fmt: skip
        wait_for_pod_phase(core, "dp", namespace, {"Running"}, 90)
        assert len(plugin.allocations) == 1 and len(plugin.allocations[0]) == 2
        logs = wait_for("pod log", lambda: core.read_namespaced_pod_log("dp", namespace), 30, interval=0.2)
        assert f"devices={','.join(plugin.allocations[0])}" in logs
    finally:
        plugin.stop()


def test_spawned_process_sees_node_private_var(kubelet_node: KubeletNode, tmp_path: Path) -> None:
    marker = tmp_path / "seen"
    daemon = kubelet_node.spawn("probe", ["sh", "-c", f"ls /var/lib/kubelet/device-plugins > {marker}"])
    daemon.proc.wait(10)
    assert "kubelet.sock" in marker.read_text().split()
    host_path = Path("/var/lib/kubelet/device-plugins/kubelet.sock")
    if host_path.exists():  # some other kubelet on this machine: it must not be ours
        assert not host_path.samefile(kubelet_node.kubelet_socket)


def test_hostpath_pod_shares_the_node_device_plugin_dir(
    core: k8s.CoreV1Api, kubelet_node: KubeletNode, namespace: str
) -> None:
    """What a DaemonSet-deployed plugin relies on: hostPath /var/lib/kubelet/device-plugins is the node's."""
    source = k8s.V1HostPathVolumeSource(path="/var/lib/kubelet/device-plugins")
    command = ["/bin/sh", "-c", f"echo {namespace} > /dp/from-pod; ls /dp"]
    pod = _pod("hostpath", BUSYBOX_IMAGE, command=command, mounts={"/dp": "dp"}, node_name=kubelet_node.name,
               restart_policy="Never", volumes=[k8s.V1Volume(name="dp", host_path=source)])  # fmt: skip
    core.create_namespaced_pod(namespace, pod)
    wait_for_pod_phase(core, "hostpath", namespace, {"Succeeded"}, 90)
    assert "kubelet.sock" in core.read_namespaced_pod_log("hostpath", namespace).split()
    written = kubelet_node.device_plugin_dir / "from-pod"
    assert written.read_text().strip() == namespace
    written.unlink()
