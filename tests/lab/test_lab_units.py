"""The lab's pieces that need no containers: its spec, the generated inventory, the simulated driver files a
host receives, and the stand-in NVIDIA runtime's injection into an OCI spec."""

from __future__ import annotations

import json
import os
import runpy
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from gpufleet_harness.cluster import cri as crimod
from gpufleet_harness.lab import hostsetup
from gpufleet_harness.lab import lab as fleetlab
from gpufleet_harness.lab.spec import DEFAULT_HOSTS, METRICS_PORT, HostSpec, LabSpec
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim.miglayout import make_layout
from gpufleet_harness.testhosts import nvidia_packages

REPO = Path(__file__).resolve().parents[2]


def test_spec_rejects_bad_names_and_host_sets(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="lab name"):
        LabSpec(name="Bad_Name", state_dir=tmp_path)
    with pytest.raises(ValueError, match="distinct"):
        LabSpec(hosts=(DEFAULT_HOSTS[0], DEFAULT_HOSTS[0]))
    with pytest.raises(ValueError, match="extender"):
        LabSpec(hosts=(HostSpec("a", "pcie-2x-t4"),))
    with pytest.raises(ValueError, match="runtime 'crio'"):
        HostSpec("a", "pcie-2x-t4", runtime="crio")
    with pytest.raises(ValueError, match="a RuntimeClass needs containerd"):
        HostSpec("a", "pcie-2x-t4", runtime="docker", runtime_class=True)
    spec = LabSpec(name="x1", state_dir=tmp_path)
    assert spec.container(DEFAULT_HOSTS[1]) == "gpufleet-x1-pcie-2x-t4"
    assert spec.volume(DEFAULT_HOSTS[1]) == "gpufleet-x1-pcie-2x-t4-docker"
    assert spec.volumes(DEFAULT_HOSTS[1]) == {"gpufleet-x1-pcie-2x-t4-containerd": "/var/lib/containerd"}
    assert spec.volumes(DEFAULT_HOSTS[2]) == {"gpufleet-x1-esxi-vm-2x-v100-docker": "/var/lib/docker"}


def test_default_lab_runs_containerd_with_one_dockershim_host(monkeypatch: pytest.MonkeyPatch) -> None:
    runtimes = {h.name: h.runtime for h in DEFAULT_HOSTS}
    assert runtimes == {"dgx-a100": "containerd", "pcie-2x-t4": "containerd", "esxi-vm-2x-v100": "docker"}
    assert [h.name for h in DEFAULT_HOSTS if h.runtime_class] == ["pcie-2x-t4"]
    monkeypatch.setenv("GPUFLEET_LAB_RUNTIME", "docker")
    assert {h.runtime for h in LabSpec.from_env().hosts} == {"docker"}
    assert not any(h.runtime_class for h in LabSpec.from_env().hosts)  # dockershim: the default runtime only
    monkeypatch.setenv("GPUFLEET_LAB_RUNTIME", "")
    assert {h.name: h.runtime for h in LabSpec.from_env().hosts} == runtimes


def test_kubelet_unit_per_runtime() -> None:
    units = {}
    for runtime, (note, unit_name, flags) in hostsetup.KUBELET_RUNTIME_FLAGS.items():
        units[runtime] = hostsetup.KUBELET_UNIT.format(
            version="v1.20.2", pause="gpufleet-lab/pause:1", runtime_note=note, runtime_unit=unit_name,
            runtime_flags=flags)  # fmt: skip
    cri = units["containerd"]
    assert "--container-runtime=remote \\\n" in cri
    assert f"--container-runtime-endpoint=unix://{crimod.CONTAINERD_SOCKET} \\\n" in cri
    assert "--runtime-request-timeout=15m" in cri and "Requires=containerd.service" in cri
    docker = units["docker"]
    assert "--container-runtime=docker \\\n" in docker and "Requires=docker.service" in docker
    for unit in units.values():
        # every continued line ends in a backslash, the last flag does not
        lines = unit.split("ExecStart=", 1)[1].split("\nRestart=")[0].splitlines()
        assert all(line.endswith(" \\") for line in lines[:-1]) and not lines[-1].endswith("\\"), lines
        assert "--pod-infra-container-image=gpufleet-lab/pause:1" in unit


