"""gpu_scheduler_extender's kube-scheduler wiring on kubeadm's own manifest, without a cluster: the merge into
the static pod (configuration, TLS files, superseded flags), its inverse byte for byte, a foreign edit kept,
the restarted scheduler's crash read from the kubelet's container logs, and the check with the image's
kube-scheduler (its calls to ctr and the binary).

``fixtures/kube-scheduler-1.37.2.yaml`` is the manifest ``kubeadm init`` of Kubernetes 1.37.2 wrote on the
kubeadm test cluster (tests/kubeadm/test_kubeadm_cluster.py), node name left out: kubeadm writes it with
sigs.k8s.io/yaml, and PyYAML's dump of it is the same text, byte for byte (tested below)."""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from labstack import REPO, ensure_collection_link

ensure_collection_link()
sys.path.insert(0, str(REPO / ".cache" / "collections"))

from ansible_collections.gpufleet.nvidia.plugins.module_utils import k8s_schedconfig as sc  # noqa: E402

MANIFEST = Path(__file__).parent / "fixtures" / "kube-scheduler-1.37.2.yaml"
CONFIG = "/etc/kubernetes/gpufleet-scheduler-config.yaml"
TLS = {"caFile": "/etc/kubernetes/gpufleet/ca.crt", "certFile": "/etc/kubernetes/gpufleet/scheduler.crt",
       "keyFile": "/etc/kubernetes/gpufleet/scheduler.key"}  # fmt: skip
OTHER = {"kubeconfig": "/etc/kubernetes/other.conf"}


def _config(**over: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "apiVersion": "kubescheduler.config.k8s.io/v1",
        "kind": "KubeSchedulerConfiguration",
        "clientConnection": {"kubeconfig": "/etc/kubernetes/scheduler.conf"},
        "leaderElection": {"leaderElect": True},
        "extenders": [{"urlPrefix": "https://10.0.2.2:8443/gpufleet", "enableHTTPS": True, "tlsConfig": TLS}],
    }
    doc.update(over)
    return doc


def _original() -> tuple[str, dict[str, Any]]:
    text = MANIFEST.read_text()
    return text, yaml.safe_load(text)


def _command(doc: dict[str, Any]) -> list[str]:
    return list(doc["spec"]["containers"][0]["command"])


def test_kubeadm_manifest_round_trips_through_pyyaml_byte_for_byte() -> None:
    text, doc = _original()
    assert sc.dump_manifest(doc) == text


def test_merge_adds_the_flag_the_files_and_the_hash_and_keeps_kubeadm_s_flags() -> None:
    text, doc = _original()
    merged = sc.with_config(doc, CONFIG, "abc", config=_config())
    command = _command(merged)
    assert command == [*_command(doc), f"--config={CONFIG}"], "nothing of kubeadm's contradicts this config"
    container = merged["spec"]["containers"][0]
    # scheduler.conf is mounted by kubeadm already: only the configuration and the three TLS files are added
    ours = {m["name"]: m["mountPath"] for m in container["volumeMounts"] if m["name"].startswith("gpufleet-")}
    assert ours == {
        "gpufleet-scheduler-config": CONFIG,
        "gpufleet-scheduler-ca": TLS["caFile"],
        "gpufleet-scheduler-cert": TLS["certFile"],
        "gpufleet-scheduler-key": TLS["keyFile"],
    }
    assert all(m["readOnly"] for m in container["volumeMounts"])
    volumes = {v["name"]: v["hostPath"] for v in merged["spec"]["volumes"]}
    assert volumes["gpufleet-scheduler-key"] == {"path": TLS["keyFile"], "type": "File"}
    assert volumes["kubeconfig"] == {"path": "/etc/kubernetes/scheduler.conf", "type": "FileOrCreate"}
    assert merged["metadata"]["annotations"] == {sc.HASH_ANNOTATION: "abc"}
    assert sc.with_config(merged, CONFIG, "abc", config=_config()) == merged, "a second merge changes nothing"
    assert sc.without_config(merged, CONFIG) == doc
    assert sc.dump_manifest(sc.without_config(merged, CONFIG)) == text


