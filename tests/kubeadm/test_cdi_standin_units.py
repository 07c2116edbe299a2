"""The stand-in nvidia-ctk's ``cdi generate`` and ``cdi list`` against the GPU simulator (no cluster, no root
beyond the simulator's device nodes): the CDI specification laid out as nvidia-ctk 1.17.8 writes it (read in
NVIDIA's source: ``pkg/nvcdi``, ``cmd/nvidia-ctk/cdi/generate``; yaml.v3 with four-space indentation),
devices named by index and UUID and ``all``, MIG devices with their capability nodes, and nvidia-ctk's error
without NVML. The end-to-end use is tests/kubeadm/test_kubeadm_cdi.py."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gpufleet_harness.sim import miglayout
from gpufleet_harness.testhosts import nvidia_packages


@pytest.fixture(scope="module")
def ctk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stand-in as the nvidia-container-toolkit-base package installs it."""
    base = next(p for p in nvidia_packages.container_toolkit_packages("1.17.8-1") if p.name.endswith("-base"))
    assert "/usr/bin/nvidia-cdi-hook" in base.files, (
        "the hook the specification names ships with the base package"
    )
    path = tmp_path_factory.mktemp("ctk") / "nvidia-ctk"
    path.write_text(base.files["/usr/bin/nvidia-ctk"].text)
    path.chmod(0o755)
    return path


def _generate(ctk: Path, root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GPUFLEET_SIM_ROOT": str(root)}
    return subprocess.run(
        ["python3", str(ctk), "cdi", "generate", f"--dev-root={root}/host", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_spec_is_laid_out_as_nvidia_ctk_writes_it(ctk: Path, sim_root: Callable[[str], Path]) -> None:
    root = sim_root("pcie-2x-t4")
    done = _generate(ctk, root)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert text.startswith(
        "---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n"
        '    - name: "0"\n      containerEdits:\n        deviceNodes:\n            - path: /dev/nvidia0\n'
        f"              hostPath: {root}/host/dev/nvidia0\n"
    ), text[:400]
    spec = yaml.safe_load(text)
    gpus = json.loads((root / "machine.json").read_text())["gpus"]
    names = [d["name"] for d in spec["devices"]]
    assert names == ["0", gpus[0]["uuid"], "1", gpus[1]["uuid"], "all"]
    edits = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    assert (
        edits["1"]
        == edits[gpus[1]["uuid"]]
        == [{"path": "/dev/nvidia1", "hostPath": f"{root}/host/dev/nvidia1"}]
    )
    assert [n["path"] for n in edits["all"]] == ["/dev/nvidia0", "/dev/nvidia1"]
    common = spec["containerEdits"]
    assert common["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in common["deviceNodes"]] == [
        "/dev/nvidia-modeset",
        "/dev/nvidia-uvm-tools",
        "/dev/nvidia-uvm",
        "/dev/nvidiactl",
    ]
    assert [(h["hookName"], h["path"], h["args"][:2], h["env"]) for h in common["hooks"]] == [
        (
            "createContainer",
            "/usr/bin/nvidia-cdi-hook",
            ["nvidia-cdi-hook", "create-symlinks"],
            ["NVIDIA_CTK_DEBUG=false"],
        ),
        (
            "createContainer",
            "/usr/bin/nvidia-cdi-hook",
            ["nvidia-cdi-hook", "update-ldcache"],
            ["NVIDIA_CTK_DEBUG=false"],
        ),
    ]
    assert all(m["options"] == ["ro", "nosuid", "nodev", "bind"] for m in common["mounts"])
    # one naming strategy, another kind, JSON, a file
    index_only = yaml.safe_load(_generate(ctk, root, "--device-name-strategy=index", "--class=gpu2").stdout)
    assert [d["name"] for d in index_only["devices"]] == ["0", "1", "all"] and index_only[
        "kind"
    ] == "nvidia.com/gpu2"
    out = root.parent / "out" / "nvidia.json"
    assert _generate(ctk, root, f"--output={out}").returncode == 0
    assert json.loads(out.read_text()) == spec


def test_mig_devices_carry_their_parent_and_capability_nodes(
    ctk: Path, fresh_root: Callable[[str], Path]
) -> None:
    root = fresh_root("dgx-a100")
    migs = miglayout.make_layout(root, {0: ["3g.40gb", "1g.10gb"]})
    spec = yaml.safe_load(_generate(ctk, root).stdout)
    by_name = {d["name"]: d["containerEdits"]["deviceNodes"] for d in spec["devices"]}
    minors = dict(
        (line.rsplit(" ", 1)[0], int(line.rsplit(" ", 1)[1]))
        for line in (root / "host/proc/driver/nvidia-caps/mig-minors").read_text().splitlines()
        if " " in line
    )
    for slot, mig in enumerate(migs[0]):
        nodes = [n["path"] for n in by_name[mig["uuid"]]]
        assert by_name[f"0:{slot}"] == by_name[mig["uuid"]]
        gi, ci = mig["gi"], mig["ci"]
        caps = [minors[f"gpu0/gi{gi}/access"], minors[f"gpu0/gi{gi}/ci{ci}/access"]]
        assert nodes == ["/dev/nvidia0", *(f"/dev/nvidia-caps/nvidia-cap{m}" for m in caps)]
    assert "1:0" not in by_name, "GPU 1 is not in MIG mode"


def test_without_nvml_it_fails_as_nvidia_ctk_does(ctk: Path, tmp_path: Path) -> None:
    done = _generate(ctk, tmp_path / "no-driver")
    assert done.returncode == 1 and "failed to initialize NVML: ERROR_LIBRARY_NOT_FOUND" in done.stderr


def test_list_names_the_devices_of_the_specs(
    ctk: Path, sim_root: Callable[[str], Path], tmp_path: Path
) -> None:
    root = sim_root("pcie-2x-t4")
    spec = tmp_path / "etc/cdi/nvidia.yaml"
    spec.parent.mkdir(parents=True)
    spec.write_text(_generate(ctk, root).stdout)
    script = ctk.read_text().replace(
        'SPEC_DIRS = ["/etc/cdi", "/var/run/cdi"]', f'SPEC_DIRS = ["{spec.parent}"]'
    )
    lister = tmp_path / "nvidia-ctk"
    lister.write_text(script)
    done = subprocess.run(["python3", str(lister), "cdi", "list"], capture_output=True, text=True, check=True)
    names = [d["name"] for d in yaml.safe_load(spec.read_text())["devices"]]
    assert done.stdout.split() == [f"nvidia.com/gpu={n}" for n in names]
    assert "Found 5 CDI devices" in done.stderr
