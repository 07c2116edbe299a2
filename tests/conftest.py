"""Fixtures shared by every test folder: the simulator library and sim roots, and the Kubernetes lab.

pynvml loads libnvidia-ml.so.1 once per process and the loader reads LD_LIBRARY_PATH only at start-up, so
tests that touch NVML do it in child processes pointed at a sim root (see each folder's helpers).

The suite runs in parallel with pytest-xdist (``--dist loadgroup``, see docs/testing.md). Tests that share
expensive session state are put in one xdist group each, so the state exists once per run and not once per
worker: every test using the Kubernetes lab (fixture ``stack``) in group ``k8s-lab``, every molecule scenario
(fixture ``repo_url``) in group ``molecule``; tests using a module-scoped fixture stay together with their
module. Everything else is spread over the workers one test at a time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from gpufleet_harness.sim import build as simbuild
from gpufleet_harness.sim import machine as simmachine

if TYPE_CHECKING:
    from labstack import LabStack

# labstack.py (the lab every Kubernetes-facing folder uses) lives with the Kubernetes modules' tests.
_LABSTACK_DIR = str(Path(__file__).resolve().parent / "k8s_modules")
if _LABSTACK_DIR not in sys.path:
    sys.path.insert(0, _LABSTACK_DIR)

# -- parallel runs (pytest-xdist) -----------------------------------------------------------------------
# Groups, by the session fixture a test needs (first match wins). Under xdist, groups are handed out first,
# these (the longest: 10-15 min each) before any other: the scheduler gives a worker its next unit of
# work only when it has at most two tests left, so a long group queued late would end the run late.
XDIST_GROUPS = {"repo_url": "molecule", "stack": "k8s-lab"}
# Where workers write each test's group for the controller's scheduler (the path travels in workerinput).
# xdist's own loadgroup passes the group as a node id suffix, which pytest 9.2 no longer lets plugins set
# (pytest-dev/pytest-xdist#1386): the tests would silently be spread over all workers, a lab on each.
_GROUPS_INPUT = "gpufleet_xdist_groups"
_GROUPS_DIR = pytest.StashKey[Path]()
_TIMINGS_KEY = "gpufleet_lab_timings"
_LAB_TIMINGS: list[dict[str, float]] = []  # this process's lab, or each worker's (sent at its end)


def _xdist_group(item: pytest.Item) -> str | None:
    """The group of XDIST_GROUPS the item's fixtures call for; else, if it uses a fixture set up once per
    module (or class or package), its module: its tests build on that fixture and some on each other."""
    names = getattr(item, "fixturenames", ())
    group = next((g for fixture, g in XDIST_GROUPS.items() if fixture in names), None)
    if group:
        return group
    info = getattr(item, "_fixtureinfo", None)
    for definitions in info.name2fixturedefs.values() if info else ():
        if definitions and definitions[-1].scope in ("class", "module", "package"):
            return item.nodeid.split("::")[0]
    return None


def _group_of(item: pytest.Item) -> str | None:
    mark = item.get_closest_marker("xdist_group")
    if mark is None:
        return None
    return str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))


def grouped_run(config: pytest.Config) -> bool:
    """True in an xdist worker whose tests are scheduled by group (``--dist loadgroup``, this conftest)."""
    return _GROUPS_INPUT in getattr(config, "workerinput", {})


# -- opt-in suites ------------------------------------------------------------------------------------------
# Marker -> the variable that asks for it (or name the marker in -m). Unasked, these tests are deselected:
# pytest reports them as deselected, never as passed or skipped. docs/testing.md says when each last ran.
OPT_IN = {
    # a kubeadm cluster of podman hosts on 1.37 (the scheduler wiring, CDI): tests/kubeadm
    "kubeadm": "GPUFLEET_KUBEADM",
    # `make lab` and more (site.yml twice, systemd units, a driver rollout): ~15 min of CI's critical path,
    # which CI's 90 minutes could not afford in session 16 (`make lab-test` runs it)
    "lab": "GPUFLEET_LAB_TEST",
    # NVIDIA's k8s-device-plugin against the simulator (root; the binary, never committed, named by
    # GPUFLEET_NVDP_BIN): tests/deviceplugin/test_dp_nvidia_plugin.py
    "nvdp": "GPUFLEET_NVDP",
}


def _deselect_opt_in(config: pytest.Config, items: list[pytest.Item]) -> None:
    markexpr = config.option.markexpr or ""
    unasked = {m for m, env in OPT_IN.items() if os.environ.get(env) != "1" and m not in markexpr}
    deselected = [item for item in items if any(item.get_closest_marker(m) for m in unasked)]
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the opt-in suites nobody asked for; mark each test's xdist group; in a grouped worker, sort:
    the groups of XDIST_GROUPS, then the other groups, then single tests, each in collection order (all
    workers sort alike, as xdist requires)."""
    _deselect_opt_in(config, items)
    for item in items:
        group = None if item.get_closest_marker("xdist_group") else _xdist_group(item)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
    if grouped_run(config):
        first = list(XDIST_GROUPS.values())

        def rank(pair: tuple[int, pytest.Item]) -> tuple[int, int, int]:
            index, item = pair
            group = _group_of(item)
            last = 1 if item.get_closest_marker("group_last") else 0
            if group in first:
                return first.index(group), last, index
            return (len(first), last, index) if group else (len(first) + 1, last, index)

        items[:] = [item for _, item in sorted(enumerate(items), key=rank)]


