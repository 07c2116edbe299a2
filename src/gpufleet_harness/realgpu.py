"""A real GPU's recordings played back: NVML answers as pynvml gives them, and the host's sysfs entry.

`tests/realgpu/<host>/` holds what a real GPU host answered (tests/realgpu/README.md says how it was taken):
`nvml-probe.json` is `nvml_probe.py`'s record of about 100 NVML getters (value or NVML error per call),
`pci.txt` the GPU's sysfs entry, `smi*.txt` nvidia-smi's outputs. This module turns them back into what
gpufleet reads, so discovery, the device plugin's inventory and its labels run on the real answers:

- :func:`replay_pynvml`: a module standing in for `pynvml` whose getters answer from the recording (the
  real pynvml's constants, structures and error classes, so an error is the one pynvml raises); a call the
  recording holds no answer for fails with :class:`RecordingLacks` instead of inventing one;
- :func:`host_root`: a host root with the recorded GPU's sysfs entry (vendor, device, class, NUMA node,
  bound driver);
- :func:`command_output`: a recorded command's output without the recorder's closing `rc=N` line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

RECORDINGS = Path(__file__).resolve().parents[2] / "tests" / "realgpu"
H200 = RECORDINGS / "h200-580.159.04"


class RecordingLacks(AssertionError):
    """The code under test asked NVML something the recording holds no answer for."""


def command_output(path: Path, rc: int = 0) -> str:
    """The output of a recorded command: the file without its last line, the recorder's `rc=N`, which must
    say `rc` (0 unless the caller knows why the command failed)."""
    text = path.read_text(encoding="utf-8")
    body, _, last = text.rstrip("\n").rpartition("\n")
    if last != f"rc={rc}":
        raise ValueError(f"{path}: expected the recorder's closing line rc={rc}, found {last!r}")
    return body + "\n"


def load_probe(directory: Path = H200) -> dict[str, Any]:
    """`nvml-probe.json` of a recording."""
    return json.loads((directory / "nvml-probe.json").read_text(encoding="utf-8"))  # type: ignore[no-any-return]


def _value(value: Any) -> Any:
    """A recorded value as pynvml returns it: structures as attribute objects, arrays as tuples."""
    if isinstance(value, dict):
        return SimpleNamespace(**{k: _value(v) for k, v in value.items()})
    if isinstance(value, list):
        return tuple(_value(v) for v in value)
    return value


class _Handle:
    """A device handle of the replay: the GPU's index in the recording."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<recorded GPU {self.index}>"


def replay_pynvml(probe: Mapping[str, Any]) -> ModuleType:
    """A `pynvml` answering from `probe` (see the module docstring); install it as `sys.modules["pynvml"]`."""
    import pynvml as real

    module = ModuleType("pynvml", "pynvml replaying a real GPU's recorded answers (gpufleet_harness.realgpu)")
    for name, value in vars(real).items():
        if not name.startswith("nvml") and not name.startswith("__"):
            setattr(module, name, value)  # constants, structures, NVMLError and its subclasses
    system: Mapping[str, Any] = probe["system"]
    devices: list[Mapping[str, Any]] = probe["devices"]
    handles = [_Handle(i) for i in range(len(devices))]

    def answer(record: Any, what: str) -> Any:
        if not isinstance(record, Mapping):
            raise RecordingLacks(f"the recording holds no answer for {what}")
        if "ok" in record:
            return _value(record["ok"])
        if "err" in record:
            raise real.NVMLError(getattr(real, record["err"]))
        raise RecordingLacks(f"the recording holds no NVML answer for {what}: {record}")

    def on_system(name: str) -> Callable[..., Any]:
        return lambda: answer(system.get(name), name)

    def on_device(name: str) -> Callable[..., Any]:
        def getter(handle: _Handle) -> Any:
            return answer(devices[handle.index].get(name), f"{name} of GPU {handle.index}")

        return getter

    def fill_from(name: str) -> Callable[..., Any]:
        """Getters that fill a structure passed by reference (nvmlDeviceGetGpuFabricInfo)."""

        def getter(handle: _Handle, ref: Any) -> None:
            found = answer(devices[handle.index].get(name), f"{name} of GPU {handle.index}")
            target = ref._obj
            for field, kind in target._fields_:
                if hasattr(found, field):
                    value = getattr(found, field)
                    setattr(target, field, kind(*value) if isinstance(value, tuple) else value)

        return getter

    def handle_by_index(index: int) -> _Handle:
        if not 0 <= index < len(handles):
            raise real.NVMLError(real.NVML_ERROR_INVALID_ARGUMENT)  # as recorded under bad_index
        return handles[index]

    def nvlink_state(handle: _Handle, link: int) -> Any:
        record = devices[handle.index].get("nvlink", {}).get(str(link), {}).get("state")
        return answer(record, f"nvmlDeviceGetNvLinkState of GPU {handle.index} link {link}")

    def mig_device(handle: _Handle, slot: int) -> Any:
        record = devices[handle.index].get(f"mig_device_{slot}")
        return answer(record, f"nvmlDeviceGetMigDeviceHandleByIndex of GPU {handle.index} slot {slot}")

    for name in system:
        setattr(module, name, on_system(name))
    for name in {key for device in devices for key in device}:
        if name.startswith("nvml") and "(" not in name:
            setattr(module, name, on_device(name))
    for name in ("nvmlDeviceGetGpuFabricInfo", "nvmlDeviceGetGpuFabricInfoV"):
        if any(name in device for device in devices):
            setattr(module, name, fill_from(name))
    module.nvmlInit = module.nvmlInit_v2 = module.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    module.nvmlDeviceGetHandleByIndex = handle_by_index  # type: ignore[attr-defined]
    module.nvmlDeviceGetNvLinkState = nvlink_state  # type: ignore[attr-defined]
    module.nvmlDeviceGetMigDeviceHandleByIndex = mig_device  # type: ignore[attr-defined]
    # The probe asked about the links it lists only: the replay has no more (pynvml's constant is 18).
    module.NVML_NVLINK_MAX_LINKS = max(len(d.get("nvlink", {})) for d in devices)  # type: ignore[attr-defined]
    return module


def pci_entry(directory: Path = H200) -> dict[str, str]:
    """`pci.txt` of a recording as {"path": ..., "class": ..., "device": ..., "numa": ..., "driver": ...}."""
    path, *fields = command_output(directory / "pci.txt").split()
    return {"path": path, **dict(field.split("=", 1) for field in fields)}


def host_root(root: Path, directory: Path = H200) -> Path:
    """A host root holding the recorded GPU's sysfs entry; its vendor is the low half of NVML's recorded
    pciDeviceId (the recorder listed NVIDIA's devices only). Returns `root`."""
    entry = pci_entry(directory)
    device_id = load_probe(directory)["devices"][0]["nvmlDeviceGetPciInfo"]["ok"]["pciDeviceId"]
    base = root / entry["path"].lstrip("/")
    base.mkdir(parents=True)
    (base / "vendor").write_text(f"0x{device_id & 0xFFFF:04x}\n")
    (base / "device").write_text(entry["device"] + "\n")
    (base / "class").write_text(entry["class"] + "\n")
    (base / "numa_node").write_text(entry["numa"] + "\n")
    drivers = root / "sys/bus/pci/drivers" / entry["driver"]
    drivers.mkdir(parents=True)
    os.symlink(os.path.relpath(drivers, base), base / "driver")
    return root


__all__ = [
    "H200",
    "RECORDINGS",
    "RecordingLacks",
    "command_output",
    "host_root",
    "load_probe",
    "pci_entry",
    "replay_pynvml",
]
