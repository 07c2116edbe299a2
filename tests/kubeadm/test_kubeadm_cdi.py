"""Issue 32 item 5: CDI end to end on a kubeadm worker (kubelet 1.37.2, containerd 1.7 from Debian trixie).

Real: the kubelet passing the device plugin's CDI device names to containerd over CRI, containerd 1.7's CDI
injection (turned on by the toolkit role's drop-in: 1.7 ships ``enable_cdi = false``), runc running the
specification's hooks, the toolkit role itself (packages from the signed stand-in repository, containerd
drop-in, ``nvidia-ctk cdi generate``), the device plugin (the gpufleet image, a pod on the worker).
Simulated: the GPUs (the simulator's NVML and device nodes of ``pcie-2x-t4``) and NVIDIA's programs
(``nvidia-ctk`` and ``nvidia-cdi-hook`` are the stand-ins of gpufleet_harness.testhosts.nvidia_packages,
which lay the specification out as nvidia-ctk 1.17 does).

The plugin runs with ``allocate.cdi.enabled`` and without device specs, and runc stays containerd's default
runtime (no NVIDIA runtime in the way): the GPU pod's device nodes and the specification's mounts and
environment can only come from containerd's CDI injection of the names the plugin returned.

Opt-in with the other kubeadm tests (tests/kubeadm/conftest.py); the tests build on each other in order.
"""

from __future__ import annotations

import json
import tempfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kadm_ansible import inventory, run_plays
from kadm_kube import core_api, kubeadm_cluster, new_namespace, running
from kubernetes import client as k8s

from gpufleet_harness.cluster import images
from gpufleet_harness.cluster.cri import stream_import
from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.node import BUSYBOX_IMAGE
from gpufleet_harness.cluster.process import ClusterError, wait_for
from gpufleet_harness.lab.hostsetup import DEVICES_UNIT, copy_in, stage_sim, write_in
from gpufleet_harness.lab.kubeadm import KubeadmCluster, KubeadmHost
from gpufleet_harness.lab.spec import SIM_DIR
from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.testhosts import aptrepo, molecule

pytestmark = [pytest.mark.root, pytest.mark.kubeadm]
VERSION = "1.37.2"
FIXTURE = "pcie-2x-t4"
TOOLKIT = "1.17.8-1"
SPEC = "/etc/cdi/nvidia.yaml"
PLUGIN = "gpufleet-device-plugin-cdi"


@pytest.fixture(scope="module")
def cluster(artifacts: K8sArtifacts) -> Iterator[KubeadmCluster]:
    with kubeadm_cluster(artifacts, ("w1", "1.7")) as made:
        yield made


@pytest.fixture(scope="module")
def worker(cluster: KubeadmCluster) -> KubeadmHost:
    return next(h for h in cluster.hosts if h.container.endswith("-w1"))


@pytest.fixture(scope="module")
def core(cluster: KubeadmCluster) -> Iterator[k8s.CoreV1Api]:
    with core_api(cluster) as api:
        yield api


