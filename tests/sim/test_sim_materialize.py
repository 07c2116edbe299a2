"""Fixtures → sim roots: machine.json, the host/ tree, dev nodes, wrappers, and the `gpufleet sim` CLI."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufleet import cli
from gpufleet_harness.sim import machine as simmachine

FIXTURES = [
    "dgx-a100", "hgx-h100", "pcie-2x-t4", "esxi-vm-2x-v100", "esxi-vm-small-mmio", "node-40-gpus",
    "firecracker-vm-h200", "hgx-h200",
]

Roots = Callable[[str], Path]  # fixture name → sim root


def test_bundled_fixtures_have_descriptions() -> None:
    assert simmachine.fixture_names() == sorted(FIXTURES)
    assert all(simmachine.fixture_description(f) for f in FIXTURES)


@pytest.mark.parametrize("fixture", FIXTURES)
def test_expansion_is_deterministic_and_complete(fixture: str) -> None:
    a, b = simmachine.expand(fixture), simmachine.expand(fixture)
    assert a == b
    assert a["schema"] == 1 and a["name"] == fixture
    n = len(a["gpus"])
    assert len(a["topology"]) == n and all(len(row) == n for row in a["topology"])
    assert len({g["uuid"] for g in a["gpus"]}) == n and len({g["bus_id"] for g in a["gpus"]}) == n
    assert a["fabricmanager_required"] == bool(a["nvswitches"])


def test_uuids_differ_between_fixtures() -> None:
    assert simmachine.gpu_uuid("dgx-a100", 0) != simmachine.gpu_uuid("hgx-h100", 0)
    assert simmachine.gpu_uuid("dgx-a100", 0) != simmachine.gpu_uuid("dgx-a100", 1)


def test_unknown_fixture() -> None:
    with pytest.raises(simmachine.FixtureError, match="known: dgx-a100"):
        simmachine.expand("dgx-z900")


def _read(p: Path) -> str:
    return p.read_text().strip()


def test_dgx_host_tree(sim_root: Roots) -> None:
    root = sim_root("dgx-a100")
    host = root / "host"
    devs = host / "sys/bus/pci/devices"
    gpu = devs / "0000:07:00.0"
    files = ("vendor", "device", "class", "subsystem_vendor", "subsystem_device", "numa_node")
    assert [_read(gpu / f) for f in files] == ["0x10de", "0x20b2", "0x030200", "0x10de", "0x1463", "0"]
    assert _read(devs / "0000:bd:00.0" / "numa_node") == "1"
    assert _read(gpu / "local_cpulist") == "0-127"
    assert (gpu / "driver").resolve() == (host / "sys/bus/pci/drivers/nvidia").resolve()
    switches = sorted(p.name for p in devs.iterdir() if _read(p / "class") == "0x068000")
    assert switches == [f"0000:{b:02x}:00.0" for b in range(0xC4, 0xCA)]
    assert {_read(devs / s / "device") for s in switches} == {"0x1af1"}
    assert _read(host / "sys/module/nvidia/version") == "535.261.03"
    version = (host / "proc/driver/nvidia/version").read_text()
    assert version.startswith("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.261.03  ")
    assert _read(host / "sys/class/dmi/id/sys_vendor") == "NVIDIA"
    efivar = host / "sys/firmware/efi/efivars" / simmachine.SECURE_BOOT_VAR
    assert efivar.read_bytes() == b"\x06\x00\x00\x00\x00"
    assert _read(host / "sys/devices/system/node/node1/cpulist") == "128-255"
    assert not (host / "sys/module/nouveau").exists()
    assert _read(host / "proc/sys/kernel/osrelease") == "6.1.0-31-amd64"
    assert _read(root / "control").splitlines() == ["driver loaded", "fabricmanager running"]
    assert (root / "events").read_text() == ""
    assert json.loads((root / "machine.json").read_text()) == simmachine.expand("dgx-a100")


def test_vm_host_tree(sim_root: Roots) -> None:
    host = sim_root("esxi-vm-2x-v100") / "host"
    assert _read(host / "sys/class/dmi/id/sys_vendor") == "VMware, Inc."
    assert _read(host / "sys/class/dmi/id/product_name") == "VMware7,1"
    assert (host / "sys/firmware/efi/efivars" / simmachine.SECURE_BOOT_VAR).read_bytes()[-1:] == b"\x00"
    assert " hypervisor" in (host / "proc/cpuinfo").read_text()
    assert [_read(host / "sys/bus/pci/devices" / b / "numa_node") for b in ("0000:0b:00.0", "0000:13:00.0")] \
        == ["-1", "-1"]


def test_secure_boot_on_and_no_nvswitch(sim_root: Roots) -> None:
    root = sim_root("node-40-gpus")
    assert (root / "host/sys/firmware/efi/efivars" / simmachine.SECURE_BOOT_VAR).read_bytes()[-1:] == b"\x01"
    assert _read(root / "control") == "driver loaded"
    assert not list((root / "host/dev").glob("nvidia-nvswitch*"))
    assert len(list((root / "host/dev").glob("nvidia[0-9]*"))) == 40


@pytest.mark.root
def test_dev_nodes_are_char_devices_when_mknod_works(sim_root: Roots) -> None:
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    dev = sim_root("dgx-a100") / "host/dev"
    st = os.stat(dev / "nvidia3")
    assert stat.S_ISCHR(st.st_mode) and (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 3)
    st = os.stat(dev / "nvidiactl")
    assert (os.major(st.st_rdev), os.minor(st.st_rdev)) == (195, 255)
    assert stat.S_IMODE(st.st_mode) == 0o666
    assert stat.S_ISCHR(os.stat(dev / "nvidia-nvswitch5").st_mode)
    for name in ("nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset", "nvidia-nvswitchctl"):
        assert stat.S_ISCHR(os.stat(dev / name).st_mode)


def test_dev_nodes_fall_back_to_files(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sim_lib: Path) -> None:
    def refuse(*_args: object) -> None:
        raise PermissionError("mknod refused")

    monkeypatch.setattr(os, "mknod", refuse)
    root = simmachine.materialize("pcie-2x-t4", tmp_path / "r", library=sim_lib)
    node = root / "host/dev/nvidia1"
    assert node.is_file() and node.stat().st_size == 0


def test_lib_links_and_smi_wrapper(sim_root: Roots, sim_lib: Path) -> None:
    root = sim_root("pcie-2x-t4")
    assert (root / "lib/libnvidia-ml.so.1").resolve() == sim_lib.resolve()
    assert (root / "host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1").resolve() == sim_lib.resolve()
    wrapper = root / "bin/nvidia-smi"
    assert os.access(wrapper, os.X_OK)
    text = wrapper.read_text()
    assert '-m gpufleet_harness.sim.smi "$@"' in text and str(root) in text
    assert subprocess.run(["sh", "-n", str(wrapper)]).returncode == 0


def test_materialize_refuses_a_foreign_directory(tmp_path: Path) -> None:
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        simmachine.materialize("pcie-2x-t4", tmp_path, build=False)
    assert (tmp_path / "precious.txt").exists()


def test_sim_env(tmp_path: Path) -> None:
    env = simmachine.sim_env(tmp_path, {"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/opt/x"})
    assert env == {"GPUFLEET_SIM_ROOT": str(tmp_path), "LD_LIBRARY_PATH": f"{tmp_path}/lib:/opt/x",
                   "GPUFLEET_HOST_ROOT": f"{tmp_path}/host", "PATH": f"{tmp_path}/bin:/usr/bin"}


# ---------------------------------------------------------------------------------------------- CLI

def test_cli_list(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sim", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == sorted(FIXTURES)


def test_cli_materialize_env_inject(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                    sim_lib: Path) -> None:
    root = tmp_path / "t4"
    assert cli.main(["sim", "materialize", "pcie-2x-t4", str(root)]) == 0
    assert capsys.readouterr().out.strip() == str(root)
    assert cli.main(["sim", "env", "pcie-2x-t4", "--root", str(root)]) == 0
    exports = capsys.readouterr().out.splitlines()
    assert exports[0] == f"export GPUFLEET_SIM_ROOT={root}"
    assert {ln.split("=")[0] for ln in exports} == {"export GPUFLEET_SIM_ROOT", "export LD_LIBRARY_PATH",
                                                    "export GPUFLEET_HOST_ROOT", "export PATH"}
    assert cli.main(["sim", "inject", str(root), "gpu", "1", "lost"]) == 0
    assert "gpu 1 lost" in _read(root / "control")
    # env keeps a current root (the injection survives) ...
    assert cli.main(["sim", "env", "pcie-2x-t4", "--root", str(root)]) == 0
    assert "gpu 1 lost" in _read(root / "control")
    # ... re-points a stale library link at the current build ...
    lib = root / "lib/libnvidia-ml.so.1"
    lib.unlink()
    lib.symlink_to("/nonexistent/old-build/libnvidia-ml.so.1")
    assert cli.main(["sim", "env", "pcie-2x-t4", "--root", str(root)]) == 0
    assert lib.resolve() == sim_lib.resolve() and "gpu 1 lost" in _read(root / "control")
    # ... and re-materializes one made from another fixture.
    assert cli.main(["sim", "env", "esxi-vm-2x-v100", "--root", str(root)]) == 0
    assert json.loads((root / "machine.json").read_text())["name"] == "esxi-vm-2x-v100"


def test_cli_env_default_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str], sim_lib: Path) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert cli.main(["sim", "env", "pcie-2x-t4"]) == 0
    root = tmp_path / f"gpufleet-sim-{os.getuid()}" / "pcie-2x-t4"
    assert f"export GPUFLEET_SIM_ROOT={root}" in capsys.readouterr().out
    assert (root / "machine.json").exists()


@pytest.mark.parametrize("argv", [
    ["sim", "materialize", "no-such-fixture", "/tmp/never-made"],
    ["sim", "env", "no-such-fixture"],
    ["sim", "inject", "/nonexistent/root", "driver", "unloaded"],
    ["sim"],
])
def test_cli_bad_input_exits_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(argv) == 2
    assert capsys.readouterr().err


def test_cli_inject_bad_words_exit_2(sim_root: Roots, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["sim", "inject", str(sim_root("pcie-2x-t4")), "gpu", "7", "lost"]) == 2
    assert "GPU 7 does not exist" in capsys.readouterr().err


def test_cli_usage_error_exits_2() -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["sim", "inject"])
    assert exc.value.code == 2
