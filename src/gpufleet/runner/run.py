"""One playbook run through ansible-runner's Python API, and what came of it.

In a checkout, the checkout is runner's ``project_dir`` (Ansible's working directory, so ``ansible.cfg``,
``roles/`` and the collection link under ``.cache/collections`` apply; ``ANSIBLE_CONFIG`` names the
checkout's ``ansible.cfg``). Installed from a wheel, the directory gpufleet is run from is, and the playbooks
are those of the installed collection gpufleet.nvidia (:func:`collection_dir`). Runner's ``private_data_dir``
is ``<state dir>/runner`` (``.lab/`` of that directory, or ``--state-dir``; ``$GPUFLEET_RUNNER_DIR`` moves
it): nothing else is written there. Every option reaches ``ansible-playbook`` on its command line
(``suppress_env_files``: no ``env/`` files that a later run would silently reuse). Artifact directories are
rotated (the newest ``KEEP_ARTIFACTS`` kept, ``$GPUFLEET_RUNNER_KEEP`` to change).

Events feed a :class:`Tracker` (per-play and per-host counts, failed tasks with their messages). Results of
``no_log`` tasks arrive censored; their messages are never read, and their ``stdout`` is replaced (Ansible
itself may print a ``no_log`` task's failure message in its error banner) before runner stores the event.
"""

from __future__ import annotations

import configparser
import contextlib
import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import gpufleet

# Exit codes of `gpufleet provision|validate|report` (docs/cli.md).
EXIT_OK = 0
EXIT_FAILED = 1  # a host failed a task, or a validation check failed
EXIT_USAGE = 2  # bad options, inventory or playbook: nothing was run on a host
EXIT_UNREACHABLE = 3  # a host could not be reached (wins over EXIT_FAILED)
EXIT_INTERNAL = 4  # ansible-runner or Ansible itself broke (ansible-playbook not found, crash)
EXIT_INTERRUPTED = 130  # Ctrl-C (or SIGTERM): the run was cancelled

EXIT_CODES_HELP = """\
exit codes:
  0    success (validate: every check of the suites asked for ran and passed)
  1    a host failed a task, or a validation check failed or did not run
  2    usage, inventory or playbook error (nothing ran on any host)
  3    a host was unreachable (wins over 1)
  4    runner or internal error (e.g. ansible-playbook not found)
  130  interrupted (Ctrl-C): the run was cancelled
"""

ANSIBLE_PLAYBOOK = "ansible-playbook"
KEEP_ARTIFACTS = 20
RUNNER_DIR_ENV = "GPUFLEET_RUNNER_DIR"
KEEP_ENV = "GPUFLEET_RUNNER_KEEP"
CENSORED = "(output hidden: no_log)"
MESSAGE_LIMIT = 2000  # characters of one failed task's message kept


class UsageError(Exception):
    """Bad options or inventory: exit 2."""


STATE_DIR_ENV = "GPUFLEET_STATE_DIR"
COLLECTION = "gpufleet.nvidia"


def checkout_dir() -> Path | None:
    """The checkout gpufleet runs from (site.yml, ansible.cfg, galaxy.yml beside src/), or None when gpufleet
    is an installed wheel."""
    root = Path(gpufleet.__file__).resolve().parents[2]
    marks = ("site.yml", "ansible.cfg", "galaxy.yml")
    return root if all((root / name).is_file() for name in marks) else None


def project_dir() -> Path:
    """Ansible's working directory: the checkout (its ansible.cfg, roles/ and collection link apply), else the
    directory gpufleet is run from (its ansible.cfg, if any, applies as it would to ansible-playbook)."""
    return checkout_dir() or Path.cwd()


def state_dir(project: Path) -> Path:
    """Where runs keep their state (runner's artifacts, the validation report): ``$GPUFLEET_STATE_DIR`` (the
    commands' ``--state-dir``), else ``<project>/.lab``: the checkout's, or the current directory's."""
    return Path(os.environ.get(STATE_DIR_ENV) or project / ".lab").resolve()


def runner_dir(project: Path) -> Path:
    """Runner's private_data_dir: ``$GPUFLEET_RUNNER_DIR``, else ``<state dir>/runner``."""
    return Path(os.environ.get(RUNNER_DIR_ENV) or state_dir(project) / "runner").resolve()


