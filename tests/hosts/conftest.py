"""Fixtures for the test-host tooling and the roles' molecule scenarios.

The scenarios spend much of their time waiting (apt in the test hosts, podman, systemd), so they run side by
side: ``molecule_runs`` starts every selected scenario when the first scenario test needs it, longest first
(by the wall times recorded in the test-host state dir), at most ``GPUFLEET_MOLECULE_JOBS`` at once
(default 3; 1 runs them one by one), and each ``test_scenario`` waits for its own.

Scenarios with a privileged test host never overlap one another: they are the heaviest. (On cgroup v1
machines stopping one privileged systemd host used to remove the others' systemd cgroups, so that every
later ``podman exec`` into them exited 127; the test hosts' init wrapper fixed that, see
tests/hosts/test_host_cgroups.py and docs/testing.md.)
"""

from __future__ import annotations

import json
import os
import statistics
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path

import pytest
import yaml

from gpufleet_harness.cluster.process import file_lock
from gpufleet_harness.testhosts import aptrepo, molecule
from gpufleet_harness.testhosts.workspace import HOST_PACKAGES, missing_tools, state_dir

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_JOBS = 3
_STOPPING = threading.Event()  # set on Ctrl-C: queued scenarios do not start any more


def pytest_keyboard_interrupt() -> None:
    _STOPPING.set()


@pytest.fixture(scope="session")
def host_tools() -> None:
    """Fail (not skip) with the apt command when the test-host tools are missing: CI must install them."""
    missing = missing_tools()
    if missing:
        pytest.fail(
            "the molecule scenarios need "
            + ", ".join(missing)
            + f"; install with: apt-get install -y {' '.join(HOST_PACKAGES)}",
            pytrace=False,
        )
    if os.geteuid() != 0:
        pytest.fail("the molecule scenarios need root (podman with systemd test hosts)", pytrace=False)


@pytest.fixture(scope="session")
def skipped_scenarios(host_tools: None) -> dict[str, str]:
    """Build the images of this session's scenarios; return the ones skipped, with why: in the default set,
    those whose Ubuntu archive does not answer. Scenarios named in GPUFLEET_MOLECULE_SCENARIOS are never
    skipped (an archive that does not answer fails the session's scenarios, naming it)."""
    # Images are cached by content key across sessions; the lock stops parallel sessions from building
    # the same one twice.
    with file_lock(state_dir() / "images.lock"):
        return molecule.prepare_images(
            molecule.selected_scenarios(ROOT), ROOT, required=bool(molecule.named_scenarios())
        )