# -- the run's deadline -------------------------------------------------------------------------------------
# CI stops the whole run after 90 minutes and then prints nothing that says why (session 16's stop: killed at
# 98 %). .ci/run sets GPUFLEET_TEST_DEADLINE (Unix time: its start + 80 minutes). Past it, every test not yet
# started fails at once, naming the deadline, so the run still ends with its report (failures, --durations)
# within CI's time. Unset (a run by hand), there is no deadline.
def _deadline() -> float | None:
    raw = os.environ.get("GPUFLEET_TEST_DEADLINE", "")
    try:
        return float(raw) if raw else None
    except ValueError:
        raise pytest.UsageError(f"GPUFLEET_TEST_DEADLINE={raw!r} is not a Unix time") from None


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = _deadline()
    if deadline is not None and time.time() > deadline:
        at = time.strftime("%H:%M:%S", time.gmtime(deadline))
        pytest.fail(
            f"not run: the run's deadline (GPUFLEET_TEST_DEADLINE, {at} UTC) has passed; the slowest tests "
            "are listed at the end (docs/testing.md)",
            pytrace=False,
        )


@pytest.hookimpl(tryfirst=True)  # before xdist's, which tells the controller collection is done
def pytest_collection_finish(session: pytest.Session) -> None:
    """In a grouped worker: write each grouped test's group for the controller's scheduler."""
    if grouped_run(session.config):
        groups = {item.nodeid: g for item in session.items if (g := _group_of(item))}
        directory = Path(session.config.workerinput[_GROUPS_INPUT])  # type: ignore[attr-defined]
        target = directory / f"{session.config.workerinput['workerid']}.json"  # type: ignore[attr-defined]
        target.with_suffix(".tmp").write_text(json.dumps(groups))
        target.with_suffix(".tmp").replace(target)


