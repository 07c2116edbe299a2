"""Request errors by kind: the server maps each kind to a gRPC status, the operator reads the detail."""

from __future__ import annotations


class RequestError(Exception):
    """A request the plugin refuses; subclasses say why in kind, the message says exactly what."""


class InvalidRequest(RequestError):
    """The request itself is wrong: unknown, duplicate or too many IDs, impossible sizes."""


class DeviceUnhealthy(RequestError):
    """The request names a device whose GPU is unhealthy now."""


class NotReady(RequestError):
    """The plugin cannot answer yet (GPUs not discovered, NVML unavailable)."""


class HandoffError(RequestError):
    """The GPU-memory hand-off with the extender found no unambiguous pod, or could not record it."""
