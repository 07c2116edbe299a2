"""The host suite on simulated hosts (sim roots, testinfra local://): passes in good state, and each
broken state fails naming the thing that is broken. Also the report formats and exit codes."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path

from validation_run import sim_host, validate

from gpufleet_harness.sim import control as simcontrol

DRIVER = "535.261.03"


def _dgx(root: Path, **extra: object) -> dict:
    return sim_host(root, gpu_count=8, gpu_model="A100-SXM4-80GB", driver_version=DRIVER, **extra)


def test_good_hosts_pass_and_the_report_has_json_junit_and_an_80_column_table(
    fresh_root: Callable[[str], Path], tmp_path: Path
) -> None:
    dgx, t4 = fresh_root("dgx-a100"), fresh_root("pcie-2x-t4")
    hosts = {"sim-dgx-a100": _dgx(dgx), "sim-pcie-2x-t4": sim_host(t4, gpu_count=2, gpu_model="T4")}
    run = validate({"hosts": hosts}, tmp_path, "host")
    assert run.rc == 0, run.proc.stdout + run.proc.stderr
    outcomes = run.outcomes()
    assert outcomes[("sim-dgx-a100", "fabricmanager_active")] == "passed"
    assert outcomes[("sim-pcie-2x-t4", "fabricmanager_active")] == "skipped"
    assert outcomes[("sim-dgx-a100", "gpu_count")] == "passed"
    assert run.report["status"] == "pass" and run.report["hosts"]["sim-dgx-a100"]["host"] == "PASS 8/8"
    assert all(len(line) <= 80 for line in run.table.splitlines())
    assert "sim-dgx-a100    whole  PASS 8/8" in run.table and run.table in run.proc.stdout
    junit = ET.parse(run.report_dir / "junit.xml").getroot()
    cases = junit.findall(".//testcase")
    assert len(cases) == 18 and not junit.findall(".//failure")


def test_driver_unloaded_fails_naming_the_module_and_nvidia_smi(
    fresh_root: Callable[[str], Path], tmp_path: Path
) -> None:
    root = fresh_root("dgx-a100")
    simcontrol.inject(root, ["driver", "unloaded"])
    run = validate({"hosts": {"h": _dgx(root)}}, tmp_path, "host")
    assert run.rc == 1
    assert run.outcomes()[("h", "nvidia_module_loaded")] == "failed"
    assert run.message("h", "nvidia_module_loaded") == (
        f"h: the nvidia kernel module is not loaded ({root}/host/sys/module/nvidia is missing)"
    )
    assert run.message("h", "nvidia_smi_runs").startswith("h: nvidia-smi exited 9: NVIDIA-SMI has failed")
    assert "FAIL" in run.report["hosts"]["h"]["host"]
    assert "h host/nvidia_module_loaded: FAILED" in run.table


def test_fabricmanager_stopped_fails_naming_the_inactive_nvlinks(
    fresh_root: Callable[[str], Path], tmp_path: Path
) -> None:
    root = fresh_root("dgx-a100")
    simcontrol.inject(root, ["fabricmanager", "stopped"])
    run = validate({"hosts": {"dgx": _dgx(root)}}, tmp_path, "host")
    assert run.rc == 1
    failed = {check for (_, check), outcome in run.outcomes().items() if outcome == "failed"}
    assert failed == {"fabricmanager_active"}
    message = run.message("dgx", "fabricmanager_active")
    assert message.startswith(
        "dgx: fabricmanager: 96 of 96 NVLinks to NVSwitches are inactive (GPU 0: 12 of 12;"
    )
    assert message.endswith("the fabric is not trained")


def test_wrong_gpu_count_and_model_expectations_fail_naming_both(
    sim_root: Callable[[str], Path], tmp_path: Path
) -> None:
    root = sim_root("dgx-a100")
    run = validate({"hosts": {"dgx": sim_host(root, gpu_count=9, gpu_model="H100")}}, tmp_path, "host")
    assert run.rc == 1
    assert run.message("dgx", "gpu_count").startswith(
        "dgx: nvidia-smi lists 8 GPUs, expected 9 (0:NVIDIA A100"
    )
    assert run.message("dgx", "gpu_model").startswith(
        "dgx: expected every GPU to be H100: GPU 0 is NVIDIA A100"
    )


def test_pinned_driver_and_nouveau_fail_naming_the_versions(
    fresh_root: Callable[[str], Path], tmp_path: Path
) -> None:
    root = fresh_root("pcie-2x-t4")
    (root / "host/sys/module/nouveau").mkdir(parents=True)
    run = validate({"hosts": {"t4": sim_host(root, driver_version="550.54.15")}}, tmp_path, "host")
    assert run.rc == 1
    assert run.message("t4", "driver_version_pinned") == (
        f"t4: the loaded nvidia kernel module is {DRIVER}, pinned 550.54.15"
    )
    assert run.message("t4", "nouveau_not_loaded").startswith("t4: the nouveau module is loaded")


def test_unreachable_host_is_could_not_run(tmp_path: Path) -> None:
    hosts = {"gone": {"connection": "ssh://nobody@127.0.0.1:1?timeout=3", "gpu_count": 1}}
    run = validate({"hosts": hosts}, tmp_path, "host")
    assert run.rc == 2, run.proc.stdout
    assert set(run.outcomes().values()) == {"error"}
    assert run.report["status"] == "could not run"


def test_missing_expectations_and_unknown_suite_are_could_not_run(tmp_path: Path) -> None:
    run = validate({"hosts": {}}, tmp_path, "host,bogus")
    assert run.rc == 2
    assert "unknown suites bogus" in run.table


def test_suites_the_expectations_cannot_feed_are_not_run_never_passed(
    sim_root: Callable[[str], Path], tmp_path: Path
) -> None:
    """No runtime for one host and no cluster section: with all four suites asked for (the default), the
    runtime checks of that host and every cluster and workload check are NOT RUN, with the reason naming the
    setting, in the table, the JSON and JUnit; the run is "could not run" (exit 2), not a pass. The
    operator's --suites leaving them out is what makes the same host suite a pass."""
    t4 = sim_root("pcie-2x-t4")
    hosts = {"t4": sim_host(t4, gpu_count=2, gpu_model="T4", driver_version=DRIVER)}
    run = validate({"hosts": hosts}, tmp_path / "all", "host,runtime,cluster,workload")
    assert run.rc == 2, run.proc.stdout + run.proc.stderr
    doc = run.report
    assert doc["status"] == "could not run" and doc["exit_code"] == 2
    assert doc["hosts"]["t4"] == {"host": "PASS 7/7", "runtime": "NOT RUN", "cluster": "NOT RUN",
                                  "workload": "NOT RUN"}  # fmt: skip
    assert doc["counts"]["not run"] == 2 + 6 + 5 and doc["not_asked"] == []
    groups = {g["suite"]: g for g in doc["not_run"]}
    assert list(groups) == ["runtime", "cluster", "workload"]
    no_runtime = groups["runtime"]
    assert no_runtime["targets"] == ["t4"]
    assert "docker or containerd (playbook variable gpufleet_validation_runtime" in no_runtime["reason"]
    assert "gpufleet_validation_cluster" in groups["cluster"]["reason"] == groups["workload"]["reason"]
    assert all(c["outcome"] == "not run" for c in doc["checks"] if c["suite"] != "host")
    # the table: the cells, and why, within 80 columns
    table = run.table
    assert "t4    whole  PASS 7/7     NOT RUN      NOT RUN      NOT RUN" in table
    assert "NOT RUN (set what each line names" in table and "result: could not run (exit 2)" in table
    assert "- runtime on t4 (2 checks): the host's expectations name no container runtime" in table
    assert all(len(line) <= 80 for line in table.splitlines())
    # JUnit: a skip whose message starts NOT RUN, and the property outcome=not run
    junit = ET.parse(run.report_dir / "junit.xml").getroot()
    cases = {c.get("name"): c for c in junit.iter("testcase")}
    runtime = cases["test_nvidia_runtime_configured[t4]"]
    assert runtime.find("skipped").get("message").startswith("NOT RUN: the host's expectations name no")
    props = {p.get("name"): p.get("value") for p in runtime.iter("property")}
    assert props["outcome"] == "not run" and props["suite"] == "runtime"
    assert not cases["test_gpu_count[t4]"].findall("skipped")

    # a runtime for the host: its runtime checks run (and fail: the sim host has no docker); cluster and
    # workload still not run
    hosts["t4"]["runtime"] = "docker"
    hosts["t4"]["docker_host"] = f"unix://{tmp_path}/no-docker.sock"
    some = validate({"hosts": hosts}, tmp_path / "some", "host,runtime,cluster")
    assert some.rc == 1, some.proc.stdout
    assert some.report["hosts"]["t4"]["runtime"].startswith("FAIL")
    assert some.report["not_asked"] == ["workload"]
    assert [g["suite"] for g in some.report["not_run"]] == ["cluster"]

    # asked for the host suite only: a pass, and the table says which suites were left out
    only = validate({"hosts": hosts}, tmp_path / "host", "host")
    assert only.rc == 0 and only.report["status"] == "pass" and only.report["not_run"] == []
    assert only.report["not_asked"] == ["runtime", "cluster", "workload"]
    assert "left out (--suites, gpufleet_validation_suites): runtime, cluster, workload\n" in only.table
