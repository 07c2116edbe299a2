"""The test session's Kubernetes lab: control plane, two real kubelet nodes with simulated GPUs, the gpufleet
image in their containerd, and the glue pods need in the lab.

One ``LabStack`` per test process (the session fixture ``stack`` in tests/conftest.py) serves tests/cluster,
tests/k8s_modules and tests/validation: tests/cluster adds its own ``lab-node`` kubelet and per-test
schedulers to the same control plane. Pieces start on first use.

Nodes (``LabStack.nodes()``):

- ``gpu-a``: dgx-a100 simulated (8 GPUs, NVLink), label ``gpufleet.io/lab-gpus=whole``;
- ``gpu-b``: pcie-2x-t4 simulated (2 GPUs), label ``gpufleet.io/gpu-sharing=memory``.

Each node's sim root is materialized at ``/var/lib/gpufleet-sim`` *inside the node* (the node's /var is
private), so one pod spec mounts the right machine on whichever node it lands.

Lab glue, all outside the code under test:

- **API access for host-network pods.** Pods with ``hostNetwork`` share containerd's network namespace, where
  127.0.0.1 is not the host's. A relay listens in that namespace on ``127.0.0.1:<apiserver port>`` and
  forwards to the host's; pods get ``KUBERNETES_SERVICE_HOST/PORT`` pointing there (``pod_env``), and the
  apiserver's certificate (which names 127.0.0.1) verifies.
- **Probes.** The kubelet probes a host-network pod at the node's InternalIP, which lives in the host's
  namespace; a relay there forwards probe ports to containerd's side of the veth.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from gpufleet_harness.cluster.cluster import ControlPlane, Scheduler, TestCluster
from gpufleet_harness.cluster.images import LabImage, ensure_lab_image, load_into
from gpufleet_harness.cluster.k8s_build import ensure_k8s
from gpufleet_harness.cluster.k8s_cache import K8sArtifacts
from gpufleet_harness.cluster.node import KubeletNode
from gpufleet_harness.sim import machine as simmachine

if TYPE_CHECKING:
    import pytest

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
SIM_DIR = "/var/lib/gpufleet-sim"  # inside every node
CLONE_NEWNET = 0x40000000
NODES = {
    "gpu-a": ("dgx-a100", {"gpufleet.io/lab-gpus": "whole"}),
    "gpu-b": ("pcie-2x-t4", {"gpufleet.io/gpu-sharing": "memory"}),
}


# -- relays ----------------------------------------------------------------------------------------
def _pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


class Relay:
    """Accepts on a listening socket (possibly in another network namespace), connects to ``target`` from
    the host's namespace, and copies bytes both ways."""

    def __init__(self, listener: socket.socket, target: tuple[str, int]) -> None:
        self.listener, self.target = listener, target
        self._thread = threading.Thread(target=self._serve, daemon=True, name=f"relay->{target}")
        self._thread.start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=5)
                upstream.settimeout(None)
            except OSError:
                client.close()
                continue
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self.listener.close()


def listen_in_netns(pid: int, address: tuple[str, int]) -> socket.socket:
    """A listening TCP socket created inside the network namespace of ``pid`` (setns in a helper thread:
    the namespace switch is per thread, and the socket keeps its namespace)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    box: dict[str, Any] = {}

    def enter_and_listen() -> None:
        try:
            with open(f"/proc/{pid}/ns/net") as ns:
                if libc.setns(ns.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
            sock.listen(64)
            box["sock"] = sock
        except OSError as exc:
            box["error"] = exc

    thread = threading.Thread(target=enter_and_listen)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["sock"]  # type: ignore[no-any-return]


def listen_on_host(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(address)
    sock.listen(64)
    return sock


# -- the stack -------------------------------------------------------------------------------------
@dataclass
class GpuNode:
    """A kubelet node with a simulated machine."""

    node: KubeletNode
    fixture: str
    labels: dict[str, str]

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def sim_root(self) -> Path:
        """Host path of the node's sim root (``/var/lib/gpufleet-sim`` inside the node)."""
        return self.node.var / SIM_DIR.removeprefix("/var/")


