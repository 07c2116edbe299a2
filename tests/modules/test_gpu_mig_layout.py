"""gpu_mig_layout through ansible-playbook on simulated hosts (inventory/sim), judged by the simulator.

Each test materializes its own sim root, runs a generated playbook against the host of inventory/sim with
`gpufleet_sim_base` pointing there (so the play's `gpufleet_env` reaches the module, nvidia-smi included),
and checks the result against the root's MIG state (the `mig` file the simulated driver keeps) and the
stand-in `nvidia-smi -L`, which reads it back through pynvml.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml
from labstack import ensure_collection_link

from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
sys.path.insert(0, str(ensure_collection_link()))
from ansible_collections.gpufleet.nvidia.plugins.module_utils.mig_layout import (  # noqa: E402
    PROFILES_H200,
    LayoutError,
    MigNvml,
    place,
    profile_table,
    refuse_busy,
    wanted_per_gpu,
)

REALGPU = REPO / "tests/realgpu"
A100_80GB, H100_80GB = "0x20B210DE", "0x233010DE"

CONFIG = {
    "version": "v1",
    "mig-configs": {
        "all-disabled": [{"devices": "all", "mig-enabled": False}],
        "all-enabled": [{"devices": "all", "mig-enabled": True, "mig-devices": {}}],
        "all-1g.10gb": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
        # mig-parted's all-balanced for A100-80GB and H100-80GB (its examples/config.yaml): 2x 1g.10gb,
        # 1x 2g.20gb, 1x 3g.40gb, picked by PCI device id.
        "all-balanced": [
            {
                "device-filter": [A100_80GB, H100_80GB],
                "devices": "all",
                "mig-enabled": True,
                "mig-devices": {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1},
            },
        ],
        "custom": [
            {"devices": [0, 1], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}},
            {"devices": [2], "mig-enabled": True, "mig-devices": {"4g.40gb": 1, "1g.10gb": 3}},
            {"devices": [3], "mig-enabled": True, "mig-devices": {"7g.80gb": 1}},
            {"devices": [4, 5, 6, 7], "mig-enabled": False},
        ],
        "gpu0-1g": [{"devices": [0], "mig-enabled": True, "mig-devices": {"1g.10gb": 7}}],
        "gpu0-2g": [{"devices": [0], "mig-enabled": True, "mig-devices": {"2g.20gb": 3}}],
        # Bad layouts, each refused with nothing changed.
        "no-such-profile": [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.5gb": 7}}],
        "too-many": [{"devices": [0], "mig-enabled": True, "mig-devices": {"1g.10gb": 8}}],
        "too-many-slices": [
            {"devices": [0], "mig-enabled": True, "mig-devices": {"4g.40gb": 1, "3g.40gb": 1, "1g.10gb": 1}}
        ],
        # 3 + 3 + 1 compute slices fit, but the two 3g.40gb take all 8 memory slices: no room for 1g.20gb.
        "bad-placement": [{"devices": [1], "mig-enabled": True, "mig-devices": {"3g.40gb": 2, "1g.20gb": 1}}],
        "no-such-gpu": [{"devices": [0, 9], "mig-enabled": False}],
    },
}


# -- running the module -------------------------------------------------------------------------------


def materialize(sim_lib: Path, tmp_path: Path, fixture: str) -> Path:
    """A fresh sim root at <tmp>/base/<fixture>, where inventory/sim looks for it."""
    return simmachine.materialize(fixture, tmp_path / "base" / fixture, library=sim_lib)


def run(root: Path, tasks: list[dict[str, Any]], *args: str) -> list[dict[str, Any]]:
    """Run `tasks` (module arguments of gpu_mig_layout, one task each) on the host of `root`; returns each
    task's registered result (failures included)."""
    ensure_collection_link()
    work = root.parent.parent
    out = work / "results.json"
    out.unlink(missing_ok=True)
    play = [
        {
            "hosts": "all",
            "gather_facts": False,
            "tasks": [
                *(
                    {
                        "name": f"layout {i}",
                        "gpufleet.nvidia.gpu_mig_layout": t,
                        "environment": "{{ gpufleet_env }}",
                        "register": f"r{i}",
                        "ignore_errors": True,
                    }
                    for i, t in enumerate(tasks)
                ),
                {
                    "name": "save",
                    "delegate_to": "localhost",
                    "check_mode": False,
                    "ansible.builtin.copy": {
                        "dest": str(out),
                        "content": "{{ [" + ", ".join(f"r{i}" for i in range(len(tasks))) + "] | to_json }}",
                    },
                },
            ],
        }
    ]
    playbook = work / "play.yml"
    playbook.write_text(yaml.safe_dump(play, sort_keys=False))
    proc = run_sim_playbook(playbook, root, {"gpufleet_sim_base": str(root.parent)}, *args)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return json.loads(out.read_text())


