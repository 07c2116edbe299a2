"""Configuration: precedence flags > env > file > defaults, and validation errors that name the culprit."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from dp_helpers import make_inventory

from gpufleet.deviceplugin import config as configuration
from gpufleet.deviceplugin.api import DEFAULT_SOCKET_DIR
from gpufleet.deviceplugin.config import ConfigError
from gpufleet.deviceplugin.rm.devices import ResourceKind, build_devices


def args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    configuration.add_flags(parser)
    return parser.parse_args(list(argv))


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def test_defaults() -> None:
    cfg = configuration.build(args(), environ={})
    assert cfg.socket_dir == DEFAULT_SOCKET_DIR
    assert cfg.resource_name == "nvidia.com/gpu"
    assert cfg.health_ignored_xids == (13, 31, 43, 45, 68, 109)
    assert cfg.nvml_on_init_failure == "retry"
    assert [(r.name, r.kind) for r in cfg.resources()] == [("nvidia.com/gpu", ResourceKind.GPU)]


def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
version: v1
socket_dir: /file/dir
health:
  probe_interval: 7
  ignored_xids: [13]
log: {level: debug}
""",
    )
    env = {"GPUFLEET_DP_SOCKET_DIR": "/env/dir", "GPUFLEET_DP_HEALTH_PROBE_INTERVAL": "3"}
    cfg = configuration.build(args("--config", path, "--socket-dir", "/flag/dir"), environ=env)
    assert cfg.socket_dir == "/flag/dir"  # flag over env and file
    assert cfg.health_probe_interval == 3.0  # env over file
    assert cfg.health_ignored_xids == (13,)  # file over default
    assert cfg.log_level == "debug"
    assert cfg.http_port == 0  # default
    assert cfg.source["socket_dir"] == "flag" and cfg.source["health.probe_interval"] == "env"


def test_config_path_from_env_and_aliases(tmp_path: Path) -> None:
    path = write(tmp_path, "version: v1\nsharing: {mode: time-slicing, time_slicing: {replicas: 4}}\n")
    cfg = configuration.build(
        args(), environ={"GPUFLEET_DP_CONFIG": path, "NODE_NAME": "n7", "GPUFLEET_HOST_ROOT": "/sim/host"}
    )
    assert cfg.node_name == "n7" and cfg.host_root == "/sim/host"
    [spec] = cfg.resources()
    assert (spec.name, spec.kind, spec.replicas) == ("nvidia.com/gpu", ResourceKind.REPLICA, 4)


def test_ignored_xids_from_a_flag() -> None:
    assert configuration.build(
        args("--health-ignored-xids", "13, 43,31"), environ={}
    ).health_ignored_xids == (
        13,
        31,
        43,
    )


