"""Named configurations: one plugin configuration file for a mixed fleet, a node label picks one per node,
and the plugin switches live when the label changes (issue 16).

The configuration half reads real files through the real loader. The switch half runs the whole App over
real unix sockets against the fake kubelet of dp_helpers, with the node label driven by hand in place of
the API watch (``NodeLabelWatcher``, exercised against the real API server in tests/cluster).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from dp_helpers import (
    FakeKubelet,
    FakeSource,
    Watcher,
    make_inventory,
    plugin_channel,
    running_plugin,
    wait_for,
)

from gpufleet.deviceplugin import config as configuration
from gpufleet.deviceplugin.app import App
from gpufleet.deviceplugin.config import CONFIG_LABEL_NAME, DEFAULT_CONFIG_LABEL, ConfigError
from gpufleet.deviceplugin.nodeconfig import SWITCHED_REASON, UNKNOWN_CONFIG_REASON
from gpufleet.handoff import SHARING_LABEL

FLEET = """\
version: v1
node_name: {node}
socket_dir: {socket_dir}
labels: {{enabled: false}}
allocate: {{device_id_strategy: uuid}}
configs:
  default: training
  named:
    training: {{}}
    inference:
      sharing: {{mode: time-slicing, time_slicing: {{replicas: 4}}}}
    renamed:
      resource_name: example.com/gpu
      allocate: {{device_id_strategy: index}}
"""


def load(tmp_path: Path, text: str, environ: dict[str, str] | None = None) -> configuration.Config:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return configuration.build(environ={configuration.CONFIG_ENV: str(path), **(environ or {})})


def fleet(
    tmp_path: Path, socket_dir: str = "/run/dp", environ: dict[str, str] | None = None
) -> configuration.Config:
    return load(tmp_path, FLEET.format(node="node-1", socket_dir=socket_dir), environ)


# ----- the configuration file ---------------------------------------------------------------------------


def test_default_runs_first_and_each_name_is_the_base_with_its_own_settings(tmp_path: Path) -> None:
    cfg = fleet(tmp_path)
    assert (cfg.config_name, cfg.config_default, cfg.config_label) == (
        "training",
        "training",
        DEFAULT_CONFIG_LABEL,
    )
    assert sorted(cfg.named) == ["inference", "renamed", "training"]
    assert [(r.name, r.kind.name, r.replicas) for r in cfg.resources()] == [("nvidia.com/gpu", "GPU", 1)]
    inference = cfg.select("inference")
    assert [(r.name, r.kind.name, r.replicas) for r in inference.resources()] == [
        ("nvidia.com/gpu", "REPLICA", 4)
    ]
    assert inference.node_name == "node-1" and inference.socket_dir == "/run/dp"  # the base's, unchanged
    renamed = cfg.select("renamed")
    assert renamed.resource_name == "example.com/gpu" and renamed.allocate_device_id_strategy == "index"
    assert renamed.source["allocate.device_id_strategy"] == "config renamed"
    # None or empty (no label on the node) is the default; each one knows them all
    assert cfg.select(None) is cfg.select("") is cfg.named["training"] is inference.select("training")


def test_environment_and_flags_still_win_over_every_named_configuration(tmp_path: Path) -> None:
    cfg = fleet(tmp_path, environ={"GPUFLEET_DP_SHARING_TIME_SLICING_REPLICAS": "2"})
    assert cfg.select("inference").sharing_time_slicing_replicas == 2


def test_unknown_name_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    cfg = fleet(tmp_path)
    with pytest.raises(ConfigError) as err:
        cfg.select("inferense")
    assert str(err.value) == (
        "unknown device plugin configuration 'inferense' (label nvidia.com/device-plugin.config); "
        "known: inference, renamed, training"
    )


NAMED = "default: a\n  named: "
PROCESS_WIDE = "process-wide; set it outside configs (file, env or flag)"


@pytest.mark.parametrize(
    ("configs", "message"),
    [
        ("default: nope\n  named: {a: {}}", "configs.default: expected one of a, got 'nope'"),
        ("named: {a: {}}", "configs.default: expected one of a, got None"),
        (NAMED + "{}", "configs.named: expected a mapping of configuration names to settings"),
        (NAMED + "{a: {http: {port: 1}}}", f"configs.named.a: http.port: {PROCESS_WIDE}"),
        (NAMED + "{a: {health: {enabled: false}}}", f"configs.named.a: health.enabled: {PROCESS_WIDE}"),
        (NAMED + "{a: {sharing: {mod: memory}}}", "configs.named.a: sharing.mod: unknown setting"),
        (NAMED + "{a: {sharing: {mode: sideways}}}",
         "yaml: configs.named.a.sharing.mode: expected one of none, time-slicing, memory, got 'sideways'"),
        (NAMED + "{a: {sharing: {time_slicing: {rename: x.io/y}}}}",
         "yaml: configs.named.a: sharing.time_slicing.rename: only valid with sharing.mode time-slicing"),
        (NAMED + "{'a b': {}}", "configs.named: 'a b' is not a valid label value for a name"),
        (NAMED + "{a: [1]}", "configs.named.a: expected a mapping of settings"),
        ("label: 'Bad Key'\n  " + NAMED + "{a: {}}", "configs.label: expected a label key like"),
        ("lable: x\n  " + NAMED + "{a: {}}", "configs.lable: unknown key (expected label, default, named)"),
    ],
)  # fmt: skip
def test_bad_named_configurations_are_refused_naming_the_place(
    tmp_path: Path, configs: str, message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        load(tmp_path, f"version: v1\nnode_name: n\nconfigs:\n  {configs}\n")
    assert message in str(err.value)


def test_without_configs_nothing_changes(tmp_path: Path) -> None:
    cfg = load(tmp_path, "version: v1\nsharing: {mode: time-slicing}\n")
    assert (cfg.named, cfg.config_name) == ({}, "")
    with pytest.raises(ConfigError, match="no named configurations"):
        cfg.select("x")


# ----- the live switch -----------------------------------------------------------------------------------


class HandLabel:
    """NodeLabelWatcher's stand-in: the test sets the node's label; ``set`` calls back from a thread."""

    def __init__(self, api: Any, node: str, label: str, on_value: Callable[[str | None], None]) -> None:
        self.api, self.node, self.label, self.on_value = api, node, label, on_value
        self.started = self.stopped = False

    def start(self) -> None:
        self.started = True
        self.set(None)  # the node has no label yet

    def stop(self) -> None:
        self.stopped = True

    def set(self, value: str | None) -> None:
        thread = threading.Thread(target=self.on_value, args=(value,))
        thread.start()
        thread.join()


class EventSink:
    """CoreV1Api's event call: records every event the plugin posts on its node."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def create_namespaced_event(self, namespace: str, body: dict[str, Any], **_: Any) -> None:
        self.events.append({"namespace": namespace, **body})

    def reasons(self) -> list[str]:
        return [e["reason"] for e in self.events]