@pytest.mark.parametrize(
    ("config", "removed"),
    [
        (_config(leaderElection={"leaderElect": False}), ["--leader-elect=true"]),
        (_config(clientConnection=OTHER), ["--kubeconfig=/etc/kubernetes/scheduler.conf"]),
        (
            _config(clientConnection=OTHER, leaderElection={"leaderElect": False}),
            ["--kubeconfig=/etc/kubernetes/scheduler.conf", "--leader-elect=true"],
        ),
    ],
)  # fmt: skip
def test_flags_the_configuration_supersedes_are_taken_out_and_put_back_in_place(
    config: dict[str, Any], removed: list[str]
) -> None:
    text, doc = _original()
    merged = sc.with_config(doc, CONFIG, "h", config=config)
    command = _command(merged)
    assert [a for a in _command(doc) if a not in command] == removed
    recorded = json.loads(merged["metadata"]["annotations"][sc.REMOVED_FLAGS_ANNOTATION])
    assert [token for _index, token in recorded] == removed
    assert sc.with_config(merged, CONFIG, "h", config=config) == merged
    # the file kube-scheduler reads instead is mounted when kubeadm does not mount it
    paths = {v["hostPath"]["path"] for v in merged["spec"]["volumes"]}
    assert (config["clientConnection"]["kubeconfig"] in paths) is True
    restored = sc.without_config(merged, CONFIG)
    assert _command(restored) == _command(doc), "back in their places"
    assert sc.dump_manifest(restored) == text


def test_a_configuration_without_a_kubeconfig_is_refused_while_the_manifest_names_one() -> None:
    _text, doc = _original()
    with pytest.raises(
        sc.SchedulerError,
        match=r"no clientConnection.kubeconfig.*--kubeconfig=/etc/kubernetes/scheduler.conf",
    ):
        sc.with_config(doc, CONFIG, "h", config=_config(clientConnection={}))  # fmt: skip


def test_a_foreign_edit_is_merged_never_overwritten() -> None:
    text, doc = _original()
    merged = sc.with_config(doc, CONFIG, "h", config=_config(leaderElection={"leaderElect": False}))
    # another tool edits the configured manifest: a flag and a label; ours stay, theirs too, nothing to do
    theirs = yaml.safe_load(sc.dump_manifest(merged))
    theirs["spec"]["containers"][0]["command"].insert(3, "--v=2")
    theirs["metadata"]["labels"]["owner"] = "platform-team"
    again = sc.with_config(theirs, CONFIG, "h", config=_config(leaderElection={"leaderElect": False}))
    assert again == theirs
    # kubeadm upgrade rewrites the manifest from its template: gpufleet's parts are gone, its own flag stays
    upgraded = yaml.safe_load(text)
    upgraded["spec"]["containers"][0]["command"].append("--v=2")
    remerged = sc.with_config(upgraded, CONFIG, "h", config=_config(leaderElection={"leaderElect": False}))
    command = _command(remerged)
    assert "--v=2" in command and command[-1] == f"--config={CONFIG}" and "--leader-elect=true" not in command
    assert _command(sc.without_config(remerged, CONFIG)) == _command(upgraded)


def test_a_file_inside_a_mount_of_something_else_is_refused() -> None:
    _text, doc = _original()
    doc["spec"]["containers"][0]["volumeMounts"].append(
        {"mountPath": "/etc/kubernetes/gpufleet", "name": "x"}
    )
    doc["spec"]["volumes"].append({"name": "x", "hostPath": {"path": "/srv/certs"}})
    with pytest.raises(sc.SchedulerError, match="shows /srv/certs there"):
        sc.with_config(doc, CONFIG, "h", config=_config())
    doc["spec"]["volumes"][-1]["hostPath"]["path"] = "/etc/kubernetes/gpufleet"
    merged = sc.with_config(doc, CONFIG, "h", config=_config())
    names = {v["name"] for v in merged["spec"]["volumes"]}
    assert {"gpufleet-scheduler-ca", "gpufleet-scheduler-cert"}.isdisjoint(names), (
        "the directory mount has them"
    )