def _tool_path() -> str:
    """PATH for Ansible's tools: this interpreter's bin/ (the venv gpufleet is installed in) first."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", os.defpath)])


def collection_dir(project: Path) -> Path:
    """The gpufleet.nvidia collection whose playbooks run: the checkout itself, else the installed collection
    ansible-galaxy finds from ``project`` (ansible.cfg's collections_path, ANSIBLE_COLLECTIONS_PATH, the
    default paths; the first, as ansible-playbook takes it). UsageError, naming the command that installs it,
    when there is none or when it is another version than this gpufleet: the runner's options and the
    playbooks' variables change together, so a mixed pair would fail late or quietly differ."""
    checkout = checkout_dir()
    if checkout is not None:
        return checkout
    hint = (f"the Ansible collection {COLLECTION} is not installed where ansible-playbook looks; install it "
            f"(the same version as gpufleet, {gpufleet.__version__}): ansible-galaxy collection install "
            f"gpufleet-nvidia-{gpufleet.__version__}.tar.gz")  # fmt: skip
    tool = shutil.which("ansible-galaxy", path=_tool_path())
    if tool is None:
        raise UsageError(f"ansible-galaxy not found (pip install 'gpufleet[controller]'); {hint}")
    proc = subprocess.run([tool, "collection", "list", COLLECTION, "--format", "json"], cwd=project,
                          capture_output=True, text=True, env={**os.environ, "PATH": _tool_path()},
                          check=False)  # fmt: skip
    try:
        found = json.loads(proc.stdout or "{}")
    except ValueError:
        found = {}
    for path, collections in found.items():
        if COLLECTION in (collections or {}):
            where = Path(path, *COLLECTION.split(".")).resolve()
            version = str((collections[COLLECTION] or {}).get("version", "unknown"))
            if version != gpufleet.__version__:
                raise UsageError(
                    f"the Ansible collection {COLLECTION} at {where} is version {version}, but gpufleet is "
                    f"{gpufleet.__version__}; install the collection of the same release: ansible-galaxy "
                    f"collection install --force gpufleet-nvidia-{gpufleet.__version__}.tar.gz (or install "
                    f"gpufleet {version}: pip install 'gpufleet[controller]=={version}')"
                )
            return where
    raise UsageError(hint)


def keep_artifacts() -> int:
    try:
        return max(1, int(os.environ.get(KEEP_ENV, KEEP_ARTIFACTS)))
    except ValueError:
        return KEEP_ARTIFACTS


def _read_cfg(cfg: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, inline_comment_prefixes=(";",))
    try:
        parser.read(cfg)
    except configparser.Error as exc:
        raise UsageError(f"{cfg}: {exc}") from exc
    return parser


def default_inventory(cfg: Path) -> list[str]:
    """``[defaults] inventory`` of ``cfg`` (comma-separated, relative to its directory); [] when unset."""
    value = _read_cfg(cfg).get("defaults", "inventory", fallback="").strip()
    return [str((cfg.parent / Path(p.strip()).expanduser()).resolve()) for p in value.split(",") if p.strip()]


def resolve_inventory(given: Sequence[str] | None, cfg: Path, cwd: Path | None = None) -> list[str]:
    """Absolute inventory sources: each ``-i`` (relative to ``cwd``), else ansible.cfg's default.

    A ``host1,host2,`` host list passes as is. Raises UsageError when there is none, or one does not exist.
    """
    cwd = cwd or Path.cwd()
    if given:
        sources: list[str] = []
        for item in given:
            path = (cwd / Path(item).expanduser()).resolve()
            if path.exists():
                sources.append(str(path))
            elif "," in item:
                sources.append(item)
            else:
                raise UsageError(f"inventory {item} not found")
        return sources
    sources = default_inventory(cfg)
    if not sources:
        raise UsageError(f"no inventory: pass -i INVENTORY (or set [defaults] inventory in {cfg})")
    missing = [s for s in sources if not Path(s).exists()]
    if missing:
        raise UsageError(f"inventory {', '.join(missing)} (from {cfg}) not found; pass -i INVENTORY")
    return sources


