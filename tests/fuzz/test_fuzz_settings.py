"""Hostile settings for the device plugin (file < env < flags) and the extender: hostile YAML (alias bombs,
deep nesting, huge files, wrong types) ends in the loader's own error, quickly."""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from budget import FUZZ, outcome, worst_case
from hypothesis import given
from hypothesis import strategies as st
from strategies import JSON_VALUES, LAUGHS, MAPPING_LAUGHS, SCALARS

from gpufleet.deviceplugin import config as dpconfig
from gpufleet.extender import settings as extsettings

DP_CONFIG = dpconfig.ConfigError
EXT_CONFIG = extsettings.SettingsError
EXT_NAMES = [f.name for f in extsettings.fields(extsettings.Settings)]


@pytest.fixture(scope="module")
def scratch() -> Iterator[Path]:
    """A directory for config files, one per module: hypothesis runs many examples per test function."""
    with tempfile.TemporaryDirectory(prefix="gpufleet-fuzz-") as path:
        yield Path(path)


def dp_load(path: Path, text: str | bytes) -> Any:
    """The device plugin's Config from a file holding `text`, or its ConfigError."""
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return outcome((DP_CONFIG,), dpconfig.build, None, {dpconfig.CONFIG_ENV: str(path), "NODE_NAME": "n"})


def ext_load(path: Path, text: str | bytes) -> Any:
    """The extender's Settings from a file holding `text`, or its SettingsError."""
    path.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"))
    return outcome((EXT_CONFIG,), extsettings.load_settings, str(path), {})


# ----- strategies ---------------------------------------------------------------------------------------


def _nest(name: str, value: Any) -> dict[str, Any]:
    head, _, rest = name.partition(".")
    return {head: _nest(rest, value) if rest else value}


def _merge(docs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"version": "v1"}
    for doc in docs:
        for key, value in doc.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = _merge([out[key], value])
                out[key].pop("version")
            else:
                out[key] = value
    return out


DP_SETTING_VALUES = st.one_of(
    SCALARS, st.sampled_from(["true", "info", "/x", "9", "0.5", "a.b/c"]), st.lists(SCALARS, max_size=3)
)
DP_DOCS = st.lists(
    st.builds(
        _nest,
        st.one_of(st.sampled_from([s.name for s in dpconfig.SETTINGS]), st.text(max_size=12)),
        DP_SETTING_VALUES,
    ),
    max_size=6,
).map(_merge)
YAML_TEXT = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.sampled_from("&*[]{}:,-!|>'\"#%@` \n\tabv1.0"), max_size=300),
)


# ----- properties: device plugin ------------------------------------------------------------------------


@FUZZ
@given(DP_DOCS)
def test_device_plugin_config_file_loads_or_raises_config_error(scratch: Path, doc: dict[str, Any]) -> None:
    result = dp_load(scratch / "dp.yaml", yaml.safe_dump(doc))
    if isinstance(result, dpconfig.Config):
        assert all(
            0 < x <= dpconfig.MAX_INTERVAL_S
            for x in (result.nvml_retry_interval, result.health_probe_interval)
        )
        assert 1 <= result.sharing_time_slicing_replicas <= 1024


@FUZZ
@given(YAML_TEXT)
def test_device_plugin_config_file_of_any_text_loads_or_raises_config_error(scratch: Path, text: str) -> None:
    dp_load(scratch / "dp-text.yaml", text)


@FUZZ
@given(st.sampled_from(dpconfig.SETTINGS), st.one_of(JSON_VALUES, st.text()))
def test_every_device_plugin_setting_parses_or_raises_value_error(
    setting: dpconfig.Setting, raw: Any
) -> None:
    outcome((ValueError,), setting.parse, raw)


@FUZZ
@given(st.dictionaries(st.sampled_from([s.env for s in dpconfig.SETTINGS]), st.text(min_size=1), max_size=5))
def test_device_plugin_environment_parses_or_raises_config_error(environ: dict[str, str]) -> None:
    outcome((DP_CONFIG,), dpconfig.build, None, {"NODE_NAME": "n", **environ})


