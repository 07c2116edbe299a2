# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""MIG layouts in mig-parted's config format: parse, validate against the GPUs, plan, apply through pynvml.

Everything is validated (the file, the layout name, each wanted GPU's profiles and whether they fit)
before any GPU is touched. `load_layouts` reads and checks a config, `run_layout` plans and applies one
layout. Two callers share this file unchanged: the module gpufleet.nvidia.gpu_mig_layout, and the boot
applier the role gpufleet.nvidia.nvidia_mig installs beside a copy of it (so it imports nothing from
Ansible).
"""

from __future__ import annotations

import ctypes
import json
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

try:
    import yaml

    HAS_YAML = True
except ImportError:  # pragma: no cover - ansible-core brings PyYAML; a bare target may lack it
    HAS_YAML = False


class LayoutError(ValueError):
    """A config, layout or GPU that cannot be applied; the message says why."""


# -- profile tables ---------------------------------------------------------------------------------------
# Per GPU-instance profile: compute slices, memory slices a placement covers, placement starts, most
# instances. The GPU's own answer comes first: NVML lists its profiles (nvmlDeviceGetGpuInstanceProfileInfo)
# and their placements (nvmlDeviceGetGpuInstancePossiblePlacements) with MIG on or off, as a real H200 did
# (tests/realgpu/h200-580.159.04*/nvml-probe.json). The tables below are the fallback for a driver that does
# not answer: A100/H100 from NVIDIA's MIG user guide ("Supported MIG Profiles"), the H200's as the real one
# listed them (`nvidia-smi mig -lgip`/`-lgipp`, NVML's profile infos). 8 memory and 7 compute slices on all.
if TYPE_CHECKING:  # a subscripted tuple at run time would need Python 3.9; targets may have 3.8
    Profile = tuple[int, int, tuple[int, ...], int]
_EIGHTH = tuple(range(7))


def _table(small: str, mid: str, half: str, big: str, whole: str) -> dict[str, Profile]:
    return {
        f"1g.{small}": (1, 1, _EIGHTH, 7),
        f"1g.{small}+me": (1, 1, _EIGHTH, 1),
        f"1g.{mid}": (1, 2, (0, 2, 4, 6), 4),
        f"2g.{mid}": (2, 2, (0, 2, 4), 3),
        f"3g.{half}": (3, 4, (0, 4), 2),
        f"4g.{big}": (4, 4, (0,), 1),
        f"7g.{whole}": (7, 8, (0,), 1),
    }


PROFILES_80GB = _table("10gb", "20gb", "40gb", "40gb", "80gb")
PROFILES_40GB = _table("5gb", "10gb", "20gb", "20gb", "40gb")
PROFILES_H200 = _table("18gb", "35gb", "71gb", "71gb", "141gb")
MEMORY_SLICES = 8
COMPUTE_SLICES = 7
# The models the fallback tables cover, for messages.
TABLE_MODELS = "A100/A800 40GB and 80GB, H100/H800 80GB, NVIDIA H200"


def profile_table(model: str) -> dict[str, Profile] | None:
    """gpufleet's MIG profile table of a GPU model as NVML names it; None when it has none for it."""
    if ("A100" in model or "H100" in model or "H800" in model or "A800" in model) and "80GB" in model:
        return PROFILES_80GB
    if ("A100" in model or "A800" in model) and "40GB" in model:
        return PROFILES_40GB
    if model == "NVIDIA H200":  # the recorded name; H200 NVL and GH200 are not verified: NVML's table only
        return PROFILES_H200
    return None


def _order(table: dict[str, Profile]) -> dict[str, Profile]:
    """Smallest profiles first, as `nvidia-smi mig -lgip` lists them."""
    return dict(sorted(table.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0])))


# -- the config format ------------------------------------------------------------------------------------

_TOP_KEYS = {"version", "mig-configs"}
_ENTRY_KEYS = {"devices", "mig-enabled", "mig-devices", "device-filter"}


def load_config_text(text: str, source: str) -> dict:
    """Parse a mig-parted file (YAML, or JSON without PyYAML)."""
    try:
        data = yaml.safe_load(text) if HAS_YAML else json.loads(text)
    except Exception as exc:  # yaml.YAMLError / ValueError: the file does not parse
        raise LayoutError(f"{source} does not parse as a mig-parted config: {exc}") from None
    return data


