"""Issue 32 item 4: gpu_scheduler_extender wires kube-scheduler on a real kubeadm control plane (Kubernetes
1.37.2 built from its Go modules, containerd 2.1; :mod:`gpufleet_harness.lab.kubeadm`).

The role's scheduler tasks (roles/gpufleet_kubernetes/tasks/scheduler.yml) run on the control-plane host
through the podman connection, with the configuration the module generated on the controller: a v1
KubeSchedulerConfiguration (``clientConnection.kubeconfig`` kubeadm's scheduler.conf, leader election on)
that reaches the extender over HTTPS with a client certificate. The extender is ``gpufleet-extender serve``
on this machine's loopback (HTTPS, client CA required), which the host reaches as 10.0.2.2, running as a
ServiceAccount with the extender's ClusterRole. The kubelet restarts the static pod; the tests check the
Lease, /readyz, and a GPU-memory pod bound by the extender to a kubelet-less GPU node. Then: a second run
changes nothing; --check --diff writes nothing; a configuration kube-scheduler refuses is refused before
anything is written (the image's own kube-scheduler says why) and, with that check off, the crash-looping
scheduler is recognised, the old manifest put back, and the cluster schedules again; removal restores
kubeadm's manifest byte for byte; a manifest another tool changed is merged and its own text restored.

Opt-in with the other kubeadm tests (tests/kubeadm/conftest.py). One cluster for the module; the tests build
on each other in file order.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import ssl
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from kadm_ansible import Run, inventory, run_plays
from kadm_kube import kubeadm_cluster, new_namespace, running
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from gpufleet_harness.cluster import pki
from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.node import BUSYBOX_IMAGE
from gpufleet_harness.cluster.process import Daemon, free_ports, wait_for
from gpufleet_harness.lab.hostsetup import write_in
from gpufleet_harness.lab.kubeadm import KubeadmCluster, KubeadmHost
from gpufleet_harness.lab.spec import GATEWAY

pytestmark = [pytest.mark.root, pytest.mark.kubeadm]
VERSION = "1.37.2"
MANIFEST = "/etc/kubernetes/manifests/kube-scheduler.yaml"
CONFIG_FILE = "/etc/kubernetes/gpufleet-scheduler-config.yaml"
BACKUPS = "/etc/kubernetes/gpufleet-backups"
TLS_DIR = "/etc/kubernetes/gpufleet"
READYZ = "https://127.0.0.1:10259/readyz"
PREFIX = "/gpufleet"
GENERATE = "Generate the scheduler configuration on the controller"
PREVIEW_LATER = "Say that check mode cannot preview the kube-scheduler change before PyYAML is installed"
CONFIGURE = "Ensure kube-scheduler on this control-plane node is configured for the extender"
RULES_FILE = Path(__file__).resolve().parents[2] / "deploy" / "extender" / "rbac.yaml"
GPUS = [
    {
        "index": 0,
        "uuid": "GPU-kadm-a100-0",
        "model": "NVIDIA A100-SXM4-80GB",
        "memory_gib": 80,
        "cc": "8.0",
        "numa": 0,
        "healthy": True,
        "nvlink": {},
    }
]


class State:
    """What the tests hand on to each other."""

    original: str = ""
    holder: str = ""
    pid: int = 0


@pytest.fixture(scope="module")
def cluster(artifacts: K8sArtifacts) -> Iterator[KubeadmCluster]:
    with kubeadm_cluster(artifacts) as made:
        yield made


@pytest.fixture(scope="module")
def cp(cluster: KubeadmCluster) -> KubeadmHost:
    assert cluster.control_plane is not None
    return cluster.control_plane


@pytest.fixture(scope="module")
def api(cluster: KubeadmCluster) -> Iterator[k8s.ApiClient]:
    client = k8s_config.new_client_from_config(config_file=str(cluster.kubeconfig))
    yield client
    client.close()


@pytest.fixture(scope="module")
def core(api: k8s.ApiClient) -> k8s.CoreV1Api:
    return k8s.CoreV1Api(api)


@pytest.fixture(scope="module")
def state() -> State:
    return State()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory, cp: KubeadmHost) -> dict[str, Path]:
    """One CA; the extender's serving certificate for the address the scheduler dials (10.0.2.2) and the
    scheduler's client certificate, which go to the control-plane host as an operator would put them."""
    where = tmp_path_factory.mktemp("tls")
    ca = pki.certificate_authority(where, "gpufleet-extender-ca")
    server = pki.serving_certificate(ca, where, "extender", "gpufleet-extender", [GATEWAY, "127.0.0.1"])
    client = pki.client_certificate(ca, where, "scheduler", "kube-scheduler")
    for source, name, mode in (
        (ca.cert, "ca.crt", 0o644),
        (client.cert, "scheduler.crt", 0o644),
        (client.key, "scheduler.key", 0o600),
    ):
        write_in(cp.container, f"{TLS_DIR}/{name}", source.read_text(), mode)
    return {
        "ca": ca.cert,
        "cert": server.cert,
        "key": server.key,
        "client_cert": client.cert,
        "client_key": client.key,
    }


