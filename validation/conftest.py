"""Plumbing of gpufleet's validation suites (run them with ``python -m gpufleet.validation``).

- ``--gpufleet-expectations FILE``: ``hosts`` (name -> what to expect and how to reach it) and ``cluster``
  (kubeconfig, workload pod settings); see docs/validation.md.
- ``--gpufleet-suites host,runtime,cluster,workload``: the others are deselected.
- Per-host checks take the ``target`` fixture and run once per host; the test id names the host. Each test
  records its suite, target and check name as user properties (JUnit properties, the runner's JSON).
- A selected check whose input the expectations lack does not run, and says so: a host without the key its
  suite's ``HOSTS_WITH`` names (the suite's ``WITHOUT`` tells why), or a check taking the ``cluster`` fixture
  when there is no ``cluster`` section. It is skipped with a reason starting ``NOT RUN: `` and the property
  ``outcome=not run``; the collector (gpufleet.validation.cli) records it as "not run", never as passed.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import testinfra
from hostcheck import Target
from metricscheck import PrometheusApi
from podcheck import Cluster

from gpufleet.validation.report import (
    CLUSTER_TARGET,
    NO_CLUSTER,
    NOT_RUN,
    NOT_RUN_PREFIX,
    SUITES,
    load_expectations,
)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("gpufleet")
    group.addoption("--gpufleet-expectations", help="expectations file (YAML or JSON)")
    group.addoption("--gpufleet-suites", default=",".join(SUITES), help="suites to run, comma-separated")


def _expectations(config: pytest.Config) -> dict[str, Any]:
    cached = getattr(config, "_gpufleet_expectations", None)
    if cached is None:
        path = config.getoption("--gpufleet-expectations")
        if not path:
            raise pytest.UsageError("--gpufleet-expectations FILE is required")
        cached = load_expectations(Path(path))
        config._gpufleet_expectations = cached  # type: ignore[attr-defined]
    return cached  # type: ignore[no-any-return]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Per-host checks run once per host of the expectations, with the host name as the test id (every
    host: one lacking what the suite needs shows as not run, see :func:`_why_not_run`)."""
    if "target" in metafunc.fixturenames:
        names = list(_expectations(metafunc.config)["hosts"])
        metafunc.parametrize("target", names, indirect=True, ids=names)


def _why_not_run(item: pytest.Item, target: str, expectations: dict[str, Any]) -> str | None:
    """Why a selected check cannot run on these expectations (None: it can)."""
    if "cluster" in getattr(item, "fixturenames", ()) and not expectations.get("cluster"):
        return NO_CLUSTER
    module = getattr(item, "module", None)
    key = getattr(module, "HOSTS_WITH", None)
    if key and target in expectations["hosts"] and not expectations["hosts"][target].get(key):
        return str(getattr(module, "WITHOUT", f"the host's expectations have no '{key}'"))
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect suites not asked for; tag each test with suite, target and check name; mark the selected
    checks the expectations cannot feed as not run, with the reason."""
    wanted = set(config.getoption("--gpufleet-suites").split(","))
    expectations = _expectations(config)
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        suite = getattr(getattr(item, "module", None), "SUITE", "?")
        callspec = getattr(item, "callspec", None)
        target = callspec.params.get("target", CLUSTER_TARGET) if callspec else CLUSTER_TARGET
        # a per-host check with no host to run on (empty parameter set) applies to nothing: drop it
        applies = isinstance(target, str) and ("target" not in getattr(item, "fixturenames", ()) or callspec)
        (keep if suite in wanted and applies else drop).append(item)
        name = getattr(item, "originalname", item.name).removeprefix("test_")
        item.user_properties += [("suite", suite), ("target", target), ("check", name)]
        reason = _why_not_run(item, target, expectations) if suite in wanted and applies else None
        if reason:
            item.user_properties.append(("outcome", NOT_RUN))
            item.add_marker(pytest.mark.skip(reason=NOT_RUN_PREFIX + reason))
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def expectations(request: pytest.FixtureRequest) -> dict[str, Any]:
    return _expectations(request.config)


_TARGETS: dict[str, Target | str] = {}


def _connect(name: str, expected: dict[str, Any]) -> Target | str:
    """A connected Target, or why the host cannot be reached (checked once: a shell must answer)."""
    spec = str(expected.get("connection") or "local://")
    try:
        host = testinfra.get_host(spec)
        answer = host.run("echo gpufleet-validation-ok")
    except Exception as exc:  # any backend failure means the checks cannot run on this host
        return f"{name}: cannot connect through {spec}: {type(exc).__name__}: {exc}"
    if answer.rc != 0 or answer.stdout.strip() != "gpufleet-validation-ok":
        detail = (answer.stderr or answer.stdout).strip().splitlines()[-1:] or [f"exit {answer.rc}"]
        return f"{name}: cannot run commands through {spec}: {detail[0]}"
    return Target(name, host, expected)


@pytest.fixture
def target(request: pytest.FixtureRequest, expectations: dict[str, Any]) -> Target:
    """The host named by the test's parameter, connected through testinfra (one connection per host).

    An unreachable host errors every check in setup: the checks could not run, they did not fail."""
    name = request.param
    if name not in _TARGETS:
        _TARGETS[name] = _connect(name, dict(expectations["hosts"][name]))
    found = _TARGETS[name]
    if isinstance(found, str):
        raise ConnectionError(found)
    return found


@pytest.fixture(scope="session")
def cluster(expectations: dict[str, Any]) -> Iterator[Cluster]:
    """The Kubernetes API as the expectations' ``cluster`` section configures it (errors: could not run)."""
    settings = expectations.get("cluster") or {}
    if not settings:  # the collection marks such checks not run first; this keeps any other path honest
        pytest.skip(NOT_RUN_PREFIX + NO_CLUSTER)
    the_cluster = Cluster(settings)
    try:
        yield the_cluster
    finally:
        the_cluster.close()


@pytest.fixture(scope="session")
def prometheus(expectations: dict[str, Any]) -> PrometheusApi:
    """The Prometheus of the expectations' ``cluster.prometheus`` section; without one the GPU metrics checks
    do not apply (the fleet has no Prometheus of gpufleet's to check)."""
    settings = (expectations.get("cluster") or {}).get("prometheus") or {}
    if not settings:
        pytest.skip("no cluster.prometheus in the expectations: GPU metrics not checked")
    return PrometheusApi(dict(settings))
