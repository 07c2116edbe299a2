"""Run the roles' molecule scenarios against podman test hosts, with everything they need in place.

For a run this module: checks the host tools, writes the containers.conf, builds (or reuses) the images a
scenario names, builds the signed stand-in repository and serves it on 127.0.0.1, then runs molecule with
state kept under the test-host state dir. The test hosts use slirp4netns with ``allow_host_loopback``, so
the server's loopback port is reachable from inside them at 10.0.2.2 while their own network (docker
bridges included) stays private.

Scenarios whose hosts run Ubuntu install from Ubuntu's archive, which CI may reach or not. In the default
set they run when it answers and are skipped, naming the archive, when it does not (also when it stops
answering during their run); named (GPUFLEET_MOLECULE_SCENARIOS, ``-s``) while it does not answer, the run
fails before anything is built. A scenario too slow for every run says so in its molecule.yml
(``# gpufleet-opt-in: <why>``) and runs only when named.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpufleet_harness.testhosts.aptrepo import Repo, RepoServer, build_repo
from gpufleet_harness.testhosts.images import (
    IMAGE_REPOSITORY,
    ArchiveUnreachableError,
    ImageSpec,
    build_image,
    is_ubuntu,
    require_archive,
)
from gpufleet_harness.testhosts.podman import podman_env
from gpufleet_harness.testhosts.workspace import require_tools, state_dir

# slirp4netns maps the host's loopback to this address when allow_host_loopback=true.
HOST_LOOPBACK_FROM_CONTAINER = "10.0.2.2"
PROJECT = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class ScenarioRun:
    """Outcome of one molecule invocation."""

    scenario: str
    command: str
    returncode: int
    seconds: float
    log: Path | None

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def all_scenarios(project: Path = PROJECT) -> list[str]:
    """Every scenario: every molecule/<name>/molecule.yml."""
    return sorted(p.parent.name for p in (project / "molecule").glob("*/molecule.yml"))


# A molecule.yml line ``# gpufleet-opt-in: <why>``: a scenario too slow for every run of the test command
# (its budget: under 60 minutes cold on two cores). Its last run belongs in docs/roles.md's scenario table.
_OPT_IN_LINE = re.compile(r"^# gpufleet-opt-in: *(\S.*)$", re.MULTILINE)


def opt_in_reason(scenario: str, project: Path = PROJECT) -> str | None:
    """Why the scenario runs only when named (its molecule.yml's ``# gpufleet-opt-in: <why>``), or None."""
    found = _OPT_IN_LINE.search((project / "molecule" / scenario / "molecule.yml").read_text())
    return found.group(1).strip() if found else None


def opt_in(scenario: str, project: Path = PROJECT) -> bool:
    """Whether the scenario runs only when named (``opt_in_reason``)."""
    return opt_in_reason(scenario, project) is not None


def scenarios(project: Path = PROJECT) -> list[str]:
    """The default set: every scenario but the opt-in ones (Ubuntu ones included: they run when their
    archive answers, see ``runnable``)."""
    return [name for name in all_scenarios(project) if not opt_in(name, project)]


def opt_in_scenarios(project: Path = PROJECT) -> list[str]:
    """Scenarios that run only when named (too slow for every run)."""
    return [name for name in all_scenarios(project) if opt_in(name, project)]


def named_scenarios() -> list[str]:
    """The scenarios GPUFLEET_MOLECULE_SCENARIOS names (comma-separated), if any."""
    return [name for name in os.environ.get("GPUFLEET_MOLECULE_SCENARIOS", "").split(",") if name]


def selected_scenarios(project: Path = PROJECT) -> list[str]:
    """Scenarios named in GPUFLEET_MOLECULE_SCENARIOS (comma-separated; opt-in ones too), else the default
    set (every scenario but the opt-in ones)."""
    return named_scenarios() or scenarios(project)


def scenario_suites(scenario: str, project: Path = PROJECT) -> list[str]:
    """Suites (Debian's, Ubuntu's) whose test-host image the scenario's platforms use."""
    text = (project / "molecule" / scenario / "molecule.yml").read_text()
    return sorted(set(re.findall(re.escape(IMAGE_REPOSITORY) + r":([a-z]+)", text)))


def unreachable(names: Sequence[str], project: Path = PROJECT) -> dict[str, str]:
    """For each scenario whose Ubuntu hosts need an archive that does not answer now, why (one probe per
    suite). Debian suites are not checked (every machine that runs the scenarios has Debian's archives)."""
    suites = {name: scenario_suites(name, project) for name in names}
    why: dict[str, str] = {}
    for suite in sorted({s for used in suites.values() for s in used if is_ubuntu(s)}):
        try:
            require_archive(ImageSpec(suite))
        except ArchiveUnreachableError as err:
            reason = f"its Ubuntu {suite} test hosts need an archive that does not answer: {err}"
            for name, used in suites.items():
                if suite in used:
                    why.setdefault(name, reason)
    return why


def require_archives(names: Sequence[str], project: Path = PROJECT) -> None:
    """Raise ArchiveUnreachableError when a scenario's Ubuntu hosts need an archive that does not answer."""
    why = unreachable(names, project)
    if why:
        raise ArchiveUnreachableError(
            "; ".join(f"scenario {name}: {reason}" for name, reason in why.items())
            + ". Drop them from GPUFLEET_MOLECULE_SCENARIOS, or point GPUFLEET_UBUNTU_MIRROR at an Ubuntu "
            "mirror that answers (in the default set they are skipped while it does not answer)."
        )


def _collection_link(project: Path) -> Path:
    """A collections path in which gpufleet.nvidia is this checkout (for the playbooks' FQCNs)."""
    root = state_dir() / "collections"
    link = root / "ansible_collections" / "gpufleet" / "nvidia"
    link.parent.mkdir(parents=True, exist_ok=True)
    if not link.is_symlink() or link.resolve() != project.resolve():
        link.unlink(missing_ok=True)
        link.symlink_to(project.resolve())
    return root


@contextmanager
def served_repo(repo: Repo | None = None) -> Iterator[tuple[Repo, str]]:
    """Build (unless given) and serve the stand-in repository; yield it and its URL as test hosts see it."""
    repo = repo or build_repo()
    with RepoServer(repo.root) as server:
        yield repo, f"http://{HOST_LOOPBACK_FROM_CONTAINER}:{server.port}"


def molecule_env(repo_url: str, project: Path = PROJECT) -> dict[str, str]:
    """Environment for molecule: podman config, stand-in repo URL, all state inside the workspace."""
    env = podman_env()
    home = state_dir() / "home"
    home.mkdir(exist_ok=True)
    # molecule calls ansible-playbook & co. by name: the interpreter's own bin directory comes first.
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env.update(
        HOME=str(home),
        GPUFLEET_TEST_REPO_URL=repo_url,
        ANSIBLE_COLLECTIONS_PATH=str(_collection_link(project)),
        ANSIBLE_FORCE_COLOR="0",
        PY_COLORS="0",
        ANSIBLE_NOCOLOR="1",
    )
    env.setdefault("ANSIBLE_LOCAL_TEMP", str(home / ".ansible" / "tmp"))
    return env


def prepare_images(names: Sequence[str], project: Path = PROJECT, *, required: bool = True) -> dict[str, str]:
    """Build every image the scenarios use (cached by content key) and return the scenarios to skip, with why.

    ``required`` (scenarios named on purpose): an Ubuntu archive that does not answer raises
    ArchiveUnreachableError before anything is built (the hosts install from it even when the image is
    cached). Otherwise (the default set) a scenario whose archive does not answer, before or while its image
    is built, is returned as skipped; any other failure raises."""
    if required:
        require_archives(names, project)
        skipped: dict[str, str] = {}
    else:
        skipped = unreachable(names, project)
    users: dict[str, list[str]] = {}
    for name in names:
        if name not in skipped:
            for suite in scenario_suites(name, project):
                users.setdefault(suite, []).append(name)
    for suite in sorted(users):
        try:
            build_image(ImageSpec(suite))
        except Exception:
            gone = {} if required or not is_ubuntu(suite) else unreachable(users[suite], project)
            if not gone:
                raise
            skipped.update(gone)
    return skipped


def run_scenario(
    scenario: str,
    repo_url: str,
    command: str = "test",
    extra: Sequence[str] = (),
    project: Path = PROJECT,
    log: Path | None = None,
) -> ScenarioRun:
    """Run ``molecule COMMAND -s SCENARIO``; output goes to ``log`` when given, else to this terminal."""
    started = time.monotonic()
    argv = [sys.executable, "-m", "molecule", command, "-s", scenario, *extra]
    env = molecule_env(repo_url, project)
    if log is None:
        result = subprocess.run(argv, cwd=project, env=env, check=False)
    else:
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("w") as out:
            result = subprocess.run(
                argv, cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT, check=False
            )
    run = ScenarioRun(scenario, command, result.returncode, time.monotonic() - started, log)
    with (state_dir() / "timings.jsonl").open("a") as fh:
        fh.write(
            json.dumps(
                {
                    "scenario": scenario,
                    "command": command,
                    "rc": run.returncode,
                    "seconds": round(run.seconds, 1),
                    "at": int(time.time()),
                }
            )
            + "\n"
        )
    return run


def run_scenarios(
    names: Sequence[str], command: str = "test", extra: Sequence[str] = ()
) -> list[ScenarioRun]:
    """Prepare once, then run the scenarios one after another (the build machines have two cores)."""
    require_tools()
    prepare_images(names)
    runs = []
    with served_repo() as (_repo, url):
        for name in names:
            runs.append(run_scenario(name, url, command, extra))
    return runs


_FAILED_TASK = re.compile(r"^(fatal|failed): \[")


def log_tail(path: Path, lines: int = 60, *, context: int = 30, most: int = 3) -> str:
    """For failure messages: the last ``most`` failed tasks of a scenario log that were not ignored (each its
    TASK line and up to ``context`` lines of its result), then the log's last ``lines`` lines. The tail alone
    is molecule's recap and clean-up, which names no failed task, and CI keeps only what the test prints."""
    if not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    parts = []
    for at in (i for i, line in enumerate(text) if _FAILED_TASK.match(line)):
        task = next((text[i] for i in range(at - 1, -1, -1) if text[i].startswith("TASK [")), "")
        end = at + 1  # the result is indented (YAML); it ends at the next line that is not
        while end < len(text) and (not text[end].strip() or text[end][0].isspace()):
            end += 1
        if end < len(text) and text[end] == "...ignoring":
            continue
        body = text[at:end][:context]
        while body and not body[-1].strip():
            body.pop()
        parts.append("\n".join([task, *body] if task else body))
    parts = parts[-most:]  # the last ones: a converge stops at its first real failure
    tail = "\n".join(text[-lines:])
    if not parts:
        return tail
    return "failed tasks:\n" + "\n...\n".join(parts) + "\n\nthe log's end:\n" + tail