def _extender_kubeconfig(
    cluster: KubeadmCluster, api: k8s.ApiClient, core: k8s.CoreV1Api, path: Path
) -> Path:
    """A ServiceAccount bound to deploy/extender/rbac.yaml's ClusterRole, with a TokenRequest token."""
    name = f"gpufleet-extender-{secrets.token_hex(3)}"
    rules = next(d for d in yaml.safe_load_all(RULES_FILE.read_text()) if d and d["kind"] == "ClusterRole")[
        "rules"
    ]
    core.create_namespaced_service_account("kube-system", {"metadata": {"name": name}})
    rbac = k8s.RbacAuthorizationV1Api(api)
    rbac.create_cluster_role({"metadata": {"name": name}, "rules": rules})
    rbac.create_cluster_role_binding(
        {
            "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": "kube-system"}],
        }
    )
    token = core.create_namespaced_service_account_token(
        name, "kube-system", {"spec": {"expirationSeconds": 7200}}
    ).status.token
    admin = yaml.safe_load(cluster.kubeconfig.read_text())
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "kadm",
        "clusters": [{"name": "kadm", "cluster": admin["clusters"][0]["cluster"]}],
        "users": [{"name": name, "user": {"token": token}}],
        "contexts": [{"name": "kadm", "context": {"cluster": "kadm", "user": name}}],
    }
    path.write_text(yaml.safe_dump(doc))
    path.chmod(0o600)
    return path


