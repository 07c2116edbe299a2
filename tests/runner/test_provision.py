"""`gpufleet provision` through ansible-runner, against throwaway playbooks and local-connection hosts:
the display and summary at 80 columns, --json, the exit codes, --check/--diff, no_log, artifacts."""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pexpect
import pytest
from runnerkit import (
    LOCAL,
    REPO,
    CliRun,
    cli_env,
    closed_port,
    ensure_collection_link,
    play,
    visible_lines,
    write_inventory,
    write_playbook,
)

from gpufleet import cli
from gpufleet.runner import run as runmod

LONG = "gpu-node-with-a-very-long-inventory-name-0001.rack-17.datacenter.example.com"
Gpufleet = Callable[..., CliRun]


def _debug(name: str, msg: str) -> dict[str, object]:
    return {"name": name, "ansible.builtin.debug": {"msg": msg}}


@pytest.fixture
def two_hosts(tmp_path: Path) -> Path:
    return write_inventory(tmp_path / "hosts.yml", {"short": LOCAL, LONG: LOCAL})


def test_success_shows_each_play_and_an_80_column_summary_with_long_names_cut(
    gpufleet: Gpufleet, tmp_path: Path, two_hosts: Path
) -> None:
    book = write_playbook(tmp_path / "ok.yml", [
        play("Prepare the hosts", [_debug("say hello", "hello"),
                                   {"name": "change something", "ansible.builtin.command": "true",
                                    "changed_when": True}]),
        play("A second play whose name is far too long to fit on one line of eighty columns at all",
             [_debug("skip me", "never"), {"name": "skipped", "ansible.builtin.debug": {"msg": "x"},
                                           "when": "inventory_hostname == 'nobody'"}]),
    ])
    result = gpufleet("provision", "-i", str(two_hosts), "--playbook", str(book))
    assert result.rc == 0, result.explain()
    lines = result.out.splitlines()
    assert all(len(line) <= 80 for line in lines), [line for line in lines if len(line) > 80]
    assert "PLAY 1 Prepare the hosts" in lines
    assert "  TASK 2 change something" in lines
    final = [line for line in lines if line.startswith("PLAY 1 ") and "hosts x" in line]
    assert final and final[0].endswith("2 hosts x 2 tasks 4/4 ok 4 chg 2 fail 0 unr 0"), final
    assert any(line.startswith("PLAY 2 A second play") and line.endswith("~") for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("HOST "))
    assert lines[header].split() == ["HOST", "OK", "CHANGED", "FAILED", "UNREACHABLE", "SKIPPED"]
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1 : header + 3]}
    cut = next(name for name in rows if name != "short")
    assert cut.endswith("~") and LONG.startswith(cut[:-1]) and len(cut) < len(LONG)
    assert rows["short"] == ["3", "1", "0", "0", "1"] and rows[cut] == ["3", "1", "0", "0", "1"]
    assert lines[-2].startswith("gpufleet provision: ok (exit 0) in ")
    assert "FAILURES" not in result.out


def test_failed_task_exits_1_and_json_is_one_document_with_stats_and_messages(
    gpufleet: Gpufleet, tmp_path: Path, two_hosts: Path
) -> None:
    book = write_playbook(tmp_path / "fail.yml", [play("Break one host", [
        _debug("fine", "fine"),
        {"name": "break it", "ansible.builtin.command": "sh -c 'echo disk on fire >&2; exit 3'",
         "when": "inventory_hostname == 'short'"},
        _debug("after", "only the healthy host gets here"),
    ])])
    human = gpufleet("provision", "-i", str(two_hosts), "--playbook", str(book))
    assert human.rc == 1, human.explain()
    assert "  FAILED short: break it" in human.out
    assert "- short | Break one host | break it: FAILED" in human.out
    assert "disk on fire" in human.out
    assert "gpufleet provision: FAILED (exit 1)" in human.out

    result = gpufleet("provision", "-i", str(two_hosts), "--playbook", str(book), "--json")
    assert result.rc == 1, result.explain()
    doc = result.json()  # the whole of stdout is one JSON document
    assert set(doc) >= {"command", "status", "rc", "exit_code", "duration", "artifact_dir", "hosts",
                        "failures", "playbook", "inventory"}
    assert doc["command"] == "provision" and doc["status"] == "failed" and doc["exit_code"] == 1
    assert doc["rc"] == 2  # ansible-playbook's own: a host failed
    assert isinstance(doc["duration"], float) and Path(doc["artifact_dir"]).is_dir()
    assert Path(doc["artifact_dir"]).parent.parent == tmp_path / "runner"
    assert doc["hosts"]["short"] == {"ok": 1, "changed": 0, "failed": 1, "unreachable": 0, "skipped": 0,
                                     "rescued": 0, "ignored": 0}
    assert doc["hosts"][LONG]["ok"] == 2 and doc["hosts"][LONG]["failed"] == 0
    [failure] = doc["failures"]
    assert failure["host"] == "short" and failure["task"] == "break it" and failure["kind"] == "failed"
    assert "disk on fire" in failure["message"] and "rc 3" in failure["message"]
    assert "PLAY" not in result.out and result.err == ""


