"""Hostile machine descriptions for the simulator: fixture YAML files (gpufleet_harness.sim.machine.expand)
and a sim root's machine.json (load_machine) give a machine or a FixtureError, at bounded cost."""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from budget import FUZZ, outcome, worst_case
from hypothesis import given
from hypothesis import strategies as st
from strategies import HOSTILE_TEXT, JSON_VALUES, LAUGHS

from gpufleet_harness.sim import machine

FIXTURES = {name: machine.load_fixture(name)[1] for name in machine.fixture_names()}


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="gpufleet-fuzz-sim-") as path:
        yield Path(path)


def expand_text(path: Path, text: str) -> Any:
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    return outcome((machine.FixtureError,), machine.expand, path)


def paths(doc: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every key path into a parsed fixture (mapping keys and list indexes)."""
    out = [prefix]
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for key, value in items:
        out += paths(value, (*prefix, key))
    return out


def replaced(doc: Any, path: tuple[Any, ...], value: Any) -> Any:
    doc = copy.deepcopy(doc)
    if not path:
        return value
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return doc


@st.composite
def mutated_fixtures(draw: st.DrawFn) -> Any:
    """A bundled fixture with one to three values anywhere in it replaced by any JSON value."""
    doc = FIXTURES[draw(st.sampled_from(sorted(FIXTURES)))]
    for _ in range(draw(st.integers(1, 3))):
        doc = replaced(doc, draw(st.sampled_from(paths(doc))), draw(JSON_VALUES))
    return doc


def check_machine(m: dict[str, Any]) -> None:
    """What the C library and the host view writer rely on in an expanded machine."""
    json.dumps(m, allow_nan=False)
    assert 0 <= len(m["gpus"]) <= machine.MAX_GPUS
    assert len({g["bus_id"] for g in m["gpus"]}) == len(m["gpus"])
    assert all(len(g["bus_id"]) == len("00000000:07:00.0") for g in m["gpus"])
    assert all(machine._DMI_NAME.fullmatch(k) for k in m["host"]["dmi"])
    assert m["host"]["fabricmanager"] in (None, "running", "stopped")
    assert 1 <= m["host"]["numa_nodes"] <= m["host"]["cpus"] <= machine.MAX_CPUS


# ----- properties ---------------------------------------------------------------------------------------


def test_every_bundled_fixture_still_expands() -> None:
    for name in FIXTURES:
        check_machine(machine.expand(name))


@FUZZ
@given(mutated_fixtures())
def test_mutated_fixture_expands_or_raises_fixture_error(scratch: Path, doc: Any) -> None:
    result = expand_text(scratch / "mutated.yaml", yaml.safe_dump(doc))
    if not isinstance(result, machine.FixtureError):
        check_machine(result)


@FUZZ
@given(HOSTILE_TEXT)
def test_fixture_file_of_any_text_expands_or_raises_fixture_error(scratch: Path, text: str) -> None:
    expand_text(scratch / "text.yaml", text)


@FUZZ
@given(st.one_of(HOSTILE_TEXT, st.builds(json.dumps, JSON_VALUES)))
def test_machine_json_of_any_text_loads_or_raises_fixture_error(scratch: Path, text: str) -> None:
    (scratch / "machine.json").write_text(text, encoding="utf-8", errors="surrogatepass")
    result = outcome((machine.FixtureError,), machine.load_machine, scratch)
    if not isinstance(result, machine.FixtureError):
        assert isinstance(result, dict) and isinstance(result["gpus"], list)


# ----- worst cases --------------------------------------------------------------------------------------

T4 = (machine.FIXTURE_DIR / "pcie-2x-t4.yaml").read_text()
WORST = {
    "a billion GPUs": T4 + "nvswitch: {}\n" + "gpus: [{first_bus: 0, count: 1000000000}]\n",
    "a billion CPUs and NUMA nodes": T4.replace("cpus: 64", "cpus: 1000000000").replace(
        "numa_nodes: 1", "numa_nodes: 1000000000"
    ),
    "a billion NVLinks": T4 + "nvswitch: {pci_device_id: 1, buses: [1], links_per_switch: [1000000000]}\n",
    "kernel log alias bomb": f"{LAUGHS}{T4}".replace("cpus: 64", "cpus: 64\n  kernel_log: *l8"),
    "description alias bomb": f"{LAUGHS}{T4}".replace("description:", "description: *l8\nx:"),
    "dmi alias bomb": f"{LAUGHS}{T4}".replace("dmi: {sys_vendor: Supermicro", "dmi: {sys_vendor: *l8"),
    "deep nesting": T4 + "nvswitch: " + "[" * 100_000,
    "megabyte file": T4 + "# " + "x" * (1 << 20) + "\n",
    "60000-digit number": T4 + "extra: " + "9" * 60_000 + "\n",
}


@pytest.mark.parametrize("name", sorted(WORST))
def test_worst_case_fixtures_cost_a_bounded_time(scratch: Path, name: str) -> None:
    (scratch / "worst.yaml").write_text(WORST[name])
    result = worst_case((machine.FixtureError,), machine.expand, scratch / "worst.yaml")
    assert isinstance(result, machine.FixtureError)


@pytest.mark.parametrize(
    "text", ["[" * 100_000 + "]" * 100_000, '{"gpus": [' + "0," * 2_000_000 + "0]}", " " * (17 << 20)]
)
def test_worst_case_machine_json_costs_a_bounded_time(scratch: Path, text: str) -> None:
    (scratch / "machine.json").write_text(text)
    assert isinstance(
        worst_case((machine.FixtureError,), machine.load_machine, scratch), machine.FixtureError
    )


# ----- regressions --------------------------------------------------------------------------------------


def test_dmi_key_cannot_write_outside_the_sim_root(scratch: Path) -> None:
    text = T4.replace("dmi: {sys_vendor: Supermicro", "dmi: {'../../../../escape': x, sys_vendor: Supermicro")
    result = expand_text(scratch / "traversal.yaml", text)
    assert isinstance(result, machine.FixtureError) and "sysfs file names" in str(result)


def test_fabricmanager_cannot_inject_control_lines(scratch: Path) -> None:
    text = T4.replace("cpus: 64", 'cpus: 64\n  fabricmanager: "running\\ngpu 0 lost"')
    result = expand_text(scratch / "control.yaml", text)
    assert isinstance(result, machine.FixtureError) and "fabricmanager" in str(result)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("cpus: 64", "cpus: 64\n  kernel_log: [[nested]]", "kernel_log"),
        ("cpus: 64", "cpus: 1", ""),  # fewer CPUs than NUMA nodes is refused below, one CPU is fine
        ("numa_nodes: 1", "numa_nodes: 2\n  cpus: 1", "host.cpus"),
        ("buses: [0xC1]", "buses: [0x41]", "share a PCI bus"),
        ("buses: [0xC1]", "buses: [0x1C1]", "bus"),
        ("numa: 0, host_bridge: 1", "numa: 3, host_bridge: 1", "numa"),
        ("pci_subsystem: [0x10DE, 0x12A2]", "pci_subsystem: 7", "not a machine description"),
        ("architecture: turing", "architecture: quantum", "quantum"),
        ("memory_mib: 15360", "memory_mib: .inf", "memory_mib"),
        ("gpus:", "gpu_layout:", "'gpu' (the model) and 'gpus'"),
    ],
)
def test_malformed_fixture_fields_are_a_fixture_error(
    scratch: Path, old: str, new: str, message: str
) -> None:
    assert old in T4
    result = expand_text(scratch / "field.yaml", T4.replace(old, new, 1))
    if message:
        assert isinstance(result, machine.FixtureError) and message in str(result), result
    else:
        check_machine(result)


@pytest.mark.parametrize("name", ["x" * 5000, "x" * 5000 + ".yaml", "nul\0.yaml"])
def test_unusable_fixture_name_is_a_fixture_error(name: str) -> None:
    with pytest.raises(machine.FixtureError, match="unknown fixture"):
        machine.fixture_path(name)


@pytest.mark.parametrize("text", ["gpu: [unclosed\n", "gpu: " + "9" * 5000 + "\n"])
def test_fixture_that_is_not_yaml_is_a_fixture_error(scratch: Path, text: str) -> None:
    result = expand_text(scratch / "broken.yaml", text)
    assert isinstance(result, machine.FixtureError) and "not valid YAML" in str(result)
