"""Validation results: one record per check, the JSON report, the 80-column per-host table, the exit code.

A check is one test of a suite for one host (``test_gpu_count[sim-dgx-a100]``) or for the cluster. Its
outcome is ``passed``, ``failed`` (the thing checked is wrong), ``error`` (the check could not run: host
unreachable, API down, bad expectations), ``skipped`` (does not apply, with the reason) or ``not run`` (it
applies, but the expectations lack what it needs, e.g. no ``cluster`` section: the reason names the setting).
A check that did not run never counts as passed: unless the operator left its suite out (``--suites``,
``gpufleet_validation_suites``), the run's result is "could not run" (exit 2).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SUITES = ("host", "runtime", "cluster", "workload")  # the GPU Operator validator's order
CLUSTER_TARGET = "(cluster)"
WIDTH = 80

EXIT_PASS, EXIT_FAIL, EXIT_NOT_RUN = 0, 1, 2
NOT_RUN = "not run"
# A selected check the expectations cannot feed is skipped with this prefix in its reason (see
# validation/conftest.py); the collector makes such a skip the outcome "not run" (JUnit: a skip, that reason).
NOT_RUN_PREFIX = "NOT RUN: "
# Why a check did not run, as the conftest tells it: what was found, what was expected, and what to set.
NO_CLUSTER = (
    "the expectations have no cluster section; expected one with a kubeconfig to reach the Kubernetes API "
    "(playbook variable gpufleet_validation_cluster, expectations key 'cluster')"
)


@dataclass
class Check:
    """One check's result."""

    suite: str
    target: str
    name: str
    outcome: str
    message: str = ""
    seconds: float = 0.0
    nodeid: str = ""