def resolve_extra_vars(values: Sequence[str] | None, cwd: Path | None = None) -> list[str]:
    """``-e`` values as Ansible takes them (``K=V``, JSON/YAML, ``@file``); ``@file`` made absolute."""
    cwd = cwd or Path.cwd()
    out = []
    for value in values or ():
        if value.startswith("@"):
            path = (cwd / Path(value[1:]).expanduser()).resolve()
            if not path.is_file():
                raise UsageError(f"extra vars file {value[1:]} not found")
            value = f"@{path}"
        elif not value.strip():
            raise UsageError("empty -e value")
        out.append(value)
    return out


def extra_var(values: Sequence[str], name: str) -> str | None:
    """The last ``name=value`` among ``-e`` values of the K=V form (None when not given that way)."""
    found = None
    for value in values:
        if value.startswith(("@", "{", "[")):
            continue
        try:
            tokens = shlex.split(value)
        except ValueError:
            continue
        for token in tokens:
            key, sep, val = token.partition("=")
            if sep and key == name:
                found = val
    return found


@dataclass
class RunRequest:
    """What to run: a playbook, its inventory and ansible-playbook's options."""

    playbook: Path
    inventory: list[str]
    limit: str | None = None
    tags: str | None = None
    check: bool = False
    diff: bool = False
    extra_vars: list[str] = field(default_factory=list)
    label: str = "run"  # names the artifact directory

    def cmdline(self) -> list[str]:
        args: list[str] = []
        for source in self.inventory:
            args += ["-i", source]
        if self.limit:
            args += ["--limit", self.limit]
        if self.tags:
            args += ["--tags", self.tags]
        if self.check:
            args.append("--check")
        if self.diff:
            args.append("--diff")
        for value in self.extra_vars:
            args += ["-e", value]
        return args


@dataclass
class HostStats:
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    rescued: int = 0
    ignored: int = 0


@dataclass
class Failure:
    """A task that failed on a host (or a host that could not be reached)."""

    host: str
    play: str
    task: str
    kind: str  # "failed" | "unreachable"
    message: str


@dataclass
class PlayState:
    number: int
    name: str
    hosts: dict[str, HostStats] = field(default_factory=dict)
    tasks: int = 0
    task: str = ""
    results: int = 0  # host results received (ok, changed, failed, skipped, unreachable)
    no_hosts: bool = False
    done: bool = False

    def totals(self) -> HostStats:
        total = HostStats()
        for stats in self.hosts.values():
            for key in asdict(total):
                setattr(total, key, getattr(total, key) + getattr(stats, key))
        return total


def is_censored(res: Any) -> bool:
    """A no_log result (or a loop result with a no_log item): nothing in it may be shown."""
    if not isinstance(res, Mapping):
        return False
    if "censored" in res or res.get("_ansible_no_log") is True:
        return True
    results = res.get("results")
    return isinstance(results, list) and any(is_censored(r) for r in results)


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, str):
        return value.strip()
    return json.dumps(value, default=str)


def _tail(text: str, lines: int = 5) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


def failure_message(res: Any) -> str:
    """What an operator needs from a failed result: msg, the command's stderr/stdout tail, failed items.
    Never anything of a censored (no_log) result or item."""
    if not isinstance(res, Mapping):
        return _text(res)
    if "censored" in res or res.get("_ansible_no_log") is True:
        return CENSORED
    parts = []
    msg = _text(res.get("msg"))
    if res.get("rc") not in (None, 0) and "rc" not in msg:
        msg = f"{msg} (rc {res.get('rc')})" if msg else f"rc {res.get('rc')}"
    if msg:
        parts.append(msg)
    for key in ("stderr", "module_stderr", "stdout", "module_stdout"):
        out = _text(res.get(key))
        if out and out not in msg:
            parts.append(_tail(out))
            break
    results = res.get("results")
    if isinstance(results, list):
        for item in results:
            if not isinstance(item, Mapping) or not (item.get("failed") or item.get("unreachable")):
                continue
            if "censored" in item or item.get("_ansible_no_log") is True:
                parts.append(f"item: {CENSORED}")
            else:
                label = _text(item.get("_ansible_item_label", item.get("item")))
                parts.append(f"item {label}: {failure_message(item)}")
    text = "\n".join(p for p in parts if p) or "(no message)"
    return text if len(text) <= MESSAGE_LIMIT else text[: MESSAGE_LIMIT - 3] + "..."


_CENSORED_STATUS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "fatal",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipping",
    "runner_item_on_ok": "ok",
    "runner_item_on_failed": "failed",
    "runner_item_on_skipped": "skipping",
    "runner_on_async_failed": "fatal",
    "runner_on_async_ok": "ok",
}