def test_label_switches_the_running_plugin_and_an_unknown_name_keeps_it(
    tmp_path: Path, socket_dir: str, kubelet: FakeKubelet
) -> None:
    cfg = fleet(tmp_path, socket_dir)
    source = FakeSource(make_inventory(2))
    u0, u1 = (g.uuid for g in source.inv.gpus)
    hands: list[HandLabel] = []
    sink = EventSink()

    def watcher(*args: Any) -> HandLabel:
        hands.append(HandLabel(*args))
        return hands[-1]

    gpu_sock = os.path.join(socket_dir, "gpufleet-nvidia.com-gpu.sock")
    with running_plugin(cfg, source, core_v1=sink, label_watcher=watcher) as running:
        app: App = running.app
        [hand] = hands
        assert (hand.node, hand.label) == ("node-1", "nvidia.com/device-plugin.config") and hand.started
        wait_for(lambda: len(kubelet.requests) == 1, "registration of the default")
        whole = Watcher(plugin_channel(socket_dir, "gpufleet-nvidia.com-gpu.sock"))
        assert whole.wait(lambda d: len(d) == 2, "2 whole GPUs") == {u0: "Healthy", u1: "Healthy"}
        assert app.config_labels() == {f"gpufleet.io/{CONFIG_LABEL_NAME}": "training", SHARING_LABEL: "none"}

        # the label names another configuration: the old server goes, the new one registers
        hand.set("inference")
        wait_for(lambda: len(kubelet.requests) == 2, "registration of the new configuration")
        whole.cancel()
        assert kubelet.requests[-1].resource_name == "nvidia.com/gpu"
        sliced = Watcher(plugin_channel(socket_dir, "gpufleet-nvidia.com-gpu.sock"))
        devices = sliced.wait(lambda d: len(d) == 8, "4 replicas of each GPU")
        assert sorted(devices) == sorted(f"{u}::{i}" for u in (u0, u1) for i in range(4))
        assert app.cfg.config_name == "inference" and app.config_labels()[SHARING_LABEL] == "time-slicing"
        wait_for(lambda: SWITCHED_REASON in sink.reasons(), "the switch's event on the node")

        # a name the file does not have: refused with a Warning event, the running one kept
        hand.set("inferense")
        event = wait_for(lambda: next((e for e in sink.events if e["reason"] == UNKNOWN_CONFIG_REASON), None),
                         "the refusal's event")  # fmt: skip
        assert event["type"] == "Warning" and event["involvedObject"] == {"kind": "Node", "name": "node-1",
                                                                          "uid": "node-1"}  # fmt: skip
        assert "'inferense'" in event["message"] and "keeping 'inference'" in event["message"]
        assert len(kubelet.requests) == 2 and app.cfg.config_name == "inference"
        assert len(sliced.latest) == 8

        # another resource name: a new socket; the old one is gone, so the kubelet drops that resource
        hand.set("renamed")
        wait_for(lambda: len(kubelet.requests) == 3, "registration of example.com/gpu")
        sliced.cancel()
        assert kubelet.requests[-1].resource_name == "example.com/gpu"
        wait_for(lambda: not os.path.exists(gpu_sock), "the old resource's socket removed")
        renamed = Watcher(plugin_channel(socket_dir, "gpufleet-example.com-gpu.sock"))
        assert renamed.wait(lambda d: len(d) == 2, "2 GPUs as example.com/gpu") == {
            u0: "Healthy",
            u1: "Healthy",
        }

        # the label removed: back to the default
        hand.set(None)
        wait_for(lambda: len(kubelet.requests) == 4, "registration of the default again")
        renamed.cancel()
        assert kubelet.requests[-1].resource_name == "nvidia.com/gpu" and app.cfg.config_name == "training"
    assert hand.stopped
    assert sink.reasons().count(SWITCHED_REASON) == 3