@pytest.fixture(scope="module")
def extender(
    cluster: KubeadmCluster,
    api: k8s.ApiClient,
    core: k8s.CoreV1Api,
    tls: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, Any]]:
    """``gpufleet-extender serve`` on this machine's loopback over HTTPS, client certificates required."""
    where = tmp_path_factory.mktemp("extender")
    kubeconfig = _extender_kubeconfig(cluster, api, core, where / "extender.kubeconfig")
    (port,) = free_ports(1)
    flags = {
        "kubeconfig": str(kubeconfig),
        "listen-address": "127.0.0.1",
        "port": str(port),
        "url-prefix": PREFIX,
        "tls-cert-file": str(tls["cert"]),
        "tls-key-file": str(tls["key"]),
        "tls-client-ca-file": str(tls["ca"]),
        "lock-ttl": "30",
    }
    script = Path(sys.executable).parent / "gpufleet-extender"
    argv = [str(script), "serve", *(a for k, v in flags.items() for a in (f"--{k}", v))]
    daemon = Daemon("gpufleet-extender", argv, where / "extender.log")
    context = ssl.create_default_context(cafile=str(tls["ca"]))
    context.load_cert_chain(str(tls["client_cert"]), str(tls["client_key"]))
    base = f"https://127.0.0.1:{port}"

    def get(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(base + path, timeout=5, context=context) as reply:
                return int(reply.status), reply.read()
        except urllib.error.HTTPError as err:
            return err.code, b""
        except OSError:
            return 0, b""

    try:
        wait_for(
            "the extender's /readyz over HTTPS",
            lambda: get("/readyz")[0] == 200,
            120,
            interval=0.3,
            alive=daemon.check,
        )
        yield {"url": f"https://{GATEWAY}:{port}{PREFIX}", "base": base, "get": get, "daemon": daemon}
    finally:
        daemon.stop()


def _plays(
    extender: dict[str, Any], state: str = "present", content: str | None = None, **scheduler: Any
) -> list[Any]:
    """The controller generates the configuration (the module, as the role's extender task does), then the
    role's scheduler tasks run on the control-plane host. ``content``: hand this text over instead."""
    generate = {
        "name": GENERATE,
        "gpufleet.nvidia.gpu_scheduler_extender": {
            "deploy": False,
            "scheduler_config": {
                "url": extender["url"],
                "ca_file": f"{TLS_DIR}/ca.crt",
                "cert_file": f"{TLS_DIR}/scheduler.crt",
                "key_file": f"{TLS_DIR}/scheduler.key",
            },
        },
        "register": "generated",
    }
    handed = "{{ hostvars['localhost'].generated }}" if content is None else {"scheduler_config": content}
    role_vars = {
        "gpufleet_kubernetes_state": state,
        "gpufleet_kubernetes_extender": handed,
        "gpufleet_kubernetes_scheduler_healthz_url": READYZ,
        "gpufleet_kubernetes_scheduler_wait_timeout": 300,
        **{f"gpufleet_kubernetes_scheduler_{k}": v for k, v in scheduler.items()},
    }
    plays: list[Any] = []
    if content is None:
        plays.append({"name": "controller", "hosts": "localhost", "gather_facts": False, "tasks": [generate]})
    plays.append(
        {
            "name": "control plane",
            "hosts": "kube_control_plane",
            "gather_facts": False,
            "tasks": [
                {
                    "name": "scheduler tasks of gpufleet_kubernetes",
                    "ansible.builtin.include_role": {
                        "name": "gpufleet_kubernetes",
                        "tasks_from": "scheduler.yml",
                    },
                    "vars": role_vars,
                }
            ],
        }
    )
    return plays


@pytest.fixture(scope="module")
def play(cp: KubeadmHost, extender: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    where = tmp_path_factory.mktemp("plays")
    hosts = inventory(where, {cp.hostname: cp}, {"kube_control_plane": [cp.hostname]})

    def run(
        state: str = "present", args: tuple[str, ...] = (), content: str | None = None, **scheduler: Any
    ) -> Run:
        return run_plays(_plays(extender, state, content, **scheduler), hosts, where, args=args)

    return run


def _lease(api: k8s.ApiClient) -> Any:
    return k8s.CoordinationV1Api(api).read_namespaced_lease("kube-scheduler", "kube-system").spec


def _in_host(cp: KubeadmHost, code: str) -> str:
    return cp.sh(f"python3 -c '{code}'", check=False).strip()


READYZ_CODE = (
    "import ssl,urllib.request; c=ssl._create_unverified_context(); "
    f'print(urllib.request.urlopen("{READYZ}", context=c, timeout=5).read().decode())'
)


def _scheduler_pid(cp: KubeadmHost) -> int:
    said = cp.sh("pgrep -x kube-scheduler || true").split()
    return int(said[0]) if len(said) == 1 else 0


def _argv(cp: KubeadmHost) -> list[str]:
    pid = _scheduler_pid(cp)
    return cp.sh(f"cat /proc/{pid}/cmdline | tr '\\0' '\\n'").split() if pid else []


def _scheduling_again(core: k8s.CoreV1Api, cp: KubeadmHost, namespace: str, name: str) -> k8s.V1Pod:
    """A plain pod is placed and runs on the control plane: the cluster is scheduling."""
    pod = k8s.V1Pod(
        metadata=k8s.V1ObjectMeta(name=name),
        spec=k8s.V1PodSpec(
            containers=[
                k8s.V1Container(
                    name="c", image=BUSYBOX_IMAGE, image_pull_policy="Never", command=["sleep", "3600"]
                )
            ],
            tolerations=[k8s.V1Toleration(operator="Exists")],
            termination_grace_period_seconds=0,
            automount_service_account_token=False,
        ),
    )
    core.create_namespaced_pod(namespace, pod)
    got = running(core, namespace, name)
    assert got.spec.node_name == cp.hostname
    return got


@pytest.fixture(scope="module")
def namespace(core: k8s.CoreV1Api) -> str:
    return new_namespace(core, "kadm-sched")


def test_check_mode_on_a_fresh_control_plane_writes_nothing(
    cp: KubeadmHost, play: Any, state: State, api: k8s.ApiClient
) -> None:
    """kubeadm's node has no PyYAML: check mode says it would be installed first and changes nothing."""
    state.original = cp.sh(f"cat {MANIFEST}")
    wait_for("kube-scheduler leading", lambda: _lease(api).holder_identity, 120, interval=1)
    state.holder = _lease(api).holder_identity
    run = play(args=("--check", "--diff"))
    assert run.rc == 0, run.output
    said = run.result(PREVIEW_LATER, cp.hostname)
    assert "python3-yaml would be installed first" in said["msg"], said
    assert run.result(CONFIGURE, cp.hostname).get("skipped")
    assert cp.sh(f"cat {MANIFEST}") == state.original
    assert cp.sh(f"test -e {CONFIG_FILE} && echo yes || echo no").strip() == "no"
    assert cp.sh("python3 -c 'import yaml' 2>/dev/null; echo $?").strip() == "1", "PyYAML still not installed"


def test_role_wires_kube_scheduler_to_the_extender_over_https(
    cp: KubeadmHost, play: Any, state: State, api: k8s.ApiClient, extender: dict[str, Any]
) -> None:
    run = play()
    assert run.rc == 0, run.output
    result = run.result(CONFIGURE, cp.hostname)
    assert result["changed"] and result["scheduler_validation"]["ran"], result
    config = yaml.safe_load(cp.sh(f"cat {CONFIG_FILE}"))
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["clientConnection"] == {"kubeconfig": "/etc/kubernetes/scheduler.conf"}
    assert config["leaderElection"] == {"leaderElect": True}
    entry = config["extenders"][0]
    assert entry["urlPrefix"] == extender["url"] and entry["enableHTTPS"] is True
    assert entry["tlsConfig"] == {
        "caFile": f"{TLS_DIR}/ca.crt",
        "certFile": f"{TLS_DIR}/scheduler.crt",
        "keyFile": f"{TLS_DIR}/scheduler.key",
    }
    manifest = yaml.safe_load(cp.sh(f"cat {MANIFEST}"))
    container = manifest["spec"]["containers"][0]
    assert container["command"] == [
        *yaml.safe_load(state.original)["spec"]["containers"][0]["command"],
        f"--config={CONFIG_FILE}",
    ]
    mounted = {m["mountPath"] for m in container["volumeMounts"]}
    assert {
        CONFIG_FILE,
        f"{TLS_DIR}/ca.crt",
        f"{TLS_DIR}/scheduler.crt",
        f"{TLS_DIR}/scheduler.key",
    } <= mounted
    backup = result["scheduler_manifest"]["backup"]
    assert backup.startswith(BACKUPS + "/") and cp.sh(f"cat {backup}") == state.original
    assert cp.sh("ls /etc/kubernetes/manifests").split() == [
        "etcd.yaml",
        "kube-apiserver.yaml",
        "kube-controller-manager.yaml",
        "kube-scheduler.yaml",
    ]
    # the kubelet restarted the static pod: the running scheduler has the flag, answers /readyz over HTTPS
    assert f"--config={CONFIG_FILE}" in _argv(cp)
    assert result["scheduler_process"]["pid"] == _scheduler_pid(cp)
    state.pid = _scheduler_pid(cp)
    assert _in_host(cp, READYZ_CODE) == "ok"
    # and it leads: a new holder of the Lease, which it renews
    holder = wait_for(
        "a new kube-scheduler leader",
        lambda: (h := _lease(api).holder_identity) != state.holder and h,
        120,
        interval=1,
    )
    assert holder.startswith(cp.hostname + "_"), holder
    first = _lease(api).renew_time
    renewed = wait_for(
        "the Lease renewed", lambda: _lease(api).renew_time > first and _lease(api), 60, interval=1
    )
    assert renewed.holder_identity == holder
    state.holder = holder


def test_a_gpu_memory_pod_is_bound_through_the_extender_over_https(
    core: k8s.CoreV1Api, namespace: str, extender: dict[str, Any], tls: dict[str, Path]
) -> None:
    node = f"kadm-gpu-{secrets.token_hex(3)}"
    core.create_node(
        k8s.V1Node(
            metadata=k8s.V1ObjectMeta(
                name=node,
                labels={"gpufleet.io/gpu-sharing": "memory", "kubernetes.io/hostname": node},
                annotations={"gpufleet.io/gpus": json.dumps(GPUS)},
            )
        )
    )
    try:
        core.patch_node_status(
            node,
            {
                "status": {
                    "capacity": {"gpufleet.io/gpu-mem": "80", "cpu": "8", "memory": "64Gi", "pods": "110"},
                    "allocatable": {"gpufleet.io/gpu-mem": "80", "cpu": "8", "memory": "64Gi", "pods": "110"},
                }
            },
        )
        wait_for(
            f"{node} in the extender's cache",
            lambda: extender["get"](f"{PREFIX}/inspect/{node}")[0] == 200,
            60,
            interval=0.5,
        )
        pod = k8s.V1Pod(
            metadata=k8s.V1ObjectMeta(name="gpu-mem-10"),
            spec=k8s.V1PodSpec(
                containers=[
                    k8s.V1Container(
                        name="c",
                        image=BUSYBOX_IMAGE,
                        image_pull_policy="Never",
                        command=["sleep", "3600"],
                        resources=k8s.V1ResourceRequirements(limits={"gpufleet.io/gpu-mem": "10"}),
                    )
                ],
                tolerations=[k8s.V1Toleration(operator="Exists")],
                node_selector={"kubernetes.io/hostname": node},
                termination_grace_period_seconds=0,
                automount_service_account_token=False,
            ),
        )
        core.create_namespaced_pod(namespace, pod)

        def bound() -> Any:
            got = core.read_namespaced_pod("gpu-mem-10", namespace)
            return got if got.spec.node_name else None

        got = wait_for("the GPU-memory pod bound", bound, 120, interval=1)
        assert got.spec.node_name == node
        # the extender's bind wrote the assignment: the scheduler called it (filter, bind) over HTTPS
        assignment = json.loads(got.metadata.annotations["gpufleet.io/assignment"])
        assert assignment["node"] == node and assignment["containers"][0]["gpus"] == ["GPU-kadm-a100-0"]
        status, body = extender["get"]("/metrics")
        metrics = body.decode()
        assert status == 200 and 'verb="bind"' in metrics and 'verb="filter"' in metrics
        # without a client certificate the extender does not talk at all
        plain = ssl.create_default_context(cafile=str(tls["ca"]))
        with (
            pytest.raises((ssl.SSLError, ConnectionResetError, urllib.error.URLError)),
            urllib.request.urlopen(extender["base"] + "/healthz", timeout=5, context=plain) as reply,
        ):
            reply.read()
    finally:
        with contextlib.suppress(k8s.ApiException):
            core.delete_namespaced_pod("gpu-mem-10", namespace, grace_period_seconds=0)
        with contextlib.suppress(k8s.ApiException):
            core.delete_node(node)


def test_a_second_run_changes_nothing_and_restarts_nothing(cp: KubeadmHost, play: Any, state: State) -> None:
    before = cp.sh(f"cat {MANIFEST}")
    run = play()
    assert run.rc == 0, run.output
    assert run.changed(cp.hostname) == [] and run.changed("localhost") == [], run.changed(cp.hostname)
    assert "scheduler_validation" not in run.result(CONFIGURE, cp.hostname), "nothing to check"
    assert cp.sh(f"cat {MANIFEST}") == before
    assert _scheduler_pid(cp) == state.pid


def _files_and_a_change(cp: KubeadmHost, **extender: Any) -> tuple[str, str, str]:
    """The manifest and configuration as they are, and the configuration with ``extender`` in its entry."""
    manifest, config = cp.sh(f"cat {MANIFEST}"), cp.sh(f"cat {CONFIG_FILE}")
    changed = yaml.safe_load(config)
    changed["extenders"][0].update(extender)
    return manifest, config, yaml.safe_dump(changed, sort_keys=False)


def test_check_mode_previews_a_change_checks_it_and_writes_nothing(
    cp: KubeadmHost, play: Any, state: State
) -> None:
    manifest, config, changed = _files_and_a_change(cp, weight=7)
    run = play(args=("--check", "--diff"), content=changed)
    assert run.rc == 0, run.output
    result = run.result(CONFIGURE, cp.hostname)
    assert (
        result["changed"]
        and result["scheduler_config_file"]["changed"]
        and result["scheduler_manifest"]["changed"]
    )
    # the image's kube-scheduler checked the configuration, also in check mode
    assert result["scheduler_validation"] == {
        "ran": True,
        "image": f"registry.k8s.io/kube-scheduler:v{VERSION}",
        "reason": "",
    }
    diffs = {d["before_header"]: d for d in result["diff"]}
    assert "weight: 7" in diffs[CONFIG_FILE]["after"] and "weight: 5" in diffs[CONFIG_FILE]["before"]
    assert "gpufleet.io/scheduler-config-sha256" in diffs[MANIFEST]["after"]
    assert cp.sh(f"cat {MANIFEST}") == manifest and cp.sh(f"cat {CONFIG_FILE}") == config
    assert _scheduler_pid(cp) == state.pid


def test_a_configuration_the_scheduler_refuses_is_refused_before_anything_is_written(
    cp: KubeadmHost, play: Any, state: State
) -> None:
    manifest, config, bad = _files_and_a_change(cp, bogusField=1)
    run = play(content=bad)
    result = run.result(CONFIGURE, cp.hostname)
    assert result.get("failed"), result
    assert (
        f"kube-scheduler (registry.k8s.io/kube-scheduler:v{VERSION}) refuses the configuration"
        in result["msg"]
    )
    assert 'strict decoding error: unknown field \\"extenders[0].bogusField\\"' in result["msg"], result[
        "msg"
    ]
    assert cp.sh(f"cat {MANIFEST}") == manifest and cp.sh(f"cat {CONFIG_FILE}") == config
    assert _scheduler_pid(cp) == state.pid


def test_a_scheduler_that_exits_on_its_configuration_is_rolled_back(
    cp: KubeadmHost, play: Any, state: State, core: k8s.CoreV1Api, namespace: str
) -> None:
    """With the check off, the kubelet starts kube-scheduler on a configuration it refuses: the module reads
    the crash from the container's log, puts the old manifest and configuration back and waits for them."""
    manifest, config, bad = _files_and_a_change(cp, weight=-3)
    started = time.monotonic()
    run = play(content=bad, validate=False)
    elapsed = time.monotonic() - started
    result = run.result(CONFIGURE, cp.hostname)
    assert result.get("failed"), result
    msg = result["msg"]
    assert msg.startswith(
        "kube-scheduler exited after the manifest change and the kubelet restarted it; it said:"
    )
    assert "weight" in msg and "Invalid value: -3" in msg, msg
    assert "were put back" in msg and "kube-scheduler runs on it again" in msg, msg
    assert cp.sh(f"cat {MANIFEST}") == manifest, "the previous manifest, byte for byte"
    assert cp.sh(f"cat {CONFIG_FILE}") == config
    assert f"--config={CONFIG_FILE}" in _argv(cp) and _in_host(cp, READYZ_CODE) == "ok"
    _scheduling_again(core, cp, namespace, "after-rollback")
    state.pid = _scheduler_pid(cp)
    print(f"rejected configuration rolled back in {elapsed:.1f} s")


def test_removal_restores_kubeadm_s_manifest_byte_for_byte(
    cp: KubeadmHost, play: Any, state: State, core: k8s.CoreV1Api, namespace: str
) -> None:
    run = play(state="absent")
    assert run.rc == 0, run.output
    result = run.result(CONFIGURE, cp.hostname)
    assert result["changed"] and result["scheduler_config_file"]["changed"]
    assert cp.sh(f"cat {MANIFEST}") == state.original
    assert cp.sh(f"test -e {CONFIG_FILE} && echo yes || echo no").strip() == "no"
    argv = _argv(cp)
    assert argv and not any(a.startswith("--config") for a in argv) and "--leader-elect=true" in argv
    assert _in_host(cp, READYZ_CODE) == "ok"
    _scheduling_again(core, cp, namespace, "after-removal")
    again = play(state="absent")
    assert again.rc == 0 and again.changed(cp.hostname) == [], again.changed(cp.hostname)


def test_a_manifest_another_tool_changed_is_merged_and_its_text_restored(
    cp: KubeadmHost, play: Any, state: State
) -> None:
    """Another tool (an operator's playbook, kubeadm upgrade) changed the manifest: gpufleet's changes go in
    beside theirs, a backup of theirs is kept, and removal writes their text back byte for byte."""
    theirs = yaml.safe_load(state.original)
    theirs["spec"]["containers"][0]["command"].insert(4, "--v=2")
    theirs["metadata"]["labels"]["managed-by"] = "platform-team"
    theirs_text = yaml.safe_dump(theirs, sort_keys=False).replace("  - --v=2\n", "  - --v=2   # verbose\n")
    write_in(cp.container, MANIFEST, theirs_text, 0o600)
    wait_for("kube-scheduler with --v=2", lambda: "--v=2" in _argv(cp), 180, interval=1)
    run = play()
    assert run.rc == 0, run.output
    result = run.result(CONFIGURE, cp.hostname)
    merged = yaml.safe_load(cp.sh(f"cat {MANIFEST}"))
    command = merged["spec"]["containers"][0]["command"]
    assert command[4] == "--v=2" and command[-1] == f"--config={CONFIG_FILE}"
    assert merged["metadata"]["labels"]["managed-by"] == "platform-team"
    assert cp.sh(f"cat {result['scheduler_manifest']['backup']}") == theirs_text, (
        "their text, comment and all"
    )
    assert "--v=2" in _argv(cp) and f"--config={CONFIG_FILE}" in _argv(cp)
    # they edit again on top of gpufleet's change: nothing for gpufleet to do, theirs stays
    merged["spec"]["containers"][0]["command"].insert(5, "--profiling=false")
    write_in(cp.container, MANIFEST, yaml.safe_dump(merged, sort_keys=False), 0o600)
    wait_for(
        "kube-scheduler with --profiling=false", lambda: "--profiling=false" in _argv(cp), 180, interval=1
    )
    again = play()
    assert again.rc == 0 and again.changed(cp.hostname) == [], again.changed(cp.hostname)
    gone = play(state="absent")
    assert gone.rc == 0, gone.output
    restored = cp.sh(f"cat {MANIFEST}")
    expected = yaml.safe_load(theirs_text)
    expected["spec"]["containers"][0]["command"].insert(5, "--profiling=false")
    assert yaml.safe_load(restored) == expected, "their later edit kept too"
    assert "--config" not in restored
    # a backup of exactly that manifest is written back byte for byte when nothing changed since
    write_in(cp.container, MANIFEST, theirs_text, 0o600)
    wait_for(
        "kube-scheduler without --profiling",
        lambda: "--profiling=false" not in _argv(cp) and _argv(cp),
        180,
        interval=1,
    )
    assert play().rc == 0
    assert play(state="absent").rc == 0
    assert cp.sh(f"cat {MANIFEST}") == theirs_text
    write_in(cp.container, MANIFEST, state.original, 0o600)