@FUZZ
@given(st.lists(st.tuples(st.sampled_from([s for s in dpconfig.SETTINGS if s.flag_ok]), st.text(min_size=1))))
def test_device_plugin_flags_parse_or_raise_config_error(flags: list[tuple[dpconfig.Setting, str]]) -> None:
    argv = [part for s, value in flags for part in (s.flag, value) if not value.startswith("-")]
    outcome((DP_CONFIG,), dpconfig.parse, argv, {"NODE_NAME": "n"})


# ----- properties: extender -----------------------------------------------------------------------------

EXT_VALUES = st.one_of(
    SCALARS, st.sampled_from(["spread", "json", "/p", "9", "0.5"]), st.lists(SCALARS, max_size=3)
)
EXT_DOCS = st.dictionaries(st.one_of(st.sampled_from(EXT_NAMES), st.text(max_size=8)), EXT_VALUES, max_size=6)


@FUZZ
@given(EXT_DOCS)
def test_extender_settings_file_loads_or_raises_settings_error(scratch: Path, doc: dict[str, Any]) -> None:
    result = ext_load(scratch / "ext.yaml", yaml.safe_dump(doc))
    if isinstance(result, extsettings.Settings):
        for name in (
            "lock_ttl",
            "reservation_ttl",
            "bind_wait",
            "lock_wait",
            "api_timeout",
            "sweep_interval",
        ):
            assert math.isfinite(getattr(result, name)) and getattr(result, name) <= extsettings.MAX_SECONDS
        assert 0 < result.max_body_mib <= extsettings.MAX_BODY_MIB


@FUZZ
@given(YAML_TEXT)
def test_extender_settings_file_of_any_text_loads_or_raises_settings_error(scratch: Path, text: str) -> None:
    ext_load(scratch / "ext-text.yaml", text)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from([extsettings.ENV_PREFIX + n.upper() for n in EXT_NAMES if not n.startswith("tls")]),
        st.text(),
        max_size=4,
    ),
    st.dictionaries(st.sampled_from([n for n in EXT_NAMES if not n.startswith("tls")]), SCALARS, max_size=4),
)
def test_extender_environment_and_flags_parse_or_raise_settings_error(
    env: dict[str, str], flags: dict[str, Any]
) -> None:
    outcome((EXT_CONFIG,), extsettings.load_settings, None, env, flags)


# ----- worst cases --------------------------------------------------------------------------------------

DIGITS = "9" * 1_000_000
DP_WORST = {
    "list bomb as a setting": f"version: v1\n{LAUGHS}health:\n  ignored_xids: *l8\n",
    "list bomb as the version": f"{LAUGHS}version: *l8\n",
    "mapping bomb under an unknown key": f"version: v1\n{MAPPING_LAUGHS}",
    "mapping bomb under a section": f"version: v1\n{MAPPING_LAUGHS}health: *m8\n",
    "mapping bomb as mounts": f"version: v1\n{MAPPING_LAUGHS}allocate:\n  driver_mounts: [*m8]\n",
    "deep nesting": "version: v1\nhealth: " + "[" * 100_000,
    "deep block nesting": "".join(" " * i + "- \n" for i in range(20_000)),
    "megabyte file": "version: v1\nnode_name: " + "x" * (1 << 20),
}
EXT_WORST = {
    "list bomb as a setting": f"{LAUGHS}port: *l8\n",
    "list bomb as the version": f"{LAUGHS}version: *l8\n",
    "mapping bomb as a setting": f"{MAPPING_LAUGHS}url_prefix: *m8\n",
    "deep nesting": "port: " + "{a: " * 100_000,
    "megabyte file": "url_prefix: /" + "x" * (1 << 20),
}


