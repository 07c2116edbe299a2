"""Typed errors for GPU discovery: callers test the kind, operators read the detail.

Every NVML failure surfaces as a subclass of `NvmlError` carrying NVML's own return code, so a caller
never needs to import pynvml to tell "no driver" from "no library" from "GPU fell off the bus".
"""

from __future__ import annotations


class GpuError(Exception):
    """Base of every error raised by gpufleet.gpu."""


class NvmlError(GpuError):
    """An NVML call failed; `code` is NVML's nvmlReturn_t value."""

    code = 999  # NVML_ERROR_UNKNOWN

    def __init__(self, message: str, code: int | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class NvmlUnavailable(NvmlError):
    """The pynvml package (nvidia-ml-py) is not importable in this Python."""

    code = 12  # same consequence as a missing library: no NVML at all


class NvmlNotSupported(NvmlError):
    """The device or driver does not support the call (NVML_ERROR_NOT_SUPPORTED)."""

    code = 3


class NvmlNoPermission(NvmlError):
    """The caller may not talk to the driver (NVML_ERROR_NO_PERMISSION)."""

    code = 4


class NvmlDriverNotLoaded(NvmlError):
    """The NVIDIA kernel module is not loaded (NVML_ERROR_DRIVER_NOT_LOADED)."""

    code = 9


class NvmlTimeout(NvmlError):
    """A wait ran out of time (NVML_ERROR_TIMEOUT)."""

    code = 10


class NvmlLibraryNotFound(NvmlError):
    """libnvidia-ml.so.1 could not be loaded (NVML_ERROR_LIBRARY_NOT_FOUND)."""

    code = 12


class NvmlFunctionNotFound(NvmlError):
    """The loaded libnvidia-ml predates the call (NVML_ERROR_FUNCTION_NOT_FOUND)."""

    code = 13


class NvmlGpuLost(NvmlError):
    """The GPU fell off the bus or became inaccessible (NVML_ERROR_GPU_IS_LOST)."""

    code = 15


class NvmlOperatingSystemBlocked(NvmlError):
    """The device node is blocked by the OS or cgroups (NVML_ERROR_OPERATING_SYSTEM)."""

    code = 17


class NvmlDriverLibraryMismatch(NvmlError):
    """The kernel module and libnvidia-ml differ in version (NVML_ERROR_LIB_RM_VERSION_MISMATCH)."""

    code = 18


_BY_CODE = {
    cls.code: cls
    for cls in (
        NvmlNotSupported,
        NvmlNoPermission,
        NvmlDriverNotLoaded,
        NvmlTimeout,
        NvmlLibraryNotFound,
        NvmlFunctionNotFound,
        NvmlGpuLost,
        NvmlOperatingSystemBlocked,
        NvmlDriverLibraryMismatch,
    )
}


def nvml_error(exc: BaseException, context: str = "") -> NvmlError:
    """Translate a pynvml NVMLError (anything with `.value`) into the matching typed error."""
    code = getattr(exc, "value", NvmlError.code)
    cls = _BY_CODE.get(code, NvmlError)
    message = f"{context}: {exc}" if context else str(exc)
    return cls(message, code)
