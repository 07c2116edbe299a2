"""What a run shows while it goes and when it ends, in at most 80 columns.

While a play runs, one line: its number and name, host results received out of hosts x tasks started, the
ok/changed/failed/unreachable counts over its hosts, and (on a terminal) the task running now. On a terminal
that line is redrawn in place and left as the play's final line; elsewhere (logs, CI) plain lines are
appended: the play, each task as it starts, the play's final line. A failed or unreachable host gets a line
of its own as it happens. At the end: the per-host table (with the validation result for ``validate``),
then each failure with its message, then the result.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, TextIO

from gpufleet.runner.run import Failure, HostStats, PlayState, RunResult, Tracker
from gpufleet.validation.report import NOT_RUN

WIDTH = 80
MESSAGE_LINES = 12  # lines of one failure's message shown (the whole of it is in --json and the artifacts)
CLEAR = "\r\x1b[K"


def fit(text: str, width: int) -> str:
    """``text`` cut to ``width`` columns, a cut marked by ``~`` (as the validation table does)."""
    if width <= 0:
        return ""
    return text if len(text) <= width else text[: width - 1] + "~"


def play_line(play: PlayState, width: int = WIDTH, *, live: bool = False) -> str:
    """``PLAY 2 Host prep > Install tools  3 hosts x 5 tasks 14/15 ok 12 chg 2 fail 0 unr 0``: the play,
    the running task (only while live), host results received of hosts x tasks started, and the counts
    over the play's hosts. Names are cut (``~``) so the line fits ``width``; the counts never are."""
    total = play.totals()
    if play.no_hosts and not play.hosts:
        counts = "no hosts matched"
    else:
        hosts, tasks = len(play.hosts), play.tasks
        counts = (f"{hosts} host{'s' * (hosts != 1)} x {tasks} task{'s' * (tasks != 1)} "
                  f"{play.results}/{hosts * tasks} "
                  f"ok {total.ok} chg {total.changed} fail {total.failed} unr {total.unreachable}")
    head = f"PLAY {play.number} "
    name = f"{play.name} > {play.task}" if live and play.task else play.name
    room = max(width - len(head) - len(counts) - 2, 8)
    return fit(f"{head}{fit(name, room):<{room}}  {counts}", width)


def task_line(play: PlayState, width: int = WIDTH) -> str:
    return fit(f"  TASK {play.tasks} {play.task}", width)


def failure_line(failure: Failure, width: int = WIDTH) -> str:
    word = "UNREACHABLE" if failure.kind == "unreachable" else "FAILED"
    return fit(f"  {word} {failure.host}: {failure.task}", width)


class Progress:
    """The live display, fed by the runner's event handler (``on_event``) and status handler."""

    def __init__(self, stream: TextIO, *, tty: bool | None = None, verbose: bool = False,
                 width: int | None = None) -> None:
        self.stream = stream
        self.tty = stream.isatty() if tty is None else tty
        self.verbose = verbose
        if width is None:
            width = min(WIDTH, shutil.get_terminal_size((WIDTH, 24)).columns) if self.tty else WIDTH
        self.width = width
        self._live: PlayState | None = None  # the play whose line is on screen, not yet ended
        self._shown_failures = 0
        self._drawn = ""  # the live line as last drawn

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def _clear(self) -> None:
        if self.tty and self._live is not None:
            self._write(CLEAR)
            self._drawn = ""

    def _end_play(self, play: PlayState) -> None:
        """The play's final line: on a terminal it replaces the live one."""
        if self.tty:
            self._write(CLEAR + play_line(play, self.width) + "\n")
            self._drawn = ""
        else:
            self._write(play_line(play, self.width) + "\n")
        self._live = None

    def on_status(self, status: str, tracker: Tracker) -> None:
        if self.tty and not self.verbose and status == "starting" and not tracker.plays:
            self._write(CLEAR + fit("starting ansible-playbook ...", self.width - 1))
            self._drawn = "starting"

    def on_event(self, event: Mapping[str, Any], tracker: Tracker) -> None:
        if self.verbose:
            stdout = event.get("stdout")
            if stdout:
                self._write(stdout.replace("\r\n", "\n") + "\n")
            return
        name = event.get("event", "")
        play = tracker.play
        if self._live is not None and (play is not self._live or self._live.done):
            self._end_play(self._live)
        if play is None or play.done:
            if self.tty and name == "playbook_on_stats":
                self._write(CLEAR)
            return
        if self._live is None:
            self._live = play
            if not self.tty:
                self._write(fit(f"PLAY {play.number} {play.name}", self.width) + "\n")
        new_failures = tracker.failures[self._shown_failures :]
        if new_failures:
            self._clear()
            for failure in new_failures:
                self._write(failure_line(failure, self.width) + "\n")
            self._shown_failures = len(tracker.failures)
        if self.tty:
            # one column short of the width: a line that fills the terminal would wrap on some terminals
            line = play_line(play, self.width - 1, live=True)
            if line != self._drawn:
                self._write(CLEAR + line)
                self._drawn = line
        elif name in ("playbook_on_task_start", "playbook_on_handler_task_start"):
            self._write(task_line(play, self.width) + "\n")

    def close(self) -> None:
        """End a live line left open (a cancelled run), or clear the "starting" one."""
        if self._live is not None:
            self._end_play(self._live)
        elif self.tty and self._drawn:
            self._write(CLEAR)
            self._drawn = ""