def _groups_dir(config: pytest.Config) -> Path | None:
    """xdist controller, ``--dist loadgroup``: the directory the workers write their groups to."""
    if config.getvalue("dist") != "loadgroup":
        return None
    if _GROUPS_DIR not in config.stash:
        import tempfile

        config.stash[_GROUPS_DIR] = Path(tempfile.mkdtemp(prefix="gpufleet-xdist-groups-"))
    return config.stash[_GROUPS_DIR]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist controller, ``--dist loadgroup``: xdist's group scheduling, groups read from the workers."""
    directory = _groups_dir(config)
    if directory is None:
        return None
    from xdist.scheduler import LoadGroupScheduling

    class Scheduling(LoadGroupScheduling):  # type: ignore[misc]
        groups: dict[str, str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            # first called once every worker finished collecting (and wrote its file)
            if self.groups is None:
                self.groups = {}
                for path in sorted(directory.glob("*.json")):
                    self.groups.update(json.loads(path.read_text()))
            return self.groups.get(nodeid) or str(super()._split_scope(nodeid))

    return Scheduling(config, log)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """xdist controller: tell each worker where to write its tests' groups."""
    directory = _groups_dir(node.config)
    if directory is not None:
        node.workerinput[_GROUPS_INPUT] = str(directory)


def pytest_unconfigure(config: pytest.Config) -> None:
    directory = config.stash.get(_GROUPS_DIR, None)
    if directory is not None:
        import shutil

        shutil.rmtree(directory, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before xdist's, which sends workeroutput to the controller
def pytest_sessionfinish(session: pytest.Session) -> None:
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None and _LAB_TIMINGS:
        workeroutput[_TIMINGS_KEY] = json.dumps(_LAB_TIMINGS)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist controller: collect the lab timings a worker reported."""
    text = getattr(node, "workeroutput", {}).get(_TIMINGS_KEY)
    if text:
        _LAB_TIMINGS.extend(json.loads(text))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """How long the lab's pieces took (build cache, control plane, nodes, image) and timed test steps."""
    for timings in _LAB_TIMINGS:
        if timings:
            parts = ", ".join(f"{name} {seconds:.1f}s" for name, seconds in timings.items())
            terminalreporter.write_line(f"gpufleet lab timings: {parts}")


# -- fixtures --------------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def sim_lib() -> Path:
    """The simulator library, built once (and cached across sessions by source hash)."""
    return simbuild.build_library()


@pytest.fixture(scope="session")
def sim_root(sim_lib: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """A sim root per fixture, materialized once per session. Never inject failures into these."""
    cache: dict[str, Path] = {}

    def get(fixture: str) -> Path:
        if fixture not in cache:
            cache[fixture] = simmachine.materialize(
                fixture, tmp_path_factory.mktemp(fixture) / "root", library=sim_lib
            )
        return cache[fixture]

    return get


@pytest.fixture
def fresh_root(sim_lib: Path, tmp_path: Path) -> Callable[[str], Path]:
    """A private sim root, for tests that inject failures."""

    def make(fixture: str) -> Path:
        return simmachine.materialize(fixture, tmp_path / f"root-{Path(fixture).stem}", library=sim_lib)

    return make


@pytest.fixture(scope="session")
def stack(sim_lib: Path) -> Iterator[LabStack]:
    """The session's Kubernetes lab (tests/k8s_modules/labstack.py), shared by tests/cluster,
    tests/k8s_modules and tests/validation: control plane on first use, the GPU nodes on ``stack.nodes()``,
    tests/cluster's ``lab-node`` on first use of ``kubelet_node``. Everything stops at session end.

    Needs root and the Kubernetes binaries: 1.37 built from its Go modules (``gpufleet cluster build``; built
    now if missing, then cached), or the build ``GPUFLEET_K8S_VERSION`` names (``1.20``: Debian's source).
    Fails, never skips, when either is missing. Tests that change the cluster (objects, node labels, the lab's
    scheduler) undo it: the next test may be from another folder. Set ``GPUFLEET_LAB_KEEP=1`` to keep the lab
    directory (logs, configs) after the run.
    """
    from labstack import LabStack

    from gpufleet_harness.cluster.k8s_build import BuildError, ensure_k8s

    if os.geteuid() != 0:
        pytest.fail("cluster tests need root (namespaces, mounts, veth, cgroups)")
    started = time.monotonic()
    try:
        artifacts = ensure_k8s()
    except BuildError as err:
        pytest.fail(f"Kubernetes binaries unavailable: {err}")
    the_stack = LabStack(sim_lib, artifacts=artifacts)
    the_stack.timings["k8s binaries"] = time.monotonic() - started
    _LAB_TIMINGS.append(the_stack.timings)
    try:
        yield the_stack
    finally:
        the_stack.close()


# -- the base install (pyproject's dependencies without extras) ---------------------------------------------
# What only the extras bring (controller, esxi, molecule, harness): a process started with base_install_env
# cannot import them, as on a machine where `pip install gpufleet` installed the base wheel alone.
EXTRAS_ONLY = ("ansible", "ansible_collections", "ansible_runner", "testinfra", "pyVmomi", "vmware",
               "molecule", "gpufleet_harness", "pytest", "_pytest")  # fmt: skip
_BLOCKER = '''\
"""Installed by tests/conftest.py _refusing_env: refuse what the host being imitated lacks."""
import importlib.abc
import sys

_REFUSED = frozenset({refused!r})


class _BaseInstall(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in _REFUSED:
            raise ModuleNotFoundError(
                f"No module named {{name!r}} (refused: the host this test imitates lacks it)", name=name
            )
        return None


sys.meta_path.insert(0, _BaseInstall())
'''


def _refusing_env(site: Path, refused: Sequence[str]) -> dict[str, str]:
    """Environment for a child Python whose sitecustomize (written to ``site``) refuses the top-level
    packages ``refused``, although this venv has them."""
    (site / "sitecustomize.py").write_text(_BLOCKER.format(refused=sorted(refused)))
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path}


@pytest.fixture(scope="session")
def base_install_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for a child Python that behaves as gpufleet's base install: every module in EXTRAS_ONLY
    is refused (they are installed in this venv, so they must be refused)."""
    return _refusing_env(tmp_path_factory.mktemp("base-install"), EXTRAS_ONLY)


@pytest.fixture(scope="session")
def without_gpufleet_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Environment for a child Python (ansible-playbook, and the modules it runs locally) on a host where
    the gpufleet package is not installed: the collection must carry what its modules need."""
    return _refusing_env(tmp_path_factory.mktemp("without-gpufleet"), ["gpufleet"])
