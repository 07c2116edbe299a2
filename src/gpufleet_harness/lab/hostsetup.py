"""One lab GPU host: the simulated driver files in it, and the shell helpers every host step uses.

A GPU host is a kubeadm node (:mod:`gpufleet_harness.lab.kubeadm`: Debian with its containerd, CRI v1 and
systemd cgroups, the kubelet and kubeadm's drop-in, ``kubeadm join``); what the lab adds before the join:

``/etc/gpufleet-sim/``            the simulated machine: ``machine.json``, ``control``, ``events``, ``lib/``
                                  (the simulator's ``libnvidia-ml.so.1``), ``host/`` (sysfs/procfs view),
                                  ``bin/nvidia-smi`` (stand-in, Python + pynvml from ``python/``); its GPUs
                                  report the driver of the host's Debian release
``/dev/nvidia*``                  character devices with the driver's numbers, made at every boot by
                                  ``gpufleet-sim-devices.service`` as the driver's udev rules would

The roles see only the one fact the lab sets, ``gpufleet_env``.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import yaml

from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.testhosts.podman import podman

from .spec import SIM_DIR, HostSpec, LabSpec

SOURCE_ROOT = Path(__file__).resolve().parents[2]  # src
# What the nvidia-smi stand-in imports: gpufleet_harness.sim.smi and gpufleet.gpu (standard library + pynvml).
_SMI_SOURCES = (
    "gpufleet/__init__.py",
    "gpufleet/gpu",
    "gpufleet_harness/__init__.py",
    "gpufleet_harness/sim/__init__.py",
    "gpufleet_harness/sim/smi.py",
    "gpufleet_harness/sim/smi_query.py",
    # `nvidia-smi --gpu-reset` (a MIG mode change on an A100) imports these when it runs; with PyYAML,
    # which the MIG role installs where it applies a layout
    "gpufleet/files.py",
    "gpufleet/yamlfile.py",
    "gpufleet_harness/sim/control.py",
    "gpufleet_harness/sim/machine.py",
    "gpufleet_harness/sim/workload.py",
)

DEVICES_UNIT = """\
# Installed by `gpufleet lab up`: the simulated GPUs' device nodes, as the driver's udev rules make them.
[Unit]
Description=gpufleet lab: device nodes of the simulated NVIDIA GPUs
DefaultDependencies=no
Before=containerd.service kubelet.service

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart={sim}/bin/gpufleet-sim-devices

