"""Runtime suite: containers started through the configured container runtime see the GPUs.

Every host's expectations name its ``runtime`` (``docker`` or ``containerd``): the runtime offers the
NVIDIA runtime (``runtime_name``, default ``nvidia``), and ``nvidia-smi -L`` inside a container started
through it (``runtime_image``) lists the host's GPUs. A host without a ``runtime`` shows these checks as not
run (``WITHOUT`` says why), never as passed.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex

import pytest
from hostcheck import Target

from gpufleet.imageref import qualified

SUITE = "runtime"
HOSTS_WITH = "runtime"
WITHOUT = (
    "the host's expectations name no container runtime; expected docker or containerd "
    "(playbook variable gpufleet_validation_runtime, expectations key 'runtime')"
)
DEFAULT_IMAGE = "nvcr.io/nvidia/cuda:12.2.2-base-ubuntu22.04"
GPU_LINE = re.compile(r"^GPU \d+: ", re.MULTILINE)


def _docker(target: Target) -> str:
    host = target.want("docker_host")
    return "docker" + (f" -H {shlex.quote(str(host))}" if host else "")


def _ctr(target: Target) -> str:
    address = target.want("containerd_address", "/run/containerd/containerd.sock")
    return f"ctr --address {shlex.quote(str(address))} --namespace k8s.io"


def test_nvidia_runtime_configured(target: Target) -> None:
    runtime, name = target.want("runtime"), target.want("runtime_name", "nvidia")
    if runtime == "docker":
        info = target.run(f"{_docker(target)} info --format '{{{{json .Runtimes}}}}'")
        assert info.rc == 0, f"{target.name}: docker info failed: {info.stderr.strip()[:300]}"
        runtimes = sorted(json.loads(info.stdout or "{}"))
        assert name in runtimes, (
            f"{target.name}: docker has no '{name}' runtime (runtimes: {', '.join(runtimes)}); "
            "run the nvidia_container_toolkit role"
        )
    elif runtime == "containerd":
        dump = target.run("containerd config dump")
        assert dump.rc == 0, f"{target.name}: containerd config dump failed: {dump.stderr.strip()[:300]}"
        assert re.search(rf"runtimes\.[\"']?{re.escape(name)}[\"']?\]", dump.stdout), (
            f"{target.name}: containerd's merged config has no '{name}' runtime; "
            "run the nvidia_container_toolkit role"
        )
    else:
        pytest.fail(f"{target.name}: runtime {runtime!r} is not one the suite knows (docker, containerd)")


def test_nvidia_smi_in_container(target: Target) -> None:
    runtime, name = target.want("runtime"), target.want("runtime_name", "nvidia")
    image = str(target.want("runtime_image", DEFAULT_IMAGE))
    smi = str(target.want("container_nvidia_smi", "nvidia-smi"))
    if runtime == "docker":
        command = (
            f"{_docker(target)} run --rm --runtime {shlex.quote(name)} -e NVIDIA_VISIBLE_DEVICES=all "
            f"--entrypoint {smi} {shlex.quote(image)} -L"
        )
    elif runtime == "containerd":
        binary = target.want("runtime_binary", "/usr/bin/nvidia-container-runtime")
        command = (
            f"{_ctr(target)} run --rm --runc-binary {shlex.quote(str(binary))} "
            f"--env NVIDIA_VISIBLE_DEVICES=all {shlex.quote(qualified(image))} "
            f"gpufleet-validate-{secrets.token_hex(3)} "
            f"{smi} -L"
        )
    else:
        pytest.fail(f"{target.name}: runtime {runtime!r} is not one the suite knows (docker, containerd)")
    result = target.run(command)
    output = (result.stdout + result.stderr).strip()
    assert result.rc == 0, (
        f"{target.name}: nvidia-smi in a {runtime} container exited {result.rc}: {output[-300:]}"
    )
    seen = len(GPU_LINE.findall(result.stdout))
    want = target.want("gpu_count")
    assert want is None or seen == int(want), (
        f"{target.name}: nvidia-smi in a {runtime} container lists {seen} GPUs, expected {want}"
    )
    assert seen, f"{target.name}: nvidia-smi in a {runtime} container lists no GPU: {output[-300:]}"
