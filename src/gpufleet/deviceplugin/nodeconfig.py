"""The node label that picks this node's named configuration: followed with a watch, refused names reported.

One watch on this node alone (``list``/``watch`` on nodes with a field selector on the name): the label's
changes arrive within a second, and the API server carries one idle stream per node, not a GET every few
seconds. The thread calls ``on_value`` with the label's value (None when absent) whenever it differs from
the last value it passed on, including once at start.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

from gpufleet.logs import log_event

EVENT_NAMESPACE = "default"  # where the kubelet, too, records a node's events
EVENT_SOURCE = "gpufleet-device-plugin"
UNKNOWN_CONFIG_REASON = "DevicePluginConfigUnknown"
SWITCHED_REASON = "DevicePluginConfigApplied"


class NodeLabelWatcher:
    """Follows one label of one node; calls ``on_value(value | None)`` from its own thread on changes."""

    def __init__(
        self,
        core_v1: Any,
        node: str,
        label: str,
        on_value: Callable[[str | None], None],
        retry_s: float = 5.0,
        watch_s: int = 300,
    ) -> None:
        self.api = core_v1
        self.node = node
        self.label = label
        self.on_value = on_value
        self.retry_s = retry_s
        self.watch_s = watch_s
        self._stop = threading.Event()
        self._last: tuple[str | None] | None = None  # the last value passed on (a 1-tuple: None is a value)
        self._watch: Any = None
        self._thread = threading.Thread(target=self._run, name="gpufleet-node-config", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._watch is not None:
            self._watch.stop()
        self._thread.join(timeout=2)

    def _seen(self, labels: dict[str, str] | None) -> None:
        value = (labels or {}).get(self.label)
        if self._last != (value,):
            self._last = (value,)
            self.on_value(value)

    def _run(self) -> None:
        from kubernetes import watch

        selector = f"metadata.name={self.node}"
        while not self._stop.is_set():
            try:
                listed = self.api.list_node(field_selector=selector, _request_timeout=30)
                for item in listed.items:
                    self._seen(item.metadata.labels)
                version = listed.metadata.resource_version
                while not self._stop.is_set():
                    self._watch = watch.Watch()
                    for event in self._watch.stream(
                        self.api.list_node,
                        field_selector=selector,
                        resource_version=version,
                        timeout_seconds=self.watch_s,
                        _request_timeout=self.watch_s + 30,
                    ):
                        if self._stop.is_set():
                            return
                        obj = event["object"]
                        version = obj.metadata.resource_version
                        if event["type"] in ("ADDED", "MODIFIED"):
                            self._seen(obj.metadata.labels)
            except Exception as exc:  # API away, watch expired (410): list again after a pause
                if self._stop.is_set():
                    return
                log_event(
                    "node_config_watch_failed",
                    level="warning",
                    node=self.node,
                    error=repr(exc)[:300],
                    retry_s=self.retry_s,
                )
                self._stop.wait(self.retry_s)


def node_event(core_v1: Any, node: str, reason: str, message: str, warning: bool) -> None:
    """Record an Event on the node (as ``kubectl describe node`` shows them); failures are only logged."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    body = {
        "metadata": {"generateName": f"{node}.", "namespace": EVENT_NAMESPACE},
        "involvedObject": {"kind": "Node", "name": node, "uid": node},
        "reason": reason,
        "message": message,
        "type": "Warning" if warning else "Normal",
        "source": {"component": EVENT_SOURCE, "host": node},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }
    try:
        core_v1.create_namespaced_event(EVENT_NAMESPACE, body, _request_timeout=10)
    except Exception as exc:  # an event is a courtesy: never let it stop the plugin
        log_event("node_event_failed", level="warning", node=node, reason=reason, error=repr(exc)[:300])
