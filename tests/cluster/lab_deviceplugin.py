"""A test-only kubelet device plugin (v1beta1): N fake devices, Allocate answers with an env variable.

It speaks the project's generated v1beta1 modules, but none of the project's plugin logic: the smoke test
proves the lab's kubelet, not gpufleet's device plugin.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import grpc

PROTO = Path(__file__).with_name("deviceplugin_v1beta1.proto")
API_VERSION = "v1beta1"


@dataclass(frozen=True)
class DevicePluginApi:
    """The generated message module and service module of the device plugin API."""

    pb2: ModuleType
    grpc: ModuleType


def load_api() -> DevicePluginApi:
    """The project's generated v1beta1 modules (gpufleet.deviceplugin.api)."""
    from gpufleet.deviceplugin.api import api_pb2, api_pb2_grpc

    return DevicePluginApi(api_pb2, api_pb2_grpc)


@dataclass
class FakeDevicePlugin:
    """Serve ``count`` healthy devices of ``resource`` from ``plugin_dir`` and register with the kubelet."""

    api: DevicePluginApi
    plugin_dir: Path
    resource: str
    count: int
    env_name: str = "LAB_VISIBLE_DEVICES"
    allocations: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.socket_name = "lab-" + self.resource.replace("/", "-").replace(".", "-") + ".sock"
        self.socket = self.plugin_dir / self.socket_name
        self._stopping = threading.Event()
        self._server: grpc.Server | None = None

    @property
    def device_ids(self) -> list[str]:
        return [f"dev-{i}" for i in range(self.count)]

    def start(self) -> FakeDevicePlugin:
        """Listen on the plugin socket, then call Register on the kubelet's socket."""
        self.socket.unlink(missing_ok=True)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        self.api.grpc.add_DevicePluginServicer_to_server(self._servicer(), server)
        server.add_insecure_port(f"unix://{self.socket}")
        server.start()
        self._server = server
        with grpc.insecure_channel(f"unix://{self.plugin_dir / 'kubelet.sock'}") as channel:
            self.api.grpc.RegistrationStub(channel).Register(
                self.api.pb2.RegisterRequest(version=API_VERSION, endpoint=self.socket_name,
                                             resource_name=self.resource),
                timeout=10,
            )  # fmt: skip
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.stop(grace=1).wait()
            self._server = None
        self.socket.unlink(missing_ok=True)

    def _servicer(self) -> Any:
        plugin, pb2 = self, self.api.pb2

        class Servicer(self.api.grpc.DevicePluginServicer):  # type: ignore[name-defined,misc]
            def GetDevicePluginOptions(self, request: Any, context: Any) -> Any:
                return pb2.DevicePluginOptions()

            def ListAndWatch(self, request: Any, context: Any) -> Any:
                devices = [pb2.Device(ID=i, health="Healthy") for i in plugin.device_ids]
                yield pb2.ListAndWatchResponse(devices=devices)
                while context.is_active() and not plugin._stopping.wait(0.5):
                    pass

            def GetPreferredAllocation(self, request: Any, context: Any) -> Any:
                return pb2.PreferredAllocationResponse()

            def Allocate(self, request: Any, context: Any) -> Any:
                responses = []
                for container in request.container_requests:
                    # field 1 is "devicesIDs" upstream and "devices_ids" in the project's .proto
                    ids = list(getattr(container, container.DESCRIPTOR.fields_by_number[1].name))
                    plugin.allocations.append(ids)
                    responses.append(pb2.ContainerAllocateResponse(envs={plugin.env_name: ",".join(ids)}))
                return pb2.AllocateResponse(container_responses=responses)

            def PreStartContainer(self, request: Any, context: Any) -> Any:
                return pb2.PreStartContainerResponse()

        return Servicer()
