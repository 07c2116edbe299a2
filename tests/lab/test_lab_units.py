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
from gpufleet_harness.lab import hostsetup, kubeadm
from gpufleet_harness.lab import lab as fleetlab
from gpufleet_harness.lab.spec import (
    CONTROL_PLANE,
    CONTROL_PLANE_CONTAINERD,
    DEFAULT_HOSTS,
    EXTENDER_TLS_SECRET,
    METRICS_PORT,
    SCHEDULER_TLS_DIR,
    HostSpec,
    LabSpec,
)
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
    with pytest.raises(ValueError, match=r"containerd '1\.5'"):
        HostSpec("a", "pcie-2x-t4", containerd="1.5")
    with pytest.raises(ValueError, match=r"CDI needs containerd 1\.7"):
        HostSpec("a", "pcie-2x-t4", containerd="1.6", cdi=True)
    with pytest.raises(ValueError, match="control plane"):
        LabSpec(hosts=(HostSpec(CONTROL_PLANE, "dgx-a100", runs_extender=True),))
    spec = LabSpec(name="x1", state_dir=tmp_path)
    assert spec.container(DEFAULT_HOSTS[1]) == "gpufleet-x1-pcie-2x-t4"
    assert spec.containerd_volume(DEFAULT_HOSTS[1]) == "gpufleet-x1-pcie-2x-t4-containerd"
    assert spec.control_plane_container == "gpufleet-x1-control-plane"


def test_default_lab_runs_containerd_as_fleets_run_it_now() -> None:
    """Every kubelet on containerd (CRI v1, systemd cgroups), no dockershim: the DGX on Debian 12's 1.6,
    the T4 host on trixie's 1.7, the V100 VM on containerd 2.1 through CDI; RuntimeClass on both trixie
    hosts; each host's driver the one of its Debian release; kubeadm's hosts exist for each containerd."""
    hosts = {h.name: h for h in DEFAULT_HOSTS}
    assert {n: (h.runtime, h.containerd, h.debian) for n, h in hosts.items()} == {
        "dgx-a100": ("containerd", "1.6", "12"),
        "pcie-2x-t4": ("containerd", "1.7", "13"),
        "esxi-vm-2x-v100": ("containerd", "2.1", "13"),
    }
    assert [n for n, h in hosts.items() if h.runtime_class] == ["pcie-2x-t4", "esxi-vm-2x-v100"]
    assert [n for n, h in hosts.items() if h.cdi] == ["esxi-vm-2x-v100"]
    assert hosts["dgx-a100"].driver == ("535", "535.261.03", 12020)
    assert hosts["pcie-2x-t4"].driver == ("550", "550.163.01", 12040)
    # the roles' own default driver of Debian 13 is the one the trixie hosts simulate
    defaults = yaml.safe_load((REPO / "roles/nvidia_driver/vars/Debian.yml").read_text())
    assert defaults["nvidia_driver_os_defaults"]["13"] == {"branch": "550", "version": "550.163.01"}
    assert {h.containerd for h in DEFAULT_HOSTS} | {CONTROL_PLANE_CONTAINERD} <= set(kubeadm.CONTAINERD)
    for h in DEFAULT_HOSTS:
        suite, _ = kubeadm.CONTAINERD[h.containerd]
        assert {"bookworm": "12", "trixie": "13"}[suite] == h.debian