def scrub(event: dict[str, Any]) -> bool:
    """Replace the stdout of an event whose result is censored (no_log); True when it was."""
    data = event.get("event_data") or {}
    if not is_censored(data.get("res")):
        return False
    word = _CENSORED_STATUS.get(event.get("event", ""), "result")
    event["stdout"] = f"{word}: [{data.get('host', '?')}] {CENSORED}"
    if data.get("ignore_errors") and "failed" in event.get("event", ""):
        event["stdout"] += "\n...ignoring"
    return True


class Tracker:
    """Folds runner events into per-play and per-host counts, failures and Ansible's final stats."""

    def __init__(self) -> None:
        self.plays: list[PlayState] = []
        self.hosts: dict[str, HostStats] = {}
        self.stats: dict[str, HostStats] | None = None
        self.failures: list[Failure] = []
        self.status = "unstarted"
        self.output: list[str] = []  # every event's (scrubbed) stdout, in order
        self.messages: deque[str] = deque(maxlen=40)  # output outside tasks: errors before any play

    @property
    def play(self) -> PlayState | None:
        return self.plays[-1] if self.plays else None

    def _host(self, play: PlayState, host: str) -> tuple[HostStats, HostStats]:
        return play.hosts.setdefault(host, HostStats()), self.hosts.setdefault(host, HostStats())

    def handle(self, event: dict[str, Any]) -> None:
        scrub(event)
        name = event.get("event", "")
        data = event.get("event_data") or {}
        stdout = event.get("stdout") or ""
        if stdout:
            self.output.append(stdout)
        if name in ("verbose", "error", "warning", "debug", "deprecated", "system_warning") and stdout:
            self.messages.extend(line for line in stdout.splitlines() if line.strip())
        if name == "playbook_on_play_start":
            if self.play:
                self.play.done = True
            name = data.get("play") or data.get("name") or "(play)"
            self.plays.append(PlayState(len(self.plays) + 1, name))
            return
        play = self.play
        if name == "playbook_on_stats":
            if play:
                play.done = True
            self.stats = _stats(data)
            return
        if play is None:
            return
        if name in ("playbook_on_task_start", "playbook_on_handler_task_start"):
            play.tasks += 1
            play.task = data.get("task") or data.get("name") or ""
        elif name == "playbook_on_no_hosts_matched":
            play.no_hosts = True
        elif name == "runner_on_start" and data.get("host"):
            self._host(play, data["host"])
        elif name in ("runner_on_ok", "runner_on_failed", "runner_on_skipped", "runner_on_unreachable"):
            self._result(play, name, data)

    def _result(self, play: PlayState, name: str, data: Mapping[str, Any]) -> None:
        host = data.get("host") or "?"
        res = data.get("res")
        counters = self._host(play, host)
        play.results += 1
        task = data.get("task") or play.task
        for stats in counters:
            if name == "runner_on_ok":
                stats.ok += 1
                stats.changed += bool(isinstance(res, Mapping) and res.get("changed"))
            elif name == "runner_on_skipped":
                stats.skipped += 1
            elif name == "runner_on_unreachable":
                stats.unreachable += 1
            elif data.get("ignore_errors"):
                stats.ignored += 1
                stats.ok += 1  # as Ansible's recap counts an ignored failure
            else:
                stats.failed += 1
        if name == "runner_on_unreachable":
            self.failures.append(Failure(host, play.name, task, "unreachable", failure_message(res)))
        elif name == "runner_on_failed" and not data.get("ignore_errors"):
            self.failures.append(Failure(host, play.name, task, "failed", failure_message(res)))

    def final_hosts(self) -> dict[str, HostStats]:
        """Ansible's own recap when the run got that far, else the counts of the events seen."""
        if self.stats is not None:
            return self.stats
        return {h: HostStats(**asdict(s)) for h, s in self.hosts.items()}

    def final_failures(self) -> list[Failure]:
        """Failures, less those a rescue block handled (the host's recap counts no failure)."""
        hosts = self.final_hosts()
        return [
            f
            for f in self.failures
            if f.kind == "unreachable" or self.stats is None or hosts.get(f.host, HostStats()).failed
        ]


