"""The main job end to end: `gpufleet lab up`, `ansible-playbook site.yml` on its inventory, a second run with
zero changes, the validation report all green, then `gpufleet lab down` leaving nothing behind. The GPU hosts'
kubelets run containerd through CRI, one runs dockershim (docs/lab.md).

One lab for the module (names unique to this run, state and inventory in a temporary directory); the tests
run in file order and build on each other, the last one takes the lab down. If `up` fails, every test fails
with its message.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.lab import lab as fleetlab
from gpufleet_harness.lab.spec import LabSpec
from gpufleet_harness.testhosts.podman import podman

# On the worker of the Kubernetes lab tests, after them (group_last), with their cluster stopped first
# (labstack.release_stacks): beside the molecule scenarios, not beside a second idle cluster. (Session 11
# tried it on a worker of its own beside both, as in session 6: at load ~25 its site.yml ran past 27 min
# against ~7, docs/testing.md.) Since the test hosts' init wrapper, privileged hosts no longer break each
# other (tests/hosts/test_host_cgroups.py, docs/testing.md).
pytestmark = [
    pytest.mark.root, pytest.mark.cluster, pytest.mark.xdist_group("k8s-lab"), pytest.mark.group_last,
]  # fmt: skip
REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
RECAP = re.compile(r"^(\S+)\s*:\s*ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.MULTILINE)
GPUS = {"dgx-a100": 8, "pcie-2x-t4": 2, "esxi-vm-2x-v100": 2}
# Each host's device plugin configuration (lab spec, inventory/lab/group_vars): nvidia.com/gpu allocatable
# (the DGX's GPU 7 is in MIG mode, its MIG devices are resources of their own; the memory host advertises
# gpufleet.io/gpu-mem instead; the sliced host 2 devices per GPU) and the mode the validation report shows.
ADVERTISED = {"dgx-a100": 7, "pcie-2x-t4": 0, "esxi-vm-2x-v100": 4}
MIG = {"nvidia.com/mig-1g.10gb": 2, "nvidia.com/mig-3g.40gb": 1}
MODES = {"dgx-a100": "whole+MIG", "pcie-2x-t4": "memory", "esxi-vm-2x-v100": "sliced x2"}
# The workload checks only its mode runs, per host: every one of them ran and passed. The DGX's NVLink pair
# check needs validate.yml to expect NVLink there: gpu_facts reads the matrix from nvidia-smi topo -m, as the
# lab hosts' Python has no pynvml.
MODE_CHECKS = {
    "dgx-a100": (
        "one_gpu_pod_sees_exactly_one_gpu",
        "two_gpu_pod_gets_an_nvlink_pair",
        "mig_pod_sees_exactly_one_mig_device",
    ),
    "pcie-2x-t4": ("gpu_memory_pod_lands_where_the_extender_put_it",),
    "esxi-vm-2x-v100": ("time_sliced_gpu_is_shared_by_pods_running_at_once",),
}


class Lab:
    def __init__(self, spec: LabSpec, state: dict[str, Any] | None, error: str | None) -> None:
        self.spec, self.state, self.error = spec, state, error
        self.runs: list[subprocess.CompletedProcess[str]] = []

    def require(self) -> dict[str, Any]:
        if self.state is None:
            pytest.fail(f"the lab did not come up: {self.error}")
        return self.state

    @contextlib.contextmanager
    def api(self) -> Iterator[Any]:
        """A Kubernetes API client for the lab's control plane, closed after the block."""
        from kubernetes import config

        api = config.new_client_from_config(config_file=self.require()["supervisor"]["kubeconfig"])
        try:
            yield api
        finally:
            api.close()

    def playbook(self, *args: str, playbook: str = "site.yml") -> subprocess.CompletedProcess[str]:
        self.require()
        env = dict(os.environ, ANSIBLE_NOCOLOR="1", ANSIBLE_FORCE_COLOR="0", PATH=os.pathsep.join(
            [str(ANSIBLE_PLAYBOOK.parent), os.environ.get("PATH", "")]))  # fmt: skip
        run = subprocess.run(
            [str(ANSIBLE_PLAYBOOK), "-i", str(self.spec.inventory_dir), playbook, *args],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=1800, check=False,
        )  # fmt: skip
        log = self.spec.state_dir.parent / f"{Path(playbook).stem}-{len(self.runs) + 1}.log"
        log.write_text(run.stdout + run.stderr)
        self.runs.append(run)
        return run


def recap(output: str) -> dict[str, dict[str, int]]:
    return {
        m.group(1): {"ok": int(m.group(2)), "changed": int(m.group(3)), "unreachable": int(m.group(4)),
                     "failed": int(m.group(5))}
        for m in RECAP.finditer(output)
    }  # fmt: skip


