"""Node labels the device plugin writes from NVML's text, and the inventory values the collection's modules
parse beyond Ansible's type checks (plugin_config, expected_gpus, the extender's settings)."""

from __future__ import annotations

import re
from typing import Any

import pytest
from ansible_collections.gpufleet.nvidia.plugins.module_utils import k8s_deviceplugin, k8s_extender
from ansible_collections.gpufleet.nvidia.plugins.module_utils.deviceplugin.config import Advertised
from budget import FUZZ, outcome
from hypothesis import given
from hypothesis import strategies as st
from strategies import JSON_VALUES, SCALARS, maybe

from gpufleet.deviceplugin.labels import gpus_annotation, node_labels
from gpufleet.deviceplugin.rm.health import GpuHealth
from gpufleet.deviceplugin.rm.model import GIB, GpuInfo, NodeInventory
from gpufleet.handoff import parse_gpus

LABEL_VALUE = re.compile(r"([A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?)?")
LABEL_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")

# ----- node labels --------------------------------------------------------------------------------------

GPUS = st.lists(
    st.builds(
        GpuInfo,
        index=st.integers(0, 64),
        uuid=st.uuids().map(lambda u: f"GPU-{u}"),
        minor=st.integers(0, 64),
        model=st.text(max_size=80),
        memory_bytes=st.integers(0, 200 * GIB),
        cc=st.tuples(st.integers(0, 12), st.integers(0, 9)),
        numa=st.none() | st.integers(-1, 7),
        bus_id=st.text(max_size=16),
    ),
    min_size=1,
    max_size=6,
    unique_by=lambda g: g.uuid,
)
INVENTORIES = st.builds(
    NodeInventory,
    gpus=GPUS.map(tuple),
    driver_version=st.one_of(
        st.text(max_size=40), st.sampled_from(["535.261.03", "550.54", "", ".", "535 beta"])
    ),
    cuda_driver_version=st.integers(0, 99_999),
    nvswitch_count=st.integers(0, 8),
)


@FUZZ
@given(INVENTORIES)
def test_node_labels_are_valid_kubernetes_labels_whatever_nvml_says(inv: NodeInventory) -> None:
    labels = node_labels(inv)
    for key, value in labels.items():
        prefix, _, name = key.partition("/")
        assert prefix == "gpufleet.io" and LABEL_NAME.fullmatch(name), key
        assert LABEL_VALUE.fullmatch(value), (key, value)


@FUZZ
@given(INVENTORIES)
def test_gpus_annotation_written_is_one_the_extender_parses_back(inv: NodeInventory) -> None:
    parsed = parse_gpus(gpus_annotation(inv, {inv.gpus[0].uuid: GpuHealth(False, "xid 79")}))
    assert [(g.uuid, g.model, g.memory_gib, g.cc) for g in parsed] == [
        (g.uuid, g.model, g.memory_gib, g.cc) for g in inv.gpus
    ]
    assert parsed[0].healthy is False


def test_driver_major_label_is_a_label_value_even_for_odd_driver_versions() -> None:
    gpu = GpuInfo(0, "GPU-a", 0, "NVIDIA A100", 80 * GIB, (8, 0), 0, "0000:07:00.0")
    for version in ("535 beta.1", "r535_00/x.1", "..."):
        labels = node_labels(NodeInventory((gpu,), driver_version=version))
        assert LABEL_VALUE.fullmatch(labels["gpufleet.io/driver.major"]), version


# ----- the gpu_device_plugin module ---------------------------------------------------------------------

DP_PARAMS = {"mode": "daemonset", "host_root": "/", "expected_gpus": {}}
PLUGIN_CONFIGS = st.fixed_dictionaries(
    {},
    optional={
        "version": maybe(st.just("v1")),
        "resource_name": maybe(st.just("example.com/gpu")),
        "sharing": maybe(
            st.fixed_dictionaries(
                {},
                optional={
                    "mode": maybe(st.sampled_from(["none", "time-slicing", "memory"])),
                    "time_slicing": maybe(
                        st.fixed_dictionaries(
                            {}, optional={"replicas": maybe(st.integers(1, 8)), "rename": JSON_VALUES}
                        )
                    ),
                    "memory": maybe(st.fixed_dictionaries({}, optional={"resource_name": JSON_VALUES})),
                },
            )
        ),
        "labels": maybe(st.fixed_dictionaries({}, optional={"enabled": maybe(st.booleans())})),
        "http": maybe(st.fixed_dictionaries({}, optional={"port": maybe(st.integers(0, 65535))})),
        "socket_dir": JSON_VALUES,
    },
)