def test_unreachable_host_exits_3(gpufleet: Gpufleet, tmp_path: Path) -> None:
    port = closed_port()
    inventory = write_inventory(tmp_path / "hosts.yml", {
        "here": LOCAL,
        "gone": {"ansible_host": "127.0.0.1", "ansible_port": port, "ansible_connection": "ssh",
                 "ansible_user": "nobody", "ansible_ssh_common_args": "-o ConnectTimeout=5"},
    })
    book = write_playbook(tmp_path / "ping.yml", [play("Reach everyone", [
        {"name": "ping", "ansible.builtin.ping": {}},
        {"name": "fail here too", "ansible.builtin.fail": {"msg": "local failure"},
         "when": "inventory_hostname == 'here'"},
    ])])
    result = gpufleet("provision", "-i", str(inventory), "--playbook", str(book), "--json")
    assert result.rc == 3, result.explain()  # unreachable wins over a failed task
    doc = result.json()
    assert doc["exit_code"] == 3
    assert doc["hosts"]["gone"]["unreachable"] == 1 and doc["hosts"]["here"]["failed"] == 1
    kinds = {(f["host"], f["kind"]) for f in doc["failures"]}
    assert kinds == {("gone", "unreachable"), ("here", "failed")}
    message = next(f["message"] for f in doc["failures"] if f["host"] == "gone")
    assert str(port) in message or "refused" in message.lower(), message


def test_inventory_and_usage_errors_exit_2(gpufleet: Gpufleet, tmp_path: Path, two_hosts: Path) -> None:
    book = write_playbook(tmp_path / "ok.yml", [play("Fine", [_debug("hi", "hi")])])
    missing = gpufleet("provision", "-i", str(tmp_path / "no-such-inventory"), "--playbook", str(book))
    assert missing.rc == 2, missing.explain()
    assert "inventory" in missing.err and "not found" in missing.err and missing.out == ""

    as_json = gpufleet("provision", "-i", "no-such-inventory", "--playbook", str(book), "--json")
    assert as_json.rc == 2 and as_json.json()["exit_code"] == 2 and "not found" in as_json.json()["error"]

    broken = tmp_path / "broken.yml"
    broken.write_text("all: [this is: not an inventory\n")
    unparsed = gpufleet("provision", "-i", str(broken), "--playbook", str(book))
    assert unparsed.rc == 2, unparsed.explain()

    nobody = gpufleet("provision", "-i", str(two_hosts), "--playbook", str(book), "--limit", "nobody")
    assert nobody.rc == 2, nobody.explain()
    assert "no hosts to target" in " ".join(nobody.out.split())

    no_playbook = gpufleet("provision", "-i", str(two_hosts), "--playbook", str(tmp_path / "nope.yml"))
    assert no_playbook.rc == 2 and "playbook" in no_playbook.err


def test_check_and_diff_reach_ansible(gpufleet: Gpufleet, tmp_path: Path) -> None:
    inventory = write_inventory(tmp_path / "hosts.yml", {"h": LOCAL})
    target = tmp_path / "written-by-the-play.txt"
    book = write_playbook(tmp_path / "copy.yml", [play("Write a file", [
        _debug("modes", "check={{ ansible_check_mode }} diff={{ ansible_diff_mode }}"),
        {"name": "write",
         "ansible.builtin.copy": {"content": "new content\n", "dest": str(target), "mode": "0644"}},
    ])])
    dry = gpufleet("provision", "-i", str(inventory), "--playbook", str(book), "--check", "--diff",
                   "--verbose")
    assert dry.rc == 0, dry.explain()
    assert "check=True diff=True" in dry.out  # --verbose streams Ansible's own output
    assert "+new content" in dry.out  # the diff Ansible shows with --diff
    assert not target.exists()  # --check: nothing written
    assert "HOST " in dry.out and "gpufleet provision: ok (exit 0)" in dry.out

    real = gpufleet("provision", "-i", str(inventory), "--playbook", str(book), "--json")
    assert real.rc == 0, real.explain()
    assert target.read_text() == "new content\n" and real.json()["hosts"]["h"]["changed"] == 1