def test_config_files_names_each_file_once_and_wants_absolute_paths() -> None:
    config = _config(
        extenders=[{"tlsConfig": TLS}, {"tlsConfig": {"caFile": TLS["caFile"], "certFile": "/b.crt"}}]
    )
    assert sc.config_files(config) == [
        ("gpufleet-scheduler-kubeconfig", "/etc/kubernetes/scheduler.conf"),
        ("gpufleet-scheduler-ca", TLS["caFile"]),
        ("gpufleet-scheduler-cert", TLS["certFile"]),
        ("gpufleet-scheduler-key", TLS["keyFile"]),
        ("gpufleet-scheduler-cert-1", "/b.crt"),
    ]
    with pytest.raises(sc.SchedulerError, match="expected an absolute path"):
        sc.config_files(_config(clientConnection={"kubeconfig": "scheduler.conf"}))
    with pytest.raises(sc.SchedulerError, match="not a KubeSchedulerConfiguration"):
        sc.config_document("kind: Pod\n")


def test_the_backup_that_parses_to_the_restored_manifest_is_written_back(tmp_path: Path) -> None:
    text, doc = _original()
    (tmp_path / "kube-scheduler.yaml.20261128T100000.000001").write_text(text)
    (tmp_path / "kube-scheduler.yaml.20261128T110000.000001").write_text(sc.dump_manifest(
        sc.with_config(doc, CONFIG, "h", config=_config())))  # fmt: skip
    (tmp_path / "other.yaml.20261128T120000.000001").write_text(text)
    assert sc.original_text(doc, str(tmp_path), "kube-scheduler.yaml") == text
    changed = dict(doc, metadata={**doc["metadata"], "labels": {"x": "y"}})
    assert sc.original_text(changed, str(tmp_path), "kube-scheduler.yaml") is None
    assert sc.original_text(doc, str(tmp_path / "none"), "kube-scheduler.yaml") is None


