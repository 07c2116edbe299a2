"""Host suite: the driver, as the GPU Operator validator checks it first.

Per host: the nvidia kernel module is loaded and built for the running kernel, nouveau is not loaded,
nvidia-smi runs and lists the expected GPUs (count and model), the driver is at the pinned version,
persistence mode is on, and on NVSwitch hosts the fabric manager is active, at the driver's exact version,
with every NVLink to the NVSwitches up.
"""

from __future__ import annotations

import re

import pytest
from hostcheck import REMOTE_SWITCH, Target

SUITE = "host"


def test_nvidia_module_loaded(target: Target) -> None:
    assert target.loaded_module_version, (
        f"{target.name}: the nvidia kernel module is not loaded "
        f"({target.path('/sys/module/nvidia')} is missing)"
    )


def test_nvidia_module_built_for_running_kernel(target: Target) -> None:
    kernel = target.kernel_release
    if target.root != "/" or not target.host.exists("modinfo"):
        modules = target.file(f"/lib/modules/{kernel}")
        if not modules.exists:
            pytest.skip(
                f"no /lib/modules/{kernel} under {target.root} (simulated host): only the loaded module "
                "is checked"
            )
    vermagic = target.run(f"modinfo -k {kernel} -F vermagic nvidia")
    assert vermagic.rc == 0, f"{target.name}: no nvidia module installed for the running kernel {kernel}"
    built_for = (vermagic.stdout.split() or ["?"])[0]
    assert built_for == kernel, (
        f"{target.name}: the nvidia module is built for {built_for}, the kernel is {kernel}"
    )
    installed = target.run(f"modinfo -k {kernel} -F version nvidia").stdout.strip()
    loaded = target.loaded_module_version
    assert not loaded or installed == loaded, (
        f"{target.name}: the loaded nvidia module is {loaded} but {installed} is installed for {kernel} "
        "(a reboot or module reload is pending)"
    )


def test_nouveau_not_loaded(target: Target) -> None:
    assert not target.file("/sys/module/nouveau").exists, (
        f"{target.name}: the nouveau module is loaded; blacklist it (gpu_host_prep) and reboot"
    )


def test_nvidia_smi_runs(target: Target) -> None:
    result, _ = target.smi_query
    assert result.rc == 0, (
        f"{target.name}: {target.smi} exited {result.rc}: {(result.stdout + result.stderr).strip()[:300]}"
    )


def test_gpu_count(target: Target) -> None:
    want = target.want("gpu_count")
    if want is None:
        pytest.skip("no gpu_count expected for this host")
    result, rows = target.smi_query
    assert result.rc == 0, f"{target.name}: cannot count GPUs, {target.smi} exited {result.rc}"
    assert len(rows) == int(want), (
        f"{target.name}: nvidia-smi lists {len(rows)} GPUs, expected {want} "
        f"({', '.join(r.index + ':' + r.name for r in rows) or 'none'})"
    )


def test_gpu_model(target: Target) -> None:
    want = target.want("gpu_model")
    if not want:
        pytest.skip("no gpu_model expected for this host")
    result, rows = target.smi_query
    assert result.rc == 0, f"{target.name}: cannot read GPU models, {target.smi} exited {result.rc}"
    wrong = [f"GPU {r.index} is {r.name}" for r in rows if str(want) not in r.name]
    assert not wrong, f"{target.name}: expected every GPU to be {want}: " + "; ".join(wrong)


def test_driver_version_pinned(target: Target) -> None:
    want = target.want("driver_version")
    if not want:
        pytest.skip("no driver_version pinned for this host")
    loaded = target.loaded_module_version
    assert loaded == want, f"{target.name}: the loaded nvidia kernel module is {loaded}, pinned {want}"
    result, rows = target.smi_query
    assert result.rc == 0, f"{target.name}: cannot read the driver version, {target.smi} exited {result.rc}"
    userspace = sorted({r.driver_version for r in rows})
    assert userspace == [want], (
        f"{target.name}: nvidia-smi reports driver {', '.join(userspace)}, pinned {want}"
    )


def test_persistence_mode(target: Target) -> None:
    if not target.want("persistence_mode", True):
        pytest.skip("persistence mode not required for this host")
    result, rows = target.smi_query
    assert result.rc == 0, f"{target.name}: cannot read persistence mode, {target.smi} exited {result.rc}"
    off = [r.index for r in rows if r.persistence_mode != "Enabled"]
    assert not off, (
        f"{target.name}: persistence mode is off on GPU {', '.join(off)} (nvidia-persistenced running?)"
    )


def test_fabricmanager_active(target: Target) -> None:
    if not target.fabricmanager_required:
        pytest.skip("no NVSwitches: fabric manager not required")
    problems = []
    if target.systemd:
        service = target.host.service("nvidia-fabricmanager")
        if not service.is_running:
            problems.append("the nvidia-fabricmanager service is not active")
        version = target.run("nv-fabricmanager --version")
        match = re.search(r"(\d+\.\d+(?:\.\d+)?)", version.stdout)
        _, rows = target.smi_query
        driver = rows[0].driver_version if rows else target.loaded_module_version
        if version.rc != 0 or not match:
            problems.append(f"nv-fabricmanager --version failed (exit {version.rc})")
        elif match.group(1) != driver:
            problems.append(f"fabric manager {match.group(1)} does not match the driver {driver}")
    probe = target.nvlinks()
    if probe.get("error"):
        problems.append(f"cannot read NVLink state: {probe['error']}")
    else:
        down, total, gpus = 0, 0, []
        for gpu in probe["gpus"]:
            links = [link for link in gpu.get("links", []) if link.get("remote") == REMOTE_SWITCH]
            inactive = [link for link in links if not link["active"]]
            total, down = total + len(links), down + len(inactive)
            if inactive:
                gpus.append(f"GPU {gpu['index']}: {len(inactive)} of {len(links)}")
        if total == 0:
            problems.append("no GPU NVLink reaches an NVSwitch")
        elif down:
            problems.append(
                f"{down} of {total} NVLinks to NVSwitches are inactive ({'; '.join(gpus[:4])}"
                f"{'; ...' if len(gpus) > 4 else ''}): the fabric is not trained"
            )
    assert not problems, f"{target.name}: fabricmanager: " + "; ".join(problems)
