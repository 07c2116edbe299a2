"""The role nvidia_mig through ansible-playbook on simulated hosts (inventory/sim), and its boot applier run
as a plain command, as gpufleet-mig.service runs it, after the GPU instances are lost.

The role's node paths point into the test's directory; packages and systemctl are off (the build machine's
systemd does not run the simulated host). Everything the role writes is read back from there; the GPUs'
state comes from the sim root's `mig` file and the stand-in `nvidia-smi -L` (helpers of
test_gpu_mig_layout.py).
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import secrets
import shlex
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from labstack import LabStack, copy_kubeconfig, ensure_collection_link
from test_gpu_mig_layout import CONFIG, assert_layout, materialize, run_sim_playbook, smi_list, state

from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

REPO = Path(__file__).resolve().parents[2]
MIG_CONFIG, MIG_STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
GPU = {"nvidia.com/gpu": "1"}


def node_paths(root: Path) -> dict[str, str]:
    """Where the role writes on the simulated node; /etc/default and /etc/systemd/system exist, as on a real
    one."""
    node = root.parent.parent / "node"
    for base in ("etc/default", "etc/systemd/system"):
        (node / base).mkdir(parents=True, exist_ok=True)
    return {
        "nvidia_mig_config_dir": str(node / "etc/gpufleet/mig"),
        "nvidia_mig_lib_dir": str(node / "usr/local/lib/gpufleet/mig"),
        "nvidia_mig_unit_dir": str(node / "etc/systemd/system"),
        "nvidia_mig_env_file": str(node / "etc/default/gpufleet-mig"),
    }


def run_role(root: Path, role_vars: dict[str, Any], *args: str) -> tuple[int, dict[str, Any], str]:
    """Run the role on the host of `root`; (rc, the host's stats, output)."""
    ensure_collection_link()
    work = root.parent.parent
    play = [
        {
            "hosts": "all",
            "gather_facts": False,
            "environment": "{{ gpufleet_env }}",
            "roles": [{"role": "gpufleet.nvidia.nvidia_mig"}],
        }
    ]
    playbook = work / "role.yml"
    playbook.write_text(yaml.safe_dump(play, sort_keys=False))
    extra = {
        "gpufleet_sim_base": str(root.parent),
        "nvidia_mig_install_packages": False,
        "nvidia_mig_manage_systemd": False,
        "nvidia_mig_python": sys.executable,
        **node_paths(root),
        **role_vars,
    }
    proc = run_sim_playbook(playbook, root, extra, *args, json_output=True)
    try:
        stats = json.loads(proc.stdout)["stats"][f"sim-{root.name}"]
    except (ValueError, KeyError):
        stats = {}
    return proc.returncode, stats, proc.stdout[-6000:] + proc.stderr[-2000:]


def task_results(output: str, name: str) -> list[dict[str, Any]]:
    """Results of the tasks called `name` in a json-callback run's output."""
    doc = json.loads(output[output.index("{") :]) if output.lstrip().startswith("{") else {}
    found = []
    for play in doc.get("plays", []):
        for task in play.get("tasks", []):
            if task["task"]["name"] == name:
                found += list(task["hosts"].values())
    return found


def unit(root: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(Path(node_paths(root)["nvidia_mig_unit_dir"]) / "gpufleet-mig.service")
    return parser


def boot_apply(root: Path) -> subprocess.CompletedProcess[str]:
    """The unit's ExecStart, as systemd would run it, in the simulated host's environment."""
    argv = shlex.split(unit(root)["Service"]["ExecStart"])
    return subprocess.run(argv, env=simmachine.sim_env(root), capture_output=True, text=True, check=False)


def events(proc: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in proc.stdout.splitlines()]


# -- tests ----------------------------------------------------------------------------------------------


def test_role_applies_writes_the_node_files_and_the_boot_unit_and_reapplies_unchanged(
    sim_lib: Path, tmp_path: Path
) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    role_vars = {"nvidia_mig_config": CONFIG, "nvidia_mig_layout": "all-1g.10gb"}
    rc, first, out = run_role(root, role_vars)
    assert rc == 0, out
    assert first["changed"] > 0
    for gpu in range(8):
        assert_layout(root, gpu, {"1g.10gb": 7})
    paths = {k: Path(v) for k, v in node_paths(root).items()}
    assert yaml.safe_load((paths["nvidia_mig_config_dir"] / "config.yaml").read_text()) == CONFIG
    assert (paths["nvidia_mig_config_dir"] / "layout").read_text() == "all-1g.10gb\n"
    shipped = paths["nvidia_mig_lib_dir"] / "mig_layout.py"
    assert shipped.read_bytes() == (REPO / "plugins/module_utils/mig_layout.py").read_bytes()
    # The boot unit orders the layout before the kubelet and the device plugin.
    u = unit(root)
    before, after = u["Unit"]["Before"].split(), u["Unit"]["After"].split()
    assert {"kubelet.service", "gpufleet-device-plugin.service"} <= set(before)
    assert {"nvidia-persistenced.service", "nvidia-fabricmanager.service"} <= set(after)
    assert u["Service"]["Type"] == "oneshot" and u["Service"]["RemainAfterExit"] == "yes"
    assert u["Service"]["EnvironmentFile"] == "-" + node_paths(root)["nvidia_mig_env_file"]
    assert u["Install"]["WantedBy"] == "multi-user.target"
    assert shlex.split(u["Service"]["ExecStart"])[:2] == [
        sys.executable,
        node_paths(root)["nvidia_mig_lib_dir"] + "/gpufleet_mig_apply.py",
    ]
    # The device plugin's unit name is the one gpufleet_kubernetes installs in systemd mode.
    dp_tasks = (REPO / "roles/gpufleet_kubernetes/tasks/device-plugin-systemd.yml").read_text()
    assert "dest: /etc/systemd/system/gpufleet-device-plugin.service" in dp_tasks
    rc, second, out = run_role(root, role_vars)
    assert rc == 0, out
    assert second["changed"] == 0, out


def test_boot_applier_recreates_lost_instances_is_idempotent_and_fails_clearly(
    sim_lib: Path, tmp_path: Path
) -> None:
    """One role run (each costs an ansible-playbook), then the applier as the unit runs it: after a reboot,
    then unchanged, then with a layout that cannot fit and a name the config lacks (nothing changes)."""
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    rc, _, out = run_role(root, {"nvidia_mig_config": CONFIG, "nvidia_mig_layout": "all-balanced"})
    assert rc == 0, out
    balanced = {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}
    # What a reboot does to MIG: the mode stays (InfoROM), the GPU and compute instances are gone.
    for gpu in range(8):
        simcontrol.inject(root, ["gpu", str(gpu), "reset"])
    assert all(s["mode"] == (1, 1) and s["gi"] == [] for s in state(root).values())
    first = boot_apply(root)
    assert first.returncode == 0, first.stdout + first.stderr
    got = events(first)
    assert got[-1] == {"event": "applied", "layout": "all-balanced", "changed": True}
    assert all(e["actions"] == ["create 4 GPU instance(s)"] for e in got if e["event"] == "gpu")
    for gpu in range(8):
        assert_layout(root, gpu, balanced)
    again = boot_apply(root)
    assert again.returncode == 0, again.stdout + again.stderr
    assert events(again)[-1] == {"event": "applied", "layout": "all-balanced", "changed": False}
    assert smi_list(root) == {g: Counter(balanced) for g in range(8)}

    before = state(root)
    layout_file = Path(node_paths(root)["nvidia_mig_config_dir"]) / "layout"
    layout_file.write_text("too-many\n")
    proc = boot_apply(root)
    assert proc.returncode == 1
    (failed,) = events(proc)
    assert failed["event"] == "failed" and "1g.10gb x8 (at most 7)" in failed["error"]
    layout_file.write_text("no-such-layout\n")
    proc = boot_apply(root)
    assert proc.returncode == 1 and "has no layout 'no-such-layout'" in events(proc)[0]["error"]
    assert state(root) == before


def test_check_mode_changes_nothing_and_bad_input_writes_nothing(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    config_dir = Path(node_paths(root)["nvidia_mig_config_dir"])
    before = state(root)
    rc, stats, out = run_role(
        root, {"nvidia_mig_config": CONFIG, "nvidia_mig_layout": "all-1g.10gb"}, "--check", "--diff"
    )
    assert rc == 0, out
    assert stats["changed"] > 0
    assert state(root) == before and not config_dir.exists()
    for layout, message in (
        ("no-such-profile", "has no MIG profile 1g.5gb"),
        ("bad-placement", "no placement of the instances fits"),
        ("nope", "has no layout 'nope'"),
    ):
        rc, _, out = run_role(root, {"nvidia_mig_config": CONFIG, "nvidia_mig_layout": layout})
        assert rc != 0 and message in out, out
    rc, _, out = run_role(root, {"nvidia_mig_layout": "all-1g.10gb"})
    assert rc != 0 and "exactly one of nvidia_mig_config" in out, out
    assert state(root) == before and not config_dir.exists()


def test_operator_config_file_is_copied_as_it_is_and_t4_refuses_mig(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "pcie-2x-t4")
    own = tmp_path / "operator-config.yaml"
    own.write_text("# our fleet's layouts\n" + yaml.safe_dump(CONFIG, sort_keys=False))
    rc, _, out = run_role(root, {"nvidia_mig_config_file": str(own), "nvidia_mig_layout": "all-1g.10gb"})
    assert rc != 0 and "GPU 0 (Tesla T4) does not support MIG" in out, out
    config = Path(node_paths(root)["nvidia_mig_config_dir"]) / "config.yaml"
    assert not config.exists()
    rc, _, out = run_role(root, {"nvidia_mig_config_file": str(own), "nvidia_mig_layout": "all-disabled"})
    assert rc == 0, out
    assert config.read_text() == own.read_text()


@pytest.mark.cluster
def test_role_on_a_cluster_node_labels_drains_and_uncordons(
    stack: LabStack, sim_lib: Path, tmp_path: Path
) -> None:
    """With a kubeconfig, the role marks the node pending, cordons it and evicts its GPU pods before a change,
    then marks it success and uncordons; a failed change leaves it cordoned and failed. The lab's API server
    with a kubelet-less node stands in for the host's node."""
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    cp = stack.control_plane
    core = cp.core_v1()
    node = f"mig-role-{secrets.token_hex(3)}"
    cp.fake_node(node, {"nvidia.com/gpu": 8})
    try:
        core.create_namespaced_pod(
            "default",
            {
                "metadata": {"name": node},
                "spec": {
                    "nodeName": node,
                    "terminationGracePeriodSeconds": 0,
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "c", "image": "x", "resources": {"limits": GPU}}],
                },
            },
        )
        cluster_vars = {
            "nvidia_mig_config": CONFIG,
            "nvidia_mig_kubeconfig": str(copy_kubeconfig(cp, tmp_path)),
            "nvidia_mig_node_name": node,
        }

        def labels() -> tuple[dict[str, str], bool, bool]:
            n = core.read_node(node)
            found = {k: v for k, v in (n.metadata.labels or {}).items() if k.startswith("nvidia.com/mig.")}
            ours = "gpufleet.io/mig-cordoned" in (n.metadata.annotations or {})
            return found, bool(n.spec.unschedulable), ours

        rc, _, out = run_role(root, {**cluster_vars, "nvidia_mig_layout": "all-1g.10gb"})
        assert rc == 0, out
        assert labels() == ({MIG_CONFIG: "all-1g.10gb", MIG_STATE: "success"}, False, False)
        assert node not in {p.metadata.name for p in core.list_namespaced_pod("default").items}
        rc, stats, out = run_role(root, {**cluster_vars, "nvidia_mig_layout": "all-1g.10gb"})
        assert rc == 0 and stats["changed"] == 0, out

        # A mode change on the A100 needs a reset; an nvidia-smi that cannot reset makes the change fail.
        broken = tmp_path / "broken-bin"
        broken.mkdir()
        script = "#!/bin/sh\necho 'Unable to reset: In use by another client'\nexit 1\n"
        (broken / "nvidia-smi").write_text(script)
        (broken / "nvidia-smi").chmod(0o755)
        env = simmachine.sim_env(root)
        gpufleet_env = {
            "GPUFLEET_SIM_ROOT": str(root),
            "GPUFLEET_HOST_ROOT": str(root / "host"),
            "LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"],
            "PATH": f"{broken}:{os.environ['PATH']}",
        }
        broken_vars = {**cluster_vars, "nvidia_mig_layout": "all-disabled", "gpufleet_env": gpufleet_env}
        rc, _, out = run_role(root, broken_vars)
        assert rc != 0 and "In use by another client" in out, out
        assert labels() == ({MIG_CONFIG: "all-disabled", MIG_STATE: "failed"}, True, True)
    finally:
        core.delete_node(node)
        with contextlib.suppress(Exception):
            core.delete_namespaced_pod(node, "default", grace_period_seconds=0)
