"""`gpufleet validate` (playbooks/validate.yml through ansible-runner, on the simulated fleet of
inventory/sim), `gpufleet report` on fabricated report directories, and `gpufleet provision --check` of the
real site.yml on inventory/sim (what `make lab` runs)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from runnerkit import LOCAL, REPO, CliRun, play, write_inventory, write_playbook

from gpufleet.validation.report import SUITES, Check, Report, mode_label, write_report
from gpufleet_harness.sim import control as simcontrol
from gpufleet_harness.sim import machine as simmachine

Gpufleet = Callable[..., CliRun]
SIM_FIXTURES = ("dgx-a100", "hgx-h100", "pcie-2x-t4", "esxi-vm-2x-v100", "node-40-gpus")
SIM_INVENTORY = str(REPO / "inventory" / "sim")


def _materialize(base: Path, sim_lib: Path, fixtures: tuple[str, ...]) -> Path:
    for fixture in fixtures:
        simmachine.materialize(fixture, base / fixture, library=sim_lib)
    return base


def test_provision_check_runs_the_real_site_yml_on_the_simulated_fleet(
    gpufleet: Gpufleet, tmp_path: Path, sim_lib: Path
) -> None:
    base = _materialize(tmp_path / "sim", sim_lib, SIM_FIXTURES)
    result = gpufleet("provision", "-i", SIM_INVENTORY, "--check", "-e", "gpufleet_target=gpu_nodes",
                      "-e", f"gpufleet_sim_base={base}", "--json")
    assert result.rc == 0, result.explain()
    doc = result.json()
    assert doc["playbook"] == str(REPO / "site.yml") and doc["inventory"] == [SIM_INVENTORY]
    sim_hosts = {f"sim-{f}" for f in SIM_FIXTURES}
    assert sim_hosts <= set(doc["hosts"])  # (and localhost, where site.yml has controller plays)
    assert all(doc["hosts"][h]["ok"] >= 1 for h in sim_hosts)
    assert all(s["failed"] == 0 and s["unreachable"] == 0 for s in doc["hosts"].values())

    human = gpufleet("provision", "-i", SIM_INVENTORY, "--check", "-e", "gpufleet_target=gpu_nodes",
                     "-e", f"gpufleet_sim_base={base}")
    assert human.rc == 0, human.explain()
    # the collection's gpu_facts play ran on every simulated host
    facts = [line for line in human.out.splitlines()
             if line.startswith("PLAY ") and "Gather GPU facts" in line and "hosts x" in line]
    assert facts and f" {len(SIM_FIXTURES)} hosts x " in facts[0] and facts[0].endswith("fail 0 unr 0")
    assert all(len(line) <= 80 for line in human.out.splitlines())


def test_validate_shows_each_hosts_result_and_fails_on_a_failed_check(
    gpufleet: Gpufleet, tmp_path: Path, sim_lib: Path
) -> None:
    base = _materialize(tmp_path / "sim", sim_lib, ("dgx-a100", "pcie-2x-t4"))
    report = tmp_path / "report"
    args = ("validate", "-i", SIM_INVENTORY, "--limit", "sim-dgx-a100:sim-pcie-2x-t4", "--suites", "host",
            "-e", f"gpufleet_sim_base={base}", "-e", "gpufleet_driver_version=535.261.03",
            "--report-dir", str(report))
    good = gpufleet(*args)
    assert good.rc == 0, good.explain()
    lines = good.out.splitlines()
    assert all(len(line) <= 80 for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("HOST ") and "VALIDATION" in line)
    rows = {line.split()[0]: line.split() for line in lines[header + 1 : header + 4]}
    assert rows["sim-dgx-a100"][-2:] == ["PASS", "8/8"] and rows["sim-pcie-2x-t4"][-2:] == ["PASS", "7/7"]
    assert rows["localhost"][-1] == "-"  # the controller runs the suites, it is not validated
    assert "result: pass (exit 0)" in good.out  # report.txt follows
    assert json.loads((report / "report.json").read_text())["status"] == "pass"

    simcontrol.inject(base / "dgx-a100", ["fabricmanager", "stopped"])
    bad = gpufleet(*args, "--json")
    assert bad.rc == 1, bad.explain()
    doc = bad.json()
    assert doc["exit_code"] == 1 and doc["validation"]["status"] == "fail"
    assert doc["validation"]["per_host"] == {"sim-dgx-a100": "FAIL 7/8", "sim-pcie-2x-t4": "PASS 7/7"}
    assert doc["validation"]["report_dir"] == str(report)
    assert doc["hosts"]["sim-dgx-a100"]["failed"] == 0 and doc["hosts"]["localhost"]["failed"] == 1

    shown = gpufleet("report", "--report-dir", str(report))
    assert shown.rc == 1, shown.explain()
    assert "sim-dgx-a100 host/fabricmanager_active: FAILED" in shown.out


def test_validate_without_runtime_or_cluster_settings_is_not_a_pass(
    gpufleet: Gpufleet, tmp_path: Path, sim_lib: Path
) -> None:
    """inventory/sim sets neither gpufleet_validation_runtime nor gpufleet_validation_cluster. All four
    suites asked for (no --suites): the host suite passes, the other three are NOT RUN with the variable to
    set, and `gpufleet validate` exits 1 (before issue 30: exit 0, "pass"). `gpufleet report` agrees."""
    base = _materialize(tmp_path / "sim", sim_lib, ("pcie-2x-t4",))
    report = tmp_path / "report"
    result = gpufleet("validate", "-i", SIM_INVENTORY, "--limit", "sim-pcie-2x-t4", "-e",
                      f"gpufleet_sim_base={base}", "-e", "gpufleet_driver_version=535.261.03",
                      "--report-dir", str(report), "--json")
    assert result.rc == 1, result.explain()
    doc = result.json()["validation"]
    assert doc["status"] == "could not run" and doc["exit_code"] == 2 and doc["not_asked"] == []
    assert doc["hosts"]["sim-pcie-2x-t4"] == {"host": "PASS 7/7", "runtime": "NOT RUN", "cluster": "NOT RUN",
                                              "workload": "NOT RUN"}  # fmt: skip
    assert doc["per_host"]["sim-pcie-2x-t4"] == "PASS 7/7, 13 NOT RUN"
    reasons = {g["suite"]: g["reason"] for g in doc["not_run"]}
    assert "gpufleet_validation_runtime" in reasons["runtime"]
    assert "gpufleet_validation_cluster" in reasons["cluster"] == reasons["workload"]
    failure = next(f for f in result.json()["failures"] if f["host"] == "localhost")
    assert "NOT RUN: runtime, cluster, workload" in failure["message"]

    shown = gpufleet("report", "--report-dir", str(report))
    assert shown.rc == 1 and "result: could not run (exit 2)" in shown.out, shown.explain()
    assert "- runtime on sim-pcie-2x-t4 (2 checks): the host's expectations name no" in shown.out
    assert all(len(line) <= 80 for line in shown.out.splitlines())


def test_validate_rejects_unknown_suites_and_notices_a_missing_report(
    gpufleet: Gpufleet, tmp_path: Path
) -> None:
    inventory = write_inventory(tmp_path / "hosts.yml", {"h": LOCAL})
    bogus = gpufleet("validate", "-i", str(inventory), "--suites", "host,bogus")
    assert bogus.rc == 2 and "bogus" in bogus.err, bogus.explain()

    # a playbook that succeeds but writes no report: not a pass
    silent = write_playbook(tmp_path / "silent.yml", [play("Say nothing", [
        {"name": "report dir", "ansible.builtin.debug": {"msg": "{{ gpufleet_validation_report_dir }}"}}])])
    report = tmp_path / "report"
    result = gpufleet("validate", "-i", str(inventory), "--playbook", str(silent),
                      "--report-dir", str(report), "--json")
    assert result.rc == 4, result.explain()
    doc = result.json()
    assert doc["validation"] is None and "no report written" in doc["validation_error"]
    assert doc["hosts"]["h"]["failed"] == 0


def _report(directory: Path, outcomes: dict[tuple[str, str], str], problems: tuple[str, ...] = (),
            modes: dict[str, str] | None = None) -> Path:
    checks = [Check("host", target, name, outcome, message=f"{name} on {target} was {outcome}")
              for (target, name), outcome in outcomes.items()]
    suites = ("host", "runtime")
    write_report(Report(checks=checks, problems=list(problems), suites=suites, modes=modes or {}), directory)
    return directory


LONG = "node-" + "x" * 90


def test_report_prints_the_last_report_and_exits_by_its_result(gpufleet: Gpufleet, tmp_path: Path) -> None:
    green = _report(tmp_path / "green", {(LONG, "driver"): "passed", ("b", "driver"): "passed",
                                         ("b", "fabric"): "skipped"})
    result = gpufleet("report", "--report-dir", str(green))
    assert result.rc == 0, result.explain()
    assert "PASS 1/1" in result.out and "result: pass (exit 0)" in result.out
    assert all(len(line) <= 80 for line in result.out.splitlines())
    doc = gpufleet("report", "--report-dir", str(green), "--json").json()
    assert doc["exit_code"] == 0 and doc["report"]["hosts"]["b"] == {"host": "PASS 1/1", "runtime": "-"}

    red = _report(tmp_path / "red", {("a", "driver"): "failed", ("b", "driver"): "passed"})
    result = gpufleet("report", "--report-dir", str(red))
    assert result.rc == 1 and "a host/driver: FAILED" in result.out, result.explain()

    errored = _report(tmp_path / "errored", {("a", "driver"): "error"}, ("a: unreachable",))
    assert gpufleet("report", "--report-dir", str(errored)).rc == 1

    # report.txt gone: the table is rebuilt from report.json, with each host's mode when the run had them
    modes = {"a": "whole", "b": mode_label({"sharing": "time-slicing", "replicas": 4})}
    red = _report(tmp_path / "red", {("a", "driver"): "failed", ("b", "driver"): "passed"}, modes=modes)
    (red / "report.txt").unlink()
    rebuilt = gpufleet("report", "--report-dir", str(red))
    assert rebuilt.rc == 1 and "FAIL 0/1" in rebuilt.out
    rows = {line.split()[0]: line.split() for line in rebuilt.out.splitlines() if line.split()}
    assert rows["HOST"][:2] == ["HOST", "MODE"]
    assert rows["a"][:2] == ["a", "whole"] and rows["b"][:3] == ["b", "sliced", "x4"]
    assert mode_label({"sharing": "memory"}) == "memory" and mode_label({}) == "whole"
    assert mode_label({"mig_strategy": "mixed"}) == "whole+MIG"
    assert mode_label({"mig_strategy": "single"}) == "MIG" and mode_label({"mig_strategy": "none"}) == "whole"
    # The lab's hosts and modes, four suites: every host name whole within 80 columns (session 12: a longer
    # MIG label cut esxi-vm-2x-v100 short).
    lab = {"dgx-a100": {"mig_strategy": "mixed"}, "pcie-2x-t4": {"sharing": "memory"},
           "esxi-vm-2x-v100": {"sharing": "time-slicing", "replicas": 2}}  # fmt: skip
    table = Report(checks=[Check(s, h, "x", "passed") for h in lab for s in SUITES],
                   modes={h: mode_label(want) for h, want in lab.items()}).table()  # fmt: skip
    assert all(f"{h} " in table for h in lab) and all(len(line) <= 80 for line in table.splitlines()), table


def test_report_without_a_readable_report_exits_2(gpufleet: Gpufleet, tmp_path: Path) -> None:
    missing = gpufleet("report", "--report-dir", str(tmp_path / "nothing-here"))
    assert missing.rc == 2 and "no validation report" in missing.err and missing.out == ""
    as_json = gpufleet("report", "--report-dir", str(tmp_path / "nothing-here"), "--json")
    assert as_json.rc == 2 and as_json.json()["exit_code"] == 2
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "report.json").write_text('{"status": "pass", "checks": [')
    result = gpufleet("report", "--report-dir", str(broken))
    assert result.rc == 2 and "cannot read" in result.err
    (broken / "report.json").write_text('{"status": "pass"}')
    assert gpufleet("report", "--report-dir", str(broken)).rc == 2


@pytest.mark.parametrize("width", [80, 60])
def test_summary_and_play_lines_fit_the_width(width: int) -> None:
    from gpufleet.runner import progress
    from gpufleet.runner.run import HostStats, PlayState

    hosts = {LONG: HostStats(ok=12345, changed=3, failed=1), "b": HostStats(unreachable=1)}
    validation = {"checks": [{"target": LONG, "outcome": "failed"}, {"target": LONG, "outcome": "passed"}]}
    table = progress.summary_table(hosts, validation, width=width)
    assert all(len(line) <= width for line in table.splitlines())
    assert "FAIL 1/2" in table and "~" in table and "12345" in table
    state = PlayState(1, "p" * 200, hosts={LONG: HostStats(ok=3)}, tasks=7, task="t" * 100, results=3)
    for live in (False, True):
        line = progress.play_line(state, width, live=live)
        assert len(line) <= width and line.startswith("PLAY 1 pp")
    assert progress.play_line(state, 80).endswith("1 host x 7 tasks 3/7 ok 3 chg 0 fail 0 unr 0")


def test_report_finds_the_newest_of_the_checkouts_and_the_labs_report(tmp_path: Path) -> None:
    from gpufleet.runner.cli import DEFAULT_REPORT_DIR, LAB_REPORT_DIR, last_report_dir

    assert last_report_dir(tmp_path) is None
    lab = _report(tmp_path / LAB_REPORT_DIR, {("a", "driver"): "passed"})
    assert last_report_dir(tmp_path) == lab  # after `make lab`, which writes the lab's
    own = _report(tmp_path / DEFAULT_REPORT_DIR, {("a", "driver"): "failed"})
    os.utime(own / "report.json", ns=(1, 1))
    assert last_report_dir(tmp_path) == lab
    os.utime(lab / "report.json", ns=(1, 1))
    os.utime(own / "report.json")
    assert last_report_dir(tmp_path) == own


def test_a_long_report_directory_wraps_before_the_time_it_was_written(tmp_path: Path) -> None:
    """`gpufleet report`'s heading: the directory, wrapped to the width, then when it was written. The time
    used to be inserted after the first line, splitting a wrapped directory in two (seen in CI with a deep
    pytest directory)."""
    from gpufleet.runner import cli, progress

    directory = tmp_path.joinpath(*(["a-rather-long-directory-name"] * 4), "validation-report")
    directory.mkdir(parents=True)
    (directory / "report.txt").write_text("HOST  MODE  HOST\n")
    text = cli._report_text(directory, Report(checks=[]), "2026-11-29 07:00:00")
    head, rest = text.split("written 2026-11-29 07:00:00\n\n")
    assert len(head.splitlines()) > 1 and all(len(line) <= progress.WIDTH for line in head.splitlines())
    assert "".join(head.split()) == f"VALIDATIONREPORT{directory}"
    assert rest == "HOST  MODE  HOST\n"
