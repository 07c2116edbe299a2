"""execution-environment.yml: ansible-builder (version 3 format) makes its build context from the built wheel
and collection, and the collection's own meta/execution-environment.yml adds its requirements, as
ansible-builder's introspection merges them inside the build. Building the image itself needs the base image
from a registry, which no machine here reaches (docs/awx.md)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from gpufleet_harness.release import collection

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def test_ansible_builder_makes_the_build_context_and_merges_the_collections_requirements(
    tmp_path: Path,
) -> None:
    project = tmp_path / "project"
    (project / "deploy").mkdir(parents=True)
    shutil.copy(REPO / "execution-environment.yml", project)
    shutil.copytree(REPO / "deploy" / "ee", project / "deploy" / "ee")
    dist = project / "dist"
    wheel, artifact = collection.build_wheel(dist), collection.build(dist)

    definition = yaml.safe_load((project / "execution-environment.yml").read_text())
    assert definition["version"] == 3
    context = tmp_path / "context"
    proc = subprocess.run(
        [str(BIN / "ansible-builder"), "create", "-f", "execution-environment.yml", "-c", str(context)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    containerfile = (context / "Containerfile").read_text()
    assert 'ARG EE_BASE_IMAGE="quay.io/centos/centos:stream9"' in containerfile
    assert (
        "COPY _build/gpufleet/ /tmp/gpufleet/" in containerfile
        and "ENV PIP_FIND_LINKS=/tmp/gpufleet" in containerfile
    )
    assert (context / "_build" / "gpufleet" / wheel.name).read_bytes() == wheel.read_bytes()
    assert (context / "_build" / "gpufleet" / artifact.name).read_bytes() == artifact.read_bytes()
    galaxy = yaml.safe_load((context / "_build" / "requirements.yml").read_text())
    assert {"name": f"/tmp/gpufleet/{artifact.name}", "type": "file"} in galaxy["collections"]

    # what the build's introspection step sees once the collection is installed: the user's requirements and
    # the collection's own (meta/execution-environment.yml)
    collections = tmp_path / "collections"
    subprocess.run(
        [
            str(BIN / "ansible-galaxy"),
            "collection",
            "install",
            "--force",
            "--no-deps",
            "-p",
            str(collections),
            str(artifact),
        ],
        cwd=tmp_path,
        capture_output=True,
        check=True,
    )
    merged = subprocess.run(
        [
            sys.executable,
            str(context / "_build" / "scripts" / "introspect.py"),
            "introspect",
            "--user-pip",
            str(context / "_build" / "requirements.txt"),
            "--user-bindep",
            str(context / "_build" / "bindep.txt"),
            str(collections),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    doc = yaml.safe_load(merged)
    python = [line.split("#")[0].strip() for line in doc["python"]]
    assert "gpufleet[controller,esxi]==0.1.0" in python and "pyvmomi>=8.0.1.0,<10" in python
    assert any("from collection gpufleet.nvidia" in line for line in doc["system"])
