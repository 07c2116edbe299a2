"""`gpufleet provision|validate|report`: site.yml and playbooks/validate.yml through ansible-runner, with a
live per-play line, a per-host summary, ``--json`` and exit codes that say what happened (docs/cli.md)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from gpufleet.runner import progress
from gpufleet.runner.run import (
    EXIT_CODES_HELP,
    EXIT_FAILED,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_USAGE,
    STATE_DIR_ENV,
    RunRequest,
    RunResult,
    UsageError,
    collection_dir,
    extra_var,
    project_dir,
    resolve_extra_vars,
    resolve_inventory,
    run_playbook,
    state_dir,
)
from gpufleet.validation.report import SUITES, Check, Report

REPORT_VAR = "gpufleet_validation_report_dir"
DEFAULT_REPORT_DIR = Path(".lab/validation-report")  # under the checkout, as playbooks/validate.yml has it
# Where `make lab` writes it: the lab's inventory (inventory/lab/group_vars/all.yml) puts the report in the
# lab's state directory.
LAB_REPORT_DIR = Path(".lab/fleet/validation-report")

PROVISION_HELP = """\
Run site.yml (or --playbook) with ansible-runner: a live line per play, then
a per-host table (ok, changed, failed, unreachable, skipped) and each failed
task's message. The inventory defaults to the one ansible.cfg names
([defaults] inventory). Artifacts (events, a scrubbed stdout) go to
<state dir>/runner/artifacts/ ($GPUFLEET_RUNNER_DIR moves them); the newest
20 are kept ($GPUFLEET_RUNNER_KEEP). site.yml's validation stage writes its
report to <state dir>/validation-report, where `gpufleet report` reads it.
"""

VALIDATE_HELP = """\
Run playbooks/validate.yml with ansible-runner: expectations from the
inventory and each host's GPU facts, the testinfra suites, and a report
(report.json, junit.xml, report.txt) in --report-dir. Ends with the per-host
table (Ansible's counts and each host's validation result), then the
validation table. --limit picks the hosts to validate (gpufleet_target).

A suite asked for (all four unless --suites) that the inventory gives
nothing to check is NOT RUN, with the reason and the variable to set
(gpufleet_validation_runtime, gpufleet_validation_cluster): never a pass,
exit 1. Leave such a suite out with --suites.
"""

REPORT_HELP = """\
Print the last validation report (the per-host table) without running
anything.

exit codes:
  0    every check passed (or was skipped as not applicable)
  1    the report is not green: a check failed or errored, a suite asked
       for did not run (NOT RUN), or the suites could not run
  2    no report in the directory, or it cannot be read