def check_config(data: object, source: str) -> dict:
    """Check the whole config's structure; returns {layout name: [entry, ...]} with entries normalized."""
    problems: list[str] = []
    if not isinstance(data, dict):
        raise LayoutError(f"{source}: a mig-parted config is a mapping with 'version' and 'mig-configs'")
    unknown = sorted(str(k) for k in data if k not in _TOP_KEYS)
    if unknown:
        problems.append(f"unknown top-level key(s) {', '.join(unknown)} (allowed: version, mig-configs)")
    if data.get("version") != "v1":
        problems.append(f"version must be v1, got {data.get('version')!r}")
    configs = data.get("mig-configs")
    if not isinstance(configs, dict) or not configs:
        problems.append("mig-configs must be a non-empty mapping of layout name to a list of entries")
        configs = {}
    layouts: dict[str, list[dict]] = {}
    for name, entries in configs.items():
        where = f"mig-configs.{name}"
        if not isinstance(entries, list) or not entries:
            problems.append(f"{where} must be a non-empty list of entries")
            continue
        layouts[str(name)] = [
            _check_entry(entry, f"{where}[{i}]", problems) for i, entry in enumerate(entries)
        ]
    if problems:
        raise LayoutError(f"{source}: " + "; ".join(problems))
    return layouts


def _check_entry(entry: object, where: str, problems: list[str]) -> dict:
    out: dict = {"devices": "all", "mig-enabled": False, "mig-devices": {}, "device-filter": None}
    if not isinstance(entry, dict):
        problems.append(f"{where} must be a mapping")
        return out
    unknown = sorted(str(k) for k in entry if k not in _ENTRY_KEYS)
    if unknown:
        problems.append(
            f"{where}: unknown key(s) {', '.join(unknown)} (allowed: {', '.join(sorted(_ENTRY_KEYS))})"
        )
    devices = entry.get("devices")
    if devices == "all":
        out["devices"] = "all"
    elif (
        isinstance(devices, list)
        and devices
        and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in devices)
    ):
        if len(set(devices)) != len(devices):
            problems.append(f"{where}.devices lists a GPU twice: {devices}")
        out["devices"] = list(devices)
    else:
        problems.append(f"{where}.devices must be 'all' or a list of GPU indexes, got {devices!r}")
    enabled = entry.get("mig-enabled")
    if not isinstance(enabled, bool):
        problems.append(f"{where}.mig-enabled must be true or false, got {enabled!r}")
    else:
        out["mig-enabled"] = enabled
    wanted = entry.get("mig-devices", {})
    if wanted is None:
        wanted = {}
    if not isinstance(wanted, dict) or not all(
        isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
        for k, v in wanted.items()
    ):
        problems.append(f"{where}.mig-devices must map profile names to counts, got {wanted!r}")
    else:
        out["mig-devices"] = {k: v for k, v in wanted.items() if v}
        if out["mig-devices"] and enabled is False:
            problems.append(f"{where}: mig-devices given with mig-enabled false")
    flt = entry.get("device-filter")
    if flt is not None:
        flts = [flt] if isinstance(flt, str) else flt
        if not isinstance(flts, list) or not flts or not all(isinstance(f, str) for f in flts):
            problems.append(
                f"{where}.device-filter must be a PCI device id like 0x20B210DE or a list of them"
            )
        else:
            try:
                out["device-filter"] = [int(f, 16) for f in flts]
            except ValueError:
                problems.append(f"{where}.device-filter must hold hexadecimal PCI device ids, got {flts}")
    return out


# -- planning ---------------------------------------------------------------------------------------------


def place(table: dict, wanted: dict[str, int]) -> list[tuple[str, int]] | None:
    """(profile, start) for every wanted instance, non-overlapping and within 7 compute slices; None if
    no placement exists. Largest profiles first, placements tried in the order the profile lists them."""
    items = sorted(
        (name for name, count in wanted.items() for _copy in range(count)),
        key=lambda n: (-table[n][1], -table[n][0], n),
    )
    if sum(table[n][0] for n in items) > COMPUTE_SLICES:
        return None
    chosen: list[tuple[str, int]] = []
    used = [False] * MEMORY_SLICES

    def fit(k: int) -> bool:
        if k == len(items):
            return True
        name = items[k]
        size, starts = table[name][1], table[name][2]
        # Identical profiles in increasing start order only: no permutation is tried twice.
        floor = chosen[-1][1] + 1 if k and items[k - 1] == name else 0
        for start in starts:
            if start < floor or start + size > MEMORY_SLICES or any(used[start : start + size]):
                continue
            used[start : start + size] = [True] * size
            chosen.append((name, start))
            if fit(k + 1):
                return True
            chosen.pop()
            used[start : start + size] = [False] * size
        return False

    return sorted(chosen, key=lambda p: p[1]) if fit(0) else None