class LabelledAtStart(HandLabel):
    """A node that already carries the label when the plugin starts (``value``), or whose label is never
    read (``value`` is ``...``: the API does not answer)."""

    def __init__(self, value: Any, *args: Any) -> None:
        super().__init__(*args)
        self.value = value

    def start(self) -> None:
        self.started = True
        if self.value is not ...:
            self.set(self.value)


def test_a_node_labelled_before_start_registers_only_its_configuration(
    tmp_path: Path, socket_dir: str, kubelet: FakeKubelet
) -> None:
    """The first registration waits for the label: the default's resource is never registered on a node
    labelled for another configuration, so the kubelet never holds it in the node's capacity."""
    sink = EventSink()
    source = FakeSource(make_inventory(2))
    watcher = lambda *args: LabelledAtStart("renamed", *args)  # noqa: E731 - the App's factory
    with running_plugin(fleet(tmp_path, socket_dir), source, core_v1=sink, label_watcher=watcher) as running:
        wait_for(lambda: len(kubelet.requests) == 1, "the first registration")
        assert kubelet.requests[0].resource_name == "example.com/gpu"
        assert running.app.cfg.config_name == "renamed"
        event = wait_for(lambda: next((e for e in sink.events if e["reason"] == SWITCHED_REASON), None),
                         "the configuration's event")  # fmt: skip
        assert "'renamed' at start serves example.com/gpu" in event["message"]
    assert [r.resource_name for r in kubelet.requests] == ["example.com/gpu"]


def test_an_unread_label_serves_the_default_after_the_wait(
    tmp_path: Path, socket_dir: str, kubelet: FakeKubelet
) -> None:
    hands: list[LabelledAtStart] = []

    def watcher(*args: Any) -> LabelledAtStart:
        hands.append(LabelledAtStart(..., *args))
        return hands[-1]

    cfg = fleet(tmp_path, socket_dir)
    with running_plugin(cfg, FakeSource(make_inventory(2)), core_v1=EventSink(), label_watcher=watcher,
                        label_wait_s=0.2) as running:  # fmt: skip
        wait_for(lambda: len(kubelet.requests) == 1, "registration of the default")
        assert kubelet.requests[0].resource_name == "nvidia.com/gpu"
        assert running.app.cfg.config_name == "training"
        hands[0].set("renamed")  # read late: followed as a live switch
        wait_for(lambda: len(kubelet.requests) == 2, "the switch once the label is read")
        assert kubelet.requests[1].resource_name == "example.com/gpu"