def test_containerd_config_is_what_cri_needs() -> None:
    import tomllib

    config = tomllib.loads(crimod.containerd_config("gpufleet-lab/pause:1", hostsetup.CONTAINERD_COMMENT))
    assert config["version"] == 2
    cri = config["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["sandbox_image"] == "gpufleet-lab/pause:1"
    assert cri["cni"] == {"bin_dir": "/usr/lib/cni", "conf_dir": "/etc/cni/net.d"}
    runc = cri["containerd"]["runtimes"]["runc"]
    assert runc["runtime_type"] == "io.containerd.runc.v2"
    assert runc["options"]["SystemdCgroup"] is False  # the kubelet's --cgroup-driver=cgroupfs
    assert "disabled_plugins" not in config
    conflist = crimod.CNI_CONFLIST
    assert [p["type"] for p in conflist["plugins"]] == ["bridge", "portmap"]
    assert hostsetup.CNI_CONFLIST_PATH.startswith(cri["cni"]["conf_dir"] + "/")
    assert hostsetup.CNI_CONFLIST_PATH.endswith(".conflist")


def test_docker_archive_carries_the_layer_and_the_import_changes(tmp_path: Path) -> None:
    import hashlib
    import io
    import tarfile

    from gpufleet_harness.cluster.images import IMPORT_CHANGES

    rootfs = tmp_path / "rootfs.tar"
    with tarfile.open(rootfs, "w") as tar:
        info = tarfile.TarInfo("./hello")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    out = io.BytesIO()
    crimod.write_docker_archive(out, "gpufleet-lab/x:1", rootfs, list(IMPORT_CHANGES))
    out.seek(0)
    with tarfile.open(fileobj=out) as archive:
        manifest = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
        (entry,) = manifest
        assert entry["RepoTags"] == ["gpufleet-lab/x:1"]
        config_blob = archive.extractfile(entry["Config"]).read()  # type: ignore[union-attr]
        layer = archive.extractfile(entry["Layers"][0]).read()  # type: ignore[union-attr]
    assert layer == rootfs.read_bytes()
    assert entry["Config"] == hashlib.sha256(config_blob).hexdigest() + ".json"
    config = json.loads(config_blob)
    assert config["rootfs"]["diff_ids"] == ["sha256:" + hashlib.sha256(layer).hexdigest()]
    assert (config["os"], config["architecture"]) == ("linux", "amd64")
    assert config["config"]["Entrypoint"] == ["python3", "-m", "gpufleet.deviceplugin"]
    assert any(e.startswith("PATH=/usr/local/sbin:") for e in config["config"]["Env"])
    with pytest.raises(ValueError, match="only ENV, ENTRYPOINT and CMD"):
        crimod.write_docker_archive(io.BytesIO(), "x:1", rootfs, ["-c", "WORKDIR /x"])


def _state() -> dict:
    return {
        "supervisor": {
            "kubeconfig": "/k/admin.kubeconfig",
            "apiserver": {"port": 6443, "url": "https://127.0.0.1:6443"},
            "repo": {"url": "http://10.0.2.2:8080"},
            "scheduler": {"kubeconfig": "/k/s", "manifest": "/m/kube-scheduler.yaml", "secure_port": 10259},
            "prometheus": {"url": "http://127.0.0.1:9090", "port": 9090},
        },
        "extender": {"host": "dgx-a100", "port": 40000},
        "gpufleet_image": "gpufleet-lab/gpufleet:abc",
        "images_dir": "/s/images",
    }


def test_inventory_groups_hosts_and_resolves_with_the_committed_group_vars(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory"
    (inventory).mkdir()
    (inventory / "group_vars").symlink_to(REPO / "inventory/lab/group_vars")
    spec = LabSpec(name="u1", state_dir=tmp_path / "state", inventory_dir=inventory)
    path = fleetlab.write_inventory(spec, _state())
    assert path.read_text().startswith(fleetlab.GENERATED_MARK)
    doc = yaml.safe_load(path.read_text())
    children = doc["all"]["children"]
    assert sorted(children["gpu_nodes"]["hosts"]) == sorted(h.name for h in DEFAULT_HOSTS)
    assert list(children["nvswitch"]["hosts"]) == ["dgx-a100"]
    assert list(children["kube_control_plane"]["hosts"]) == ["lab-control-plane"]
    # What Ansible makes of it together with inventory/lab/group_vars.
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(inventory),
         "--host", "dgx-a100"],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    hostvars = json.loads(out.stdout)
    assert hostvars["ansible_host"] == "gpufleet-u1-dgx-a100"
    assert hostvars["ansible_connection"] == "gpufleet.nvidia.podman"
    assert hostvars["gpufleet_lab"]["repo_url"] == "http://10.0.2.2:8080"
    # the device plugin and the extender come the operator's way: role gpufleet_images, from built archives
    assert hostvars["gpufleet_images_dir"] == "{{ gpufleet_lab.images_dir }}"
    assert hostvars["gpufleet_lab"]["images_dir"] == "/s/images"
    assert "gpufleet_kubernetes_device_plugin_image" not in hostvars
    assert "gpufleet_kubernetes_extender_image" not in hostvars
    # the runtime suite checks the runtime the host's kubelet uses (group_vars/all.yml reads this)
    assert hostvars["gpufleet_container_runtime"] == "containerd"
    assert "gpufleet_container_runtime" in hostvars["gpufleet_validation_runtime"]
    assert children["gpu_nodes"]["hosts"]["esxi-vm-2x-v100"]["gpufleet_container_runtime"] == "docker"
    # runc stays the default where GPU pods name the RuntimeClass; the toolkit role reads this
    gpu_hosts = children["gpu_nodes"]["hosts"]
    assert gpu_hosts["pcie-2x-t4"]["nvidia_container_toolkit_default_runtime"] is False
    assert "nvidia_container_toolkit_default_runtime" not in gpu_hosts["dgx-a100"]
    # each host's mode: a named configuration of the one DaemonSet (group_vars/all.yml has them)
    picks = {name: h.get("gpufleet_device_plugin_config_name") for name, h in gpu_hosts.items()}
    assert picks == {"dgx-a100": "mig", "pcie-2x-t4": "memory", "esxi-vm-2x-v100": "sliced"}
    named = hostvars["gpufleet_kubernetes_device_plugin_config"]["configs"]["named"]
    assert {p for p in picks.values() if p} <= set(named)
    # the DGX's MIG layout: playbooks/runtime.yml runs role nvidia_mig there, with a layout of the config
    assert (hostvars["gpufleet_mig_enabled"], hostvars["nvidia_mig_layout"]) == (True, "lab-mixed")
    assert "lab-mixed" in hostvars["nvidia_mig_config"]["mig-configs"]
    assert not any("gpufleet_mig_enabled" in h for n, h in gpu_hosts.items() if n != "dgx-a100")
    assert "gpufleet_target" not in hostvars  # plays pick hosts before group_vars apply: never set it there
    # the cluster suite's metrics checks ask the lab's Prometheus, which scrapes the plugins' http.port
    assert hostvars["gpufleet_lab"]["prometheus_url"] == "http://127.0.0.1:9090"
    assert "gpufleet_lab.prometheus_url" in hostvars["gpufleet_validation_cluster"]["prometheus"]["url"]
    assert hostvars["gpufleet_kubernetes_device_plugin_config"]["http"]["port"] == METRICS_PORT


@pytest.mark.root
def test_staged_sim_root_has_real_files_and_a_device_script(sim_lib: Path, tmp_path: Path) -> None:
    root = hostsetup.stage_sim("pcie-2x-t4", tmp_path, sim_lib)
    lib = root / "lib/libnvidia-ml.so.1"
    assert lib.is_file() and not lib.is_symlink()
    assert lib.read_bytes() == sim_lib.read_bytes()
    assert not any(stat.S_ISCHR(p.lstat().st_mode) for p in root.rglob("*"))
    script = (root / "bin/gpufleet-sim-devices").read_text()
    assert "mknod -m 666 /dev/nvidia0 c 195 0" in script
    assert "mknod -m 666 /dev/nvidia1 c 195 1" in script
    assert "mknod -m 666 /dev/nvidia2 " not in script
    assert str(tmp_path) not in (root / "bin/nvidia-smi").read_text()
    assert (root / "python/pynvml.py").is_file() and (root / "python/gpufleet_harness/sim/smi.py").is_file()
    # The stand-in works from the staged copy with only the standard library + the copied modules.
    env = {"PATH": "/usr/bin:/bin", "GPUFLEET_SIM_ROOT": str(root), "LD_LIBRARY_PATH": str(root / "lib"),
           "GPUFLEET_HOST_ROOT": str(root / "host"), "PYTHONPATH": str(root / "python")}  # fmt: skip
    out = subprocess.run(["/usr/bin/python3", "-s", "-m", "gpufleet_harness.sim.smi", "-L"], env=env,
                         capture_output=True, text=True, check=False, cwd=root / "python")  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("Tesla T4") == 2, out.stdout

    # MIG-capable GPUs: their capability nodes too (a MIG device's pod is given its GI/CI nodes), in /dev's
    # nvidia-caps/ and in the host view's
    staged = hostsetup.stage_sim("dgx-a100", tmp_path / "dgx", sim_lib)
    assert (staged / "workloads").is_dir()  # GPU containers get it writable (the burner registers there)
    dgx = (staged / "bin/gpufleet-sim-devices").read_text()
    assert dgx.count("mkdir -p /dev/nvidia-caps\n") == 1
    assert f"mkdir -p {hostsetup.SIM_DIR}/host/dev/nvidia-caps\n" in dgx
    caps = [line for line in dgx.splitlines() if "mknod -m 666 /dev/nvidia-caps/nvidia-cap" in line]
    assert caps and all(f" c {simmachine.NVIDIA_CAPS_MAJOR} " in line for line in caps), caps[:3]


def _runtime(tmp_path: Path, machine: dict | None) -> dict:
    shim = tmp_path / "nvidia-container-runtime"
    shim.write_text(nvidia_packages._RUNTIME_SHIM.replace("sys.exit(main(sys.argv[1:]))", ""))
    sim = tmp_path / "sim"
    sim.mkdir()
    if machine is not None:
        (sim / "machine.json").write_text(json.dumps(machine))
    os.environ["GPUFLEET_SIM_ROOT"] = str(sim)
    os.environ["GPUFLEET_RUNTIME_LOG"] = str(tmp_path / "runtime.log")  # not this machine's /var/log
    try:
        return runpy.run_path(str(shim))
    finally:
        del os.environ["GPUFLEET_SIM_ROOT"], os.environ["GPUFLEET_RUNTIME_LOG"]


def _bundle(tmp_path: Path, env: list[str]) -> Path:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"process": {"env": ["PATH=/bin", *env]}, "mounts": []}))
    return config