def failures(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith(("fatal:", "failed:", "ERROR!"))]
    return "\n".join(lines[-8:]) or output[-3000:]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Lab]:
    from labstack import release_stacks

    release_stacks(request.config)
    base = tmp_path_factory.mktemp("fleetlab")
    inventory = base / "inventory"
    shutil.copytree(REPO / "inventory/lab/group_vars", inventory / "group_vars")
    spec = LabSpec(name=f"t{secrets.token_hex(3)}", state_dir=base / "state", inventory_dir=inventory)
    state, error = None, None
    try:
        state = fleetlab.up(spec, progress=lambda msg: None)
    except Exception as exc:  # reported by every test through Lab.require
        error = f"{type(exc).__name__}: {exc}"
    the_lab = Lab(spec, state, error)
    try:
        yield the_lab
    finally:
        fleetlab.down(spec, progress=lambda msg: None)


def test_lab_is_up_with_every_node_ready(lab: Lab) -> None:
    lab.require()
    status = fleetlab.status(lab.spec)
    assert status["up"], status
    assert sorted(status["hosts"]) == sorted(GPUS)
    inventory = (lab.spec.inventory_dir / "hosts.yml").read_text()
    for host in lab.spec.hosts:
        assert f"ansible_host: {lab.spec.container(host)}" in inventory


def test_site_converges_every_host_and_validation_is_green(lab: Lab) -> None:
    run = lab.playbook()
    assert run.returncode == 0, f"site.yml failed (rc {run.returncode}):\n{failures(run.stdout + run.stderr)}"
    stats = recap(run.stdout)
    assert set(GPUS) <= set(stats), stats
    assert all(s["failed"] == 0 and s["unreachable"] == 0 for s in stats.values()), stats
    report = json.loads((lab.spec.state_dir / "validation-report" / "report.json").read_text())
    text = (lab.spec.state_dir / "validation-report" / "report.txt").read_text()
    failed = [c for c in report.get("checks", []) if c.get("outcome") not in ("passed", "skipped")]
    assert not failed, f"validation checks failed:\n{text}"
    assert report["status"] == "pass", text
    passed_suites = {c["suite"] for c in report["checks"] if c["outcome"] == "passed"}
    assert passed_suites == {"host", "runtime", "cluster", "workload"}, text
    for host in GPUS:
        assert host in text, f"{host} missing from the validation report:\n{text}"
    # every host in its mode, and no suite cell of any host skipped as a whole
    assert report["modes"] == MODES, text
    assert all("SKIP" not in cell for cells in report["hosts"].values() for cell in cells.values()), text
    outcomes = {(c["target"], c["name"]): c["outcome"] for c in report["checks"]}
    for host, checks in MODE_CHECKS.items():
        for check in checks:
            got = outcomes.get((host, check))
            assert got == "passed", f"{host} {check}: {got}\n{text}"


def test_nodes_advertise_their_simulated_gpus(lab: Lab) -> None:
    state = lab.require()
    nodes = fleetlab.node_conditions(state["supervisor"]["kubeconfig"])
    _advertise_their_modes(nodes)


def _advertise_their_modes(nodes: dict[str, dict[str, Any]]) -> None:
    assert {name: nodes.get(name, {}).get("gpus") for name in GPUS} == ADVERTISED
    assert nodes["pcie-2x-t4"]["gpu_mem"] > 0, nodes["pcie-2x-t4"]  # GiB of its 2 T4s to share
    assert nodes["dgx-a100"]["mig"] == MIG, nodes["dgx-a100"]  # GPU 7's layout (lab-mixed)


def test_fabricmanager_runs_only_on_the_nvswitch_host(lab: Lab) -> None:
    lab.require()
    for host in lab.spec.hosts:
        argv = ["podman", "exec", lab.spec.container(host), "systemctl", "is-active", "nvidia-fabricmanager"]
        state = subprocess.run(argv, capture_output=True, text=True, check=False).stdout.strip()
        want = ("active",) if host.name == "dgx-a100" else ("inactive", "unknown")
        assert state in want, f"{host.name}: nvidia-fabricmanager is {state!r}, expected {' or '.join(want)}"


def test_each_kubelet_runs_the_runtime_its_host_names(lab: Lab) -> None:
    """containerd CRI on the GPU hosts, dockershim on one: as the kubelets report it to the API server."""
    from kubernetes import client

    with lab.api() as api:
        nodes = client.CoreV1Api(api).list_node(_request_timeout=10).items
    seen = {n.metadata.name: n.status.node_info.container_runtime_version.split("://")[0] for n in nodes}
    assert seen == {h.name: h.runtime for h in lab.spec.hosts}
    assert sorted(seen.values()).count("docker") == 1, seen


