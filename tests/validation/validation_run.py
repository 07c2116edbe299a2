"""Run ``python -m gpufleet.validation`` as operators do and read its report (helpers for the tests)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml


@dataclass
class ValidationRun:
    """One run of the validation CLI."""

    proc: subprocess.CompletedProcess[str]
    report_dir: Path

    @property
    def rc(self) -> int:
        return self.proc.returncode

    @property
    def report(self) -> dict[str, Any]:
        return json.loads((self.report_dir / "report.json").read_text())  # type: ignore[no-any-return]

    @property
    def table(self) -> str:
        return (self.report_dir / "report.txt").read_text()

    def outcomes(self) -> dict[tuple[str, str], str]:
        """{(target, check): outcome}."""
        return {(c["target"], c["name"]): c["outcome"] for c in self.report["checks"]}

    def message(self, target: str, check: str) -> str:
        return next(
            c["message"] for c in self.report["checks"] if (c["target"], c["name"]) == (target, check)
        )


def validate(expectations: dict[str, Any], tmp: Path, suites: str, *extra: str) -> ValidationRun:
    """Write the expectations and run the validation CLI on them."""
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "expectations.yml"
    path.write_text(yaml.safe_dump(expectations, sort_keys=False))
    report_dir = tmp / "report"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpufleet.validation",
            "-e",
            str(path),
            "--suites",
            suites,
            "--report-dir",
            str(report_dir),
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")},
    )
    return ValidationRun(proc, report_dir)


def sim_host(root: Path, **expected: Any) -> dict[str, Any]:
    """Expectations of a simulated host: local:// with its sim root's environment and host root."""
    return {
        "connection": "local://",
        "host_root": str(root / "host"),
        "env": {
            "GPUFLEET_SIM_ROOT": str(root),
            "LD_LIBRARY_PATH": str(root / "lib"),
            "GPUFLEET_HOST_ROOT": str(root / "host"),
            "PATH": f"{root / 'bin'}:/usr/bin:/bin",
        },
        **expected,
    }