def wanted_per_gpu(entries: list[dict], layout: str, gpus: list[dict]) -> dict[int, dict]:
    """{GPU index: {"enabled", "devices", "placement"}} for the GPUs the layout covers; raises LayoutError
    with every problem found (unknown index, profile, no fit, MIG where there is none)."""
    problems: list[str] = []
    by_index = {g["index"]: g for g in gpus}
    wanted: dict[int, dict] = {}
    covered_by: dict[int, int] = {}
    for i, entry in enumerate(entries):
        where = f"layout {layout} entry {i}"
        if entry["devices"] == "all":
            indexes = sorted(by_index)
        else:
            indexes = entry["devices"]
            missing = [d for d in indexes if d not in by_index]
            if missing:
                problems.append(
                    f"{where}: no GPU {', '.join(map(str, missing))} on this host "
                    f"(it has {len(gpus)}: 0-{len(gpus) - 1})"
                )
                indexes = [d for d in indexes if d in by_index]
        if entry["device-filter"] is not None:
            indexes = [d for d in indexes if by_index[d]["pci_device_id"] in entry["device-filter"]]
        for index in indexes:
            gpu = by_index[index]
            if index in covered_by:
                problems.append(f"{where}: GPU {index} is already covered by entry {covered_by[index]}")
                continue
            covered_by[index] = i
            want = {"enabled": entry["mig-enabled"], "devices": dict(entry["mig-devices"]), "placement": []}
            if not gpu["mig_supported"]:
                if want["enabled"]:
                    problems.append(f"{where}: GPU {index} ({gpu['model']}) does not support MIG")
                wanted[index] = want
                continue
            if want["enabled"]:
                table = gpu.get("profiles") or profile_table(gpu["model"])
                source = "as NVML lists them" if gpu.get("profiles") else "gpufleet's table for the model"
                if table is None:
                    problems.append(
                        f"{where}: GPU {index} ({gpu['model']}): NVML lists no MIG profiles for it and "
                        f"gpufleet has no profile table for this model (it has tables for {TABLE_MODELS}), "
                        "so the layout cannot be checked"
                    )
                    continue
                unknown = sorted(p for p in want["devices"] if p not in table)
                if unknown:
                    problems.append(
                        f"{where}: GPU {index} ({gpu['model']}) has no MIG profile "
                        f"{', '.join(unknown)} (it offers {', '.join(_order(table))}, {source}; "
                        "change the layout's mig-devices)"
                    )
                    continue
                too_many = [
                    f"{p} x{n} (at most {table[p][3]})"
                    for p, n in sorted(want["devices"].items())
                    if n > table[p][3]
                ]
                placement = None if too_many else place(table, want["devices"])
                if placement is None:
                    slices = sum(table[p][0] * n for p, n in want["devices"].items())
                    why = (
                        ", ".join(too_many)
                        if too_many
                        else (
                            f"{slices} compute slices of {COMPUTE_SLICES}"
                            if slices > COMPUTE_SLICES
                            else "no placement of the instances fits the GPU's 8 memory slices"
                        )
                    )
                    problems.append(
                        f"{where}: {_describe(want['devices'])} does not fit GPU {index} "
                        f"({gpu['model']}): {why}"
                    )
                    continue
                want["placement"] = placement
            wanted[index] = want
    if problems:
        raise LayoutError("; ".join(problems))
    return wanted


def _describe(devices: dict[str, int]) -> str:
    return ", ".join(f"{n}x {p}" for p, n in sorted(devices.items())) or "no instances"


def view(enabled: bool | None, instances: list[str], pending: bool | None = None) -> dict:
    """What --diff shows for one GPU."""
    if enabled is None:
        return {"mig": "not supported"}
    out: dict = {"mig": "enabled" if enabled else "disabled", "instances": list(instances)}
    if pending is not None and pending != enabled:
        out["mig_pending"] = "enabled" if pending else "disabled"
    return out


def differs(state: dict, want: dict) -> bool:
    """Whether a GPU's current state is not the wanted one."""
    if not state["mig_supported"]:
        return False
    if state["current"] != want["enabled"] or state["pending"] != want["enabled"]:
        return True
    if not want["enabled"]:
        return False
    return not state["clean"] or Counter(state["instances"]) != Counter(want["devices"])