def run_sim_playbook(
    playbook: Path, root: Path, extra: dict[str, Any], *args: str, json_output: bool = False
) -> subprocess.CompletedProcess[str]:
    """ansible-playbook ``playbook`` on the inventory/sim host of ``root`` with ``extra`` variables, none of
    this process's sim or cluster environment leaking in; ``json_output``: ansible.posix.json's report."""
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0"}
    if json_output:
        env["ANSIBLE_STDOUT_CALLBACK"] = "ansible.posix.json"
    for name in ("GPUFLEET_SIM_ROOT", "GPUFLEET_HOST_ROOT", "GPUFLEET_SIM_BASE", "KUBECONFIG"):
        env.pop(name, None)
    inventories = ["-i", "inventory/sim"]
    # A root inventory/sim does not list (a fixture not in it yet, a fixture of a test's own) joins its group
    # here, with the group's variables.
    listed = yaml.safe_load((REPO / "inventory/sim/hosts.yml").read_text())["gpufleet_sim"]["hosts"]
    if f"sim-{root.name}" not in listed:
        hosts = root.parent.parent / "extra-hosts.yml"
        hosts.write_text(
            json.dumps({"gpufleet_sim": {"hosts": {f"sim-{root.name}": {"gpufleet_sim_fixture": root.name}}}})
        )
        inventories += ["-i", str(hosts)]
    argv = [str(ANSIBLE_PLAYBOOK), *inventories, str(playbook), "--limit", f"sim-{root.name}",
            "-e", json.dumps(extra), *args]  # fmt: skip
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False)


def write_config(root: Path, config: dict[str, Any] = CONFIG) -> str:
    path = root.parent.parent / "mig-config.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return str(path)


def task(root: Path, layout: str) -> dict[str, Any]:
    return {"config_file": write_config(root), "layout": layout}


# -- reading the simulated driver's state ---------------------------------------------------------------


def state(root: Path) -> dict[int, dict[str, Any]]:
    """Per GPU: MIG mode (current, pending) and GPU-instance profile names by placement, with the compute
    instances, from the root's `mig` file."""
    machine = simmachine.load_machine(root)
    out: dict[int, dict[str, Any]] = {}
    names: dict[int, dict[int, str]] = {}  # per GPU: profile id -> name, from the fixture's MIG table
    for i, g in enumerate(machine["gpus"]):
        mode = g.get("mig_mode")
        out[i] = {"mode": None if mode is None else (mode["current"], mode["pending"]), "gi": [], "ci": []}
        names[i] = {p["id"]: p["name"] for p in (g["mig"] or {"profiles": []})["profiles"]}
    path = root / "mig"
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        w = line.split()
        if w and w[0] == "mode":
            out[int(w[1])]["mode"] = (int(w[2]), int(w[3]))
        elif w and w[0] == "gi":
            out[int(w[1])]["gi"].append((int(w[4]), names[int(w[1])][int(w[3])], int(w[2])))
        elif w and w[0] == "ci":
            out[int(w[1])]["ci"].append((int(w[2]), int(w[4]), int(w[5])))  # GI id, CI profile, start
    for s in out.values():
        s["profiles"] = [name for _, name, _ in sorted(s["gi"])]
    return out