[Install]
WantedBy=multi-user.target
"""

SMI_WRAPPER = """\
#!/bin/sh
# nvidia-smi stand-in of the gpufleet lab: gpufleet-sim-smi against the simulated machine in {sim}.
: "${{GPUFLEET_SIM_ROOT:={sim}}}"
: "${{LD_LIBRARY_PATH:={sim}/lib}}"
: "${{GPUFLEET_HOST_ROOT:={sim}/host}}"
export GPUFLEET_SIM_ROOT LD_LIBRARY_PATH GPUFLEET_HOST_ROOT
PYTHONPATH={sim}/python exec /usr/bin/python3 -m gpufleet_harness.sim.smi "$@"
"""


class HostError(RuntimeError):
    """A lab host could not be created or set up; the message says which step and why."""


def exec_in(container: str, *argv: str, check: bool = True, input_text: str | None = None) -> str:
    """Run a command in the container; return its stdout."""
    result = subprocess.run(
        ["podman", "exec", *(["-i"] if input_text is not None else []), container, *argv],
        input=input_text, capture_output=True, text=True, check=False,
    )  # fmt: skip
    if check and result.returncode != 0:
        raise HostError(f"{container}: {' '.join(argv)} exited {result.returncode}: "
                        f"{(result.stderr or result.stdout).strip()[-800:]}")  # fmt: skip
    return result.stdout


def write_in(container: str, path: str, text: str, mode: int = 0o644) -> None:
    script = f'mkdir -p "$(dirname "$1")" && cat > "$1" && chmod {mode:o} "$1"'
    exec_in(container, "sh", "-c", script, "sh", path, input_text=text)


def copy_in(container: str, source: Path, dest: str) -> None:
    result = podman("cp", str(source), f"{container}:{dest}", check=False)
    if result.returncode != 0:
        raise HostError(f"podman cp {source} {container}:{dest}: {result.stderr.strip()}")


# -- the simulated driver --------------------------------------------------------------------------------
def stage_sim(fixture: str, stage: Path, library: Path, driver: tuple[str, int] | None = None) -> Path:
    """A sim root for ``fixture`` laid out for /etc/gpufleet-sim in a host: real files, no host paths.
    ``driver``: (version, CUDA version as NVML reports it) the GPUs report instead of the fixture's."""
    if driver is not None:
        # the same fixture (its name keeps the GPUs' UUIDs) with the host's driver
        name, doc = simmachine.load_fixture(fixture)
        doc.setdefault("host", {}).update(driver_version=driver[0], cuda_driver_version=driver[1])
        (stage / "fixture").mkdir(parents=True, exist_ok=True)
        fixture = str(stage / "fixture" / f"{name}.yaml")
        Path(fixture).write_text(yaml.safe_dump(doc, sort_keys=False))
    root = simmachine.materialize(fixture, stage / "gpufleet-sim", library=library)
    for link in (root / "lib/libnvidia-ml.so.1", root / "host/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1"):
        link.unlink()
        shutil.copy2(library, link)
    (root / "lib/.libnvidia-ml.so.1.target").write_text(f"{SIM_DIR}/lib/libnvidia-ml.so.1\n")
    # Device nodes become a boot script: podman cp would not carry them, and /dev is the host's own.
    lines = ["#!/bin/sh", "# Device nodes of the simulated GPUs, at /dev and in the sim root's host view.",
             "set -e", f"mkdir -p {SIM_DIR}/host/dev"]  # fmt: skip
    dev, made = root / "host/dev", {"/dev", f"{SIM_DIR}/host/dev"}
    # (nvidia-caps/: the MIG capability nodes of MIG-capable GPUs, which MIG devices' pods are given)
    for node in sorted(dev.rglob("*")):
        st = node.lstat()
        if not stat.S_ISCHR(st.st_mode):
            continue
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        name = node.relative_to(dev).as_posix()
        for where in (f"/dev/{name}", f"{SIM_DIR}/host/dev/{name}"):
            parent = where.rsplit("/", 1)[0]
            if parent not in made:
                made.add(parent)
                lines.append(f"mkdir -p {parent}")
            lines.append(f"[ -c {where} ] || mknod -m 666 {where} c {major} {minor}")
        node.unlink()
    script = root / "bin/gpufleet-sim-devices"
    script.write_text("\n".join(lines) + "\n")
    script.chmod(0o755)
    (root / "bin/nvidia-smi").write_text(SMI_WRAPPER.format(sim=SIM_DIR))
    python = root / "python"
    for rel in _SMI_SOURCES:
        source = SOURCE_ROOT / rel
        target = python / rel
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    import pynvml  # the same nvidia-ml-py the project pins; one pure-Python module

    shutil.copy2(pynvml.__file__, python / "pynvml.py")
    return root


def install_sim(spec: LabSpec, host: HostSpec, library: Path) -> None:
    """The simulated machine of ``host``'s fixture, its GPUs on the driver of the host's Debian release."""
    name = spec.container(host)
    _, version, cuda = host.driver
    with tempfile.TemporaryDirectory(prefix="gpufleet-lab-sim-") as tmp:
        root = stage_sim(host.fixture, Path(tmp), library, (version, cuda))
        exec_in(name, "rm", "-rf", SIM_DIR)
        copy_in(name, root, SIM_DIR)
    write_in(name, "/etc/systemd/system/gpufleet-sim-devices.service", DEVICES_UNIT.format(sim=SIM_DIR))
    exec_in(name, "systemctl", "daemon-reload")
    exec_in(name, "systemctl", "enable", "--now", "gpufleet-sim-devices.service")