def _cri_log(path: Path, stamp: str, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{stamp} stderr F {line}\n" for line in lines))


def test_a_scheduler_that_exited_is_found_in_the_kubelet_s_logs_once_restarted(tmp_path: Path) -> None:
    since = datetime.datetime(2026, 11, 18, 8, 26, 40, tzinfo=datetime.UTC).timestamp()
    said = [
        'I1128 20:01:02.000000       1 serving.go:411] Generated self-signed cert in-memory',
        'E1128 20:01:02.500000       1 run.go:72] "command failed" err="strict decoding error: unknown field'
        ' \\"bogus\\""',
    ]  # fmt: skip
    old = tmp_path / "kube-system_kube-scheduler-cp_aaa" / "kube-scheduler"
    _cri_log(old / "0.log", "2026-11-18T08:00:00.123456789Z", ["E1128 old error"])
    _cri_log(old / "1.log", "2026-11-18T08:10:00Z", ["E1128 old error again"])
    new = tmp_path / "kube-system_kube-scheduler-cp_bbb" / "kube-scheduler"
    _cri_log(new / "0.log", "2026-11-18T08:26:41.987654321Z", said)
    assert sc.crashed_scheduler(since, str(tmp_path)) is None, "one run only: it may still be starting"
    _cri_log(new / "1.log", "2026-11-18T08:26:52Z", said)
    assert sc.crashed_scheduler(since, str(tmp_path)) == said[1]
    assert sc.crashed_scheduler(since + 3600, str(tmp_path)) is None, "logs of runs before the change"


class FakeRun:
    """AnsibleModule.run_command for validate_with_image: ``ctr images mount`` lays out a root filesystem
    with an executable kube-scheduler; the binary "refuses" configurations containing ``bogus``."""

    def __init__(self, refuse: bool = False, mount_rc: int = 0) -> None:
        self.calls: list[list[str]] = []
        self.refuse, self.mount_rc = refuse, mount_rc

    def __call__(self, argv: list[str]) -> tuple[int, str, str]:
        self.calls.append(list(argv))
        if argv[:4] == ["ctr", "--namespace", "k8s.io", "images"] and argv[4] == "mount":
            if self.mount_rc:
                return self.mount_rc, "", 'ctr: image "x": not found'
            binary = Path(argv[6]) / "usr/local/bin/kube-scheduler"
            binary.parent.mkdir(parents=True)
            binary.write_text("#!/bin/sh\n")
            binary.chmod(0o755)
            return 0, "", ""
        if argv[:5] == ["ctr", "--namespace", "k8s.io", "images", "unmount"]:
            return 0, "", ""
        config = next(a.split("=", 1)[1] for a in argv if a.startswith("--config="))
        if "bogus" in Path(config).read_text():
            err = 'I1128 ok\nE1128 20:01:02.5 1 run.go:72] "command failed" err="strict decoding error: '
            return 1, "", err + 'unknown field \\"extenders[0].bogus\\""'
        Path(next(a.split("=", 1)[1] for a in argv if a.startswith("--write-config-to="))).write_text("{}")
        return 0, "", ""


@pytest.fixture
def ctr_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake = tmp_path / "bin" / "ctr"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:{os.environ['PATH']}")


def test_validation_runs_the_image_s_binary_with_the_manifest_s_flags(ctr_on_path: None) -> None:
    _text, doc = _original()
    merged = sc.with_config(doc, CONFIG, "h", config=_config())
    run = FakeRun()
    checked = sc.validate_with_image(run, merged, yaml.safe_dump(_config()))
    assert checked.ran and checked.image == "registry.k8s.io/kube-scheduler:v1.37.2"
    mount, scheduler, unmount = run.calls
    assert mount[:6] == [
        "ctr",
        "--namespace",
        "k8s.io",
        "images",
        "mount",
        "registry.k8s.io/kube-scheduler:v1.37.2",
    ]
    assert (
        unmount[:6] == ["ctr", "--namespace", "k8s.io", "images", "unmount", "--rm"]
        and unmount[6] == mount[6]
    )
    assert scheduler[:3] == ["timeout", "60", mount[6] + "/usr/local/bin/kube-scheduler"]
    flags = scheduler[3:]
    assert flags[:5] == _command(doc)[1:], "kubeadm's flags, as the static pod runs them"
    assert [f for f in flags if f.startswith("--config=")] != [f"--config={CONFIG}"], (
        "the candidate, not the file"
    )
    assert flags[-2:] == ["--secure-port=0", flags[-1]] and flags[-1].startswith("--write-config-to=")
    assert not Path(mount[6]).exists(), "the scratch directory is removed"


def test_validation_fails_with_the_scheduler_s_own_error(ctr_on_path: None) -> None:
    _text, doc = _original()
    with pytest.raises(sc.SchedulerError) as err:
        sc.validate_with_image(FakeRun(), doc, "kind: KubeSchedulerConfiguration\nbogus: 1\n")
    assert "refuses the configuration (exit 1); nothing was changed:\nE1128" in str(err.value)
    assert 'unknown field \\"extenders[0].bogus\\"' in str(err.value)


def test_validation_is_skipped_with_a_reason_where_it_cannot_run(
    ctr_on_path: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    _text, doc = _original()
    checked = sc.validate_with_image(FakeRun(mount_rc=1), doc, "kind: KubeSchedulerConfiguration\n")
    assert not checked.ran and "ctr cannot mount registry.k8s.io/kube-scheduler:v1.37.2" in checked.reason
    monkeypatch.setenv("PATH", "/nonexistent")
    checked = sc.validate_with_image(FakeRun(), doc, "kind: KubeSchedulerConfiguration\n")
    assert not checked.ran and checked.reason == "ctr is not installed (containerd's client)"