def refuse_busy(plan: list[tuple[dict, dict]]) -> None:
    """LayoutError when a GPU that would change has processes running (on it or its MIG devices)."""
    busy = [
        f"GPU {g['index']} ({g['processes']} process(es))"
        for g, w in plan
        if differs(g, w) and g["processes"]
    ]
    if busy:
        raise LayoutError("refusing to change MIG while processes use the GPU: " + ", ".join(busy))


# -- NVML -------------------------------------------------------------------------------------------------


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


class MigNvml:
    """MIG reads and changes through pynvml (`nv`, initialized)."""

    def __init__(self, nv) -> None:
        self.nv = nv

    def gpus(self) -> list[dict]:
        nv = self.nv
        out = []
        for index in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(index)
            gpu = {
                "index": index,
                "uuid": _text(nv.nvmlDeviceGetUUID(h)),
                "model": _text(nv.nvmlDeviceGetName(h)),
                "pci_device_id": int(nv.nvmlDeviceGetPciInfo(h).pciDeviceId),
                "mig_supported": True,
                "current": None,
                "pending": None,
                "instances": [],
                "clean": True,
                "processes": 0,
            }
            try:
                current, pending = nv.nvmlDeviceGetMigMode(h)
            except nv.NVMLError_NotSupported:
                gpu["mig_supported"] = False
            else:
                gpu["current"], gpu["pending"] = current == 1, pending == 1
                gpu["profiles"] = self.nvml_profiles(h)
                if gpu["current"]:
                    gpu["instances"], gpu["clean"] = self._instances(h)
            gpu["processes"] = self.processes(h, gpu["current"])
            out.append(gpu)
        return out

    def _gpu_instances(self, h) -> list[tuple[object, object, str]]:
        """(GPU instance, its info, profile name) for every GPU instance, ordered by placement."""
        nv = self.nv
        found = []
        for profile, info in self.gi_profiles(h).items():
            arr = (nv.c_nvmlGpuInstance_t * max(info.instanceCount, 1))()
            count = ctypes.c_uint(0)
            nv.nvmlDeviceGetGpuInstances(h, info.id, arr, ctypes.byref(count))
            for k in range(count.value):
                gi_info = nv.nvmlGpuInstanceGetInfo(arr[k])
                found.append((arr[k], gi_info, profile))
        return sorted(found, key=lambda t: t[1].placement.start)

    def gi_profiles(self, h) -> dict:
        """{profile name without "MIG ": profile info} of the GPU (MIG must be on)."""
        nv = self.nv
        out = {}
        for index in range(nv.NVML_GPU_INSTANCE_PROFILE_COUNT):
            try:
                info = nv.nvmlDeviceGetGpuInstanceProfileInfo(h, index)
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                continue
            out[_text(info.name).replace("MIG ", "", 1)] = info
        return out

    def nvml_profiles(self, h) -> dict[str, Profile] | None:
        """The GPU's MIG profile table as NVML answers it (with MIG on or off), in the form of the fallback
        tables; None when NVML lists no profile or no placements (a driver that does not answer them with
        MIG off): the caller falls back to gpufleet's table for the model."""
        nv = self.nv
        table: dict[str, Profile] = {}
        try:
            profiles = self.gi_profiles(h)
            for name, info in profiles.items():
                placements = _placements(nv, h, info.id)
                if not placements:
                    return None
                # One size per profile on every MIG GPU so far; the largest is the safe one to plan with
                # (creating asks NVML for the size at the chosen start).
                size = max(p.size for p in placements)
                starts = tuple(sorted(p.start for p in placements))
                table[name] = (int(info.sliceCount), int(size), starts, int(info.instanceCount))
        except nv.NVMLError:
            return None
        return _order(table) or None

    def _compute_instances(self, gi) -> list[tuple[object, int]]:
        """(compute instance, its CI profile's slice count) in a GPU instance."""
        nv = self.nv
        found = []
        for index in range(nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, index, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                continue
            arr = (nv.c_nvmlComputeInstance_t * max(info.instanceCount, 1))()
            count = ctypes.c_uint(0)
            nv.nvmlGpuInstanceGetComputeInstances(gi, info.id, arr, ctypes.byref(count))
            found += [(arr[k], info.sliceCount) for k in range(count.value)]
        return found

    def _instances(self, h) -> tuple[list[str], bool]:
        """Profile names of the GPU instances; whether each has exactly one compute instance spanning it."""
        names, clean = [], True
        profiles = self.gi_profiles(h)
        for gi, _info, profile in self._gpu_instances(h):
            cis = self._compute_instances(gi)
            if len(cis) != 1 or cis[0][1] != profiles[profile].sliceCount:
                clean = False
            names.append(profile)
        return names, clean

    def processes(self, h, mig_on: bool | None) -> int:
        """Compute and graphics processes on the GPU and, with MIG on, on its MIG devices."""
        nv = self.nv
        handles = [h]
        if mig_on:
            for k in range(nv.nvmlDeviceGetMaxMigDeviceCount(h)):
                try:
                    handles.append(nv.nvmlDeviceGetMigDeviceHandleByIndex(h, k))
                except nv.NVMLError:
                    continue
        total = 0
        for handle in handles:
            for fn in (nv.nvmlDeviceGetComputeRunningProcesses, nv.nvmlDeviceGetGraphicsRunningProcesses):
                try:
                    total += len(fn(handle))
                except nv.NVMLError_NotSupported:
                    continue
        return total

    def destroy_all(self, index: int) -> int:
        """Destroy every compute and GPU instance of GPU `index`; returns how many GPU instances went."""
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(index)
        gone = 0
        for gi, _info, _profile in self._gpu_instances(h):
            for ci, _slices in self._compute_instances(gi):
                nv.nvmlComputeInstanceDestroy(ci)
            nv.nvmlGpuInstanceDestroy(gi)
            gone += 1
        return gone

    def mode(self, index: int) -> tuple[bool, bool]:
        current, pending = self.nv.nvmlDeviceGetMigMode(self.nv.nvmlDeviceGetHandleByIndex(index))
        return current == 1, pending == 1

    def set_mode(self, index: int, enabled: bool) -> None:
        nv = self.nv
        # The return value is the activation status (IN_USE on Ampere: pending until a GPU reset).
        nv.nvmlDeviceSetMigMode(
            nv.nvmlDeviceGetHandleByIndex(index),
            nv.NVML_DEVICE_MIG_ENABLE if enabled else nv.NVML_DEVICE_MIG_DISABLE,
        )

    def create(self, index: int, placement: list[tuple[str, int]]) -> None:
        """A GPU instance per (profile, start), each with one compute instance spanning it."""
        nv = self.nv
        h = nv.nvmlDeviceGetHandleByIndex(index)
        profiles = self.gi_profiles(h)
        for name, start in placement:
            if name not in profiles:
                raise LayoutError(f"GPU {index}: NVML lists no GPU-instance profile {name}")
            info = profiles[name]
            where = nv.c_nvmlGpuInstancePlacement_t()
            where.start, where.size = start, _placement_size(nv, h, info.id, start)
            gi = nv.nvmlDeviceCreateGpuInstanceWithPlacement(h, info.id, ctypes.byref(where))
            nv.nvmlGpuInstanceCreateComputeInstance(gi, self._full_ci_profile(gi, info.sliceCount))

    def _full_ci_profile(self, gi, slices: int) -> int:
        nv = self.nv
        for index in range(nv.NVML_COMPUTE_INSTANCE_PROFILE_COUNT):
            try:
                info = nv.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                    gi, index, nv.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
                )
            except (nv.NVMLError_NotSupported, nv.NVMLError_InvalidArgument):
                continue
            if info.sliceCount == slices:
                return index
        raise LayoutError(f"no compute-instance profile spans a {slices}-slice GPU instance")