def validation_cell(checks: Iterable[Mapping[str, Any]], host: str) -> str:
    """One host's validation over all suites: ``PASS 8/8``, ``FAIL 7/8``, ``ERROR 3/4``, ``SKIP`` or ``-``;
    checks that did not run are added (``PASS 8/8, 11 NOT RUN``), or are all there is (``NOT RUN``)."""
    mine = [c for c in checks if c.get("target") == host]
    if not mine:
        return "-"
    not_run = sum(c.get("outcome") == NOT_RUN for c in mine)
    ran = [c for c in mine if c.get("outcome") not in ("skipped", NOT_RUN)]
    if not ran:
        return "NOT RUN" if not_run else "SKIP"
    passed = sum(c.get("outcome") == "passed" for c in ran)
    word = "PASS"
    if any(c.get("outcome") == "failed" for c in ran):
        word = "FAIL"
    elif any(c.get("outcome") == "error" for c in ran):
        word = "ERROR"
    return f"{word} {passed}/{len(ran)}" + (f", {not_run} NOT RUN" if not_run else "")


_COLUMNS = (("OK", "ok", 5), ("CHANGED", "changed", 9), ("FAILED", "failed", 8),
            ("UNREACHABLE", "unreachable", 13), ("SKIPPED", "skipped", 9))


def summary_table(hosts: Mapping[str, HostStats], validation: Mapping[str, Any] | None = None,
                  width: int = WIDTH) -> str:
    """Per host: ok, changed, failed, unreachable, skipped (Ansible's recap), and the validation result
    when ``validation`` (a report.json document) is given. Long host names are cut with ``~``."""
    checks = (validation or {}).get("checks") or []
    cells = {h: validation_cell(checks, h) for h in hosts} if validation is not None else {}
    extra = (2 + max([len("VALIDATION"), *(len(c) for c in cells.values())])) if validation is not None else 0
    numbers = sum(w for _, _, w in _COLUMNS)
    host_width = max(4, min(max([4, *(len(h) for h in hosts)]), width - numbers - extra))
    head = f"{'HOST':<{host_width}}" + "".join(f"{title:>{w}}" for title, _, w in _COLUMNS)
    if validation is not None:
        head += "  VALIDATION"
    lines = [head]
    for host, stats in hosts.items():
        row = f"{fit(host, host_width):<{host_width}}"
        row += "".join(f"{getattr(stats, attr):>{w}}" for _, attr, w in _COLUMNS)
        if validation is not None:
            row += f"  {cells[host]}"
        lines.append(fit(row.rstrip(), width))
    if not hosts:
        lines.append("(no host ran a task)")
    return "\n".join(lines) + "\n"


def failures_text(failures: Sequence[Failure], width: int = WIDTH) -> str:
    """Each failed task and unreachable host with its message (censored ones say so), wrapped."""
    if not failures:
        return ""
    lines = ["FAILURES"]
    for failure in failures:
        word = "UNREACHABLE" if failure.kind == "unreachable" else "FAILED"
        head = f"{failure.host} | {failure.play} | {failure.task}: {word}"
        lines += textwrap.wrap(head, width, initial_indent="- ", subsequent_indent="  ")
        body: list[str] = []
        for paragraph in failure.message.splitlines() or [""]:
            body += textwrap.wrap(paragraph, width, initial_indent="    ", subsequent_indent="    ") or [""]
        if len(body) > MESSAGE_LINES:
            body = [*body[:MESSAGE_LINES], "    ... (the rest: --json, or the artifacts)"]
        lines += body
    return "\n".join(lines) + "\n"


_RESULT_WORDS = {0: "ok", 1: "FAILED", 2: "NOT RUN (usage)", 3: "UNREACHABLE", 4: "ERROR", 130: "INTERRUPTED"}


def result_lines(result: RunResult, exit_code: int, width: int = WIDTH, *, command: str = "run",
                 note: str = "") -> str:
    """What went wrong before any play (Ansible's own words), then
    ``gpufleet provision: FAILED (exit 1) in 4.2s`` and where the artifacts are."""
    lines = []
    if result.error and result.status != "canceled" and (result.status == "error" or not result.plays):
        for paragraph in result.error.splitlines():
            lines += textwrap.wrap(paragraph, width, subsequent_indent="  ") or [""]
    word = _RESULT_WORDS.get(exit_code, "exit")
    head = f"gpufleet {command}: {word} (exit {exit_code}) in {result.duration:.1f}s"
    if note:
        head += f"; {note}"
    lines += textwrap.wrap(head, width, subsequent_indent="  ")
    if result.artifact_dir:
        lines += textwrap.wrap(f"artifacts: {_short(result.artifact_dir)}", width, subsequent_indent="  ",
                               break_long_words=True, break_on_hyphens=False)
    return "\n".join(lines) + "\n"


def _short(path: Any) -> str:
    """A path relative to the working directory when it lies under it."""
    from pathlib import Path

    path = Path(path)
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
