"""Fixtures for tests/runner: a private runner directory, and `gpufleet` run as a child process."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from runnerkit import CliRun, cli_env, ensure_collection_link


@pytest.fixture
def runner_dir(tmp_path: Path) -> Path:
    return tmp_path / "runner"


@pytest.fixture
def gpufleet(runner_dir: Path, tmp_path: Path) -> Callable[..., CliRun]:
    """Run ``gpufleet ARGS`` in tmp_path (stdout a pipe, not a terminal)."""
    ensure_collection_link()

    def run(*args: str, env: Mapping[str, str] | None = None, timeout: float = 300) -> CliRun:
        proc = subprocess.run(
            [sys.executable, "-m", "gpufleet.cli", *args],
            cwd=tmp_path,
            env=cli_env(runner_dir, **(env or {})),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        return CliRun(proc)

    return run