@pytest.fixture(scope="module")
def simulated_gpus(worker: KubeadmHost) -> dict[str, Any]:
    """The simulated driver on the worker, as the lab installs it: /etc/gpufleet-sim and /dev/nvidia*."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-kadm-sim-") as tmp:
        root = stage_sim(FIXTURE, Path(tmp), simbuild.build_library())
        machine = json.loads((root / "machine.json").read_text())
        copy_in(worker.container, root, SIM_DIR)
    write_in(
        worker.container, "/etc/systemd/system/gpufleet-sim-devices.service", DEVICES_UNIT.format(sim=SIM_DIR)
    )
    worker.sh("systemctl daemon-reload && systemctl enable -q --now gpufleet-sim-devices.service")
    assert worker.sh("ls /dev | grep -c '^nvidia[0-9]'").strip() == str(len(machine["gpus"]))
    return machine


@pytest.fixture(scope="module")
def repo_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    repo = aptrepo.build_repo(tmp_path_factory.mktemp("stand-in-repo") / "apt-repo")
    with molecule.served_repo(repo) as (_repo, url):
        yield url


@pytest.fixture(scope="module")
def toolkit(
    worker: KubeadmHost,
    repo_url: str,
    simulated_gpus: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    where = tmp_path_factory.mktemp("toolkit")
    hosts = inventory(where, {worker.hostname: worker}, {"gpu_nodes": [worker.hostname]})
    role_vars = {
        "nvidia_container_toolkit_apt_repo_url": f"{repo_url}/libnvidia-container/stable/deb/amd64",
        "nvidia_container_toolkit_key_url": f"{repo_url}/gpgkey",
        "nvidia_container_toolkit_version": TOOLKIT,
        # runc stays the default runtime: no NVIDIA runtime hook between the pod and the proof
        "nvidia_container_toolkit_default_runtime": False,
        # a simulated driver has no nvidia.ko in modules.dep: auto would (rightly) leave the spec alone
        "nvidia_container_toolkit_cdi_spec": "always",
    }
    play = [
        {
            "name": "toolkit",
            "hosts": "gpu_nodes",
            "gather_facts": True,
            "vars": role_vars,
            "roles": ["nvidia_container_toolkit"],
        }
    ]

    def run(*args: str, **over: Any) -> Any:
        return run_plays([{**play[0], "vars": {**role_vars, **over}}], hosts, where, args=args)

    return run


def test_toolkit_role_turns_on_containerd_s_cdi_and_writes_nvidia_s_spec(
    worker: KubeadmHost, toolkit: Any, simulated_gpus: dict[str, Any]
) -> None:
    dump_before = worker.sh("containerd config dump")
    assert "enable_cdi = false" in dump_before, "containerd 1.7 ships CDI off"
    run = toolkit()
    assert run.rc == 0, "\n".join(run.failed()) + run.output
    containerd = run.result(
        "Ensure containerd offers the nvidia runtime through a drop-in, keeping the existing CRI settings",
        worker.hostname,
    )
    assert containerd["cdi"] == {
        "supported": True,
        "enabled": True,
        "spec_dirs": ["/etc/cdi", "/var/run/cdi"],
    }
    cri = _toml(worker.sh("containerd config dump"))["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == ["/etc/cdi", "/var/run/cdi"]
    assert cri["containerd"]["default_runtime_name"] == "runc"
    # the specification, laid out as nvidia-ctk writes it, for the simulated GPUs
    spec = yaml.safe_load(worker.sh(f"cat {SPEC}"))
    assert spec["cdiVersion"] == "0.5.0" and spec["kind"] == "nvidia.com/gpu"
    gpus = simulated_gpus["gpus"]
    names = [d["name"] for d in spec["devices"]]
    assert names == [n for i, g in enumerate(gpus) for n in (str(i), g["uuid"])] + ["all"]
    by_name = {d["name"]: d["containerEdits"] for d in spec["devices"]}
    for index, gpu in enumerate(gpus):
        nodes = [{"path": f"/dev/nvidia{gpu['minor']}"}]
        assert by_name[str(index)] == by_name[gpu["uuid"]] == {"deviceNodes": nodes}
    common = spec["containerEdits"]
    assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert {"path": "/dev/nvidiactl"} in common["deviceNodes"]
    assert {h["args"][1] for h in common["hooks"]} == {"create-symlinks", "update-ldcache"}
    assert all(
        h["hookName"] == "createContainer" and h["path"] == "/usr/bin/nvidia-cdi-hook"
        for h in common["hooks"]
    )
    listed = worker.sh("nvidia-ctk cdi list 2>/dev/null").split()
    assert listed == [f"nvidia.com/gpu={n}" for n in names]
    again = toolkit()
    assert again.rc == 0 and again.changed(worker.hostname) == [], again.changed(worker.hostname)


def _toml(text: str) -> dict[str, Any]:
    return tomllib.loads(text)


def _load_plugin_image(worker: KubeadmHost) -> str:
    image = images.ensure_lab_image()
    present = worker.sh("ctr --namespace k8s.io images ls -q")
    if image.name not in present:
        argv = [
            "podman",
            "exec",
            "-i",
            worker.container,
            "ctr",
            "--namespace",
            "k8s.io",
            "images",
            "import",
            "-",
        ]
        rc, said = stream_import(argv, image.name, image.tarball, list(images.IMPORT_CHANGES))
        assert rc == 0, said
    return image.name


def test_a_pod_gets_its_gpu_through_the_cdi_names_the_plugin_returns(
    worker: KubeadmHost, core: k8s.CoreV1Api, simulated_gpus: dict[str, Any]
) -> None:
    namespace = new_namespace(core, "kadm-cdi")
    image = _load_plugin_image(worker)
    env = {
        "GPUFLEET_SIM_ROOT": SIM_DIR,
        "LD_LIBRARY_PATH": f"{SIM_DIR}/lib",
        "GPUFLEET_HOST_ROOT": f"{SIM_DIR}/host",
    }
    plugin = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": PLUGIN},
        "spec": {
            "nodeName": worker.hostname,
            "containers": [
                {
                    "name": "plugin",
                    "image": image,
                    "imagePullPolicy": "Never",
                    "args": [
                        "--node-name",
                        worker.hostname,
                        "--allocate-cdi-enabled",
                        "true",
                        "--allocate-pass-device-specs",
                        "false",
                        "--labels-enabled",
                        "false",
                        "--health-enabled",
                        "false",
                    ],
                    "env": [{"name": k, "value": v} for k, v in env.items()],
                    "volumeMounts": [
                        {"name": "sockets", "mountPath": "/var/lib/kubelet/device-plugins"},
                        {"name": "sim", "mountPath": SIM_DIR, "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "sockets", "hostPath": {"path": "/var/lib/kubelet/device-plugins"}},
                {"name": "sim", "hostPath": {"path": SIM_DIR}},
            ],
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 5,
        },
    }
    core.create_namespaced_pod(namespace, plugin)
    count = len(simulated_gpus["gpus"])

    def advertised() -> Any:
        node = core.read_node(worker.hostname)
        return (node.status.allocatable or {}).get("nvidia.com/gpu") == str(count)

    try:
        wait_for(f"{worker.hostname} advertising {count} nvidia.com/gpu", advertised, 240, interval=2)
    except ClusterError as err:
        said = worker.sh("tail -n 30 /var/log/pods/*gpufleet-device-plugin-cdi*/plugin/*.log", check=False)
        raise AssertionError(f"{err}; the plugin said:\n{said}") from None
    script = (
        "ls -l /dev | grep nvidia | awk '{print $NF}'; echo env=$NVIDIA_VISIBLE_DEVICES; "
        f"grep -c ' {SIM_DIR} ' /proc/self/mounts; echo done; sleep 3600"
    )
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "gpu-1"},
        "spec": {
            "containers": [
                {
                    "name": "c",
                    "image": BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["sh", "-c", script],
                    "resources": {"limits": {"nvidia.com/gpu": "1"}},
                }
            ],
            "nodeSelector": {"kubernetes.io/hostname": worker.hostname},
            "automountServiceAccountToken": False,
            "terminationGracePeriodSeconds": 0,
        },
    }
    core.create_namespaced_pod(namespace, pod)

    got = running(core, namespace, "gpu-1")
    uid = got.metadata.uid
    log = f"/var/log/pods/{namespace}_gpu-1_{uid}/c/0.log"
    said = wait_for(
        "the GPU pod's output",
        lambda: "done" in worker.sh(f"cat {log}", check=False) and worker.sh(f"cat {log}"),
        60,
        interval=1,
    )
    lines = [line.split(" ", 3)[3] for line in said.splitlines() if line.count(" ") >= 3]
    devices = [line for line in lines if line.startswith("nvidia")]
    gpu = [d for d in devices if d[len("nvidia") :].isdigit()]
    assert len(gpu) == 1, f"one GPU's node, from the CDI spec: {devices}"
    assert {"nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset"} <= set(devices), devices
    assert "env=void" in lines, "NVIDIA_VISIBLE_DEVICES from the spec's common edits"
    assert "1" in lines, f"{SIM_DIR} mounted by the spec"
    # the container's OCI spec, as containerd wrote it: the injected devices and nvidia-cdi-hook's hooks
    container_id = got.status.container_statuses[0].container_id.split("://", 1)[1]
    info = json.loads(worker.sh(f"ctr --namespace k8s.io containers info {container_id}"))
    oci = info["Spec"]
    injected = {d["path"] for d in oci["linux"]["devices"]}
    assert f"/dev/{gpu[0]}" in injected and "/dev/nvidiactl" in injected
    hooks = oci["hooks"]["createContainer"]
    assert [h["args"][1] for h in hooks] == ["create-symlinks", "update-ldcache"]
    assert container_id in worker.sh("cat /var/log/nvidia-cdi-hook.log"), "runc ran the spec's hooks"
    # which GPU: the kubelet gave the pod the device the plugin allocated, by its CDI name (the UUID)
    minor = int(gpu[0][len("nvidia") :])
    uuid = next(g["uuid"] for g in simulated_gpus["gpus"] if g["minor"] == minor)
    checkpoint = worker.sh("cat /var/lib/kubelet/device-plugins/kubelet_internal_checkpoint")
    assert uuid in checkpoint
    core.delete_namespace(namespace)
