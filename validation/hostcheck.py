"""A validated host: testinfra's Host plus what the inventory expects of it.

Commands run with the host's ``env`` (simulated hosts point NVML and nvidia-smi at their sim root that
way), and files are read under its ``host_root`` (``/`` on real hosts; a sim root's ``host/`` directory on
simulated ones, where ``sys/module/nvidia`` says whether "the driver is loaded").
"""

from __future__ import annotations

import csv
import io
import json
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

# NVML through ctypes, so that validation needs nothing on the host beyond python3 and the driver: per GPU,
# each NVLink's state and what is at its far end (0 GPU, 1 IBM NPU, 2 NVSwitch).
NVLINK_PROBE = r"""
import ctypes, json
out = {"gpus": []}
try:
    nv = ctypes.CDLL("libnvidia-ml.so.1")
except OSError as exc:
    print(json.dumps({"error": "cannot load libnvidia-ml.so.1: %s" % exc})); raise SystemExit(0)
rc = nv.nvmlInit_v2()
if rc:
    print(json.dumps({"error": "nvmlInit failed with NVML error %d" % rc})); raise SystemExit(0)
count = ctypes.c_uint(0)
nv.nvmlDeviceGetCount_v2(ctypes.byref(count))
for i in range(count.value):
    handle = ctypes.c_void_p()
    if nv.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(handle)):
        out["gpus"].append({"index": i, "error": "no handle"}); continue
    links = []
    for link in range(18):
        state, kind = ctypes.c_uint(0), ctypes.c_uint(0)
        rc = nv.nvmlDeviceGetNvLinkState(handle, link, ctypes.byref(state))
        if rc:
            break
        rc = nv.nvmlDeviceGetNvLinkRemoteDeviceType(handle, link, ctypes.byref(kind))
        links.append({"link": link, "active": bool(state.value), "remote": kind.value if rc == 0 else None})
    out["gpus"].append({"index": i, "links": links})
nv.nvmlShutdown()
print(json.dumps(out))
"""
REMOTE_SWITCH = 2


def parse_query(stdout: str, fields: Sequence[str] | None = None) -> list[dict[str, str]]:
    """The rows of ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]``, one mapping per GPU from
    field name to value. ``fields``: the names queried, for output without a header; None: the first line
    is nvidia-smi's header ("index, name, memory.total [MiB]"), whose names count without their unit. A line
    with another number of values than names is left out."""
    lines = csv.reader(io.StringIO(stdout), skipinitialspace=True)
    if fields is None:
        fields = [name.split(" [", 1)[0].strip() for name in next(lines, [])]
    return [
        dict(zip(fields, (value.strip() for value in values), strict=True))
        for values in lines
        if len(values) == len(fields)
    ]


@dataclass
class SmiRow:
    """One GPU of ``nvidia-smi --query-gpu=index,name,uuid,driver_version,persistence_mode``."""

    index: str
    name: str
    uuid: str
    driver_version: str
    persistence_mode: str


class Target:
    """One host under validation."""

    def __init__(self, name: str, host: Any, expected: dict[str, Any]) -> None:
        self.name, self.host, self.expected = name, host, expected
        self.root = str(expected.get("host_root") or "/")

    # -- plumbing ----------------------------------------------------------------------------------
    def cmd(self, command: str) -> str:
        """``command`` with the host's environment in front."""
        env = self.expected.get("env") or {}
        if not env:
            return command
        return "env " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()) + " " + command

    def run(self, command: str) -> Any:
        """Run a shell command on the host (its env applied); testinfra's CommandResult."""
        return self.host.run(self.cmd(command))

    def path(self, path: str) -> str:
        """``path`` (absolute, as on a real host) under the host root."""
        return path if self.root == "/" else self.root.rstrip("/") + path

    def file(self, path: str) -> Any:
        return self.host.file(self.path(path))

    def read(self, path: str) -> str | None:
        """A file's text under the host root, or None when it does not exist."""
        handle = self.file(path)
        return str(handle.content_string).strip() if handle.exists else None

    def want(self, key: str, default: Any = None) -> Any:
        return self.expected.get(key, default)

    # -- facts the checks share --------------------------------------------------------------------
    @property
    def smi(self) -> str:
        return str(self.want("nvidia_smi", "nvidia-smi"))

    @cached_property
    def smi_query(self) -> tuple[Any, list[SmiRow]]:
        """(CommandResult, rows) of nvidia-smi's per-GPU query, read by its header's field names."""
        fields = ("index", "name", "uuid", "driver_version", "persistence_mode")
        result = self.run(f"{self.smi} --query-gpu={','.join(fields)} --format=csv,nounits")
        found = parse_query(result.stdout) if result.rc == 0 else []
        return result, [SmiRow(**{f: row[f] for f in fields}) for row in found if set(fields) <= set(row)]

    @cached_property
    def kernel_release(self) -> str:
        """The running kernel's release (``/proc/sys/kernel/osrelease`` under the host root)."""
        return self.read("/proc/sys/kernel/osrelease") or str(self.host.check_output("uname -r")).strip()

    @cached_property
    def loaded_module_version(self) -> str | None:
        """Version of the loaded nvidia kernel module, None when it is not loaded."""
        return self.read("/sys/module/nvidia/version")

    @cached_property
    def nvswitches(self) -> int:
        """NVIDIA NVSwitch PCI functions (class 0x0680) under the host root's sysfs."""
        script = (
            "import glob, os, sys\n"
            "n = 0\n"
            "for d in glob.glob(os.path.join(sys.argv[1], 'sys/bus/pci/devices/*')):\n"
            "    try:\n"
            "        v, c = (open(os.path.join(d, f)).read().strip() for f in ('vendor', 'class'))\n"
            "    except OSError:\n"
            "        continue\n"
            "    n += v == '0x10de' and c.startswith('0x0680')\n"
            "print(n)\n"
        )
        python = self.want("python", "python3")
        out = self.host.check_output(f"{python} -c {shlex.quote(script)} {shlex.quote(self.root)}")
        return int(str(out).strip() or 0)

    @property
    def fabricmanager_required(self) -> bool:
        """Inventory/facts say so, else: NVSwitches are present."""
        wanted = self.want("fabricmanager")
        return bool(self.nvswitches) if wanted is None else bool(wanted)

    @cached_property
    def systemd(self) -> bool:
        """Whether the host runs systemd (simulated hosts do not)."""
        wanted = self.want("systemd")
        if wanted is not None:
            return bool(wanted)
        return self.root == "/" and self.host.file("/run/systemd/system").is_directory

    def nvlinks(self) -> dict[str, Any]:
        """The NVLink probe's JSON (``error`` set when NVML is unusable)."""
        python = self.want("python", "python3")
        result = self.run(f"{python} -c {shlex.quote(NVLINK_PROBE)}")
        if result.rc != 0:
            return {"error": f"NVLink probe exited {result.rc}: {result.stderr.strip()[-300:]}"}
        try:
            return dict(json.loads(result.stdout))
        except ValueError:
            return {"error": f"NVLink probe printed no JSON: {result.stdout.strip()[-300:]}"}
