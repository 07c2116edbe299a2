"""The product installs and runs without the controller, ESXi and harness extras (pyproject.toml).

The node and cluster services (device plugin, scheduler extender) need grpcio, protobuf, kubernetes,
nvidia-ml-py and PyYAML; the controller's CLI (ansible-core, ansible-runner, pytest-testinfra), ESXi
(pyvmomi) and the test harness (gpufleet_harness) come as extras. A child Python with base_install_env
(tests/conftest.py) refuses every module only an extra brings, so an import of one anywhere in the product
fails here. The device plugin and the extender are run that way end to end in
tests/deviceplugin/test_dp_sim.py and tests/extender/test_ext_kube.py."""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import gpufleet

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
BASE = {"grpcio", "protobuf", "kubernetes", "nvidia-ml-py", "pyyaml"}
# Every module of the product, the controller's too (they import ansible-runner or testinfra only when
# called): importing any of them must work without the extras.
# (__main__ modules run their command when imported: `python -m` is what they are for.)
PRODUCT_MODULES = sorted(
    m.name for m in pkgutil.walk_packages(gpufleet.__path__, "gpufleet.") if not m.name.endswith(".__main__")
)


def _names(requirements: list[str]) -> set[str]:
    return {Requirement(text).name.lower() for text in requirements}


def test_base_dependencies_are_the_services_needs() -> None:
    assert _names(PROJECT["dependencies"]) == BASE


def test_extras_carry_the_controller_esxi_and_harness() -> None:
    extras = {name: _names(reqs) for name, reqs in PROJECT["optional-dependencies"].items()}
    assert {"ansible-core", "ansible-runner", "pytest-testinfra"} <= extras["controller"]
    assert extras["esxi"] == {"pyvmomi"}
    # The harness drives Ansible (the lab, molecule) and pyVmomi (vcsim): it pulls both extras in.
    assert "gpufleet" in extras["harness"]
    harness = next(Requirement(r) for r in PROJECT["optional-dependencies"]["harness"])
    assert {"controller", "esxi"} <= harness.extras


def test_every_product_module_imports_without_the_extras(base_install_env: dict[str, str]) -> None:
    script = (
        "import importlib, json, sys\n"
        "failed = {}\n"
        f"for name in {PRODUCT_MODULES!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed[name] = f'{type(exc).__name__}: {exc}'\n"
        "print(json.dumps(failed))\n"
    )
    env = {**os.environ, **base_install_env}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(PRODUCT_MODULES) > 40
    assert json.loads(out.stdout) == {}


def test_the_blocker_really_refuses_the_extras(base_install_env: dict[str, str]) -> None:
    """The check above proves something only if the extras are installed here and refused there."""
    env = {**os.environ, **base_install_env}
    for module in ("ansible_runner", "testinfra", "pyVmomi", "gpufleet_harness.sim"):
        __import__(module)  # present in this venv
        out = subprocess.run([sys.executable, "-c", f"import {module}"], env=env, capture_output=True,
                             text=True, timeout=60)  # fmt: skip
        assert out.returncode != 0 and "the host this test imitates lacks it" in out.stderr, (
            module,
            out.stderr,
        )


@pytest.mark.parametrize(
    ("argv", "extra"),
    [
        (["provision", "-i", "inventory/sim"], "controller"),
        (["validate", "-i", "inventory/sim"], "controller"),
    ],
)
def test_cli_names_the_extra_a_command_needs(
    base_install_env: dict[str, str], argv: list[str], extra: str
) -> None:
    env = {**os.environ, **base_install_env}
    out = subprocess.run([sys.executable, "-m", "gpufleet.cli", *argv], env=env, capture_output=True,
                         text=True, timeout=120, cwd=REPO)  # fmt: skip
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"pip install 'gpufleet[{extra}]'" in out.stderr, out.stderr