def _stats(data: Mapping[str, Any]) -> dict[str, HostStats]:
    keys = {"ok": "ok", "changed": "changed", "failures": "failed", "dark": "unreachable",
            "skipped": "skipped", "rescued": "rescued", "ignored": "ignored"}
    hosts: dict[str, HostStats] = {}
    for key in keys:
        for host in data.get(key) or {}:
            hosts.setdefault(host, HostStats())
    for host, stats in hosts.items():
        for key, attr in keys.items():
            setattr(stats, attr, int((data.get(key) or {}).get(host, 0)))
    return dict(sorted(hosts.items()))


@dataclass
class RunResult:
    """The outcome of one run (``to_dict`` is the core of ``--json``)."""

    status: str  # successful | failed | canceled | timeout | error
    rc: int | None
    duration: float
    artifact_dir: Path | None
    hosts: dict[str, HostStats]
    failures: list[Failure]
    plays: int
    error: str | None = None

    @property
    def exit_code(self) -> int:
        if self.status == "canceled":
            return EXIT_INTERRUPTED
        if self.status == "error":
            return EXIT_INTERNAL
        if any(s.unreachable for s in self.hosts.values()):
            return EXIT_UNREACHABLE
        if any(s.failed for s in self.hosts.values()) or any(f.kind == "failed" for f in self.failures):
            return EXIT_FAILED
        if self.rc == 0 and self.status == "successful":
            return EXIT_OK
        if self.plays == 0 and self.rc in (1, 4, 5):
            return EXIT_USAGE  # Ansible refused the options, inventory or playbook before any play
        return EXIT_INTERNAL

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "rc": self.rc,
            "exit_code": self.exit_code,
            "duration": round(self.duration, 3),
            "artifact_dir": str(self.artifact_dir) if self.artifact_dir else None,
            "hosts": {h: asdict(s) for h, s in self.hosts.items()},
            "failures": [asdict(f) for f in self.failures],
            "error": self.error,
        }


def _collections_env(project: Path, private: Path) -> dict[str, str]:
    """When the collection link a checkout's ansible.cfg expects is missing, one under private_data_dir, after
    ansible.cfg's own collections_path (so this checkout's gpufleet.nvidia resolves). Nothing for an installed
    gpufleet: Ansible finds the installed collection where collection_dir() found it."""
    link = project / ".cache/collections/ansible_collections/gpufleet/nvidia"
    if project != checkout_dir() or link.exists():
        return {}
    fallback = private / "collections"
    link = fallback / "ansible_collections/gpufleet/nvidia"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink():
            link.unlink()
        link.symlink_to(project, target_is_directory=True)
    configured = _read_cfg(project / "ansible.cfg").get("defaults", "collections_path", fallback="")
    paths = [str((project / Path(p.strip()).expanduser()).resolve())
             for p in configured.split(":") if p.strip()]
    return {"ANSIBLE_COLLECTIONS_PATH": ":".join([*paths, str(fallback)])}


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: Sequence[int], sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, sig)


