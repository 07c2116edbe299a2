"""Run one of the collection's modules as Ansible runs it: the module file with its arguments file, the
collection importable (the checkout's collection link on PYTHONPATH); the module's JSON result."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from labstack import ensure_collection_link


def run_module(module: Path, tmp_path: Path, **args: Any) -> dict[str, Any]:
    argfile = tmp_path / "args.json"
    argfile.write_text(json.dumps({"ANSIBLE_MODULE_ARGS": args}))
    env = {**os.environ, "PYTHONPATH": str(ensure_collection_link())}
    proc = subprocess.run(
        [sys.executable, str(module), str(argfile)], capture_output=True, text=True, env=env, check=False
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result