@pytest.fixture(scope="session")
def repo_url(skipped_scenarios: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The signed stand-in NVIDIA repository, served for the whole session; its URL as test hosts see it.

    The repository (and its signing key) is this session's own, under its temporary directory: another
    session on this machine rebuilding its repository cannot pull files from under scenarios still
    installing from this one.
    """
    repo = aptrepo.build_repo(tmp_path_factory.mktemp("stand-in-repo") / "apt-repo")
    with molecule.served_repo(repo) as (_repo, url):
        yield url


# Wall times of a fresh clone's CI run (session 7's cold run, all groups side by side), for a machine with no
# history yet: the longest scenarios start first there too.
_CI_SECONDS = {
    "nvidia_container_toolkit": 1260.0,
    "nvidia_driver_upgrade": 1300.0,  # opt-in; session 4
    "nvidia_cuda_mps": 1200.0,  # session 10: nvidia_cuda_toolkit (1075 s) and nvidia_mps (434 s) on one host
    "nvidia_driver": 1067.0,
    "nvidia_fabricmanager": 686.0,
    "gpu_host_prep": 495.0,
    "nvidia_driver_ubuntu": 450.0,  # 190 s alone in session 8; beside a CI run about 2.5 times that
}


def _usual_seconds() -> dict[str, float]:
    """Each scenario's usual wall time: the median of its last five successful ``molecule test`` runs
    (a median, not the last run: a run on a busy machine takes twice as long or more); else the figure of
    the last CI run (_CI_SECONDS)."""
    runs: dict[str, list[float]] = {name: [seconds] for name, seconds in _CI_SECONDS.items()}
    path = state_dir() / "timings.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if entry.get("command") == "test" and entry.get("rc") == 0:
                runs.setdefault(entry["scenario"], []).append(float(entry["seconds"]))
    return {name: statistics.median(seconds[-5:]) for name, seconds in runs.items()}


def privileged(scenario: str) -> bool:
    """Whether any test host of the scenario is a privileged container."""
    doc = yaml.safe_load((ROOT / "molecule" / scenario / "molecule.yml").read_text()) or {}
    return any(platform.get("privileged") for platform in doc.get("platforms") or [])


class ScenarioPool:
    """Scenarios running in the background: at most ``jobs`` at a time, one privileged at a time."""

    def __init__(self, repo_url: str, jobs: int) -> None:
        # molecule_env creates the collection link and the home directory: once, before the threads do.
        molecule.molecule_env(repo_url, ROOT)
        self._url = repo_url
        self._jobs = jobs
        self._cond = threading.Condition()
        self._queued: list[str] = []
        self._running: dict[str, threading.Thread] = {}
        self._runs: dict[str, Future[molecule.ScenarioRun]] = {}
        self._privileged: dict[str, bool] = {}
        self._closing = False

    @staticmethod
    def log(scenario: str) -> Path:
        return state_dir() / "logs" / f"{scenario}.log"

    def start(self, scenarios: Sequence[str]) -> None:
        """Queue the scenarios, longest first (by their usual wall times; unknown ones last)."""
        usual = _usual_seconds()
        with self._cond:
            for name in sorted(scenarios, key=lambda name: -usual.get(name, 0.0)):
                if name not in self._runs:
                    self._runs[name] = Future()
                    self._privileged[name] = privileged(name)
                    self._queued.append(name)
            self._dispatch()

    def _dispatch(self) -> None:
        """Start queued scenarios while there is room (called with the lock held)."""
        while len(self._running) < self._jobs and not (self._closing or _STOPPING.is_set()):
            busy = any(self._privileged[name] for name in self._running)
            name = next((n for n in self._queued if not (busy and self._privileged[n])), None)
            if name is None:
                return
            self._queued.remove(name)
            thread = threading.Thread(target=self._run, args=(name,), name=f"molecule-{name}")
            self._running[name] = thread
            thread.start()

    def _run(self, scenario: str) -> None:
        future = self._runs[scenario]
        try:
            future.set_result(
                molecule.run_scenario(scenario, self._url, project=ROOT, log=self.log(scenario))
            )
        except BaseException as err:  # handed to the test that waits for this scenario
            future.set_exception(err)
        finally:
            with self._cond:
                del self._running[scenario]
                self._dispatch()

    def result(self, scenario: str) -> molecule.ScenarioRun:
        """Wait for the scenario's run (queued now if it was not); raises what running it raised."""
        self.start([scenario])
        return self._runs[scenario].result()

    def close(self) -> None:
        """Drop scenarios not started yet (an interrupted session); wait for the running ones."""
        with self._cond:
            self._closing = True
            for name in self._queued:
                self._runs[name].set_exception(RuntimeError(f"molecule scenario {name} not started"))
            self._queued.clear()
            running = list(self._running.values())
        for thread in running:
            thread.join()


@pytest.fixture(scope="session")
def molecule_runs(
    request: pytest.FixtureRequest, repo_url: str, skipped_scenarios: dict[str, str]
) -> Iterator[ScenarioPool]:
    """The pool, with every scenario of this session's ``test_scenario`` items already started.

    Under xdist the scenarios are all started only when tests are scheduled by group (``--dist loadgroup``
    with tests/conftest.py: group ``molecule``, so one worker runs them all); with another distribution
    each worker runs the ones it is handed, as the tests ask for them (two workers could then run two
    privileged scenarios at once: use ``--dist loadgroup``).
    """
    jobs = int(os.environ.get("GPUFLEET_MOLECULE_JOBS") or DEFAULT_JOBS)
    pool = ScenarioPool(repo_url, max(1, jobs))
    workerinput = getattr(request.config, "workerinput", None)
    if workerinput is None or "gpufleet_xdist_groups" in workerinput:
        pool.start([
            item.callspec.params["scenario"]
            for item in request.session.items
            if item.path.name == "test_molecule.py" and hasattr(item, "callspec")
            and item.callspec.params["scenario"] not in skipped_scenarios
        ])  # fmt: skip
    try:
        yield pool
    finally:
        pool.close()