class _Interrupt:
    """Ctrl-C (SIGINT) or SIGTERM while the run goes, as runner's ``cancel_callback``.

    Ansible's workers run in sessions of their own, so runner's kill of ansible-playbook's process group
    would leave them (and the commands they run) behind. The first signal therefore interrupts
    ansible-playbook and every process below it, as Ctrl-C on a terminal would, and gives Ansible
    ``GRACE`` seconds to stop; then whatever is left is killed and runner cancels. A second Ctrl-C raises
    KeyboardInterrupt. The previous signal handlers come back afterwards.
    """

    GRACE = 5.0

    def __init__(self) -> None:
        self.requested = False
        self.ansible_pid: int | None = None  # from the events (each carries ansible-playbook's pid)
        self._since = 0.0
        self._saved: dict[int, Any] = {}

    def __enter__(self) -> _Interrupt:
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                self._saved[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: no cancel on signals
                break
        return self

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.requested = True

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _tree(self) -> list[int]:
        return [self.ansible_pid, *_descendants(self.ansible_pid)] if self.ansible_pid else []

    def __call__(self) -> bool:
        if not self.requested:
            return False
        if not self._since:
            self._since = time.monotonic()
            _signal(self._tree(), signal.SIGINT)
            return self.ansible_pid is None
        if time.monotonic() - self._since < self.GRACE:
            return False
        _signal(list(reversed(self._tree())), signal.SIGKILL)
        return True


def run_playbook(
    request: RunRequest,
    *,
    project: Path | None = None,
    private_data_dir: Path | None = None,
    on_event: Callable[[dict[str, Any], Tracker], None] | None = None,
    on_status: Callable[[str, Tracker], None] | None = None,
    color: bool = False,
    keep: int | None = None,
) -> RunResult:
    """Run ``request`` with ansible-runner; ``on_event`` sees each (scrubbed) event after the tracker."""
    import ansible_runner

    project = project or project_dir()
    private = private_data_dir or runner_dir(project)
    tracker = Tracker()
    start = time.monotonic()

    def result(status: str, rc: int | None, artifact: Path | None, error: str | None = None) -> RunResult:
        return RunResult(status, rc, time.monotonic() - start, artifact, tracker.final_hosts(),
                         tracker.final_failures(), len(tracker.plays), error)

    path = _tool_path()
    if not shutil.which(ANSIBLE_PLAYBOOK, path=path):
        return result("error", None, None, f"{ANSIBLE_PLAYBOOK} not found on PATH ({path})")
    try:
        private.mkdir(parents=True, exist_ok=True, mode=0o700)
        envvars = {
            # a checkout's ansible.cfg, or the one where an installed gpufleet is run from (if any)
            **({"ANSIBLE_CONFIG": str(cfg)} if (cfg := project / "ansible.cfg").is_file() else {}),
            "PATH": path,
            # playbooks/validate.yml writes its report under it unless gpufleet_validation_report_dir says
            # otherwise: where `gpufleet report` looks, and never inside the (maybe read-only) collection
            STATE_DIR_ENV: str(state_dir(project)),
            "ANSIBLE_INVENTORY_ANY_UNPARSED_IS_FAILED": "True",
            **({} if color else {"ANSIBLE_NOCOLOR": "1"}),
            **_collections_env(project, private),
        }
    except (OSError, UsageError) as exc:
        return result("error", None, None, str(exc))
    ident = f"{time.strftime('%Y%m%d-%H%M%S')}-{request.label}-{secrets.token_hex(2)}"
    artifact = private / "artifacts" / ident

    interrupt = _Interrupt()

    def event_handler(event: dict[str, Any]) -> bool:
        if isinstance(event.get("pid"), int):
            interrupt.ansible_pid = event["pid"]
        tracker.handle(event)
        if on_event:
            on_event(event, tracker)
        return True

    def status_handler(data: Mapping[str, Any], runner_config: Any = None) -> None:
        tracker.status = str(data.get("status", tracker.status))
        if on_status:
            on_status(tracker.status, tracker)

    with interrupt:
        try:
            runner = ansible_runner.run(
                private_data_dir=str(private),
                project_dir=str(project),
                playbook=str(request.playbook),
                cmdline=shlex.join(request.cmdline()),
                envvars=envvars,
                ident=ident,
                rotate_artifacts=keep or keep_artifacts(),
                suppress_env_files=True,
                # the raw stdout file would keep what Ansible prints of no_log failures; a scrubbed one is
                # written below. A short pexpect timeout lets a cancel act within a fraction of a second.
                settings={"suppress_output_file": True, "pexpect_timeout": 0.2},
                quiet=True,
                event_handler=event_handler,
                status_handler=status_handler,
                cancel_callback=interrupt,
            )
        except KeyboardInterrupt:
            return result("canceled", None, artifact, "interrupted")
        except Exception as exc:  # runner itself broke: never a success
            return result("error", None, artifact if artifact.exists() else None,
                          f"ansible-runner: {type(exc).__name__}: {exc}")
    with contextlib.suppress(OSError):
        (artifact / "stdout").write_text("\n".join(tracker.output).replace("\r\n", "\n") + "\n")
    status, rc = str(runner.status), runner.rc
    error = None
    if interrupt.requested:
        # Ansible may have stopped on the interrupt by itself (rc 99) before runner cancelled
        status = "canceled"
    if status == "canceled":
        error = "interrupted"
    elif rc == 127 and not tracker.plays:
        status, error = "error", f"{ANSIBLE_PLAYBOOK} could not be started: " + " ".join(tracker.messages)
    elif status != "successful" and not tracker.plays:
        error = "\n".join(tracker.messages) or f"{ANSIBLE_PLAYBOOK} exited {rc}"
    return result(status, rc, artifact, error)
