"""`gpufleet wheelhouse DIR --python X.Y`: the wheels of another Python go in too (the lab's systemd-mode test
installs from one wheelhouse on Debian 12's Python 3.11 and Debian 13's 3.13, tests/lab/test_lab_site.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

from gpufleet import wheelhouse


def test_a_python_that_is_not_major_minor_is_refused_before_pip_runs(tmp_path: Path) -> None:
    for bad in ("3", "3.13.1", "python3.13", "2.7"):
        with pytest.raises(RuntimeError, match=r"--python .*expected a Python 3 major\.minor"):
            wheelhouse.build(tmp_path / bad.replace("/", "_"), pythons=[bad])


def test_other_pythons_get_binary_wheels_of_gpufleet_s_dependencies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After this interpreter's `pip wheel`, one `pip download` per other Python: binary wheels only, for
    CPython of that version on manylinux, gpufleet's own wheel found in the directory."""
    calls: list[list[str]] = []

    def run(argv: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        calls.append(argv)
        return subprocess.CompletedProcess(argv, 0, "", "")

    monkeypatch.setattr(wheelhouse.subprocess, "run", run)
    wheelhouse.build(tmp_path, pythons=["3.13"])
    assert [c[3] for c in calls] == ["wheel", "download"]
    download = calls[1]
    for pair in (("--python-version", "3.13"), ("--implementation", "cp"), ("--find-links", str(tmp_path))):
        assert download[download.index(pair[0]) + 1] == pair[1], download
    assert "--only-binary=:all:" in download
    platforms = [download[i + 1] for i, a in enumerate(download) if a == "--platform"]
    assert platforms and all(p.startswith("manylinux") for p in platforms), platforms
    assert download[-1].startswith("gpufleet==")