def test_no_logged_task_content_is_never_printed_or_stored(
    gpufleet: Gpufleet, tmp_path: Path, runner_dir: Path
) -> None:
    secret = "s3cr3t-" + secrets.token_hex(8)
    inventory = write_inventory(tmp_path / "hosts.yml", {"h1": LOCAL, "h2": LOCAL})
    book = write_playbook(tmp_path / "secret.yml", [play("Handle a secret", [
        {"name": "use the secret", "ansible.builtin.command": f"echo {secret}", "no_log": True},
        {"name": "ignored secret failure", "ansible.builtin.fail": {"msg": f"ignored {secret}"},
         "no_log": True, "ignore_errors": True},
        {"name": "secret loop", "ansible.builtin.fail": {"msg": "item {{ item }}"},
         "loop": [f"{secret}-item"], "no_log": True, "when": "inventory_hostname == 'h2'"},
        {"name": "secret failure", "ansible.builtin.fail": {"msg": f"fatal {secret}"}, "no_log": True},
    ])])
    outputs = []
    for extra in ((), ("--json",), ("--verbose",), ("--json", "--verbose")):
        result = gpufleet("provision", "-i", str(inventory), "--playbook", str(book), *extra)
        assert result.rc == 1, result.explain()
        outputs.append(result.out + result.err)
    assert all(secret not in text for text in outputs)
    assert "(output hidden: no_log)" in outputs[0]
    failures = json.loads(outputs[1][: outputs[1].rindex("}") + 1])["failures"]
    assert {(f["host"], f["task"]) for f in failures} == {("h1", "secret failure"), ("h2", "secret loop")}
    assert all(f["message"] == runmod.CENSORED for f in failures)
    assert "TASK [secret failure]" in outputs[2]  # --verbose did stream Ansible's output
    stored = [p for p in runner_dir.rglob("*") if p.is_file()]
    assert any(p.name == "stdout" for p in stored) and any(p.parent.name == "job_events" for p in stored)
    leaked = [p for p in stored if secret in p.read_text(errors="replace")]
    assert leaked == []


def test_terminal_gets_one_live_line_per_play_redrawn_in_place(tmp_path: Path, runner_dir: Path) -> None:
    ensure_collection_link()
    inventory = write_inventory(tmp_path / "hosts.yml", {"short": LOCAL, LONG: LOCAL})
    book = write_playbook(tmp_path / "two.yml", [
        play("First", [_debug("one", "1"), _debug("two", "2"), _debug("three", "3")]),
        play("Second", [_debug("four", "4")]),
    ])
    child = pexpect.spawn(sys.executable, ["-m", "gpufleet.cli", "provision", "-i", str(inventory),
                                           "--playbook", str(book)],
                          cwd=str(tmp_path), env=cli_env(runner_dir), dimensions=(24, 80), encoding="utf-8",
                          timeout=300)
    child.expect(pexpect.EOF)
    child.close()
    raw = child.before
    assert child.exitstatus == 0, raw
    assert raw.count("\r\x1b[K") > 6  # redrawn in place
    assert "PLAY 1 First > two" in raw  # the running task shows while live
    shown = visible_lines(raw)
    assert all(len(line) <= 80 for line in shown), [line for line in shown if len(line) > 80]
    plays = [line for line in shown if line.startswith("PLAY ")]
    assert len(plays) == 2  # one line per play is left on screen
    assert plays[0].endswith("2 hosts x 3 tasks 6/6 ok 6 chg 0 fail 0 unr 0") and ">" not in plays[0]
    assert plays[1].startswith("PLAY 2 Second")
    assert plays[1].endswith("2 hosts x 1 task 2/2 ok 2 chg 0 fail 0 unr 0")
    assert any(line.startswith("short ") for line in shown) and "gpufleet provision: ok (exit 0)" in raw


