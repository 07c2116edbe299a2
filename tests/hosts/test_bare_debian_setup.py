"""The README's set-up on a bare Debian 12 (issue 30 item 7): `make` must be there for `make lab`/`make test`
(README's first screen says so), `.ci/run` installs it itself before calling `make test`, and
scripts/bootstrap installs `python3-venv`, without which Debian's `python3 -m venv` cannot make the venv.

On a minimal bookworm test host (debootstrap minbase plus python3 and systemd: no make, no python3-venv),
with real apt from Debian's archive: the premise holds, `.ci/run` (the checked-in file, in a copy of the
checkout's layout whose Makefile only answers `make test`) installs make and reaches `make test`, and the
packages scripts/bootstrap lists make `python3 -m venv` work and bring pip.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from pathlib import Path

import pytest

from gpufleet_harness.testhosts import images
from gpufleet_harness.testhosts.podman import podman
from gpufleet_harness.testhosts.workspace import missing_tools

pytestmark = [pytest.mark.root, pytest.mark.xdist_group("molecule")]
REPO = Path(__file__).resolve().parents[2]
REACHED = "gpufleet-make-test-reached"


def _apt_packages() -> list[str]:
    """The APT_PACKAGES array of scripts/bootstrap (comments dropped)."""
    text = (REPO / "scripts/bootstrap").read_text()
    body = re.search(r"^APT_PACKAGES=\((.*?)^\)", text, re.S | re.M)
    assert body, "scripts/bootstrap has no APT_PACKAGES=( ... ) array"
    return [w for line in body.group(1).splitlines() for w in line.split("#", 1)[0].split()]


def test_bootstrap_lists_make_and_python3_venv() -> None:
    packages = _apt_packages()
    assert "python3-venv" in packages and "make" in packages, packages


def test_ci_run_and_bootstrap_packages_make_the_setup_work_on_bare_debian_12(tmp_path: Path) -> None:
    if os.geteuid() != 0 or missing_tools():
        pytest.fail(f"needs root and the test-host tools (missing: {missing_tools()})", pytrace=False)
    image = images.build_image(images.ImageSpec("bookworm"))
    work = tmp_path / "checkout"
    (work / ".ci").mkdir(parents=True)
    shutil.copy2(REPO / ".ci/run", work / ".ci/run")
    (work / "Makefile").write_text(f"test:\n\t@echo {REACHED}\n")
    wanted = " ".join(p for p in _apt_packages() if p in ("make", "python3-venv"))
    script = f"""
set -u
command -v make >/dev/null && echo PREMISE-BROKEN: make is installed
python3 -m venv /tmp/before >/dev/null 2>&1 && echo PREMISE-BROKEN: python3 -m venv works
/w/.ci/run || exit 10
command -v make || exit 11
export DEBIAN_FRONTEND=noninteractive
apt-get install -y -qq --no-install-recommends {wanted} >/dev/null || exit 12
python3 -m venv /tmp/venv || exit 13
/tmp/venv/bin/pip --version || exit 14
"""
    name = f"gpufleet-bare-{uuid.uuid4().hex[:8]}"
    try:
        run = podman("run", "--rm", "--name", name, "-v", f"{work}:/w:Z", "--entrypoint", "/bin/bash", image,
                     "-c", script, check=False)  # fmt: skip
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)
    out = run.stdout + run.stderr
    assert "PREMISE-BROKEN" not in out, f"the test host is not bare: {out}"
    assert run.returncode == 0, f"exit {run.returncode}: {out[-3000:]}"
    assert "==> apt-get install make (needed to run make test)" in out and REACHED in out
    assert re.search(r"^pip \d", run.stdout, re.M), out