@FUZZ
@given(PLUGIN_CONFIGS)
def test_plugin_config_shape_is_read_or_refused_with_a_parameter_error(cfg: dict[str, Any]) -> None:
    doc = outcome(
        (k8s_deviceplugin.ParameterError,),
        k8s_deviceplugin.plugin_config,
        {**DP_PARAMS, "plugin_config": cfg},
    )
    if isinstance(doc, dict):
        cfg = outcome((k8s_deviceplugin.ParameterError,), k8s_deviceplugin.load_config, doc)
        if not isinstance(cfg, k8s_deviceplugin.ParameterError):
            advertised = cfg.advertised()
            assert isinstance(advertised.resource, str) and advertised.resource
            assert advertised.per_gpu is None or 1 <= advertised.per_gpu <= 1024
            assert type(cfg.labels_enabled) is bool and 0 <= cfg.http_port <= 65535


@FUZZ
@given(st.dictionaries(st.text(max_size=10), st.one_of(JSON_VALUES, st.text(max_size=12)), max_size=4))
def test_expected_gpus_are_whole_counts_or_a_parameter_error(expected: dict[str, Any]) -> None:
    counts = outcome(
        (k8s_deviceplugin.ParameterError,),
        k8s_deviceplugin.expected_counts,
        {"expected_gpus": expected},
        Advertised("nvidia.com/gpu", 4),
    )
    if isinstance(counts, dict):
        assert all(
            type(n) is int and 0 <= n <= 4 * k8s_deviceplugin.MAX_EXPECTED_GPUS for n in counts.values()
        )


@pytest.mark.parametrize(
    "cfg",
    [
        {"sharing": "memory"},
        {"labels": 5},
        {"http": {"port": [9400]}},
        {"http": {"port": 1e300}},
        {"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": float("inf")}}},
        {"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": "9" * 5000}}},
        {"sharing": {"mode": "time-slicing", "time_slicing": {"replicas": 2.5}}},
        {"sharing": {"mode": "memory", "memory": {"resource_name": ["x"]}}},
        {"labels": {"enabled": "sometimes"}},
    ],
)
def test_malformed_plugin_config_is_a_parameter_error_not_a_module_crash(cfg: dict[str, Any]) -> None:
    doc = k8s_deviceplugin.plugin_config({**DP_PARAMS, "plugin_config": cfg})
    with pytest.raises(k8s_deviceplugin.ParameterError, match="plugin_config"):
        k8s_deviceplugin.load_config(doc)


def _read(cfg: dict[str, Any]) -> Any:
    return k8s_deviceplugin.load_config(k8s_deviceplugin.plugin_config({**DP_PARAMS, "plugin_config": cfg}))


def test_labels_disabled_as_text_is_read_as_the_plugin_reads_it() -> None:
    # bool("false") is True: the module granted node RBAC the plugin would not use.
    assert _read({"labels": {"enabled": "false"}}).labels_enabled is False
    assert _read({"labels": {"enabled": "yes"}}).labels_enabled is True


@pytest.mark.parametrize("gpus", [float("inf"), 2.7, -3, [1], "many", True, 10**12])
def test_expected_gpus_that_are_not_a_whole_count_are_refused(gpus: Any) -> None:
    with pytest.raises(k8s_deviceplugin.ParameterError, match=r"expected_gpus\.node-a"):
        k8s_deviceplugin.expected_counts({"expected_gpus": {"node-a": gpus}}, Advertised("nvidia.com/gpu", 1))


def test_expected_gpus_still_read_from_numbers_and_digits() -> None:
    two = Advertised("nvidia.com/gpu", 2)
    assert k8s_deviceplugin.expected_counts({"expected_gpus": {"a": 4, "b": "8", "c": 2.0}}, two) == {
        "a": 8,
        "b": 16,
        "c": 4,
    }


# ----- the gpu_scheduler_extender module ----------------------------------------------------------------

EXT_PARAMS = {
    "tls_secret": None,
    "service_type": "NodePort",
    "node_port": 32766,
    "name": "x",
    "namespace": "ns",
}


@FUZZ
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "version": maybe(st.just("v1")),
            "port": maybe(st.integers(1, 65535)),
            "url_prefix": maybe(st.just("/gpufleet")),
            "kubeconfig": SCALARS,
            "lock_ttl": JSON_VALUES,
        },
    ),
    st.sampled_from(["NodePort", "ClusterIP"]),
)
def test_extender_settings_doc_and_url_are_built_or_refused(settings: dict[str, Any], service: str) -> None:
    params = {**EXT_PARAMS, "settings": settings, "service_type": service}
    doc = outcome((k8s_extender.ParameterError,), k8s_extender.settings_doc, params)
    if isinstance(doc, dict):
        url = k8s_extender.default_url(params, doc)
        assert re.fullmatch(r"http://[a-z0-9.]+:[0-9]{1,5}/\S*", url), url


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"port": [8800]}, "settings.port"),
        ({"port": 0}, "settings.port"),
        ({"url_prefix": 5}, "settings.url_prefix"),
    ],
)
def test_extender_settings_the_module_reads_are_checked_before_use(
    settings: dict[str, Any], message: str
) -> None:
    with pytest.raises(k8s_extender.ParameterError, match=message):
        k8s_extender.settings_doc({**EXT_PARAMS, "settings": settings})