def test_containerd_config_is_what_cri_needs() -> None:
    """The installer's containerd configuration of each host's containerd: CRI v1 with systemd cgroups,
    kubeadm's sandbox image, the CNI directories the lab's bridge conflist is in."""
    import tomllib

    pause = "registry.k8s.io/pause:3.10.2"
    for version in ("1.6.20", "1.7.24"):
        config = tomllib.loads(kubeadm.containerd_config(version, pause))
        assert config["version"] == 2
        cri = config["plugins"]["io.containerd.grpc.v1.cri"]
        assert cri["sandbox_image"] == pause
        assert cri["cni"] == {"bin_dir": "/usr/lib/cni", "conf_dir": "/etc/cni/net.d"}
        runc = cri["containerd"]["runtimes"]["runc"]
        assert runc["runtime_type"] == "io.containerd.runc.v2"
        assert runc["options"]["SystemdCgroup"] is True  # the kubelet's cgroupDriver: systemd
        assert "disabled_plugins" not in config
    config = tomllib.loads(kubeadm.containerd_config("2.1.9", pause))
    assert config["version"] == 3
    runtime = config["plugins"]["io.containerd.cri.v1.runtime"]
    assert runtime["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    assert config["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"] == pause
    conflist = crimod.CNI_CONFLIST
    assert [p["type"] for p in conflist["plugins"]] == ["bridge", "portmap"]
    assert kubeadm.CNI_CONFLIST_PATH.startswith(runtime["cni"]["conf_dir"] + "/")
    assert kubeadm.CNI_CONFLIST_PATH.endswith(".conflist")


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
        "kubeconfig": "/k/admin.conf",
        "apiserver": {"port": 6443, "url": "https://127.0.0.1:6443"},
        "supervisor": {
            "repo": {"url": "http://10.0.2.2:8080"},
            "prometheus": {"url": "http://127.0.0.1:9090", "port": 9090},
        },
        "extender": {"host": "dgx-a100", "port": 40000},
        "gpufleet_image": "gpufleet-lab/gpufleet:abc",
        "images_dir": "/s/images",
    }