def test_containerd_config_kept_the_installers_cri_settings_and_ran_gpu_pods(lab: Lab) -> None:
    """The toolkit role's drop-in on the containerd hosts: nvidia is CRI's default runtime (on the
    RuntimeClass host runc stays the default, and the collection made the RuntimeClass nvidia), the
    installer's sandbox image and CNI paths survive the merge, and the validation pods went through the
    NVIDIA runtime (its log: containerd's k8s.io runc root, the GPU it injected into a one-GPU pod; on the
    RuntimeClass host only a pod naming it can have gone that way)."""
    lab.require()
    hosts = [h for h in lab.spec.hosts if h.runtime == "containerd"]
    assert hosts and any(h.runtime_class for h in hosts) and not all(h.runtime_class for h in hosts)
    from kubernetes import client

    with lab.api() as api:
        assert client.NodeV1Api(api).read_runtime_class("nvidia", _request_timeout=10).handler == "nvidia"
    cri = 'plugins."io.containerd.grpc.v1.cri"'
    for host in hosts:
        name = lab.spec.container(host)
        dump = podman("exec", name, "containerd", "config", "dump").stdout
        default = "runc" if host.runtime_class else "nvidia"
        assert f'default_runtime_name = "{default}"' in dump, f"{host.name}: {default} is not CRI's default"
        assert f"[{cri}.containerd.runtimes.nvidia.options]" in dump, host.name
        assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in dump, host.name
        assert 'sandbox_image = "gpufleet-lab/pause:1"' in dump, f"{host.name}: the sandbox image was lost"
        assert 'bin_dir = "/usr/lib/cni"' in dump, f"{host.name}: the CNI bin_dir was lost"
        assert podman("exec", name, "sh", "-c", "command -v dockerd", check=False).returncode != 0
        log = podman("exec", name, "cat", "/var/log/nvidia-container-runtime.log").stdout
        assert "--root /run/containerd/runc/k8s.io" in log, f"{host.name}: nothing ran through nvidia"
        # the runtime suite's `ctr run` asks for all GPUs; one GPU is the workload suite's pod, through CRI
        assert "injected 1 GPU(s)" in log, f"{host.name}: no one-GPU pod went through the NVIDIA runtime"


def test_docker_config_was_merged_not_overwritten(lab: Lab) -> None:
    lab.require()
    from gpufleet_harness.lab.hostimage import INSTALLER_DAEMON_JSON

    hosts = [h for h in lab.spec.hosts if h.runtime == "docker"]
    assert hosts, "no dockershim host left to prove the daemon.json merge"
    for host in hosts:
        text = podman("exec", lab.spec.container(host), "cat", "/etc/docker/daemon.json").stdout
        config = json.loads(text)
        assert config.get("default-runtime") == "nvidia", (host.name, config)
        assert "nvidia" in config.get("runtimes", {}), (host.name, config)
        for key, value in INSTALLER_DAEMON_JSON.items():
            assert config.get(key) == value, f"{host.name}: the installer's {key} was lost: {config}"


def test_second_run_changes_nothing(lab: Lab) -> None:
    run = lab.playbook()
    assert run.returncode == 0, f"second site.yml failed:\n{failures(run.stdout + run.stderr)}"
    stats = recap(run.stdout)
    changed = {host: s["changed"] for host, s in stats.items() if s["changed"]}
    assert not changed, f"a second converge changed something: {changed}\n" + "\n".join(
        line for line in run.stdout.splitlines() if line.startswith("changed:")
    )


def _unit_states(lab: Lab) -> dict[str, str]:
    argv = ("systemctl", "is-active", "gpufleet-device-plugin")
    states = {}
    for host in lab.spec.hosts:
        states[host.name] = podman("exec", lab.spec.container(host), *argv, check=False).stdout.strip()
    return states


def _daemonsets(lab: Lab) -> list[str]:
    from kubernetes import client

    with lab.api() as api:
        items = client.AppsV1Api(api).list_daemon_set_for_all_namespaces(_request_timeout=10).items
    return [d.metadata.name for d in items]