def _placements(nv, h, profile_id: int) -> list:
    """The placements (start, size in memory slices) NVML offers GPU-instance profile `profile_id`."""
    count = ctypes.c_uint(0)
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, None, ctypes.byref(count))
    arr = (nv.c_nvmlGpuInstancePlacement_t * count.value)()
    nv.nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ctypes.byref(count))
    return list(arr)[: count.value]


def _placement_size(nv, h, profile_id: int, start: int) -> int:
    """The memory-slice size NVML gives profile `profile_id` at `start`."""
    for p in _placements(nv, h, profile_id):
        if p.start == start:
            return p.size
    raise LayoutError(
        f"NVML offers no placement at memory slice {start} for GPU-instance profile {profile_id}"
    )


# -- reading a config and applying a layout ------------------------------------------------------------


def load_layouts(layout: str, config_file: str | None = None, config: object = None) -> dict:
    """The checked layouts of a config (a file, or the parsed mapping); LayoutError unless `layout` is one
    of them."""
    if config_file:
        try:
            with open(config_file, encoding="utf-8") as f:
                data = load_config_text(f.read(), config_file)
        except OSError as exc:
            raise LayoutError(f"cannot read {config_file}: {exc.strerror}") from None
        source = config_file
    else:
        data, source = config, "config"
    layouts = check_config(data, source)
    if layout not in layouts:
        raise LayoutError(f"{source} has no layout {layout!r} (it has {', '.join(sorted(layouts))})")
    return layouts


