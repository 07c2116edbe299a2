"""Shared fixtures for the simulator tests: one library build, sim roots, a pynvml-in-a-subprocess runner.

pynvml loads libnvidia-ml.so.1 once per process, and the loader reads LD_LIBRARY_PATH only at start-up,
so every NVML scenario runs in a child interpreter with the sim root's environment.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from gpufleet_harness.sim import machine as simmachine

# Prepended to every scenario: `n` is pynvml, `out(x)` prints the JSON result, `err(f, *a)` returns the
# NVMLError class name a call raises (or "ok").
PRELUDE = textwrap.dedent("""
    import ctypes, json, sys, threading, time
    from ctypes import byref
    import pynvml as n
    def out(x):
        print(json.dumps(x), flush=True)
    def err(f, *a):
        try:
            f(*a)
        except n.NVMLError as e:
            return type(e).__name__
        return "ok"
""")

Runner = Callable[..., Any]


def run_nvml(root: Path, code: str, *, timeout: float = 30, check: bool = True) -> Any:
    """Run PRELUDE + code in a child interpreter pointed at `root`; returns the last JSON line printed."""
    env = simmachine.sim_env(root)
    full_env = {**os.environ, **env}
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"scenario failed (rc {proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    result = json.loads(lines[-1]) if lines else None
    if not check:
        return result, proc
    return result


@pytest.fixture
def nvml() -> Runner:
    """`nvml(root, code)` → the scenario's JSON result (see run_nvml)."""
    return run_nvml