def _alive_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_ctrl_c_cancels_the_run_leaves_nothing_running_and_exits_130(
    tmp_path: Path, runner_dir: Path
) -> None:
    ensure_collection_link()
    inventory = write_inventory(tmp_path / "hosts.yml", {"h1": LOCAL, "h2": LOCAL})
    seconds = f"{300 + secrets.randbelow(1000)}.{secrets.randbelow(10**6):06d}"  # marks our sleeps
    book = write_playbook(tmp_path / "sleep.yml", [play("Sleep", [
        {"name": "sleep a long while", "ansible.builtin.command": f"sleep {seconds}"}])])
    child = pexpect.spawn(sys.executable, ["-m", "gpufleet.cli", "provision", "-i", str(inventory),
                                           "--playbook", str(book)],
                          cwd=str(tmp_path), env=cli_env(runner_dir), dimensions=(24, 80), encoding="utf-8",
                          timeout=120)
    try:
        child.expect("2 hosts x 1 task 0/2")
        deadline = time.monotonic() + 60
        while len(_alive_with(f"sleep {seconds}")) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_alive_with(f"sleep {seconds}")) == 2
        child.sendintr()
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130, child.before
    assert "gpufleet provision: INTERRUPTED (exit 130)" in child.before
    deadline = time.monotonic() + 10
    while _alive_with(f"sleep {seconds}") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive_with(f"sleep {seconds}") == []


def test_artifacts_are_rotated_and_nothing_lands_in_the_checkout(
    gpufleet: Gpufleet, tmp_path: Path, two_hosts: Path
) -> None:
    book = write_playbook(tmp_path / "ok.yml", [play("Fine", [_debug("hi", "hi")])])
    for _ in range(3):
        result = gpufleet("provision", "-i", str(two_hosts), "--playbook", str(book),
                          env={"GPUFLEET_RUNNER_KEEP": "2"})
        assert result.rc == 0, result.explain()
    assert len(list((tmp_path / "runner" / "artifacts").iterdir())) == 2
    assert not (tmp_path / "runner" / "env").exists()  # suppress_env_files: nothing a later run reuses

    # the default place: <checkout>/.lab/runner, and nothing of runner's or Ansible's elsewhere in it
    env = {k: v for k, v in cli_env(tmp_path).items() if k != "GPUFLEET_RUNNER_DIR"}
    proc = subprocess.run([sys.executable, "-m", "gpufleet.cli", "provision", "-i", str(two_hosts),
                           "--playbook", str(book), "--json"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    artifact = Path(json.loads(proc.stdout)["artifact_dir"])
    assert artifact.parent == REPO / ".lab" / "runner" / "artifacts" and artifact.is_dir()
    assert [name for name in ("artifacts", "env", "project", "inventory/hosts", ".ansible", "fact_cache")
            if (REPO / name).exists()] == []


def test_default_inventory_comes_from_ansible_cfg(tmp_path: Path) -> None:
    (tmp_path / "inventory" / "lab").mkdir(parents=True)
    cfg = tmp_path / "ansible.cfg"
    cfg.write_text("[defaults]\ninventory = inventory/lab ; the lab\nroles_path = roles\n")
    assert runmod.default_inventory(cfg) == [str(tmp_path / "inventory" / "lab")]
    assert runmod.resolve_inventory(None, cfg) == [str(tmp_path / "inventory" / "lab")]
    # -i wins, relative to the working directory
    (tmp_path / "mine.yml").write_text("all: {}\n")
    assert runmod.resolve_inventory(["mine.yml"], cfg, cwd=tmp_path) == [str(tmp_path / "mine.yml")]
    hosts = "a.example.com,b.example.com,"
    assert runmod.resolve_inventory([hosts], cfg) == [hosts]
    cfg.write_text("[defaults]\ninventory = inventory/missing\n")
    with pytest.raises(runmod.UsageError, match="not found"):
        runmod.resolve_inventory(None, cfg)
    cfg.write_text("[defaults]\n# no default inventory\nforks = 10\n")
    with pytest.raises(runmod.UsageError, match="pass -i"):
        runmod.resolve_inventory(None, cfg)


def test_ansible_playbook_missing_is_an_internal_error(
    tmp_path: Path, two_hosts: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    book = write_playbook(tmp_path / "ok.yml", [play("Fine", [_debug("hi", "hi")])])
    monkeypatch.setattr(runmod, "ANSIBLE_PLAYBOOK", "ansible-playbook-" + secrets.token_hex(4))
    monkeypatch.setenv("GPUFLEET_RUNNER_DIR", str(tmp_path / "runner"))
    code = cli.main(["provision", "-i", str(two_hosts), "--playbook", str(book), "--json"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 4 and doc["exit_code"] == 4 and doc["status"] == "error"
    assert "not found" in doc["error"]


def test_help_documents_the_exit_codes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    for command in ("provision", "validate"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = capsys.readouterr().out
        assert all(len(line) <= 80 for line in text.splitlines())
        for code in ("0", "1", "2", "3", "4", "130"):
            assert any(line.strip().startswith(code + " ") for line in text.splitlines()), (command, code)
