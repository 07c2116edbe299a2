"""playbooks/upgrade_driver.yml checks runfile hosts in its preflight, before any host is drained (audit of
issue 30, gap 3).

The package method's downgrade check ran in the preflight; the runfile method's only in the rollout, after the
cordon and drain: a host whose runfile driver was newer than the version asked for was drained, then refused.
A missing runfile checksum was found there too. Here this machine (Debian 12, connection local) is a runfile
host whose ``nvidia-installer`` (a stand-in on PATH, printing what the real one prints) reports a newer build
of the branch. The run is in check mode, and the refusals come before anything that changes a host.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from playbookrun import Played, local_inventory, playbook

UPGRADE = "playbooks/upgrade_driver.yml"
PREFLIGHT = "Check that every host can move to the new driver version before any is touched"
ROLLOUT = "Upgrade the NVIDIA driver and fabric manager, one batch of hosts at a time"
REFUSE = "nvidia_driver : Refuse to move a newer installed build of the driver branch back"
CHECKSUM = "nvidia_driver : Fail when the runfile has no checksum"
INSTALLED, TARGET = "535.309.01", "535.261.03"


def _runfile_host(tmp_path: Path, checksum: str) -> tuple[Path, str]:
    """A local runfile host's inventory and the -e that puts a stand-in nvidia-installer first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    installer = bin_dir / "nvidia-installer"
    # the real one's first line: "nvidia-installer:  version 535.261.03  (buildmeister@...)  <date>"
    installer.write_text(
        "#!/bin/sh\n"
        f'[ "$1" = --version ] && echo "nvidia-installer:  version {INSTALLED}  (buildmeister@host)  Sat"\n'
    )
    installer.chmod(0o755)
    inventory = local_inventory(tmp_path / "inv", ["rf-a"], {
        "gpufleet_driver_version": TARGET,
        "nvidia_driver_install_method": "runfile",
        "nvidia_driver_runfile_checksum": checksum,
        "gpufleet_fabricmanager_enabled": False,
    })  # fmt: skip
    env = {"gpufleet_env": {"PATH": f"{bin_dir}:{os.environ['PATH']}"}}
    return inventory, json.dumps(env)


def _failed_in(run: Played, task: str) -> str:
    """The play in which ``task`` failed."""
    for play in run.report["plays"]:
        for entry in play["tasks"]:
            if entry["task"]["name"] == task and any(r.get("failed") for r in entry["hosts"].values()):
                return str(play["play"]["name"])
    raise AssertionError(f"{task!r} did not fail: {run.explain()}")


def test_a_newer_runfile_driver_is_refused_in_the_preflight_before_any_drain(tmp_path: Path) -> None:
    inventory, env = _runfile_host(tmp_path, "sha256:" + "0" * 64)
    run = playbook(UPGRADE, inventory, "--check", "-e", env)
    assert run.rc != 0, run.explain()
    assert _failed_in(run, REFUSE) == PREFLIGHT  # before: in the rollout, after the drain
    assert ROLLOUT not in run.plays()
    msg = run.results(REFUSE)["rf-a"]["msg"]
    assert f"a newer build of branch 535 is installed than {TARGET}" in msg
    assert f"nvidia-installer at {INSTALLED}" in msg
    assert "nvidia_driver_allow_downgrade (or gpufleet_driver_allow_downgrade)" in msg
    assert "Nothing was changed" in msg


def test_a_runfile_host_without_a_checksum_is_refused_in_the_preflight(tmp_path: Path) -> None:
    inventory, env = _runfile_host(tmp_path, "")
    run = playbook(UPGRADE, inventory, "--check", "-e", env)
    assert run.rc != 0, run.explain()
    assert _failed_in(run, CHECKSUM) == PREFLIGHT
    assert ROLLOUT not in run.plays()
    msg = run.results(CHECKSUM)["rf-a"]["msg"]
    assert "nvidia_driver_runfile_checksum is required for runfile installs" in msg and "found ''" in msg