@dataclass
class LabStack:
    """One lab for the session; pieces start on first use."""

    sim_lib: Path
    artifacts: K8sArtifacts | None = None
    timings: dict[str, float] = field(default_factory=dict)
    _lab: TestCluster | None = None
    _cp: ControlPlane | None = None
    _nodes: dict[str, GpuNode] = field(default_factory=dict)
    _image: LabImage | None = None
    _relays: list[Relay] = field(default_factory=list)
    _probe_ports: set[tuple[str, int]] = field(default_factory=set)
    _scheduler: Scheduler | None = None
    _scheduler_config: Any = None

    @property
    def lab(self) -> TestCluster:
        if self._lab is None:
            with timed(self.timings, "k8s binaries + lab dir"):
                artifacts = self.artifacts or ensure_k8s()
                self._lab = TestCluster(artifacts, keep=os.environ.get("GPUFLEET_LAB_KEEP") == "1")
        return self._lab

    @property
    def control_plane(self) -> ControlPlane:
        if self._cp is None:
            with timed(self.timings, "control plane"):
                self._cp = self.lab.start_control_plane()
        return self._cp

    @property
    def image(self) -> LabImage:
        if self._image is None:
            with timed(self.timings, "gpufleet image (cache or build)"):
                self._image = ensure_lab_image()
        return self._image

    def nodes(self) -> dict[str, GpuNode]:
        """Both GPU nodes, Ready, with their sim roots, the image and the API relay."""
        if not self._nodes:
            cp = self.control_plane
            image = self.image
            self.scheduler()  # DaemonSet pods are placed by the scheduler (1.12+)
            for name, (fixture, labels) in NODES.items():
                with timed(self.timings, f"node {name} Ready"):
                    node = self.lab.start_kubelet_node(name, labels=labels)
                gpu_node = GpuNode(node, fixture, labels)
                simmachine.materialize(fixture, gpu_node.sim_root, library=self.sim_lib)
                with timed(self.timings, f"image import on {name}"):
                    load_into(node, image)
                listener = listen_in_netns(node.netns_pid(), ("127.0.0.1", cp.port))
                self._relays.append(Relay(listener, ("127.0.0.1", cp.port)))
                self._nodes[name] = gpu_node
        return self._nodes

    def scheduler(self, extenders: Any = None) -> Scheduler:
        """The lab's default-scheduler, (re)started when the extender configuration changes."""
        if self._scheduler is not None and self._scheduler_config == extenders:
            return self._scheduler
        if self._scheduler is not None:
            self._scheduler.stop()
        started = time.monotonic()
        self._scheduler = self.lab.start_scheduler(extenders)
        self._scheduler_config = extenders
        self.timings.setdefault("scheduler healthy", time.monotonic() - started)
        return self._scheduler

    @contextlib.contextmanager
    def scheduler_paused(self) -> Iterator[None]:
        """No lab default-scheduler while the block runs (a test runs its own under that name); the
        lab's comes back afterwards with the configuration it had. Nothing to do if none runs."""
        if self._scheduler is None:
            yield
            return
        config = self._scheduler_config
        self._scheduler.stop()
        self._scheduler = None
        try:
            yield
        finally:
            self.scheduler(config)

    def expose_probe_port(self, port: int) -> None:
        """Forward ``node IP:port`` (where the kubelet probes host-network pods) into each node's runtime."""
        for gpu_node in self.nodes().values():
            node = gpu_node.node
            key = (str(node.node_ip), port)
            if key in self._probe_ports:
                continue
            self._relays.append(Relay(listen_on_host(key), (str(node.peer_ip), port)))
            self._probe_ports.add(key)

    def pod_env(self) -> dict[str, str]:
        """Environment for lab pods: API through the relay, NVML and discovery from the node's sim root."""
        return {
            "KUBERNETES_SERVICE_HOST": "127.0.0.1",
            "KUBERNETES_SERVICE_PORT": str(self.control_plane.port),
            "GPUFLEET_SIM_ROOT": SIM_DIR,
            "LD_LIBRARY_PATH": f"{SIM_DIR}/lib",
            "GPUFLEET_HOST_ROOT": f"{SIM_DIR}/host",
        }

    def sim_volumes(self) -> list[dict[str, Any]]:
        """hostPath volumes a pod needs for the simulated NVML: the sim root and the library it links to."""
        return [
            {"name": "gpufleet-sim", "host_path": SIM_DIR},
            {"name": "gpufleet-sim-lib", "host_path": str(self.sim_lib.parent)},
        ]

    def __post_init__(self) -> None:
        _STACKS.append(self)

    def close(self) -> None:
        """Stop everything; a later use starts the pieces again."""
        relays, self._relays = self._relays, []
        for relay in relays:
            relay.close()
        lab, self._lab = self._lab, None
        self._cp, self._nodes, self._scheduler, self._scheduler_config = None, {}, None, None
        self._probe_ports = set()
        if lab is not None:
            lab.close()