@pytest.mark.parametrize("name", sorted(DP_WORST))
def test_device_plugin_worst_case_files_cost_a_bounded_time(scratch: Path, name: str) -> None:
    (scratch / "worst.yaml").write_text(DP_WORST[name])
    env = {dpconfig.CONFIG_ENV: str(scratch / "worst.yaml"), "NODE_NAME": "n"}
    result = worst_case((DP_CONFIG,), dpconfig.build, None, env)
    assert isinstance(result, DP_CONFIG)


@pytest.mark.parametrize("name", sorted(EXT_WORST))
def test_extender_worst_case_files_cost_a_bounded_time(scratch: Path, name: str) -> None:
    (scratch / "worst.yaml").write_text(EXT_WORST[name])
    result = worst_case((EXT_CONFIG,), extsettings.load_settings, str(scratch / "worst.yaml"), {})
    assert isinstance(result, EXT_CONFIG)


@pytest.mark.parametrize(
    "setting", ["SHARING_TIME_SLICING_REPLICAS", "HEALTH_PROBE_INTERVAL", "HEALTH_IGNORED_XIDS"]
)
def test_device_plugin_million_digit_environment_values_cost_a_bounded_time(setting: str) -> None:
    env = {dpconfig.ENV_PREFIX + setting: DIGITS, "NODE_NAME": "n"}
    assert isinstance(worst_case((DP_CONFIG,), dpconfig.build, None, env), DP_CONFIG)


@pytest.mark.parametrize("setting", ["PORT", "LOCK_TTL", "MAX_BODY_MIB"])
def test_extender_million_digit_environment_values_cost_a_bounded_time(setting: str) -> None:
    env = {extsettings.ENV_PREFIX + setting: DIGITS}
    assert isinstance(worst_case((EXT_CONFIG,), extsettings.load_settings, None, env), EXT_CONFIG)


def test_largest_config_files_under_the_caps_load_within_budget(scratch: Path) -> None:
    xids = "1," * (dpconfig.MAX_CONFIG_BYTES // 2 - 40)
    (scratch / "dp-big.yaml").write_text(f"version: v1\nhealth:\n  ignored_xids: [{xids}1]\n")
    assert len((scratch / "dp-big.yaml").read_bytes()) <= dpconfig.MAX_CONFIG_BYTES
    cfg = worst_case((), dpconfig.load_file, scratch / "dp-big.yaml")
    assert cfg["health.ignored_xids"][:2] == [1, 1]
    ports = "1," * (extsettings.MAX_SETTINGS_BYTES // 2 - 20)
    (scratch / "ext-big.yaml").write_text(f"port: [{ports}1]\n")
    assert len((scratch / "ext-big.yaml").read_bytes()) <= extsettings.MAX_SETTINGS_BYTES
    result = worst_case((EXT_CONFIG,), extsettings.load_settings, str(scratch / "ext-big.yaml"), {})
    assert isinstance(result, EXT_CONFIG) and "port" in str(result)


def test_endless_config_file_is_read_only_up_to_the_cap() -> None:
    # /dev/zero never ends: reading it whole would never return.
    assert isinstance(worst_case((DP_CONFIG,), dpconfig.load_file, "/dev/zero"), DP_CONFIG)
    assert isinstance(worst_case((EXT_CONFIG,), extsettings.load_settings, "/dev/zero", {}), EXT_CONFIG)


# ----- regressions --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sharing:\n  mode: time-slicing\n  time_slicing:\n    replicas: .inf\n", "integer"),
        ("sharing:\n  mode: time-slicing\n  time_slicing:\n    replicas: 2.5\n", "integer"),
        ("health:\n  probe_interval: .inf\n", "at most"),
        ("health:\n  probe_interval: .nan\n", "number > 0"),
        ("nvml:\n  retry_interval: 1e300\n", "at most"),
        ("nvml:\n  retry_interval: 1" + "0" * 400 + "\n", "at most"),
        ("health:\n  ignored_xids: [[1]]\n", "integer"),
        ("labels:\n  prefix: Not A Domain\n", "DNS subdomain"),
        ('socket_dir: "/run/\\0x"\n', "absolute path"),
    ],
)
def test_device_plugin_refuses_non_finite_fractional_and_malformed_values(
    scratch: Path, text: str, message: str
) -> None:
    result = dp_load(scratch / "regression.yaml", "version: v1\n" + text)
    assert isinstance(result, DP_CONFIG) and message in str(result)


