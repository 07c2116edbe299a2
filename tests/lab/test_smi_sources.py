"""The nvidia-smi stand-in runs in the lab's hosts from the few sources `gpufleet lab up` copies there
(hostsetup._SMI_SOURCES): an import beyond them breaks every host's `nvidia-smi` (session 8: a top-level
import of the simulator's control module failed site.yml's driver check on all three lab hosts)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pynvml
import yaml

from gpufleet_harness.lab.hostsetup import _SMI_SOURCES, SOURCE_ROOT


def test_stand_in_imports_from_the_sources_the_lab_copies(tmp_path: Path) -> None:
    for rel in _SMI_SOURCES:
        source = SOURCE_ROOT / rel
        target = tmp_path / rel
        if source.is_dir():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)
    # -S: no site-packages, so the checkout (on the path through the editable install) cannot stand in for
    # a missing file; pynvml (a single module) is added by hand, as the hosts have it.
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(Path(pynvml.__file__).parent)!r}]; "
            "import gpufleet_harness.sim.smi as smi; print(smi.__file__)")  # fmt: skip
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path))
    # `--gpu-reset` (session 12: a MIG layout's reset failed in the lab) needs the simulator's control
    # module, which needs PyYAML (the MIG role installs Debian's python3-yaml): also from the copies.
    extra = tmp_path / "extra"
    shutil.copytree(Path(yaml.__file__).parent, extra / "yaml", ignore=shutil.ignore_patterns("__pycache__"))
    code = (f"import sys; sys.path[:0] = [{str(tmp_path)!r}, {str(extra)!r}]; "
            "import gpufleet_harness.sim.control as c; print(c.__file__)")  # fmt: skip
    result = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().startswith(str(tmp_path))