def test_every_problem_is_reported_with_its_source(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
version: v1
health: {probe_interval: -1, bogus: 1}
sharing: {mode: sideways}
""",
    )
    with pytest.raises(ConfigError) as err:
        configuration.build(args("--config", path), environ={})
    assert f"{path}: health.bogus: unknown setting" in str(err.value)
    with pytest.raises(ConfigError) as err:
        configuration.build(
            args("--http-port", "99999"),
            environ={"GPUFLEET_DP_LOG_LEVEL": "loud"},
            file_values={"health.probe_interval": -1, "sharing.mode": "sideways"},
        )
    text = str(err.value)
    assert "health.probe_interval: expected a number > 0, got -1" in text
    assert "sharing.mode: expected one of none, time-slicing, memory, got 'sideways'" in text
    assert "env GPUFLEET_DP_LOG_LEVEL: expected one of debug, info, warning, error, got 'loud'" in text
    assert "--http-port: expected an integer in [0, 65535], got 99999" in text


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("socket_dir: /x\n", "version: expected 'v1', got None"),
        ("version: v2\n", "version: expected 'v1', got 'v2'"),
        ("version: v1\n- a list\n", "not valid YAML"),
        ("[1, 2]\n", "expected a mapping at the top level"),
        ("version: v1\nresource_name: gpu\n", "expected an extended resource name"),
        ("version: v1\nsocket_dir: relative/dir\n", "expected an absolute path"),
        ("version: v1\nallocate: {driver_mounts: [{path: /x}]}\n", "allocate.driver_mounts: item 0"),
    ],
)
def test_bad_files_are_refused(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        configuration.build(args("--config", write(tmp_path, text)), environ={})


def test_missing_file_is_refused() -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        configuration.build(args("--config", "/nonexistent/config.yaml"), environ={})


def test_cross_checks() -> None:
    with pytest.raises(ConfigError, match=r"node_name: required with sharing\.mode memory"):
        configuration.build(args("--sharing-mode", "memory"), environ={})
    with pytest.raises(ConfigError, match=r"rename: only valid with sharing\.mode time-slicing"):
        configuration.build(args("--sharing-time-slicing-rename", "nvidia.com/shared"), environ={})
    with pytest.raises(ConfigError, match=r"mps: only valid with sharing\.mode memory"):
        configuration.build(args("--sharing-memory-mps", "true"), environ={})


def test_memory_mode_advertises_only_gpu_memory() -> None:
    cfg = configuration.build(args("--sharing-mode", "memory", "--node-name", "n1"), environ={})
    assert [(r.name, r.kind) for r in cfg.resources()] == [("gpufleet.io/gpu-mem", ResourceKind.MEMORY)]


def test_driver_mounts_from_file(tmp_path: Path) -> None:
    path = write(tmp_path, "version: v1\nallocate:\n  driver_mounts:\n    - {host_path: /usr/lib/nvidia}\n")
    [mount] = configuration.build(args("--config", path), environ={}).allocate_driver_mounts
    assert (mount.host_path, mount.container_path, mount.read_only) == (
        "/usr/lib/nvidia",
        "/usr/lib/nvidia",
        True,
    )


def test_main_exits_2_with_the_errors_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    from gpufleet.deviceplugin.app import main

    assert main(["--health-probe-interval", "soon"]) == 2
    assert "--health-probe-interval: expected a number > 0, got 'soon'" in capsys.readouterr().err


def test_example_config_in_deploy_is_valid() -> None:
    example = Path(__file__).resolve().parents[2] / "deploy" / "deviceplugin" / "config.example.yaml"
    cfg = configuration.build(args("--config", str(example)), environ={})
    assert cfg.sharing_mode == "none"
    named = example.with_name("config.named.example.yaml")
    cfg = configuration.build(args("--config", str(named)), environ={"NODE_NAME": "n1"})
    assert {name: c.sharing_mode for name, c in cfg.named.items()} == {
        "training": "none", "inference-sliced": "time-slicing", "inference-memory": "memory"}  # fmt: skip
    assert cfg.config_name == "training" and cfg.config_label == "nvidia.com/device-plugin.config"


def test_daemonset_configmap_configs_are_valid(tmp_path: Path) -> None:
    import yaml

    manifest = Path(__file__).resolve().parents[2] / "deploy" / "deviceplugin" / "daemonset.yaml"
    [configmap] = [d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "ConfigMap"]
    modes = {}
    for name, text in configmap["data"].items():
        cfg = configuration.build(args("--config", write(tmp_path, text)), environ={"NODE_NAME": "n1"})
        modes[name] = cfg.sharing_mode
    assert modes == {"whole.yaml": "none", "memory.yaml": "memory"}


# ----- a config file's text checked without the file (the gpu_device_plugin module's check) --------------
NAMED_TEXT = """\
version: v1
http: {port: 9402}
configs:
  default: whole
  named:
    whole: {}
    sliced: {sharing: {mode: time-slicing, time_slicing: {replicas: 4, rename: nvidia.com/gpu.shared}}}
    memory: {sharing: {mode: memory}}
    mixed: {mig: {strategy: mixed}}
"""


def test_text_gives_the_config_its_file_gives(tmp_path: Path) -> None:
    env = {"NODE_NAME": "n1"}
    from_file = configuration.build(args("--config", write(tmp_path, NAMED_TEXT)), environ=env)
    from_text = configuration.from_text(NAMED_TEXT, "plugin_config", env)
    assert from_text == from_file and from_text.named == from_file.named
    assert from_text.source["http.port"] == "file" and from_text.config_name == "whole"
    assert configuration.from_text("version: v1\n", "x") == configuration.build(environ={})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("version: v1\nhealth: {bogus: 1}\n", "plugin_config: health.bogus: unknown setting"),
        ("version: v1\nlog: {level: loud}\n", "plugin_config: log.level: expected one of debug"),
        ("version: v1\n- a list\n", "plugin_config: not valid YAML"),
        ("version: v1\n# " + "x" * configuration.MAX_CONFIG_BYTES, "plugin_config: larger than 16384 bytes"),
        ("version: v1\nconfigs: {default: c, named: {a: {}}}\n", "plugin_config: configs.default: expected"),
        ("version: v1\nsharing: {mode: memory}\n", "node_name: required with sharing.mode memory"),
    ],
)
def test_text_is_refused_as_its_file_would_be_naming_where_it_came_from(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        configuration.from_text(text, "plugin_config")
    assert message in str(err.value)


def test_what_each_named_configuration_advertises_is_what_its_devices_come_to() -> None:
    """Config.advertised: the resource and devices per GPU, known without NVML, agree with the devices the
    plugin builds for 4 GPUs of 16 GiB; None where the GPUs decide (GiB of memory, the MIG layout)."""
    cfg = configuration.from_text(NAMED_TEXT, "plugin_config", {"NODE_NAME": "n1"})
    inventory = make_inventory(4, 16)
    seen = {}
    for name, named in cfg.named.items():
        advertised = named.advertised()
        first = named.resources(inventory)[0]
        devices = build_devices(first, inventory, {})
        assert advertised.resource == first.name, name
        if advertised.per_gpu is not None:
            assert len(devices) == 4 * advertised.per_gpu, name
        seen[name] = (advertised.resource, advertised.per_gpu, len(devices))
    assert seen == {
        "whole": ("nvidia.com/gpu", 1, 4),
        "sliced": ("nvidia.com/gpu.shared", 4, 16),
        "memory": ("gpufleet.io/gpu-mem", None, 64),  # one per GiB
        "mixed": ("nvidia.com/gpu", None, 4),  # no GPU in MIG mode here; with some, fewer whole GPUs
    }
    single = configuration.build(environ={}, file_values={"mig.strategy": "single"}).advertised()
    assert (single.resource, single.per_gpu) == ("nvidia.com/gpu", None)
    assert cfg.running_label == "gpufleet.io/device-plugin.config"