@dataclass
class Report:
    """Every check of a run, plus why the run itself could not complete (if it could not)."""

    checks: list[Check] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    suites: tuple[str, ...] = SUITES
    # host → how it serves its GPUs (mode_label); the table shows a MODE column when any host has one
    modes: dict[str, str] = field(default_factory=dict)

    def exit_code(self) -> int:
        """0: every check passed or was skipped as not applicable; 1: a check failed; 2: nothing failed but
        something could not run (a problem, a check in error, a selected check not run, or no check)."""
        if any(c.outcome == "failed" for c in self.checks):
            return EXIT_FAIL
        if self.problems or any(c.outcome in ("error", NOT_RUN) for c in self.checks) or not self.checks:
            return EXIT_NOT_RUN
        return EXIT_PASS

    def not_run(self) -> list[dict[str, Any]]:
        """The checks that did not run, per suite and reason: ``{suite, reason, targets, checks}``."""
        groups: dict[tuple[str, str], dict[str, Any]] = {}
        for check in self.checks:
            if check.outcome != NOT_RUN:
                continue
            group = groups.setdefault(
                (check.suite, check.message),
                {"suite": check.suite, "reason": check.message, "targets": [], "checks": 0},
            )
            group["checks"] += 1
            if check.target not in group["targets"]:
                group["targets"].append(check.target)
        order = {s: i for i, s in enumerate(SUITES)}
        return sorted(groups.values(), key=lambda g: order.get(g["suite"], len(order)))

    @property
    def status(self) -> str:
        return {EXIT_PASS: "pass", EXIT_FAIL: "fail", EXIT_NOT_RUN: "could not run"}[self.exit_code()]

    def targets(self) -> list[str]:
        """Hosts in first-seen order, the cluster-wide row last."""
        seen = dict.fromkeys(c.target for c in self.checks if c.target != CLUSTER_TARGET)
        if any(c.target == CLUSTER_TARGET for c in self.checks):
            seen[CLUSTER_TARGET] = None
        return list(seen)

    def to_dict(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for check in self.checks:
            counts[check.outcome] = counts.get(check.outcome, 0) + 1
        return {
            "status": self.status,
            "exit_code": self.exit_code(),
            "counts": counts,
            "problems": self.problems,
            "suites": list(self.suites),
            "not_asked": [s for s in SUITES if s not in self.suites],
            "not_run": self.not_run(),
            "hosts": {t: self._host_summary(t) for t in self.targets()},
            **({"modes": dict(self.modes)} if self.modes else {}),
            "checks": [asdict(c) for c in self.checks],
        }

    def _host_summary(self, target: str) -> dict[str, str]:
        return {suite: self.cell(target, suite) for suite in self.suites}

    def cell(self, target: str, suite: str) -> str:
        """``PASS 9/9``, ``FAIL 2/9``, ``ERROR 0/9``, ``NOT RUN`` (checks that apply did not run: the table
        says why), ``SKIP`` (none applies) or ``-`` (no check) for one host and suite."""
        checks = [c for c in self.checks if c.target == target and c.suite == suite]
        if not checks:
            return "-"
        ran = [c for c in checks if c.outcome not in ("skipped", NOT_RUN)]
        passed = sum(c.outcome == "passed" for c in ran)
        if any(c.outcome == "failed" for c in ran):
            return f"FAIL {passed}/{len(ran)}"
        if any(c.outcome == "error" for c in ran):
            return f"ERROR {passed}/{len(ran)}"
        if any(c.outcome == NOT_RUN for c in checks):
            return "NOT RUN"
        if not ran:
            return "SKIP"
        return f"PASS {passed}/{len(ran)}"

    def table(self) -> str:
        """The per-host table, then each failure and error wrapped to 80 columns."""
        mode_width = max([len("MODE"), *(len(m) for m in self.modes.values())]) + 2 if self.modes else 0
        host_width = max([len("HOST"), *(len(t) for t in self.targets())])
        # the last suite's cell needs 11 columns at most (``ERROR 12/12``; lines are right-stripped)
        host_width = min(host_width, WIDTH - 2 - mode_width - 13 * (len(self.suites) - 1) - 11)
        mode_head = f"{'MODE':<{mode_width}}" if mode_width else ""
        lines = [f"{'HOST':<{host_width}}  {mode_head}" + "".join(f"{s.upper():<13}" for s in self.suites)]
        for target in self.targets():
            name = target if len(target) <= host_width else target[: host_width - 1] + "~"
            mode = f"{self.modes.get(target, '-'):<{mode_width}}" if mode_width else ""
            lines.append(
                f"{name:<{host_width}}  {mode}" + "".join(f"{self.cell(target, s):<13}" for s in self.suites)
            )
        lines = [line.rstrip() for line in lines]
        bad = [c for c in self.checks if c.outcome in ("failed", "error")]
        if bad or self.problems:
            lines.append("")
            lines.append("FAILURES" if bad else "PROBLEMS")
        for check in bad:
            head = f"{check.target} {check.suite}/{check.name}: {check.outcome.upper()}"
            lines += textwrap.wrap(head, WIDTH, initial_indent="- ", subsequent_indent="  ")
            for paragraph in check.message.splitlines() or [""]:
                lines += textwrap.wrap(paragraph, WIDTH, initial_indent="    ", subsequent_indent="    ")
        for problem in self.problems:
            lines += textwrap.wrap(problem, WIDTH, initial_indent="- ", subsequent_indent="  ")
        not_run = self.not_run()
        if not_run:
            lines += ["", "NOT RUN (set what each line names, or leave the suite out: --suites)"]
        for group in not_run:
            where = ", ".join(group["targets"])
            head = f"{group['suite']} on {where} ({group['checks']} checks): {group['reason']}"
            lines += textwrap.wrap(head, WIDTH, initial_indent="- ", subsequent_indent="  ")
        lines.append("")
        left_out = [s for s in SUITES if s not in self.suites]
        if left_out:
            lines += textwrap.wrap(
                f"left out (--suites, gpufleet_validation_suites): {', '.join(left_out)}", WIDTH
            )
        lines.append(f"result: {self.status} (exit {self.exit_code()})")
        return "\n".join(lines) + "\n"


def mode_label(expected: Mapping[str, Any]) -> str:
    """How a host serves its GPUs, from its expectations: ``whole``, ``memory`` (GPU-memory sharing through
    the extender) or ``sliced xN`` (time-slicing, N devices per GPU); ``whole+MIG`` where the device plugin
    serves whole GPUs and MIG devices (MIG strategy mixed), ``MIG`` where every device is a MIG device
    (strategy single). Short: the table keeps to 80 columns."""
    sharing = str(expected.get("sharing") or "none")
    if sharing == "time-slicing":
        label = f"sliced x{expected.get('replicas') or 2}"
    else:
        label = {"none": "whole"}.get(sharing, sharing)
    strategy = str(expected.get("mig_strategy") or "none")
    return {"none": label, "single": "MIG"}.get(strategy, f"{label}+MIG")


def write_report(report: Report, directory: Path) -> dict[str, Path]:
    """``report.json`` and ``report.txt`` (the table) in ``directory``; JUnit is pytest's ``junit.xml``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = {"json": directory / "report.json", "table": directory / "report.txt"}
    paths["json"].write_text(json.dumps(report.to_dict(), indent=2) + "\n")
    paths["table"].write_text(report.table())
    return paths


def load_expectations(path: Path) -> dict[str, Any]:
    """The expectations file (JSON or YAML): ``hosts`` {name: {...}} and optional ``cluster`` {...}."""
    import yaml

    doc = yaml.safe_load(path.read_text())
    if not isinstance(doc, Mapping):
        raise ValueError(f"{path}: expected a mapping with 'hosts' and optionally 'cluster'")
    hosts = doc.get("hosts") or {}
    if not isinstance(hosts, Mapping) or not all(isinstance(v, Mapping) for v in hosts.values()):
        raise ValueError(f"{path}: 'hosts' must map host names to mappings")
    unknown = set(doc) - {"hosts", "cluster"}
    if unknown:
        raise ValueError(f"{path}: unknown top-level keys {sorted(unknown)}")
    return {"hosts": dict(hosts), "cluster": dict(doc.get("cluster") or {})}


def checks_from(records: Iterable[Mapping[str, Any]]) -> list[Check]:
    """Checks from the collector's records (one per test; its worst phase wins)."""
    return [Check(**{k: r[k] for k in Check.__dataclass_fields__ if k in r}) for r in records]