def test_device_plugin_moves_to_systemd_units_and_back(lab: Lab, tmp_path: Path) -> None:
    """The role's other mode on the same hosts: the plugin as a systemd unit in a virtualenv installed from a
    wheelhouse (the hosts reach no package index), the DaemonSet gone; then back, the units gone."""
    lab.require()
    from gpufleet import wheelhouse

    wheels = tmp_path / "wheels"
    wheelhouse.build(wheels)
    systemd = ("-e", "gpufleet_kubernetes_device_plugin_mode=systemd",
               "-e", f"gpufleet_kubernetes_device_plugin_wheelhouse={wheels}")  # fmt: skip
    run = lab.playbook(*systemd, playbook="playbooks/kubernetes.yml")
    assert run.returncode == 0, f"systemd mode failed:\n{failures(run.stdout + run.stderr)}"
    assert _unit_states(lab) == dict.fromkeys(GPUS, "active")
    assert "gpufleet-device-plugin" not in _daemonsets(lab)
    _advertise_their_modes(fleetlab.node_conditions(lab.require()["supervisor"]["kubeconfig"]))
    again = lab.playbook(*systemd, playbook="playbooks/kubernetes.yml")
    changed = {h: s["changed"] for h, s in recap(again.stdout).items() if s["changed"]}
    assert again.returncode == 0, f"systemd mode, second run:\n{failures(again.stdout + again.stderr)}"
    assert not changed, f"systemd mode, second run changed: {changed}"

    back = lab.playbook(playbook="playbooks/kubernetes.yml")
    assert back.returncode == 0, f"back to the DaemonSet failed:\n{failures(back.stdout + back.stderr)}"
    assert set(_unit_states(lab).values()) <= {"inactive", "unknown"}, _unit_states(lab)
    assert "gpufleet-device-plugin" in _daemonsets(lab)
    _advertise_their_modes(fleetlab.node_conditions(lab.require()["supervisor"]["kubeconfig"]))


def _boot(lab: Lab, host: str) -> str:
    """When the host's PID 1 started (clock ticks since the machine booted): changes when the host reboots."""
    container = lab.spec.container(next(h for h in lab.spec.hosts if h.name == host))
    return podman("exec", container, "cut", "-d", " ", "-f22", "/proc/1/stat").stdout.strip()


def test_driver_rollout_drains_reboots_and_uncordons_a_node(lab: Lab) -> None:
    """playbooks/upgrade-driver.yml on one node of the live cluster, at the version it runs (the lab has one
    driver build; molecule's nvidia_driver_upgrade moves versions): cordon, drain, reboot (the host's
    container restarts), validation, the node Ready with its GPUs again, uncordon. The other hosts stay up."""
    from kubernetes import client

    node, others = "pcie-2x-t4", ("dgx-a100", "esxi-vm-2x-v100")
    boots = {host: _boot(lab, host) for host in (node, *others)}
    run = lab.playbook("-e", f"gpufleet_target={node}", playbook="playbooks/upgrade-driver.yml")
    assert run.returncode == 0, f"upgrade-driver.yml failed:\n{failures(run.stdout + run.stderr)}"
    assert set(recap(run.stdout)) == {node}, recap(run.stdout)
    assert _boot(lab, node) != boots[node], f"{node} did not reboot"
    assert {host: _boot(lab, host) for host in others} == {host: boots[host] for host in others}

    with lab.api() as api:
        core = client.CoreV1Api(api)
        found = core.read_node(node, _request_timeout=10)
        events = core.list_event_for_all_namespaces(
            field_selector=f"involvedObject.kind=Node,involvedObject.name={node}", _request_timeout=10).items
    assert not found.spec.unschedulable, f"{node} was left cordoned"
    ready = {c.type: c.status for c in found.status.conditions}.get("Ready")
    assert ready == "True", f"{node} is not Ready after the rollout: {found.status.conditions}"
    # its GPUs back, in its mode (GPU memory to share on this host)
    assert int(found.status.allocatable.get("gpufleet.io/gpu-mem", "0")) > 0, found.status.allocatable
    reasons = {e.reason for e in events}
    # The kubelet saw the cordon (its NodeSchedulable event for the uncordon may come later; the node's
    # spec above shows it).
    assert "NodeNotSchedulable" in reasons, reasons


def test_down_removes_everything(lab: Lab) -> None:
    state = lab.require()
    fleetlab.down(lab.spec, progress=lambda msg: None)
    assert fleetlab.containers(lab.spec) == {}
    volumes = podman("volume", "ls", "-q").stdout.split()
    assert not [v for v in volumes if v.startswith(f"gpufleet-{lab.spec.name}-")]
    assert not lab.spec.state_dir.exists()
    assert not (lab.spec.inventory_dir / "hosts.yml").exists()
    assert not Path(f"/proc/{state['supervisor']['pid']}").exists()
    leftovers = subprocess.run(["pgrep", "-f", str(lab.spec.state_dir)], capture_output=True, text=True)
    assert leftovers.stdout.strip() == "", f"processes of the lab still run: {leftovers.stdout}"