# Both loaders read files through gpufleet.yamlfile; each must turn its failures into its own error.
LOADERS = [(dp_load, DP_CONFIG, "version: v1\nhttp:\n  port: "), (ext_load, EXT_CONFIG, "port: ")]


@pytest.mark.parametrize(("load", "error", "head"), LOADERS, ids=["device-plugin", "extender"])
def test_an_integer_past_pythons_digit_limit_is_the_loaders_error(
    scratch: Path, load: Any, error: type[Exception], head: str
) -> None:
    result = load(scratch / "digits.yaml", head + "9" * 5000 + "\n")
    assert isinstance(result, error) and "not valid YAML" in str(result)


@pytest.mark.parametrize(("load", "error", "head"), LOADERS, ids=["device-plugin", "extender"])
def test_a_file_that_is_not_utf8_is_the_loaders_error(
    scratch: Path, load: Any, error: type[Exception], head: str
) -> None:
    result = load(scratch / "latin1.yaml", head.encode() + b"caf\xe9\n")
    assert isinstance(result, error) and "not valid YAML" in str(result)


def test_device_plugin_alias_bomb_error_message_stays_short(scratch: Path) -> None:
    result = dp_load(scratch / "bomb.yaml", f"version: v1\n{LAUGHS}health:\n  ignored_xids: *l8\n")
    assert isinstance(result, DP_CONFIG) and len(str(result)) < 10_000


def test_device_plugin_config_path_with_a_nul_byte_is_a_config_error() -> None:
    with pytest.raises(DP_CONFIG, match="cannot read"):
        dpconfig.load_file("/etc/gpufleet\0/config.yaml")


def test_device_plugin_integers_and_intervals_still_read_from_text() -> None:
    cfg = dpconfig.build(
        None,
        {
            "NODE_NAME": "n",
            "GPUFLEET_DP_SHARING_MODE": "time-slicing",
            "GPUFLEET_DP_SHARING_TIME_SLICING_REPLICAS": " 4 ",
            "GPUFLEET_DP_HEALTH_PROBE_INTERVAL": "0.25",
            "GPUFLEET_DP_HTTP_PORT": "9400",
        },
    )
    assert (cfg.sharing_time_slicing_replicas, cfg.health_probe_interval, cfg.http_port) == (4, 0.25, 9400)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("port: [8800]\n", "port"),
        ("port: .inf\n", "port"),
        ("port: 8800.5\n", "port"),
        ("lock_ttl: .nan\n", "lock_ttl"),
        ("lock_ttl: .inf\n", "lock_ttl"),
        ("lock_wait: 1e300\n", "lock_wait"),
        ("lock_ttl: 1" + "0" * 400 + "\n", "lock_ttl"),
        ("url_prefix: {a: 1}\n", "url_prefix"),
        ("node_policy: [spread]\n", "node_policy"),
        ("max_body_mib: 1000000000\n", "max_body_mib"),
    ],
)
def test_extender_refuses_non_finite_fractional_and_non_scalar_values(
    scratch: Path, text: str, message: str
) -> None:
    result = ext_load(scratch / "regression.yaml", text)
    assert isinstance(result, EXT_CONFIG) and message in str(result)


def test_extender_numbers_still_read_from_text_and_yaml(scratch: Path) -> None:
    (scratch / "ok.yaml").write_text("version: v1\nport: 9000\nlock_ttl: 30\nmax_body_mib: 512.0\n")
    s = extsettings.load_settings(str(scratch / "ok.yaml"), env={"GPUFLEET_EXTENDER_BIND_WAIT": "2.5"})
    assert (s.port, s.lock_ttl, s.max_body_mib, s.bind_wait) == (9000, 30.0, 512, 2.5)
    assert os.path.exists(scratch / "ok.yaml")
