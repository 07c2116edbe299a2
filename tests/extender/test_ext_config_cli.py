"""Settings precedence, scheduler-config generation per API version, the CLI, and the shipped examples."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpufleet.extender.cli import main
from gpufleet.extender.request import Policy
from gpufleet.extender.schedconfig import (
    SchedulerConfigError,
    SchedulerConfigOptions,
    render,
    scheduler_config,
)
from gpufleet.extender.settings import Settings, SettingsError, load_settings

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "extender"


def test_settings_precedence_is_defaults_file_env_flags(tmp_path: Path) -> None:
    config = tmp_path / "extender.yaml"
    config.write_text("version: v1\nport: 9000\nnode_policy: spread\nlock_ttl: 30\nurl_prefix: /x/\n")
    env = {"GPUFLEET_EXTENDER_PORT": "9100", "GPUFLEET_EXTENDER_GPU_POLICY": "spread", "HOME": "/root"}
    s = load_settings(str(config), env=env, flags={"port": "9200", "lock_ttl": None})
    assert (s.port, s.node_policy, s.gpu_policy, s.lock_ttl, s.url_prefix) == (
        9200,
        Policy.SPREAD,
        Policy.SPREAD,
        30.0,
        "/x",
    )
    assert load_settings(env={}) == Settings()


@pytest.mark.parametrize(
    ("text", "env", "flags", "message"),
    [
        ("version: v2\n", {}, {}, "version"),
        ("colour: blue\n", {}, {}, "unknown setting"),
        ("port: many\n", {}, {}, "port"),
        ("- a\n", {}, {}, "mapping"),
        ("", {"GPUFLEET_EXTENDER_NOPE": "1"}, {}, "names no setting"),
        ("", {}, {"node_policy": "random"}, "node_policy"),
        ("", {}, {"tls_cert_file": "/nonexistent.crt", "tls_key_file": "/nonexistent.key"}, "does not exist"),
        ("", {}, {"tls_cert_file": "x"}, "go together"),
        ("", {}, {"port": 70000}, "out of range"),
        ("", {}, {"url_prefix": "gpufleet"}, "start with"),
        ("", {}, {"log_format": "xml"}, "log_format"),
        ("", {}, {"lock_ttl": 0}, "positive"),
    ],
)
def test_bad_settings_are_refused_with_the_setting_named(
    tmp_path: Path, text: str, env: dict, flags: dict, message: str
) -> None:
    config = tmp_path / "extender.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError, match=message):
        load_settings(str(config), env=env, flags=flags)


def _extender(doc: dict) -> dict:
    [extender] = doc["extenders"]
    return extender


def test_v1_scheduler_config_with_https_and_client_certificate() -> None:
    doc = scheduler_config(
        SchedulerConfigOptions(
            url="https://127.0.0.1:32766/gpufleet/",
            ca_file="/ca.crt",
            cert_file="/c.crt",
            key_file="/c.key",
            server_name="gpufleet-extender.gpufleet-system.svc",
            weight=3,
            http_timeout="5s",
        )
    )
    assert (
        doc["apiVersion"] == "kubescheduler.config.k8s.io/v1" and doc["kind"] == "KubeSchedulerConfiguration"
    )
    ext = _extender(doc)
    assert ext["urlPrefix"] == "https://127.0.0.1:32766/gpufleet"
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == ("filter", "prioritize", "bind")
    assert ext["enableHTTPS"] is True and ext["weight"] == 3 and ext["httpTimeout"] == "5s"
    assert ext["tlsConfig"] == {
        "serverName": "gpufleet-extender.gpufleet-system.svc",
        "caFile": "/ca.crt",
        "certFile": "/c.crt",
        "keyFile": "/c.key",
    }
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is False
    assert ext["managedResources"] == [
        {"name": "gpufleet.io/gpu-mem", "ignoredByScheduler": True},
        {"name": "nvidia.com/gpu", "ignoredByScheduler": False},
    ]
    assert "healthzBindAddress" not in doc


def test_v1beta1_scheduler_config_for_the_120_cluster() -> None:
    text = render(
        SchedulerConfigOptions(
            url="http://127.0.0.1:18888/gpufleet",
            api_version="v1beta1",
            node_cache_capable=False,
            ignorable=True,
            bind=False,
            manage_whole_gpus=False,
            healthz_bind_address="127.0.0.1:20251",
            metrics_bind_address="127.0.0.1:20251",
            leader_elect=False,
            kubeconfig="/run/s.kubeconfig",
        )
    )
    doc = yaml.safe_load(text)
    assert doc["apiVersion"] == "kubescheduler.config.k8s.io/v1beta1"
    assert doc["healthzBindAddress"] == doc["metricsBindAddress"] == "127.0.0.1:20251"
    assert doc["leaderElection"] == {"leaderElect": False}
    assert doc["clientConnection"] == {"kubeconfig": "/run/s.kubeconfig"}
    ext = _extender(doc)
    assert ext["enableHTTPS"] is False and "tlsConfig" not in ext and "bindVerb" not in ext
    assert ext["nodeCacheCapable"] is False and ext["ignorable"] is True
    assert ext["managedResources"] == [{"name": "gpufleet.io/gpu-mem", "ignoredByScheduler": True}]


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        ({"url": "ftp://x/y"}, "http"),
        ({"url": "http://x:1/p", "ca_file": "/ca"}, "https"),
        ({"url": "https://x:1/p", "cert_file": "/c"}, "together"),
        ({"url": "https://x:1/p", "weight": 0}, "weight"),
        ({"url": "https://x:1/p", "http_timeout": "10"}, "duration"),
        ({"url": "https://x:1/p", "healthz_bind_address": "127.0.0.1:1"}, "v1beta1"),
        ({"url": "https://x:1/p", "api_version": "v1alpha1"}, "api version"),
    ],
)
def test_inconsistent_scheduler_config_options_are_refused(opts: dict, message: str) -> None:
    with pytest.raises(SchedulerConfigError, match=message):
        scheduler_config(SchedulerConfigOptions(**opts))


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        (
            "scheduler-config-v1.yaml",
            [
                "--url",
                "https://127.0.0.1:32766/gpufleet",
                "--server-name",
                "gpufleet-extender.gpufleet-system.svc",
                "--ca-file",
                "/etc/kubernetes/gpufleet/ca.crt",
                "--cert-file",
                "/etc/kubernetes/gpufleet/scheduler.crt",
                "--key-file",
                "/etc/kubernetes/gpufleet/scheduler.key",
                "--kubeconfig",
                "/etc/kubernetes/scheduler.conf",
                "--leader-elect",
            ],
        ),
        (
            "scheduler-config-v1beta1.yaml",
            [
                "--api-version",
                "v1beta1",
                "--url",
                "http://127.0.0.1:18888/gpufleet",
                "--kubeconfig",
                "/var/lib/gpufleet-lab/run/scheduler.kubeconfig",
                "--no-leader-elect",
                "--healthz-bind-address",
                "127.0.0.1:20251",
                "--metrics-bind-address",
                "127.0.0.1:20251",
            ],
        ),
    ],
)
def test_shipped_scheduler_config_examples_match_the_generator(
    name: str, argv: list[str], tmp_path: Path
) -> None:
    out = tmp_path / name
    assert main(["scheduler-config", *argv, "-o", str(out)]) == 0
    assert yaml.safe_load(out.read_text()) == yaml.safe_load((DEPLOY / name).read_text())


def test_deploy_manifests_are_valid_yaml_with_the_rbac_the_binder_needs() -> None:
    docs = [d for f in sorted(DEPLOY.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    role = next(d for d in docs if d["kind"] == "ClusterRole")
    rules = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert {("nodes", "watch"), ("nodes", "patch"), ("pods", "patch"), ("pods/binding", "create")} <= rules
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    command = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:2] == ["gpufleet-extender", "serve"]
    config = next(d for d in docs if d["kind"] == "ConfigMap")
    settings = yaml.safe_load(config["data"]["extender.yaml"])
    assert settings.pop("version") == "v1" and set(settings) <= set(Settings.__dataclass_fields__)


def test_cli_scheduler_config_to_stdout_and_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["scheduler-config", "--url", "http://127.0.0.1:8800/gpufleet", "--weight", "2"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["extenders"][0]["weight"] == 2
    assert main(["scheduler-config", "--url", "http://x/p", "--insecure"]) == 2
    assert "https" in capsys.readouterr().err
    assert main(["version"]) == 0 and "gpufleet-extender" in capsys.readouterr().out
    assert main([]) == 2


def test_serve_refuses_bad_settings_before_touching_the_cluster(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--port", "-1"]) == 2
    assert "port" in capsys.readouterr().err


def test_python_dash_m_entry_point() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gpufleet.extender", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0 and "scheduler-config" in result.stdout