"""


def _add_run_options(parser: argparse.ArgumentParser, *, playbook_help: str) -> None:
    parser.add_argument("-i", "--inventory", action="append", metavar="INVENTORY",
                        help="inventory path or host list (repeatable; default: ansible.cfg's inventory)")
    parser.add_argument("--limit", "-l", metavar="L", help="limit to hosts matching this pattern")
    parser.add_argument("-e", "--extra-vars", action="append", default=[], metavar="K=V",
                        help="extra variables as Ansible takes them (K=V, JSON, @file); repeatable")
    parser.add_argument("--playbook", type=Path, help=playbook_help)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document (and nothing else) on stdout")
    parser.add_argument("--verbose", "-v", action="store_true",
                        help="stream Ansible's own output (to stderr with --json)")
    _add_state_dir(parser)


def _add_state_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", type=Path, metavar="DIR",
                        help="where runs keep their artifacts (DIR/runner) and the validation report "
                             "(DIR/validation-report); default: .lab/ of the checkout, or of the current "
                             f"directory for an installed gpufleet (${STATE_DIR_ENV})")


def _apply_state_dir(args: argparse.Namespace) -> None:
    if getattr(args, "state_dir", None) is not None:
        os.environ[STATE_DIR_ENV] = str(args.state_dir.expanduser().resolve())


def _playbook(given: Path | None, default: str, project: Path) -> Path:
    """The playbook to run: ``--playbook`` (a path, or a playbook of the collection by name, e.g.
    ``gpufleet.nvidia.drivers``), else ``default`` of the collection (the checkout, or the installed one)."""
    if given is None:
        return collection_dir(project) / default
    path = given.expanduser()
    name = str(given)
    if not path.exists() and name.startswith("gpufleet.nvidia.") and "/" not in name:
        return collection_dir(project) / "playbooks" / f"{name.removeprefix('gpufleet.nvidia.')}.yml"
    return path.resolve()


def register(subparsers: Any) -> None:
    """Add ``provision``, ``validate`` and ``report`` to the top-level ``gpufleet`` CLI."""
    fmt = argparse.RawDescriptionHelpFormatter
    parser = subparsers.add_parser("provision", help="converge hosts: run site.yml through ansible-runner",
                                   description=PROVISION_HELP, epilog=EXIT_CODES_HELP, formatter_class=fmt)
    _add_run_options(parser,
                     playbook_help="run this playbook instead of site.yml (e.g. playbooks/drivers.yml)")
    parser.add_argument("--tags", "-t", metavar="T", help="only tasks tagged with these (comma-separated)")
    parser.add_argument("--check", "-C", action="store_true", help="dry run: report what would change")
    parser.add_argument("--diff", "-D", action="store_true", help="show the changes made to files")
    parser.set_defaults(func=_provision)

    parser = subparsers.add_parser("validate",
                                   help="validate hosts: run playbooks/validate.yml, show the report",
                                   description=VALIDATE_HELP, epilog=EXIT_CODES_HELP, formatter_class=fmt)
    _add_run_options(parser, playbook_help="run this playbook instead of playbooks/validate.yml")
    parser.add_argument("--suites", metavar="S",
                        help=f"comma-separated, of {','.join(SUITES)} (default: all)")
    parser.add_argument("--report-dir", type=Path, metavar="DIR",
                        help="where the report goes (default: <state dir>/validation-report)")
    parser.set_defaults(func=_validate)

    parser = subparsers.add_parser("report", help="print the last validation report",
                                   description=REPORT_HELP, formatter_class=fmt)
    parser.add_argument("--report-dir", type=Path, metavar="DIR",
                        help="the report's directory (default: <state dir>/validation-report)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON document")
    _add_state_dir(parser)
    parser.set_defaults(func=_report)


def _error(command: str, message: str, code: int, as_json: bool) -> int:
    if as_json:
        doc = {"command": command, "status": "error", "exit_code": code, "error": message}
        print(json.dumps(doc, indent=2))
    else:
        print(f"gpufleet {command}: {message}", file=sys.stderr)
    return code


@dataclass
class _Outcome:
    result: RunResult
    request: RunRequest


def _execute(command: str, args: argparse.Namespace, request: RunRequest) -> _Outcome:
    out = sys.stderr if args.json else sys.stdout
    show = args.verbose or not args.json
    display = progress.Progress(out, verbose=args.verbose) if show else None
    result = run_playbook(
        request,
        on_event=display.on_event if display else None,
        on_status=display.on_status if display else None,
        color=bool(args.verbose and out.isatty()),
    )
    if display:
        display.close()
    return _Outcome(result, request)


def _request(command: str, args: argparse.Namespace, default_playbook: str,
             generated_vars: Sequence[str] = (), final_vars: Sequence[str] = ()) -> RunRequest:
    """The run's request; ``generated_vars`` go before the user's -e (which may override them),
    ``final_vars`` after (an explicit option wins)."""
    project = project_dir()
    playbook = _playbook(args.playbook, default_playbook, project)
    if not playbook.is_file():
        raise UsageError(f"playbook {playbook} not found")
    return RunRequest(
        playbook=playbook,
        inventory=resolve_inventory(args.inventory, project / "ansible.cfg"),
        limit=getattr(args, "limit", None) if command == "provision" else None,
        tags=getattr(args, "tags", None),
        check=bool(getattr(args, "check", False)),
        diff=bool(getattr(args, "diff", False)),
        extra_vars=[*generated_vars, *resolve_extra_vars(args.extra_vars), *final_vars],
        label=command,
    )


def _document(command: str, outcome: _Outcome, exit_code: int) -> dict[str, Any]:
    doc = {"command": command, "playbook": str(outcome.request.playbook),
           "inventory": outcome.request.inventory, **outcome.result.to_dict()}
    doc["exit_code"] = exit_code
    return doc


def _provision(args: argparse.Namespace) -> int:
    _apply_state_dir(args)
    try:
        request = _request("provision", args, "site.yml")
    except UsageError as exc:
        return _error("provision", str(exc), EXIT_USAGE, args.json)
    outcome = _execute("provision", args, request)
    result = outcome.result
    code = result.exit_code
    if args.json:
        print(json.dumps(_document("provision", outcome, code), indent=2))
        return code
    _print_summary("provision", result, code)
    return code


def _print_summary(command: str, result: RunResult, code: int, validation: Mapping[str, Any] | None = None,
                   note: str = "", report_table: str = "") -> None:
    parts = []
    if result.plays or result.hosts:
        parts.append(progress.summary_table(result.hosts, validation))
    if result.failures:
        parts.append(progress.failures_text(result.failures))
    if report_table:
        parts.append(report_table)
    parts.append(progress.result_lines(result, code, command=command, note=note))
    sys.stdout.write("\n" + "\n".join(parts))
    sys.stdout.flush()


# ---------------------------------------------------------------- validate


def _report_dir(args: argparse.Namespace, project: Path) -> tuple[Path, list[str]]:
    """The report directory: --report-dir, else the user's ``-e gpufleet_validation_report_dir=``, else
    the checkout's .lab/validation-report; and the -e that tells the playbook (none for the user's own)."""
    given = extra_var(args.extra_vars, REPORT_VAR)
    if args.report_dir is not None:
        path = args.report_dir.expanduser().resolve()
    elif given:
        # relative to Ansible's working directory, the checkout
        return (project / Path(given).expanduser()).resolve(), []
    else:
        path = state_dir(project) / DEFAULT_REPORT_DIR.name
    return path, [json.dumps({REPORT_VAR: str(path)})]


def load_report(directory: Path) -> tuple[dict[str, Any], Report]:
    """report.json of ``directory`` and the Report it describes; ValueError/OSError when unreadable."""
    doc = json.loads((directory / "report.json").read_text())
    if not isinstance(doc, dict) or not isinstance(doc.get("checks"), list):
        raise ValueError("report.json is not a validation report (no 'checks')")
    hosts = doc.get("hosts") or {}
    suites = tuple(doc["suites"]) if isinstance(doc.get("suites"), list) else next(
        (tuple(v) for v in hosts.values() if isinstance(v, Mapping)), SUITES)
    checks = [Check(**{k: c[k] for k in Check.__dataclass_fields__ if k in c}) for c in doc["checks"]]
    modes = {str(k): str(v) for k, v in (doc.get("modes") or {}).items()}
    return doc, Report(checks=checks, problems=list(doc.get("problems") or []), suites=suites, modes=modes)


def _report_text(directory: Path, report: Report, written: str = "") -> str:
    """The report's heading (its directory, wrapped to the width; then when it was written) and its table."""
    try:
        table = (directory / "report.txt").read_text()
    except OSError:
        table = report.table()
    head = textwrap.wrap(f"VALIDATION REPORT {progress._short(directory)}", progress.WIDTH,
                         break_long_words=True, break_on_hyphens=False)
    return "\n".join(head) + "\n" + (f"written {written}\n\n" if written else "") + table


