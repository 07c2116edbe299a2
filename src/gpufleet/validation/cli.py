"""``python -m gpufleet.validation`` (and ``gpufleet validate-suites``): run the testinfra suites
of ``validation/`` against an expectations file; write ``report.json``, ``junit.xml`` and ``report.txt``
(the per-host table, also printed). Exit 0 pass, 1 a check failed, 2 the validation could not run.

``register(subparsers)`` adds the ``validate-suites`` command to the top-level CLI (``gpufleet validate`` runs
playbooks/validate.yml, which calls this module; see gpufleet.runner.cli); :func:`run_validation` is the
function behind both.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gpufleet
from gpufleet.validation.report import (
    CLUSTER_TARGET,
    EXIT_NOT_RUN,
    NOT_RUN,
    NOT_RUN_PREFIX,
    SUITES,
    Report,
    checks_from,
    load_expectations,
    mode_label,
    write_report,
)

SUITES_ENV = "GPUFLEET_VALIDATION_SUITES"


def suites_dir() -> Path | None:
    """The suites: ``$GPUFLEET_VALIDATION_SUITES``, else ``validation/`` of the checkout gpufleet runs
    from."""
    if os.environ.get(SUITES_ENV):
        return Path(os.environ[SUITES_ENV])
    candidate = Path(gpufleet.__file__).resolve().parents[2] / "validation"
    return candidate if (candidate / "conftest.py").is_file() else None


class Collector:
    """pytest plugin: one record per test (its worst phase), plus collection problems."""

    def __init__(self) -> None:
        self.records: dict[str, dict[str, Any]] = {}
        self.problems: list[str] = []

    def pytest_collectreport(self, report: Any) -> None:
        if report.failed:
            self.problems.append(f"cannot load {report.nodeid or 'the suites'}: {_text(report.longrepr)}")

    def pytest_runtest_logreport(self, report: Any) -> None:
        props = dict(report.user_properties)
        record = self.records.setdefault(
            report.nodeid,
            {
                "nodeid": report.nodeid,
                "suite": props.get("suite", "?"),
                "target": props.get("target", CLUSTER_TARGET),
                "name": props.get("check", report.nodeid.rsplit("::", 1)[-1].split("[")[0]),
                "outcome": "passed",
                "message": "",
                "seconds": 0.0,
            },
        )
        record["seconds"] = round(record["seconds"] + report.duration, 3)
        if report.skipped and record["outcome"] == "passed":
            reason = _skip_reason(report.longrepr)
            if reason.startswith(NOT_RUN_PREFIX):  # applies, but the expectations lack its input
                record["outcome"], record["message"] = NOT_RUN, reason.removeprefix(NOT_RUN_PREFIX)
            else:
                record["outcome"], record["message"] = "skipped", reason
        elif report.failed:
            outcome = "failed" if report.when == "call" else "error"
            if record["outcome"] not in ("failed", "error"):
                record["outcome"], record["message"] = outcome, _failure_message(report.longrepr)


def _text(longrepr: Any) -> str:
    return str(longrepr).strip().splitlines()[-1] if longrepr else ""


def _skip_reason(longrepr: Any) -> str:
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return _text(longrepr)


def _failure_message(longrepr: Any) -> str:
    """The assertion's own message (without pytest's introspection), else the exception line."""
    crash = getattr(longrepr, "reprcrash", None)
    message = str(crash.message) if crash is not None else str(longrepr)
    for prefix in ("AssertionError: ", "Failed: "):
        if message.startswith(prefix):
            message = message[len(prefix) :]
    # pytest appends "assert <expr>" lines after the message; they explain nothing to an operator
    return message.split("\nassert ")[0].strip()


def run_validation(
    expectations: Path,
    report_dir: Path,
    suites: Sequence[str] = SUITES,
    *,
    directory: Path | None = None,
    extra_args: Sequence[str] = (),
    echo: bool = True,
) -> Report:
    """Run the suites and write the report; the Report's ``exit_code()`` is the process exit code."""
    import pytest

    report = Report(suites=tuple(s for s in SUITES if s in suites))
    unknown = sorted(set(suites) - set(SUITES))
    directory = directory or suites_dir()
    try:
        hosts = load_expectations(expectations)["hosts"]
        report.modes = {name: mode_label(want) for name, want in hosts.items()}
    except (OSError, ValueError) as exc:
        report.problems.append(f"expectations {expectations}: {exc}")
    if unknown:
        report.problems.append(f"unknown suites {', '.join(unknown)} (choose from {', '.join(SUITES)})")
    if directory is None or not (directory / "conftest.py").is_file():
        report.problems.append(f"validation suites not found (set {SUITES_ENV} to the validation/ directory)")
    if report.problems:
        write_report(report, report_dir)
        if echo:
            sys.stdout.write(report.table())
        return report
    assert directory is not None
    collector = Collector()
    report_dir.mkdir(parents=True, exist_ok=True)
    args = [
        str(directory),
        "-c",
        str(directory / "pytest.ini"),
        "--rootdir",
        str(directory),
        f"--gpufleet-expectations={expectations}",
        f"--gpufleet-suites={','.join(report.suites)}",
        f"--junitxml={report_dir / 'junit.xml'}",
        "-o",
        "junit_suite_name=gpufleet-validation",
        "-q",
        "--no-header",
        "-p",
        "no:cacheprovider",
        *extra_args,
    ]
    code = int(pytest.main(args, plugins=[collector]))
    report.checks = checks_from(collector.records.values())
    report.problems += collector.problems
    if code not in (0, 1) and not (code == 5 and not report.checks):
        report.problems.append(f"pytest could not run the suites (exit {code})")
    if not report.checks:
        report.problems.append("no checks ran: the expectations list no host the selected suites apply to")
    write_report(report, report_dir)
    if echo:
        sys.stdout.write("\n" + report.table())
    return report


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--expectations",
        "-e",
        required=True,
        type=Path,
        help="YAML/JSON: hosts {name: {connection, gpu_count, ...}} and cluster {...}",
    )
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, of {', '.join(SUITES)}")
    parser.add_argument(
        "--report-dir",
        type=Path,
        default=Path("validation-report"),
        help="where report.json, junit.xml and report.txt go",
    )
    parser.add_argument("--suites-dir", type=Path, help=f"the validation/ directory (default ${SUITES_ENV})")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest after --, e.g. -- -k fabricmanager")


def _run(args: argparse.Namespace) -> int:
    suites = [s.strip() for s in args.suites.split(",") if s.strip()]
    try:
        report = run_validation(
            args.expectations, args.report_dir, suites, directory=args.suites_dir, extra_args=args.pytest_args
        )
    except Exception as exc:  # the runner itself broke: that is "could not run", never "passed"
        print(f"gpufleet validate: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NOT_RUN
    return report.exit_code()


def register(subparsers: Any) -> None:
    """Add ``validate-suites`` to the top-level ``gpufleet`` CLI."""
    parser = subparsers.add_parser(
        "validate-suites",
        help="run the validation suites directly on an expectations file",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    parser.set_defaults(func=_run)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m gpufleet.validation``."""
    parser = argparse.ArgumentParser(
        prog="python -m gpufleet.validation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_arguments(parser)
    return _run(parser.parse_args(argv))