def _apply(mig: MigNvml, gpu: dict, want: dict, reset: Callable[[int], None]) -> tuple[list[str], bool]:
    index, actions, was_reset = gpu["index"], [], False
    if gpu["current"]:
        gone = mig.destroy_all(index)
        if gone:
            actions.append(f"destroy {gone} GPU instance(s)")
    if (gpu["current"], gpu["pending"]) != (want["enabled"], want["enabled"]):
        mig.set_mode(index, want["enabled"])
        actions.append("enable MIG" if want["enabled"] else "disable MIG")
        if mig.mode(index)[0] != want["enabled"]:
            reset(index)
            was_reset = True
            actions.append("reset GPU")
            current = mig.mode(index)[0]
            if current != want["enabled"]:
                raise LayoutError(
                    f"GPU {index}: MIG mode still {'on' if current else 'off'} after a GPU reset"
                )
    if want["enabled"] and want["placement"]:
        mig.create(index, want["placement"])
        actions.append(f"create {len(want['placement'])} GPU instance(s)")
    return actions, was_reset


def _planned_actions(gpu: dict, want: dict) -> list[str]:
    actions = []
    if gpu["current"] and gpu["instances"]:
        actions.append(f"destroy {len(gpu['instances'])} GPU instance(s)")
    if (gpu["current"], gpu["pending"]) != (want["enabled"], want["enabled"]):
        actions.append("enable MIG" if want["enabled"] else "disable MIG")
    if want["enabled"] and want["placement"]:
        actions.append(f"create {len(want['placement'])} GPU instance(s)")
    return actions


def run_layout(
    nv, layouts: dict, layout: str, result: dict, *, check_mode: bool, reset: Callable[[int], None]
) -> None:
    """Apply `layout` to the GPUs NVML (`nv`, initialized) shows; fills `result` as it goes: `changed`,
    `gpus` (one entry per GPU the layout covers) and `diff`. In check mode nothing is changed. `reset(i)`
    resets GPU i (nvidia-smi --gpu-reset -i i) and raises LayoutError when that fails. Raises LayoutError
    (or the NVML error) with `result` holding what was done before."""
    result.setdefault("changed", False)
    result.setdefault("gpus", [])
    mig = MigNvml(nv)
    gpus = mig.gpus()
    wanted = wanted_per_gpu(layouts[layout], layout, gpus)
    plan = [(g, wanted[g["index"]]) for g in gpus if g["index"] in wanted]
    refuse_busy(plan)
    before: dict = {}
    after: dict = {}
    result["diff"] = {"before": before, "after": after}
    for gpu, want in plan:
        change = differs(gpu, want)
        entry = {
            "index": gpu["index"],
            "uuid": gpu["uuid"],
            "model": gpu["model"],
            "changed": change,
            "actions": [],
            "reset": False,
            "before": view(
                gpu["current"] if gpu["mig_supported"] else None, gpu["instances"], gpu["pending"]
            ),
        }
        wanted_view = view(
            want["enabled"] if gpu["mig_supported"] else None, [p[0] for p in want["placement"]]
        )
        if change and check_mode:
            entry["actions"] = _planned_actions(gpu, want)
            entry["after"] = wanted_view
        elif change:
            result["changed"] = True  # from here on the GPU may have changed, even if applying fails
            entry["actions"], entry["reset"] = _apply(mig, gpu, want, reset)
            current, pending = mig.mode(gpu["index"])
            instances = mig.gpus()[gpu["index"]]["instances"] if current else []
            entry["after"] = view(current, instances, pending)
        else:
            entry["after"] = entry["before"]
        result["changed"] = result["changed"] or change
        result["gpus"].append(entry)
        key = f"gpu{gpu['index']}"
        before[key], after[key] = entry["before"], entry["after"]
