"""The collection shares code with the gpufleet package one way: links in plugins/module_utils to the
package's own files, which import nothing beyond the standard library, PyYAML (pynvml lazily, where GPUs are
read) and each other (relative
imports, so they resolve the same in both trees). AnsiballZ ships them with the modules, so a module works
on a host where the package is not installed: the Kubernetes modules' scheduler part on a control-plane
node, and their checks of the plugin's and the extender's settings (docs/architecture.md)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest
from labstack import run_tasks
from modargs import DEVICE_PLUGIN, EXTENDER, OBJECTS_IMAGE

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "plugins"
MODULE_UTILS = PLUGINS / "module_utils"
PACKAGE = REPO / "src" / "gpufleet"
# pynvml: gpu/nvml.py imports it lazily; without it the GPU hosts' modules read sysfs (docs/architecture.md).
ALLOWED_TOP_LEVEL = {"__future__", "yaml", "pynvml"}


def _links() -> list[Path]:
    return sorted(p for p in MODULE_UTILS.rglob("*") if p.is_symlink())


def _imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)]


def _relative_target(link: Path, node: ast.ImportFrom) -> list[Path]:
    """The module_utils files a relative import in ``link`` names (a module, or a package's names)."""
    base = link.parent
    for _ in range(node.level - 1):
        base = base.parent
    if node.module:
        stem = base.joinpath(*node.module.split("."))
        return [stem.with_suffix(".py") if stem.with_suffix(".py").exists() else stem / "__init__.py"]
    return [base / f"{alias.name}.py" for alias in node.names]


def test_links_mirror_the_package_tree() -> None:
    """Each link sits where its target sits in src/gpufleet, so relative imports mean the same in both."""
    links = _links()
    assert len(links) >= 20, links
    for link in links:
        target = link.resolve()
        assert target.is_file(), f"{link} is a dangling link"
        assert target.is_relative_to(PACKAGE), f"{link} points outside src/gpufleet: {target}"
        assert target.relative_to(PACKAGE) == link.relative_to(MODULE_UTILS), link


def test_no_plugin_imports_the_installed_package() -> None:
    """The one way: nothing in plugins/ imports ``gpufleet`` (it may not be installed where modules run)."""
    offenders = []
    for path in sorted(PLUGINS.rglob("*.py")):
        for node in _imports(path):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            if isinstance(node, ast.ImportFrom) and node.level:
                continue
            offenders += [
                f"{path.relative_to(REPO)}: {n}" for n in names if n.partition(".")[0] == "gpufleet"
            ]
    assert offenders == []


def test_linked_files_import_only_the_stdlib_pyyaml_and_each_other() -> None:
    problems = []
    for link in _links():
        for node in _imports(link):
            if isinstance(node, ast.ImportFrom) and node.level:
                missing = [t for t in _relative_target(link, node) if not t.exists()]
                problems += [f"{link.relative_to(MODULE_UTILS)}: {m} is not in module_utils" for m in missing]
                continue
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                top = name.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in ALLOWED_TOP_LEVEL:
                    problems.append(f"{link.relative_to(MODULE_UTILS)}: imports {name}")
    assert problems == []


def test_checks_catch_a_missing_link(tmp_path: Path) -> None:
    """The relative-import check above fails when a linked file's neighbour is not linked."""
    (tmp_path / "sub").mkdir()
    user = tmp_path / "sub" / "user.py"
    user.write_text("from ..absent import thing\nfrom .present import other\n")
    (tmp_path / "sub" / "present.py").write_text("")
    found = [t.exists() for node in _imports(user) if isinstance(node, ast.ImportFrom) for t in
             _relative_target(user, node)]  # fmt: skip
    assert found == [False, True]


# -- the modules on a host without the gpufleet package ------------------------------------------------------
UNREACHABLE_API = {
    "host": "https://127.0.0.1:9", "api_key": "unused", "validate_certs": False, "image": OBJECTS_IMAGE,
}  # fmt: skip


@pytest.mark.parametrize("version", ["v1", "v1beta1"])
def test_scheduler_configuration_is_generated_without_the_package(
    tmp_path: Path, without_gpufleet_env: dict[str, str], version: str
) -> None:
    out = tmp_path / "scheduler-config.yaml"
    args = {"deploy": False, "scheduler_config_file": str(out), "scheduler_config_version": version}
    result = run_tasks([{EXTENDER: args}], tmp_path, env=without_gpufleet_env).task()
    assert not result.get("failed"), result
    text = out.read_text()
    assert f"apiVersion: kubescheduler.config.k8s.io/{version}" in text
    assert "urlPrefix: http://127.0.0.1:32766/gpufleet" in text and "name: gpufleet.io/gpu-mem" in text, text


def test_extender_settings_are_checked_by_its_loader_without_the_package(
    tmp_path: Path, without_gpufleet_env: dict[str, str]
) -> None:
    args = {**UNREACHABLE_API, "settings": {"node_policy": "sideways"}}
    result = run_tasks([{EXTENDER: args}], tmp_path, env=without_gpufleet_env).task()
    assert result.get("failed"), result
    assert "settings are invalid" in result["msg"] and "expected one of binpack, spread" in result["msg"], (
        result
    )
    assert result.get("objects", []) == [], "nothing is written before the check"


def test_plugin_config_is_checked_by_its_loader_without_the_package(
    tmp_path: Path, without_gpufleet_env: dict[str, str]
) -> None:
    args = {**UNREACHABLE_API, "plugin_config": {"no_such_key": 1}, "wait": False}
    result = run_tasks([{DEVICE_PLUGIN: args}], tmp_path, env=without_gpufleet_env).task()
    assert result.get("failed"), result
    assert "plugin_config is invalid" in result["msg"] and "no_such_key: unknown setting" in result["msg"], (
        result
    )
    assert result.get("objects", []) == [], "nothing is written before the check"
