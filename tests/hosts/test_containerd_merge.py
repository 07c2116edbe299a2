"""The nvidia_container_toolkit role's containerd module, run as Ansible runs it, against real containerd."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

MODULE = (
    Path(__file__).resolve().parents[2]
    / "roles/nvidia_container_toolkit/library/nvidia_containerd_runtime.py"
)
SITE = textwrap.dedent("""\
    # site config
    version = 2

    [plugins."io.containerd.grpc.v1.cri"]
      sandbox_image = "registry.example.internal/pause:3.9"
      [plugins."io.containerd.grpc.v1.cri".cni]
        bin_dir = "/usr/lib/cni"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
""")

@pytest.fixture
def _containerd() -> None:
    if shutil.which("containerd") is None:
        pytest.fail("containerd is not installed (scripts/bootstrap installs it: apt-get install containerd)")


needs_containerd = pytest.mark.usefixtures("_containerd")


def run_module(tmp_path: Path, check: bool = False, **args: Any) -> dict[str, Any]:
    params = {
        "config": str(tmp_path / "config.toml"),
        "drop_in": str(tmp_path / "conf.d/99-nvidia.toml"),
        **args,
    }
    argfile = tmp_path / "args.json"
    argfile.write_text(
        json.dumps({"ANSIBLE_MODULE_ARGS": {**params, "_ansible_check_mode": check, "_ansible_diff": True}})
    )
    proc = subprocess.run(
        [sys.executable, str(MODULE), str(argfile)], capture_output=True, text=True, check=False
    )
    return json.loads(proc.stdout)


def dump(config: Path, containerd: str = "containerd") -> str:
    return subprocess.run(
        [containerd, "--config", str(config), "config", "dump"], capture_output=True, text=True, check=True
    ).stdout


def section(text: str, header: str) -> str:
    return text.split(header + "]", 1)[1].split("[", 1)[0]


@needs_containerd
def test_drop_in_adds_nvidia_and_keeps_site_cri_settings(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(SITE)
    result = run_module(tmp_path)
    assert result["changed"] and result["config_version"] == 2
    merged = dump(tmp_path / "config.toml")
    prefix = '[plugins."io.containerd.grpc.v1.cri".containerd'
    assert 'default_runtime_name = "nvidia"' in section(merged, prefix)
    assert 'BinaryName = "/usr/bin/nvidia-container-runtime"' in section(
        merged, prefix + ".runtimes.nvidia.options"
    )
    assert "SystemdCgroup = true" in section(merged, prefix + ".runtimes.nvidia.options")
    assert "SystemdCgroup = true" in section(merged, prefix + ".runtimes.runc.options")
    assert 'sandbox_image = "registry.example.internal/pause:3.9"' in merged
    assert 'bin_dir = "/usr/lib/cni"' in merged


@needs_containerd
def test_main_config_only_gains_the_import_and_a_backup(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(SITE)
    result = run_module(tmp_path)
    text = (tmp_path / "config.toml").read_text()
    assert text == SITE.replace(
        "version = 2\n", f'version = 2\nimports = ["{tmp_path}/conf.d/99-nvidia.toml"]\n'
    )
    assert len(result["backups"]) == 1 and Path(result["backups"][0]).read_text() == SITE


@needs_containerd
def test_second_run_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(SITE)
    run_module(tmp_path)
    assert run_module(tmp_path)["changed"] is False


@needs_containerd
def test_site_edit_after_first_run_is_carried_into_the_drop_in(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(SITE)
    run_module(tmp_path)
    config = tmp_path / "config.toml"
    config.write_text(config.read_text().replace("pause:3.9", "pause:3.10"))
    assert run_module(tmp_path)["changed"] is True
    assert 'sandbox_image = "registry.example.internal/pause:3.10"' in dump(config)


@needs_containerd
def test_unparsable_config_fails_and_is_left_untouched(tmp_path: Path) -> None:
    broken = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"\n'
    (tmp_path / "config.toml").write_text(broken)
    result = run_module(tmp_path)
    assert result["failed"] and "cannot parse" in result["msg"] and "left untouched" in result["msg"]
    assert (tmp_path / "config.toml").read_text() == broken
    assert not (tmp_path / "conf.d").exists()


@needs_containerd
def test_missing_main_config_is_created_with_the_import(tmp_path: Path) -> None:
    run_module(tmp_path, set_default=False)
    assert (tmp_path / "config.toml").read_text() == (
        f'version = 2\nimports = ["{tmp_path}/conf.d/99-nvidia.toml"]\n'
    )
    merged = dump(tmp_path / "config.toml")
    assert "runtimes.nvidia]" in merged and 'default_runtime_name = "runc"' in merged


@needs_containerd
def test_existing_imports_are_kept(tmp_path: Path) -> None:
    other = tmp_path / "other.toml"
    other.write_text("version = 2\n")
    (tmp_path / "config.toml").write_text(f'version = 2\nimports = ["{other}"]\n')
    run_module(tmp_path)
    assert (
        f'imports = ["{other}", "{tmp_path}/conf.d/99-nvidia.toml"]' in (tmp_path / "config.toml").read_text()
    )


@needs_containerd
def test_check_mode_reports_without_writing(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(SITE)
    result = run_module(tmp_path, check=True)
    assert result["changed"] is True and result["diff"]
    assert (tmp_path / "config.toml").read_text() == SITE
    assert not (tmp_path / "conf.d").exists()


@needs_containerd
def test_absent_removes_import_and_drop_in(tmp_path: Path) -> None:
    (tmp_path / "config.toml").write_text(SITE)
    run_module(tmp_path)
    assert run_module(tmp_path, state="absent")["changed"] is True
    assert (tmp_path / "config.toml").read_text() == SITE
    assert not (tmp_path / "conf.d/99-nvidia.toml").exists()
    assert "runtimes.nvidia" not in dump(tmp_path / "config.toml")


FAKE_CONTAINERD_2 = textwrap.dedent("""\
    #!/usr/bin/env python3
    # containerd 2.x stand-in: --version, and `config dump` = the file plus its imports (no defaults).
    import re, sys
    if sys.argv[1:] == ["--version"]:
        print("containerd github.com/containerd/containerd/v2 v2.0.5 fb4c30d4")
        sys.exit(0)
    path = sys.argv[sys.argv.index("--config") + 1]
    text = open(path).read()
    print(text)
    found = re.search(r'^imports\\s*=\\s*\\[(.*)\\]', text, re.M)
    for name in re.findall(r'"([^"]+)"', found.group(1)) if found else []:
        print(open(name).read())
""")


def test_containerd_2_gets_a_version_3_drop_in(tmp_path: Path) -> None:
    fake = tmp_path / "containerd"
    fake.write_text(FAKE_CONTAINERD_2)
    fake.chmod(0o755)
    site = textwrap.dedent("""\
        version = 3
        [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
          SystemdCgroup = true
    """)
    (tmp_path / "config.toml").write_text(site)
    result = run_module(tmp_path, containerd=str(fake))
    assert result["config_version"] == 3, result
    drop_in = (tmp_path / "conf.d/99-nvidia.toml").read_text()
    assert drop_in.splitlines()[1] == "version = 3"
    assert '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options]' in drop_in
    assert "SystemdCgroup = true" in section(
        drop_in, '[plugins."io.containerd.cri.v1.runtime".containerd.runtimes.nvidia.options'
    )
    assert '  default_runtime_name = "nvidia"' in drop_in