def smi_list(root: Path) -> dict[int, Counter[str]]:
    """MIG devices per GPU as the stand-in `nvidia-smi -L` lists them (through pynvml)."""
    proc = subprocess.run(
        [str(root / "bin/nvidia-smi"), "-L"],
        env=simmachine.sim_env(root),
        capture_output=True,
        text=True,
        check=True,
    )
    found: dict[int, Counter[str]] = {}
    gpu = -1
    for line in proc.stdout.splitlines():
        if line.startswith("GPU "):
            gpu = int(line.split()[1].rstrip(":"))
            found[gpu] = Counter()
        elif line.strip().startswith("MIG "):
            found[gpu][line.split()[1]] += 1
    return found


def assert_layout(root: Path, gpu: int, profiles: dict[str, int]) -> None:
    """GPU `gpu` has MIG on and exactly `profiles`, each GPU instance with one compute instance over it."""
    s = state(root)[gpu]
    assert s["mode"] == (1, 1)
    assert Counter(s["profiles"]) == Counter(profiles)
    # One compute instance per GPU instance, at placement 0, of the CI profile as large as the GPU instance
    # (NVML_COMPUTE_INSTANCE_PROFILE_1/2/3/4/7_SLICE = 0/1/2/3/4).
    full_ci = {"1g": 0, "2g": 1, "3g": 2, "4g": 3, "7g": 4}
    assert sorted(s["ci"]) == sorted((gi_id, full_ci[name[:2]], 0) for _, name, gi_id in s["gi"])
    assert smi_list(root)[gpu] == Counter(profiles)