def _hostvars(inventory: Path, host: str) -> dict:
    """What Ansible makes of the generated hosts.yml together with inventory/lab/group_vars."""
    out = subprocess.run(
        [str(Path(sys.executable).parent / "ansible-inventory"), "-i", str(inventory), "--host", host],
        capture_output=True, text=True, check=True, cwd=REPO,
    )  # fmt: skip
    return json.loads(out.stdout)


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
    control_plane = {"lab-control-plane": {"ansible_host": "gpufleet-u1-control-plane"}}
    assert children["kube_control_plane"]["hosts"] == control_plane
    hostvars = _hostvars(inventory, "dgx-a100")
    assert hostvars["ansible_host"] == "gpufleet-u1-dgx-a100"
    assert hostvars["ansible_connection"] == "gpufleet.nvidia.podman"
    assert hostvars["gpufleet_lab"]["repo_url"] == "http://10.0.2.2:8080"
    # the device plugin and the extender come the operator's way: role gpufleet_images, from built archives
    assert hostvars["gpufleet_images_dir"] == "{{ gpufleet_lab.images_dir }}"
    assert hostvars["gpufleet_lab"]["images_dir"] == "/s/images"
    assert "gpufleet_kubernetes_device_plugin_image" not in hostvars
    assert "gpufleet_kubernetes_extender_image" not in hostvars
    # the runtime suite checks the runtime the host's kubelet uses (group_vars/all.yml reads this)
    gpu_hosts = children["gpu_nodes"]["hosts"]
    assert {h["gpufleet_container_runtime"] for h in gpu_hosts.values()} == {"containerd"}
    assert "gpufleet_container_runtime" in hostvars["gpufleet_validation_runtime"]
    # the driver of each host's Debian release, which its simulated GPUs report
    drivers = {n: (h["gpufleet_driver_branch"], h["gpufleet_driver_version"]) for n, h in gpu_hosts.items()}
    assert drivers == {"dgx-a100": ("535", "535.261.03"), "pcie-2x-t4": ("550", "550.163.01"),
                       "esxi-vm-2x-v100": ("550", "550.163.01")}  # fmt: skip
    group_vars = yaml.safe_load((REPO / "inventory/lab/group_vars/all.yml").read_text())
    assert "gpufleet_driver_version" not in group_vars
    # runc stays the default where GPU pods name the RuntimeClass; the toolkit role reads this
    assert gpu_hosts["pcie-2x-t4"]["nvidia_container_toolkit_default_runtime"] is False
    assert gpu_hosts["esxi-vm-2x-v100"]["nvidia_container_toolkit_default_runtime"] is False
    assert "nvidia_container_toolkit_default_runtime" not in gpu_hosts["dgx-a100"]
    # CDI on the V100 VM: NVIDIA's specification written, containerd's CDI on, the plugin returns CDI names
    cdi = {n: h.get("nvidia_container_toolkit_cdi_spec") for n, h in gpu_hosts.items()}
    assert cdi == {"dgx-a100": None, "pcie-2x-t4": None, "esxi-vm-2x-v100": "always"}
    assert gpu_hosts["esxi-vm-2x-v100"]["nvidia_container_toolkit_containerd_cdi"] == "enabled"
    # each host's mode: a named configuration of the one DaemonSet (group_vars/all.yml has them)
    picks = {name: h.get("gpufleet_device_plugin_config_name") for name, h in gpu_hosts.items()}
    assert picks == {"dgx-a100": "mig", "pcie-2x-t4": "memory", "esxi-vm-2x-v100": "sliced-cdi"}
    named = hostvars["gpufleet_kubernetes_device_plugin_config"]["configs"]["named"]
    assert {p for p in picks.values() if p} <= set(named)
    assert named["sliced-cdi"]["allocate"] == {"pass_device_specs": False, "cdi": {"enabled": True}}
    assert named["sliced-cdi"]["sharing"] == named["sliced"]["sharing"]
    # the DGX's MIG layout: playbooks/runtime.yml runs role nvidia_mig there, with a layout of the config
    assert (hostvars["gpufleet_mig_enabled"], hostvars["nvidia_mig_layout"]) == (True, "lab-mixed")
    assert "lab-mixed" in hostvars["nvidia_mig_config"]["mig-configs"]
    assert not any("gpufleet_mig_enabled" in h for n, h in gpu_hosts.items() if n != "dgx-a100")
    assert "gpufleet_target" not in hostvars  # plays pick hosts before group_vars apply: never set it there
    # the cluster suite's metrics checks ask the lab's Prometheus, which scrapes the plugins' http.port
    assert hostvars["gpufleet_lab"]["prometheus_url"] == "http://127.0.0.1:9090"
    assert "gpufleet_lab.prometheus_url" in hostvars["gpufleet_validation_cluster"]["prometheus"]["url"]
    assert hostvars["gpufleet_kubernetes_device_plugin_config"]["http"]["port"] == METRICS_PORT
    # kube-scheduler on kubeadm's control plane reaches the extender over HTTPS with a client certificate
    assert hostvars["gpufleet_kubernetes_extender_tls_secret"] == "{{ gpufleet_lab.extender_tls_secret }}"
    assert hostvars["gpufleet_lab"]["extender_tls_secret"] == EXTENDER_TLS_SECRET
    sched = hostvars["gpufleet_kubernetes_scheduler_config"]
    assert sched["url"].startswith("https://{{ gpufleet_lab.gateway }}:{{ gpufleet_lab.extender_port }}/")
    assert {k: v.rsplit("/", 1)[1] for k, v in sched.items() if k.endswith("_file")} == {
        "ca_file": "ca.crt", "cert_file": "scheduler.crt", "key_file": "scheduler.key"}  # fmt: skip
    scheduler_vars = [k for k in hostvars if k.startswith("gpufleet_kubernetes_scheduler_")]
    assert scheduler_vars == ["gpufleet_kubernetes_scheduler_config"], "the rest: the role's kubeadm default"
    cp = _hostvars(inventory, "lab-control-plane")
    assert cp["ansible_host"] == "gpufleet-u1-control-plane"
    assert cp["ansible_connection"] == "gpufleet.nvidia.podman"
    assert cp["gpufleet_lab"]["scheduler_tls_dir"] == SCHEDULER_TLS_DIR


def test_sim_root_reports_the_driver_of_the_host_s_debian_release(sim_lib: Path, tmp_path: Path) -> None:
    """The trixie hosts' GPUs report trixie's 550.163.01 (CUDA 12.4), the same GPUs (UUIDs) as the
    fixture's; the fixture's own driver otherwise."""
    _, version, cuda = DEFAULT_HOSTS[1].driver
    staged = json.loads((hostsetup.stage_sim("pcie-2x-t4", tmp_path / "a", sim_lib, (version, cuda))
                         / "machine.json").read_text())  # fmt: skip
    plain = json.loads((hostsetup.stage_sim("pcie-2x-t4", tmp_path / "b", sim_lib) / "machine.json")
                       .read_text())  # fmt: skip
    assert (staged["driver_version"], staged["cuda_driver_version"]) == ("550.163.01", 12040)
    assert plain["driver_version"] == "535.261.03"
    assert [g["uuid"] for g in staged["gpus"]] == [g["uuid"] for g in plain["gpus"]]


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