def _validate(args: argparse.Namespace) -> int:
    _apply_state_dir(args)
    project = project_dir()
    try:
        report_dir, final = _report_dir(args, project)
        generated: list[str] = []
        if args.suites is not None:
            suites = [s.strip() for s in args.suites.split(",") if s.strip()]
            unknown = sorted(set(suites) - set(SUITES))
            if unknown or not suites:
                raise UsageError(f"--suites: unknown {', '.join(unknown) or '(none)'}; choose from "
                                 f"{', '.join(SUITES)}")
            generated.append(json.dumps({"gpufleet_validation_suites": ",".join(suites)}))
        if args.limit:
            # validate.yml's report play runs on the controller, so --limit picks the hosts under test
            generated.append(json.dumps({"gpufleet_target": args.limit}))
        request = _request("validate", args, "playbooks/validate.yml", generated, final)
    except UsageError as exc:
        return _error("validate", str(exc), EXIT_USAGE, args.json)
    started = time.time()
    outcome = _execute("validate", args, request)
    result = outcome.result
    code = result.exit_code
    doc: dict[str, Any] | None = None
    report: Report | None = None
    note = ""
    report_file = report_dir / "report.json"
    try:
        if report_file.stat().st_mtime >= started - 1:
            doc, report = load_report(report_dir)
        else:
            note = f"no report written by this run (an older one is in {progress._short(report_dir)})"
    except FileNotFoundError:
        note = "no report written by this run"
    except (OSError, ValueError) as exc:
        note = f"report unreadable: {exc}"
    if report is not None and code in (EXIT_OK, EXIT_FAILED) and report.exit_code() != 0:
        code = EXIT_FAILED
    elif report is None and code == EXIT_OK:
        code = EXIT_INTERNAL  # the playbook passed yet wrote no report: something is wrong with it
    if args.json:
        out = _document("validate", outcome, code)
        out["validation"] = None if doc is None else {
            "report_dir": str(report_dir), "status": doc.get("status"), "exit_code": doc.get("exit_code"),
            "counts": doc.get("counts"), "problems": doc.get("problems"), "not_run": doc.get("not_run", []),
            "not_asked": doc.get("not_asked", []), "hosts": doc.get("hosts"),
            "per_host": {h: progress.validation_cell(doc["checks"], h) for h in (doc.get("hosts") or {})},
        }
        if note:
            out["validation_error"] = note
        print(json.dumps(out, indent=2))
        return code
    _print_summary("validate", result, code, doc if doc is not None else {}, note,
                   _report_text(report_dir, report) if report is not None else "")
    return code