MACHINE = {"gpus": [{"uuid": f"GPU-{c * 3}", "minor": i} for i, c in enumerate("abc")]}


def test_runtime_injects_only_the_visible_gpus(tmp_path: Path) -> None:
    shim = _runtime(tmp_path, MACHINE)
    config = _bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=GPU-bbb,2"])
    assert shim["inject"](str(config)) is True
    spec = json.loads(config.read_text())
    assert {m["destination"] for m in spec["mounts"]} == {str(tmp_path / "sim"), "/usr/bin/nvidia-smi"}
    assert f"GPUFLEET_SIM_ROOT={tmp_path / 'sim'}" in spec["process"]["env"]
    wanted = {d["path"] for d in spec["linux"]["devices"]}
    # Only device nodes that exist on the host are added; the GPU nodes chosen are minors 1 and 2.
    allowed = {"/dev/nvidia1", "/dev/nvidia2", "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    assert not wanted - allowed
    assert [g["uuid"] for g in shim["visible"]({"NVIDIA_VISIBLE_DEVICES": "GPU-bbb,2"}, MACHINE["gpus"])] == [
        "GPU-bbb", "GPU-ccc"]  # fmt: skip


def test_runtime_gives_gpu_containers_the_workloads_directory_writable(tmp_path: Path) -> None:
    """A GPU burner in the container registers its workloads in the sim root's workloads/: that one directory
    is mounted read-write inside the read-only root, after it (mounts apply in order)."""
    shim = _runtime(tmp_path, MACHINE)
    (tmp_path / "sim" / "workloads").mkdir()
    config = _bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=0"])
    assert shim["inject"](str(config)) is True
    mounts = {m["destination"]: m for m in json.loads(config.read_text())["mounts"]}
    root, workloads = str(tmp_path / "sim"), str(tmp_path / "sim" / "workloads")
    assert "ro" in mounts[root]["options"] and "rw" in mounts[workloads]["options"]
    assert list(mounts).index(workloads) > list(mounts).index(root)
    assert mounts[workloads]["source"] == workloads


@pytest.mark.parametrize("env", [[], ["NVIDIA_VISIBLE_DEVICES=none"], ["NVIDIA_VISIBLE_DEVICES=void"]])
def test_runtime_leaves_containers_without_gpus_alone(tmp_path: Path, env: list[str]) -> None:
    shim = _runtime(tmp_path, MACHINE)
    config = _bundle(tmp_path, env)
    before = config.read_text()
    assert shim["inject"](str(config)) is False
    assert config.read_text() == before


def test_runtime_without_a_simulated_machine_changes_nothing(tmp_path: Path) -> None:
    shim = _runtime(tmp_path, None)
    config = _bundle(tmp_path, ["NVIDIA_VISIBLE_DEVICES=all"])
    before = config.read_text()
    assert shim["inject"](str(config)) is False
    assert config.read_text() == before


def test_runtime_injects_the_parent_gpu_of_a_mig_device(
    fresh_root: Callable[[str], Path], tmp_path: Path
) -> None:
    """NVIDIA_VISIBLE_DEVICES=MIG-<uuid>: the stand-in runtime finds the parent GPU through the simulated
    NVML (as the toolkit does) and injects that GPU; an unknown MIG UUID injects nothing. In a child process,
    so that this one never loads the simulated library."""
    root = fresh_root("dgx-a100")
    made = make_layout(root, {6: ["1g.10gb"], 7: ["3g.40gb"]})
    shim = tmp_path / "nvidia-container-runtime"
    shim.write_text(nvidia_packages._RUNTIME_SHIM.replace("sys.exit(main(sys.argv[1:]))", ""))
    machine = json.loads((root / "machine.json").read_text())
    script = (
        "import json, runpy, sys\n"
        "shim = runpy.run_path(sys.argv[1])\n"
        "gpus = json.load(open(sys.argv[2]))['gpus']\n"
        "print(json.dumps([[g['uuid'] for g in shim['visible']({'NVIDIA_VISIBLE_DEVICES': v}, gpus)]"
        " for v in sys.argv[3:]]))\n"
    )
    unknown = "MIG-00000000-0000-4000-8000-000000000000"
    asks = [made[7][0]["uuid"], f"{made[6][0]['uuid']},0", unknown]
    env = {**os.environ, "GPUFLEET_SIM_ROOT": str(root), "GPUFLEET_RUNTIME_LOG": f"{tmp_path}/runtime.log"}
    argv = [sys.executable, "-c", script, str(shim), str(root / "machine.json"), *asks]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=True, timeout=60)
    uuids = [g["uuid"] for g in machine["gpus"]]
    assert json.loads(out.stdout) == [[uuids[7]], [uuids[6], uuids[0]], []]
    assert f"MIG device {unknown}: not found" in (tmp_path / "runtime.log").read_text()