def by_index(result: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {g["index"]: g for g in result["gpus"]}


# -- tests ----------------------------------------------------------------------------------------------


def test_a100_all_1g_needs_a_reset_and_reapply_is_unchanged(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    first, second = run(root, [task(root, "all-1g.10gb"), task(root, "all-1g.10gb")])
    assert first["changed"] is True and not first.get("failed")
    for gpu in range(8):
        assert_layout(root, gpu, {"1g.10gb": 7})
        got = by_index(first)[gpu]
        assert got["reset"] is True
        assert got["actions"] == ["enable MIG", "reset GPU", "create 7 GPU instance(s)"]
        assert got["before"] == {"mig": "disabled", "instances": []}
        assert got["after"] == {"mig": "enabled", "instances": ["1g.10gb"] * 7}
    assert second["changed"] is False
    assert all(not g["changed"] and g["actions"] == [] and not g["reset"] for g in second["gpus"])


def test_h100_mode_applies_at_once_without_reset(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "hgx-h100")
    (result,) = run(root, [task(root, "all-balanced")])
    assert result["changed"] is True
    for gpu in range(8):
        assert_layout(root, gpu, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})
        assert by_index(result)[gpu]["reset"] is False
        assert "reset GPU" not in by_index(result)[gpu]["actions"]


def test_a100_all_balanced_custom_and_back_to_disabled(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    balanced, custom, custom_again, disabled, disabled_again = run(
        root,
        [
            task(root, "all-balanced"),
            task(root, "custom"),
            task(root, "custom"),
            task(root, "all-disabled"),
            task(root, "all-disabled"),
        ],
    )
    assert balanced["changed"] is True
    # After all-balanced, what custom found and did.
    c = by_index(custom)
    assert c[0]["before"] == {"mig": "enabled", "instances": ["2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb"]}
    assert c[0]["after"] == {"mig": "enabled", "instances": ["3g.40gb", "3g.40gb"]}
    assert c[0]["actions"] == ["destroy 4 GPU instance(s)", "create 2 GPU instance(s)"]
    assert c[0]["reset"] is False  # MIG stays on: no mode change, no reset
    assert c[4]["actions"] == ["destroy 4 GPU instance(s)", "disable MIG", "reset GPU"]
    assert custom_again["changed"] is False
    assert disabled["changed"] is True and disabled_again["changed"] is False
    s = state(root)
    assert all(s[g]["mode"] == (0, 0) and s[g]["gi"] == [] for g in range(8))
    assert smi_list(root) == {g: Counter() for g in range(8)}


def test_custom_layout_per_index(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "hgx-h100")
    (result,) = run(root, [{"config": CONFIG, "layout": "custom"}])
    assert result["changed"] is True
    assert_layout(root, 0, {"3g.40gb": 2})
    assert_layout(root, 1, {"3g.40gb": 2})
    assert_layout(root, 2, {"4g.40gb": 1, "1g.10gb": 3})
    assert_layout(root, 3, {"7g.80gb": 1})
    s = state(root)
    assert all(s[g]["mode"] == (0, 0) for g in (4, 5, 6, 7))
    assert [g["changed"] for g in result["gpus"]] == [True] * 4 + [False] * 4  # 4-7 already disabled


def test_only_differing_gpus_are_touched(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    (first,) = run(root, [task(root, "all-1g.10gb")])
    assert first["changed"] is True
    # GPU 3 drifts (a GPU reset drops its instances); GPU 5's instances change by hand.
    simcontrol.inject(root, ["gpu", "3", "reset"])
    before = state(root)
    assert before[3]["gi"] == [] and before[3]["mode"] == (1, 1)
    (second,) = run(root, [task(root, "all-1g.10gb")])
    assert second["changed"] is True
    assert [g["index"] for g in second["gpus"] if g["changed"]] == [3]
    after = state(root)
    assert_layout(root, 3, {"1g.10gb": 7})
    for gpu in (0, 1, 2, 4, 5, 6, 7):
        assert after[gpu]["gi"] == before[gpu]["gi"]  # same GPU-instance ids and placements: untouched
    assert by_index(second)[3]["actions"] == ["create 7 GPU instance(s)"]


def test_check_mode_with_diff_changes_nothing(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    run(root, [task(root, "gpu0-2g")])
    before = state(root)
    (result,) = run(root, [task(root, "all-balanced")], "--check", "--diff")
    assert state(root) == before
    assert result["changed"] is True
    assert all(g["reset"] is False for g in result["gpus"])
    diff = result["diff"]
    assert diff["before"]["gpu0"] == {"mig": "enabled", "instances": ["2g.20gb", "2g.20gb", "2g.20gb"]}
    assert diff["before"]["gpu1"] == {"mig": "disabled", "instances": []}
    balanced = {"mig": "enabled", "instances": ["2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb"]}
    assert diff["after"]["gpu0"] == diff["after"]["gpu7"] == balanced
    assert by_index(result)[0]["actions"] == ["destroy 3 GPU instance(s)", "create 4 GPU instance(s)"]
    assert by_index(result)[1]["actions"] == ["enable MIG", "create 4 GPU instance(s)"]
    # Check mode on an applied layout: unchanged, before == after.
    (applied,) = run(root, [task(root, "gpu0-2g")], "--check", "--diff")
    assert applied["changed"] is False
    assert applied["diff"]["before"] == applied["diff"]["after"]


def test_refusals_change_nothing(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    run(root, [task(root, "gpu0-2g")])
    before = state(root)
    garbage = root.parent.parent / "garbage.yaml"
    garbage.write_text("version: v1\nmig-configs: {all: [devices: all\n")
    bad_key = {**CONFIG, "mig-configs": {"x": [{"devices": "all", "mig-enabled": False, "mig-device": {}}]}}
    results = run(
        root,
        [
            task(root, "no-such-profile"),
            task(root, "too-many"),
            task(root, "too-many-slices"),
            task(root, "bad-placement"),
            task(root, "no-such-layout"),
            task(root, "no-such-gpu"),
            {"config_file": str(garbage), "layout": "all"},
            {"config": bad_key, "layout": "x"},
            {"config": {**CONFIG, "version": "v2"}, "layout": "all-disabled"},
            {"config": {**CONFIG, "extra": 1}, "layout": "all-disabled"},
            {"config_file": str(root.parent.parent / "missing.yaml"), "layout": "all-disabled"},
        ],
    )
    assert all(r.get("failed") is True for r in results), [r.get("msg") for r in results]
    msgs = [r["msg"] for r in results]
    assert "has no MIG profile 1g.5gb" in msgs[0]
    assert "1g.10gb x8 (at most 7)" in msgs[1]
    assert "8 compute slices of 7" in msgs[2]
    assert "no placement of the instances fits" in msgs[3]
    assert "has no layout 'no-such-layout'" in msgs[4]
    assert "no GPU 9 on this host" in msgs[5]
    assert "does not parse" in msgs[6]
    assert "unknown key(s) mig-device" in msgs[7]
    assert "version must be v1" in msgs[8]
    assert "unknown top-level key(s) extra" in msgs[9]
    assert "cannot read" in msgs[10]
    assert state(root) == before


def test_mig_on_a_gpu_without_mig_is_refused(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "pcie-2x-t4")
    enable, disable = run(root, [task(root, "all-1g.10gb"), task(root, "all-disabled")])
    assert enable["failed"] is True
    assert "GPU 0 (Tesla T4) does not support MIG" in enable["msg"]
    assert "GPU 1 (Tesla T4) does not support MIG" in enable["msg"]
    # Disabled is what a GPU without MIG already is: nothing to do.
    assert not disable.get("failed") and disable["changed"] is False
    assert [g["before"] for g in disable["gpus"]] == [{"mig": "not supported"}] * 2


def test_a100_pending_mode_is_settled(sim_lib: Path, tmp_path: Path) -> None:
    """A GPU left with a mode change pending (set, never reset) differs from its layout and is settled."""
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    code = "import pynvml as n; n.nvmlInit(); n.nvmlDeviceSetMigMode(n.nvmlDeviceGetHandleByIndex(1), 1)"
    subprocess.run([sys.executable, "-c", code], env=simmachine.sim_env(root), check=True)
    assert state(root)[1]["mode"] == (0, 1)
    disabled, enabled = run(root, [task(root, "all-disabled"), task(root, "all-enabled")])
    assert [g["index"] for g in disabled["gpus"] if g["changed"]] == [1]
    got = by_index(disabled)[1]
    assert got["before"] == {"mig": "disabled", "instances": [], "mig_pending": "enabled"}
    assert got["actions"] == ["disable MIG"] and got["reset"] is False  # pending undone: nothing to reset
    assert enabled["changed"] is True
    assert all(g["actions"] == ["enable MIG", "reset GPU"] and g["reset"] for g in enabled["gpus"])
    assert all(s["mode"] == (1, 1) and s["gi"] == [] for s in state(root).values())


def test_stand_in_nvidia_smi_gpu_reset(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "dgx-a100")
    env = simmachine.sim_env(root)
    smi = str(root / "bin/nvidia-smi")
    code = "import pynvml as n; n.nvmlInit(); n.nvmlDeviceSetMigMode(n.nvmlDeviceGetHandleByIndex(2), 1)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert state(root)[2]["mode"] == (0, 1)
    proc = subprocess.run([smi, "-r", "-i", "2"], env=env, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    bus = simmachine.load_machine(root)["gpus"][2]["bus_id"]
    assert proc.stdout.splitlines() == [f"GPU {bus} was successfully reset.", "All done."]
    assert state(root)[2]["mode"] == (1, 1)
    missing_id = subprocess.run([smi, "--gpu-reset"], env=env, capture_output=True, text=True, check=False)
    assert missing_id.returncode == 2


# -- the H200: its profiles as NVML lists them --------------------------------------------------------------

H200_OFFERS = "1g.18gb, 1g.18gb+me, 1g.35gb, 2g.35gb, 3g.71gb, 4g.71gb, 7g.141gb"
H200_CONFIG = {
    "version": "v1",
    "mig-configs": {
        "balanced": [
            {"devices": "all", "mig-enabled": True, "mig-devices": {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1}}
        ],
        "custom": [
            {"devices": [0], "mig-enabled": True, "mig-devices": {"4g.71gb": 1, "3g.71gb": 1}},
            {"devices": [1, 2], "mig-enabled": True, "mig-devices": {"1g.18gb+me": 1, "1g.18gb": 6}},
            {"devices": [3], "mig-enabled": True, "mig-devices": {"7g.141gb": 1}},
            {"devices": [4], "mig-enabled": True, "mig-devices": {"1g.35gb": 4}},
            {"devices": [5, 6, 7], "mig-enabled": False},
        ],
        "a100-names": CONFIG["mig-configs"]["all-1g.10gb"],
        "too-many": [{"devices": [0], "mig-enabled": True, "mig-devices": {"1g.18gb+me": 2}}],
    },
}


def h200_task(layout: str) -> dict[str, Any]:
    return {"config": H200_CONFIG, "layout": layout}


def test_h200_vm_applies_its_own_profiles_and_refuses_others_naming_them(
    sim_lib: Path, tmp_path: Path
) -> None:
    """The recorded H200 (one GPU in a VM): NVML's profile table plans the layout; a profile of another
    model is refused naming the seven the H200 offers, and nothing changes."""
    root = materialize(sim_lib, tmp_path, "firecracker-vm-h200")
    first, again, foreign, too_many = run(
        root, [h200_task("balanced"), h200_task("balanced"), h200_task("a100-names"), h200_task("too-many")]
    )
    assert first["changed"] is True and not first.get("failed"), first.get("msg")
    assert_layout(root, 0, {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1})
    got = by_index(first)[0]
    assert (got["model"], got["reset"]) == ("NVIDIA H200", False)  # Hopper: the mode applies at once
    assert got["actions"] == ["enable MIG", "create 4 GPU instance(s)"]
    assert got["after"] == {"mig": "enabled", "instances": ["2g.35gb", "1g.18gb", "1g.18gb", "3g.71gb"]}
    assert again["changed"] is False
    before = state(root)
    assert foreign["failed"] is True
    assert foreign["msg"] == (
        "layout a100-names entry 0: GPU 0 (NVIDIA H200) has no MIG profile 1g.10gb "
        f"(it offers {H200_OFFERS}, as NVML lists them; change the layout's mig-devices)"
    )
    assert too_many["failed"] is True and "1g.18gb+me x2 (at most 1)" in too_many["msg"]
    assert state(root) == before


def test_hgx_h200_custom_layout_per_index(sim_lib: Path, tmp_path: Path) -> None:
    root = materialize(sim_lib, tmp_path, "hgx-h200")
    (result,) = run(root, [h200_task("custom")])
    assert result["changed"] is True and not result.get("failed"), result.get("msg")
    assert_layout(root, 0, {"4g.71gb": 1, "3g.71gb": 1})
    assert_layout(root, 1, {"1g.18gb+me": 1, "1g.18gb": 6})
    assert_layout(root, 2, {"1g.18gb+me": 1, "1g.18gb": 6})
    assert_layout(root, 3, {"7g.141gb": 1})
    assert_layout(root, 4, {"1g.35gb": 4})
    s = state(root)
    assert all(s[g]["mode"] == (0, 0) for g in (5, 6, 7))
    assert [g["changed"] for g in result["gpus"]] == [True] * 5 + [False] * 3


def test_a_model_without_a_gpufleet_table_is_planned_from_nvml(sim_lib: Path, tmp_path: Path) -> None:
    """A GPU whose name no fallback table knows (the H200 fixture under another name): the layout is
    checked and applied with the profiles NVML lists."""
    fixture = yaml.safe_load((simmachine.FIXTURE_DIR / "firecracker-vm-h200.yaml").read_text())
    fixture["gpu"]["name"] = "NVIDIA H200 renamed by a test"
    path = tmp_path / "h200-renamed.yaml"
    path.write_text(yaml.safe_dump(fixture))
    root = simmachine.materialize(path, tmp_path / "base" / "h200-renamed", library=sim_lib)
    assert profile_table(fixture["gpu"]["name"]) is None
    applied, foreign = run(root, [h200_task("balanced"), h200_task("a100-names")])
    assert applied["changed"] is True and not applied.get("failed"), applied.get("msg")
    assert_layout(root, 0, {"1g.18gb": 2, "2g.35gb": 1, "3g.71gb": 1})
    assert f"has no MIG profile 1g.10gb (it offers {H200_OFFERS}, as NVML lists them" in foreign["msg"]


def recorded_h200_table() -> dict[str, tuple[int, int, tuple[int, ...], int]]:
    """The real H200's MIG profiles in mig_layout's form (compute slices, memory slices per placement,
    starts, most instances): NVML's profile infos and placements as two H200s answered them with MIG off
    (the first host's probe could not read placements; `nvidia-smi mig -lgipp` there listed them)."""
    first = json.loads((REALGPU / "h200-580.159.04/nvml-probe.json").read_text())["devices"][0][
        "mig_profiles"
    ]
    second = json.loads((REALGPU / "h200-580.159.04-host2/nvml-probe.json").read_text())["devices"][0]
    lgipp = (REALGPU / "h200-580.159.04/smi-mig-lgipp.txt").read_text()
    listed = {  # profile id -> [(start, size)] from `nvidia-smi mig -lgipp`
        int(pid): [(int(start), int(size)) for start in starts.split(",")]
        for pid, starts, size in re.findall(r"Profile ID\s+(\d+) Placements?\s*: \{([\d,]+)\}:(\d+)", lgipp)
    }
    table = {}
    assert first.keys() == second["mig_profiles"].keys()
    for index, entry in second["mig_profiles"].items():
        assert ("ok" in entry) == ("ok" in first[index]), index  # the same profile indexes answered
        if "ok" not in entry:
            continue
        info = entry["ok"]
        assert info == first[index]["ok"]  # both H200s list the same profiles
        placements = [tuple(p) for p in entry["placements"]["ok"]]
        assert placements == listed[info["id"]]
        (size,) = {size for _, size in placements}
        starts = tuple(start for start, _ in placements)
        table[info["name"].removeprefix("MIG ")] = (info["sliceCount"], size, starts, info["instanceCount"])
    return table


def test_gpufleets_h200_table_is_the_recorded_one(sim_lib: Path, tmp_path: Path) -> None:
    """The fallback table equals what the real H200 listed, and so does NVML's table on the simulated H200
    (read through MigNvml, as the module reads it)."""
    recorded = recorded_h200_table()
    assert len(recorded) == 7 and ", ".join(recorded) != H200_OFFERS  # NVML's index order is not -lgip's
    assert recorded == PROFILES_H200
    assert ", ".join(PROFILES_H200) == H200_OFFERS
    assert profile_table("NVIDIA H200") is PROFILES_H200
    root = materialize(sim_lib, tmp_path, "firecracker-vm-h200")
    code = (
        "import json, pynvml, sys; sys.path.insert(0, sys.argv[1]); import mig_layout; pynvml.nvmlInit(); "
        "print(json.dumps([g['profiles'] for g in mig_layout.MigNvml(pynvml).gpus()]))"
    )
    utils = str(REPO / "plugins/module_utils")
    proc = subprocess.run(
        [sys.executable, "-c", code, utils], env=simmachine.sim_env(root), capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    (nvml,) = json.loads(proc.stdout)
    assert list(nvml) == H200_OFFERS.split(", ")  # smallest first, as -lgip lists them
    assert {name: (c, m, tuple(starts), n) for name, (c, m, starts, n) in nvml.items()} == recorded


def test_without_nvmls_table_the_fallback_table_or_a_clear_refusal() -> None:
    """Where NVML lists no profiles (profiles None), gpufleet's table for the model plans the layout; a
    model without one is refused, saying which models have one."""

    def gpu(model: str) -> dict[str, Any]:
        return {
            "index": 0,
            "model": model,
            "pci_device_id": 0x233510DE,
            "mig_supported": True,
            "profiles": None,
        }

    entries = [{"devices": "all", "mig-enabled": True, "mig-devices": {"1g.18gb": 2, "4g.71gb": 1},
                "device-filter": None}]  # fmt: skip
    planned = wanted_per_gpu(entries, "mine", [gpu("NVIDIA H200")])
    assert planned[0]["placement"] == [("4g.71gb", 0), ("1g.18gb", 4), ("1g.18gb", 5)]
    with pytest.raises(LayoutError) as refused:
        wanted_per_gpu([{**entries[0], "mig-devices": {"1g.10gb": 1}}], "mine", [gpu("NVIDIA H200")])
    assert str(refused.value) == (
        f"layout mine entry 0: GPU 0 (NVIDIA H200) has no MIG profile 1g.10gb (it offers {H200_OFFERS}, "
        "gpufleet's table for the model; change the layout's mig-devices)"
    )
    with pytest.raises(LayoutError, match=r"GPU 0 \(NVIDIA B200\): NVML lists no MIG profiles for it and "
                       r"gpufleet has no profile table for this model \(it has tables for A100"):  # fmt: skip
        wanted_per_gpu(entries, "mine", [gpu("NVIDIA B200")])


# -- in-process: the placement search and the process refusal ---------------------------------------------


@pytest.mark.parametrize(
    ("wanted", "fits"),
    [
        ({"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}, True),  # needs the 3g at slice 4
        ({"4g.40gb": 1, "2g.20gb": 1, "1g.20gb": 1}, True),
        ({"3g.40gb": 2, "1g.10gb": 1}, False),  # memory slices all taken by the two 3g
        ({"1g.20gb": 4, "1g.10gb": 3}, False),  # 7 compute slices, but 8 memory slices used by the 1g.20gb
        ({"2g.20gb": 3, "1g.10gb": 1}, True),
    ],
)
def test_placement_search(wanted: dict[str, int], fits: bool) -> None:
    table = profile_table("NVIDIA A100-SXM4-80GB")
    assert table is not None
    placed = place(table, wanted)
    assert (placed is not None) == fits
    if placed:
        used = [s for name, start in placed for s in range(start, start + table[name][1])]
        assert len(used) == len(set(used)) and max(used) < 8
        assert Counter(name for name, _ in placed) == Counter(wanted)
        assert all(start in table[name][2] for name, start in placed)


class _NotSupported(Exception):
    pass


class _FakeNvml:
    """Just the process calls of pynvml: the simulator runs no processes (docs/simulator.md), so the
    refusal is tested against this stand-in. GPU 0 has MIG on, with a process in MIG device 1."""

    NVMLError = Exception
    NVMLError_NotSupported = _NotSupported

    def nvmlDeviceGetMaxMigDeviceCount(self, h: str) -> int:
        return 3

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: str, k: int) -> str:
        if k == 2:
            raise self.NVMLError("not found")
        return f"{h}/mig{k}"

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[object]:
        return [object()] if h == "gpu0/mig1" else []

    def nvmlDeviceGetGraphicsRunningProcesses(self, h: str) -> list[object]:
        if h == "gpu1":
            raise _NotSupported
        return []


def test_processes_are_counted_on_the_gpu_and_its_mig_devices() -> None:
    mig = MigNvml(_FakeNvml())
    assert mig.processes("gpu0", True) == 1
    assert mig.processes("gpu0", False) == 0  # MIG off: its MIG devices are not asked
    assert mig.processes("gpu1", None) == 0  # NOT_SUPPORTED counts as none


def test_busy_gpus_that_would_change_are_refused() -> None:
    def gpu(index: int, processes: int, instances: list[str]) -> dict[str, Any]:
        return {
            "index": index,
            "mig_supported": True,
            "current": True,
            "pending": True,
            "clean": True,
            "instances": instances,
            "processes": processes,
        }

    want = {"enabled": True, "devices": {"3g.40gb": 2}, "placement": []}
    # GPU 0 busy but already as wanted: allowed; GPU 1 would change and is idle: allowed.
    refuse_busy([(gpu(0, 2, ["3g.40gb", "3g.40gb"]), want), (gpu(1, 0, []), want)])
    with pytest.raises(LayoutError, match=r"processes use the GPU: GPU 2 \(1 process\(es\)\)"):
        refuse_busy([(gpu(0, 2, ["3g.40gb", "3g.40gb"]), want), (gpu(2, 1, ["7g.80gb"]), want)])


class _Refusing:
    """A driver that answers no profile info with MIG off (what the fallback tables are for)."""

    NVMLError = Exception
    NVMLError_NotSupported = _NotSupported
    NVMLError_InvalidArgument = ValueError
    NVML_GPU_INSTANCE_PROFILE_COUNT = 15

    def nvmlDeviceGetGpuInstanceProfileInfo(self, h: str, index: int) -> object:
        raise _NotSupported


def test_nvml_without_profiles_gives_no_table() -> None:
    assert MigNvml(_Refusing()).nvml_profiles("gpu0") is None
