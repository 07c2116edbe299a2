"""Plumbing of gpufleet's validation suites (run them with ``python -m gpufleet.validation``).

- ``--gpufleet-expectations FILE``: ``hosts`` (name -> what to expect and how to reach it) and ``cluster``
  (kubeconfig, workload pod settings); see docs/validation.md.
- ``--gpufleet-suites host,runtime,cluster,workload``: the others are deselected.
- Per-host checks take the ``target`` fixture and run once per host; the test id names the host. Each test
  records its suite, target and check name as user properties (JUnit properties, the runner's JSON).
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

from gpufleet.validation.report import CLUSTER_TARGET, SUITES, load_expectations


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
    """Per-host checks run once per host of the expectations, with the host name as the test id."""
    if "target" in metafunc.fixturenames:
        hosts = _expectations(metafunc.config)["hosts"]
        selector = getattr(metafunc.module, "HOSTS_WITH", None)
        names = [n for n, exp in hosts.items() if selector is None or exp.get(selector)]
        metafunc.parametrize("target", names, indirect=True, ids=names)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect suites not asked for; tag each test with suite, target and check name."""
    wanted = set(config.getoption("--gpufleet-suites").split(","))
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
    if not settings:
        pytest.skip("no cluster section in the expectations")
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