# ---------------------------------------------------------------- report


def report_dirs(project: Path) -> tuple[Path, ...]:
    """Where reports are looked for without --report-dir: the state directory's, then the lab's."""
    return state_dir(project) / DEFAULT_REPORT_DIR.name, project / LAB_REPORT_DIR


def last_report_dir(project: Path) -> Path | None:
    """Of :func:`report_dirs`, the one holding the newest report.json; None when none holds one."""
    reports = [d / "report.json" for d in report_dirs(project)]
    dated = [(r.stat().st_mtime_ns, r.parent) for r in reports if r.is_file()]
    return max(dated)[1] if dated else None


def _report(args: argparse.Namespace) -> int:
    _apply_state_dir(args)
    if args.report_dir:
        directory = args.report_dir.expanduser().resolve()
    else:
        newest = last_report_dir(project_dir())
        if newest is None:
            where = " or ".join(str(d) for d in report_dirs(project_dir()))
            return _error("report", f"no validation report in {where} (run gpufleet validate or make lab)",
                          EXIT_USAGE, args.json)
        directory = newest
    try:
        doc, report = load_report(directory)
    except FileNotFoundError:
        return _error("report", f"no validation report in {directory} (run gpufleet validate)", EXIT_USAGE,
                      args.json)
    except (OSError, ValueError, TypeError) as exc:
        return _error("report", f"cannot read the report in {directory}: {exc}", EXIT_USAGE, args.json)
    code = EXIT_OK if report.exit_code() == 0 else EXIT_FAILED
    if args.json:
        print(json.dumps({"report_dir": str(directory), "exit_code": code, "report": doc}, indent=2))
        return code
    mtime = (directory / "report.json").stat().st_mtime
    written = datetime.fromtimestamp(mtime).strftime("%Y-%m-%d %H:%M:%S")
    sys.stdout.write(_report_text(directory, report, written))
    return code
