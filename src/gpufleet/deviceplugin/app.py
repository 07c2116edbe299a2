"""Wiring: configuration → resource manager → gRPC servers, kubelet supervisor, HTTP side, labels."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from gpufleet.deviceplugin import config as configuration
from gpufleet.deviceplugin import nodeconfig
from gpufleet.deviceplugin.gfd import Sharing
from gpufleet.deviceplugin.gpumem.handoff import MemoryHandoff
from gpufleet.deviceplugin.gpumem.resolver import KubernetesPodResolver, PodResolver
from gpufleet.deviceplugin.labels import NodePublisher
from gpufleet.deviceplugin.metrics import HttpEndpoint, Metrics
from gpufleet.deviceplugin.nodeconfig import NodeLabelWatcher
from gpufleet.deviceplugin.plugin.allocate import AllocateOptions
from gpufleet.deviceplugin.plugin.kubelet import Supervisor
from gpufleet.deviceplugin.plugin.server import DevicePluginService, PluginServer, Wakeup
from gpufleet.deviceplugin.rm.devices import ResourceKind
from gpufleet.deviceplugin.rm.manager import HealthSettings, ResourceManager, StartSettings
from gpufleet.deviceplugin.rm.model import DeviceSource, GpuInfo, SourceUnavailable
from gpufleet.deviceplugin.telemetry.exporter import GpuSample, Settings, Telemetry, hostname, nvml_reader
from gpufleet.deviceplugin.telemetry.pods import (
    API_TIMEOUT_S,
    AssignmentCache,
    PodAttributor,
    PodResourcesClient,
)
from gpufleet.handoff import SHARING_LABEL
from gpufleet.kubeconfig import api_client
from gpufleet.logs import log_event, setup_logging

EXIT_CONFIG = 2
EXIT_STARTUP = 1
MIG_REFUSED_REASON = "DevicePluginMigLayoutInvalid"  # Event: a configuration's MIG strategy cannot serve
FIRST_LABEL_WAIT_S = (
    10.0  # at start, how long the first registration waits for the node's label (named configs)
)


class StartupError(Exception):
    """A dependency the configuration requires is missing (e.g. API access for GPU-memory sharing)."""


def kubernetes_api(kubeconfig: str) -> Any:
    """CoreV1Api from a kubeconfig path, else in-cluster, else ~/.kube/config (gpufleet.kubeconfig)."""
    from kubernetes import client

    return client.CoreV1Api(api_client(kubeconfig))


class App:
    """One device plugin process; dependencies can be injected (tests, benches)."""

    def __init__(
        self,
        cfg: configuration.Config,
        source: DeviceSource | None = None,
        resolver: PodResolver | None = None,
        core_v1: Any = None,
        metrics: Metrics | None = None,
        label_watcher: Callable[..., Any] = NodeLabelWatcher,
        label_wait_s: float = FIRST_LABEL_WAIT_S,
        telemetry_reader: Callable[[GpuInfo], GpuSample] | None = None,
    ) -> None:
        self.cfg = cfg
        self.telemetry_reader = telemetry_reader  # tests read scripted GPUs; else NVML through the source
        self.telemetry: Telemetry | None = None
        self.label_wait_s = label_wait_s
        self.label_watcher = label_watcher  # NodeLabelWatcher's signature; tests drive the label by hand
        self.metrics = metrics or Metrics()
        if source is None:
            from gpufleet.deviceplugin.rm.nvml_source import NvmlDeviceSource

            source = NvmlDeviceSource(cfg.host_root)
        self.rm = ResourceManager(
            source,
            cfg.resources(),
            HealthSettings(
                cfg.health_enabled,
                frozenset(cfg.health_ignored_xids),
                cfg.health_probe_interval,
                cfg.health_probe_timeout,
            ),
            StartSettings(cfg.nvml_on_init_failure == "fail", cfg.nvml_retry_interval),
            self.metrics,
        )
        self.resolver = resolver
        self._own_resolver: PodResolver | None = None  # made here (not injected): closed at the end
        self.core_v1 = core_v1
        self.supervisor: Supervisor | None = None
        self.ready = asyncio.Event()
        self._pending: configuration.Config | None = None  # the named configuration to switch to
        self._label_read = asyncio.Event()  # the node's label was read once (named configurations)
        self.specs = cfg.resources()  # what the running configuration serves, MIG worked out at start

    def _api(self) -> Any:
        if self.core_v1 is None:
            try:
                self.core_v1 = kubernetes_api(self.cfg.kubernetes_kubeconfig)
            except Exception as exc:  # the client raises several unrelated types for "no config"
                raise StartupError(f"no Kubernetes API access: {exc}") from exc
        return self.core_v1

    def healthz(self) -> tuple[bool, str]:
        """(ok, why) for /healthz."""
        if self.supervisor is None:
            return False, "starting"
        ok, why = self.supervisor.healthy
        if not self.rm.ready:
            why += f"; GPUs not discovered: {self.rm.last_error}"
        return ok, why

    async def run(self, stop: asyncio.Event) -> None:
        """Run until `stop` is set (raises SourceUnavailable at start when configured to fail fast).

        With named configurations, the node's label picks one (``nodeconfig``); when it changes, the
        plugin servers of the old configuration stop (their sockets go, so the kubelet drops those
        resources from the node's allocatable) and the new ones start and register. The process, its
        NVML session and every GPU's health stay."""
        loop = asyncio.get_running_loop()
        wakeup = Wakeup(loop)
        self.rm.subscribe(wakeup.poke)
        switch = asyncio.Event()
        http = publisher = watcher = None
        self.rm.start()
        try:
            self._resolve_mig()
            if self.cfg.http_port:
                self.telemetry = self._telemetry()
                extra = self.telemetry.render if self.telemetry else None
                address, port = self.cfg.http_address, self.cfg.http_port
                http = HttpEndpoint(address, port, self.metrics, self.healthz, extra)
                http.start()
                if self.telemetry:
                    self.telemetry.start()
                log_event("http_listening", address=self.cfg.http_address, port=http.port)
            publisher = self._publisher()
            watcher = self._config_watcher(loop, switch)
            if watcher is not None:
                await self._first_label(switch, publisher)
            while not stop.is_set():
                until = asyncio.Event()
                supervisor = self._supervisor(self.cfg, wakeup)
                supervising = asyncio.create_task(supervisor.run(until))
                started = asyncio.create_task(supervisor.started.wait())
                await asyncio.wait([supervising, started], return_when=asyncio.FIRST_COMPLETED)
                started.cancel()
                self.ready.set()
                ending = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(switch.wait())]
                await asyncio.wait([supervising, *ending], return_when=asyncio.FIRST_COMPLETED)
                for waiter in ending:
                    waiter.cancel()
                until.set()
                await supervising  # stops its servers and removes their sockets; raises what it raised
                if switch.is_set() and not stop.is_set():
                    switch.clear()
                    self._apply_switch(publisher)
        finally:
            if self._own_resolver is not None:
                self._own_resolver.close()
                self.resolver = self._own_resolver = None
            if watcher:
                watcher.stop()
            if publisher:
                publisher.stop()
            if http:
                http.stop()
            if self.telemetry:
                self.telemetry.stop()
            self.rm.stop()

    def _telemetry(self) -> Telemetry | None:
        """GPU series for /metrics (docs/metrics.md), unless switched off or there is no NVML to read."""
        cfg = self.cfg
        if not cfg.telemetry_enabled:
            return None
        read = self.telemetry_reader
        nvml = getattr(self.rm.source, "nvml", None)
        if read is None and nvml is not None:
            read = nvml_reader(nvml)
        if read is None:
            log_event("telemetry_off", level="warning", reason="the device source offers no GPU readings")
            return None
        attribute = None
        if cfg.pod_resources_in_use:
            configs = [cfg, *cfg.named.values()]
            attribute = PodAttributor(
                PodResourcesClient(cfg.pod_resources_in_use),
                {c.sharing_memory_resource_name for c in configs},
                AssignmentCache(self._pod_annotations),
            )
        settings = Settings(cfg.telemetry_interval, cfg.telemetry_gpu_timeout)
        log_event(
            "telemetry_on",
            interval_s=settings.interval_s,
            gpu_timeout_s=settings.gpu_timeout_s,
            pod_resources=cfg.telemetry_pod_resources_socket or None,
        )
        host = hostname(cfg.node_name)
        return Telemetry(self.rm.inventory, read, self.rm.last_xids, attribute, host, settings)

    def _pod_annotations(self, namespace: str, name: str) -> dict[str, str] | None:
        """A pod's annotations (None when it does not exist), for the GPU-memory shares' assignments."""
        from kubernetes.client.rest import ApiException

        try:
            pod = self._api().read_namespaced_pod(name, namespace, _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return dict(pod.metadata.annotations or {})

    def _resolve_mig(self) -> None:
        """With a MIG strategy, the resources follow the GPUs discovered at start (one per MIG profile
        with mixed); strategy single refuses a layout it cannot serve, as NVIDIA's plugin does."""
        if self.cfg.mig_strategy == "none":
            return
        if not self.rm.ready:
            log_event(
                "mig_resources_unknown",
                level="warning",
                strategy=self.cfg.mig_strategy,
                reason="GPUs not discovered at start: serving whole GPUs until a restart",
            )
        try:
            self.specs = self.cfg.resources(self.rm.inventory() if self.rm.ready else None)
        except configuration.MigLayoutError as exc:
            raise StartupError(str(exc)) from None
        self.rm.set_resources(self.specs)
        names = ",".join(r.name for r in self.specs)
        log_event("mig_resources", strategy=self.cfg.mig_strategy, resources=names)

    def _supervisor(self, cfg: configuration.Config, wakeup: Wakeup) -> Supervisor:
        """The plugin servers of one configuration, under a new supervisor (``self.supervisor``)."""
        opts = AllocateOptions.from_config(cfg)
        servers = []
        for spec in self.specs:
            allocator = None
            if spec.kind is ResourceKind.MEMORY:
                if self.resolver is None:
                    # One per process, kept across configuration switches: its watch of the node's pods
                    # stays synced. Closed when the plugin stops (`run`).
                    self.resolver = self._own_resolver = KubernetesPodResolver(self._api())
                allocator = MemoryHandoff(
                    self.resolver,
                    cfg.node_name,
                    lambda: self.rm.inventory().by_uuid(),
                    self.rm.gpu_health,
                    opts,
                    self.metrics,
                    resource=spec.name,
                )
            service = DevicePluginService(spec, self.rm, wakeup, opts, self.metrics, allocator)
            servers.append(PluginServer(service, cfg.socket_dir))
        self.supervisor = Supervisor(servers, cfg.socket_dir, self.metrics)
        return self.supervisor

    # ----- named configurations -------------------------------------------------------------------

    def _config_watcher(self, loop: asyncio.AbstractEventLoop, switch: asyncio.Event) -> Any:
        """With named configurations and a node name: follow the node's label (None otherwise)."""
        cfg = self.cfg
        if not cfg.named:
            return None
        if not cfg.node_name:
            log_event("node_config_fixed", config=cfg.config_name, reason="node_name not set")
            return None
        try:
            api = self._api()
        except StartupError as exc:
            log_event("node_config_fixed", level="warning", config=cfg.config_name, reason=str(exc))
            return None

        def on_value(value: str | None) -> None:  # the watcher's thread
            loop.call_soon_threadsafe(self._label_changed, value, switch)

        watcher = self.label_watcher(api, cfg.node_name, cfg.config_label, on_value)
        watcher.start()
        return watcher

    async def _first_label(self, switch: asyncio.Event, publisher: NodePublisher | None) -> None:
        """Before the first registration, the configuration the node's label names (waiting at most
        ``label_wait_s``): registering the default first would leave its resource in the node's capacity
        (allocatable 0) for the kubelet's grace period on a node labelled for another one. Unread in
        time (API down): the default is served, and the label is followed once the watch reads it."""
        try:
            await asyncio.wait_for(self._label_read.wait(), self.label_wait_s)
        except TimeoutError:
            log_event(
                "node_config_unread",
                level="warning",
                serving=self.cfg.config_name,
                waited_s=self.label_wait_s,
            )
            return
        if switch.is_set():
            switch.clear()
            self._apply_switch(publisher, starting=True)

    def _label_changed(self, value: str | None, switch: asyncio.Event) -> None:
        """On the event loop: the node's label now says ``value``. Another known configuration is queued
        for the switch; an unknown name is refused with an event on the node, and the running one stays."""
        self._label_read.set()
        try:
            wanted = self.cfg.select(value)
        except configuration.ConfigError as exc:
            self.metrics.inc("gpufleet_dp_config_refused_total")
            running = self.cfg.config_name
            log_event("node_config_unknown", level="warning", label=value, error=str(exc), keeping=running)
            self._event(nodeconfig.UNKNOWN_CONFIG_REASON, f"{exc}; keeping {running!r}", warning=True)
            wanted = self.cfg
        if wanted.config_name == self.cfg.config_name:
            self._pending = None
            switch.clear()
        else:
            self._pending = wanted
            switch.set()

    def _apply_switch(self, publisher: NodePublisher | None, starting: bool = False) -> None:
        """Between two generations (or before the first, ``starting``): make the pending configuration the
        running one."""
        new, self._pending = self._pending, None
        if new is None:
            return
        try:
            specs = new.resources(self.rm.inventory() if self.rm.ready else None)
        except configuration.MigLayoutError as exc:
            log_event("node_config_refused", level="warning", config=new.config_name, error=str(exc))
            self._event(MIG_REFUSED_REASON, f"{exc}; keeping {self.cfg.config_name!r}", warning=True)
            return
        old, self.cfg, self.specs = self.cfg, new, specs
        resources = ", ".join(r.name for r in specs)
        self.rm.set_resources(specs)
        previous = None if starting else old.config_name
        if not starting:
            self.metrics.inc("gpufleet_dp_config_switches_total")
        log_event("node_config_applied", config=new.config_name, previous=previous, resources=resources)
        was = "at start" if starting else f"(was {old.config_name!r})"
        message = f"configuration {new.config_name!r} {was} serves {resources}"
        self._event(nodeconfig.SWITCHED_REASON, message, warning=False)
        if publisher is not None:
            publisher.poke()

    def _event(self, reason: str, message: str, warning: bool) -> None:
        """An Event on this node, posted from a thread (the event loop never waits on the API)."""
        try:
            api = self._api()
        except StartupError:
            return
        post = (api, self.cfg.node_name, reason, message, warning)
        threading.Thread(
            target=nodeconfig.node_event, args=post, name="gpufleet-node-event", daemon=True
        ).start()

    def config_labels(self) -> dict[str, str]:
        """Labels saying which named configuration runs and its sharing mode (none without named ones):
        the node's one source for its mode, read by the extender (``gpufleet.io/gpu-sharing``)."""
        cfg = self.cfg
        if not cfg.named:
            return {}
        return {cfg.running_label: cfg.config_name, SHARING_LABEL: cfg.sharing_mode}

    def _publisher(self) -> NodePublisher | None:
        cfg = self.cfg
        if not cfg.labels_enabled:
            return None
        if not cfg.node_name:
            log_event("labels_disabled", reason="node_name not set")
            return None
        try:
            api = self._api()
        except StartupError as exc:
            log_event("labels_disabled", level="warning", reason=str(exc))
            return None

        def snapshot() -> tuple[Any, Any]:
            return self.rm.inventory(), self.rm.gpu_health()

        publisher = NodePublisher(
            api,
            cfg.node_name,
            cfg.labels_prefix,
            snapshot,
            extra=self.config_labels,
            mig_strategy=lambda: self.cfg.mig_strategy,
            gfd_mode=lambda: self.cfg.labels_gfd,
            sharing=lambda: gfd_sharing(self.cfg),
        )
        self.rm.subscribe(publisher.poke)
        publisher.start()
        return publisher


def gfd_sharing(cfg: configuration.Config) -> Sharing:
    """The configuration's sharing as gpu-feature-discovery labels it: time-slicing with its replicas (a
    renamed resource keeps its product unsuffixed); GPU-memory sharing is not a GFD strategy (`none`)."""
    if cfg.sharing_mode == "time-slicing":
        renamed = bool(cfg.sharing_time_slicing_rename)
        return Sharing("time-slicing", cfg.sharing_time_slicing_replicas, renamed)
    return Sharing()


async def freeze_after_start(app: App) -> None:
    """Once serving, move everything start-up created out of the cyclic GC's sight (`gc.freeze`).

    Start-up leaves ~35,000 tracked objects (grpc, protobuf, pynvml, the inventory). Left in the oldest
    generation, every full collection walks them all: a pause of the event loop of several milliseconds
    (5-12 ms on a loaded 2-core machine) that lands on whatever RPC is in flight. Frozen, a full
    collection only walks what was created since. The price: frozen objects that later become garbage
    inside reference cycles are never freed. Start-up objects live as long as the process, except the
    gRPC server replaced after a kubelet restart, whose cyclic remains (if any) stay, once per restart.
    """
    await app.ready.wait()
    gc.collect()
    gc.freeze()


async def _serve(cfg: configuration.Config) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    app = App(cfg)
    # Process-wide, so here rather than in App (tests run Apps inside the pytest process).
    freezing = asyncio.create_task(freeze_after_start(app))
    log_event(
        "starting",
        resources=",".join(r.name for r in cfg.resources()),
        socket_dir=cfg.socket_dir,
        sharing=cfg.sharing_mode,
        node=cfg.node_name or None,
    )
    try:
        await app.run(stop)
    except SourceUnavailable as exc:
        log_event(
            "nvml_unavailable", level="error", error=str(exc), action="exiting (nvml.on_init_failure=fail)"
        )
        return EXIT_STARTUP
    except StartupError as exc:
        log_event("startup_failed", level="error", error=str(exc))
        return EXIT_STARTUP
    finally:
        freezing.cancel()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point (`gpufleet-device-plugin`, `python -m gpufleet.deviceplugin`)."""
    try:
        cfg = configuration.parse(argv)
    except configuration.ConfigError as exc:
        print(f"gpufleet-device-plugin: invalid configuration:\n{exc}", file=sys.stderr)
        return EXIT_CONFIG
    setup_logging(cfg.log_level, cfg.log_format)
    return asyncio.run(_serve(cfg))