_STACKS: list[LabStack] = []  # every LabStack of this process


def release_stacks(config: pytest.Config) -> None:
    """Stop this process's labs now, in an xdist worker (whose grouped tests are sorted, ``group_last``
    tests at the end of their group, tests/conftest.py): a test with its own cluster (the site.yml lab test)
    then does not share two cores with an idle one for its ~13 minutes. In a plain run, a no-op: tests
    using `stack` may still follow."""
    if hasattr(config, "workerinput"):
        for the_stack in _STACKS:
            the_stack.close()


# -- ansible-playbook ------------------------------------------------------------------------------
def ensure_collection_link() -> Path:
    """The link ansible.cfg's collections_path expects (what `make bootstrap` creates); returns that path
    (what PYTHONPATH needs for running a module of the collection directly)."""
    link = REPO / ".cache/collections/ansible_collections/gpufleet/nvidia"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to("../../../..", target_is_directory=True)
    return REPO / ".cache/collections"


@dataclass
class PlaybookRun:
    """One ansible-playbook run: exit code, output, and each task's result on localhost."""

    proc: subprocess.CompletedProcess[str]
    results: list[dict[str, Any]]

    @property
    def rc(self) -> int:
        return self.proc.returncode

    @property
    def output(self) -> str:
        return self.proc.stdout + self.proc.stderr

    def task(self, index: int = 0) -> dict[str, Any]:
        return self.results[index]


def run_tasks(
    tasks: Sequence[Mapping[str, Any]],
    tmp: Path,
    *,
    args: Sequence[str] = (),
    json_output: bool = True,
    env: Mapping[str, str] | None = None,
    timeout: float = 600,
) -> PlaybookRun:
    """Run ``tasks`` on localhost through ansible-playbook from the repository root (ansible.cfg applies)."""
    ensure_collection_link()
    tmp.mkdir(parents=True, exist_ok=True)
    play = [
        {"name": "gpufleet module test", "hosts": "localhost", "gather_facts": False, "tasks": list(tasks)}
    ]
    path = tmp / f"play-{time.monotonic_ns()}.yml"
    path.write_text(yaml.safe_dump(play, sort_keys=False))
    environ = {
        **os.environ,
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_LOCALHOST_WARNING": "0",
        "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0",
        **(env or {}),
    }
    for name in ("KUBECONFIG", "K8S_AUTH_KUBECONFIG"):
        environ.pop(name, None)
    if json_output:
        environ["ANSIBLE_STDOUT_CALLBACK"] = "ansible.posix.json"
    proc = subprocess.run(
        [
            str(ANSIBLE_PLAYBOOK),
            "-i",
            "localhost,",
            "-c",
            "local",
            "-e",
            f"ansible_python_interpreter={sys.executable}",
            str(path),
            *args,
        ],
        cwd=REPO,
        env=environ,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    results: list[dict[str, Any]] = []
    if json_output:
        try:
            doc = json.loads(proc.stdout)
        except ValueError:
            doc = {"plays": []}
        for play_doc in doc.get("plays", []):
            for task in play_doc.get("tasks", []):
                results.append(task.get("hosts", {}).get("localhost", {}))
    return PlaybookRun(proc, results)


def wait_until(what: str, probe: Any, timeout: float, interval: float = 0.5) -> Any:
    """Poll ``probe()`` until it returns something truthy; AssertionError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what} (last: {last!r})")


@contextlib.contextmanager
def timed(timings: dict[str, float], name: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        timings[name] = round(time.monotonic() - started, 1)


def scheduler_config_options(control_plane: ControlPlane, health_port: int) -> tuple[str, dict[str, str]]:
    """The extender module's ``scheduler_config_version`` for the lab's kube-scheduler, and the options that
    version needs here: v1 (1.25 and later: health on the secure port) needs none; v1beta1 (1.20) gets its
    plain-HTTP healthz and metrics onto loopback and a free port."""
    if not control_plane.legacy:
        return "v1", {}
    bind = f"127.0.0.1:{health_port}"
    return "v1beta1", {"healthz_bind_address": bind, "metrics_bind_address": bind}


def copy_kubeconfig(control_plane: ControlPlane, tmp: Path, user: str = "admin") -> Path:
    """A private copy of a lab kubeconfig (tests may edit it)."""
    target = tmp / f"{user.replace(':', '_')}.kubeconfig"
    shutil.copy2(control_plane.kubeconfig(user), target)
    return target
