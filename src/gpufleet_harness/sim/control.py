"""Failure injection into a sim root: the `control` file, the `events` log and host-tree side effects.

The C library re-reads `control` whenever it changes (one stat() per NVML call) and event sets read
`events` as it grows, so injections reach processes that are already running.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.files import atomic_write
from gpufleet_harness.sim import machine as simmachine


class InjectError(ValueError):
    """An injection that makes no sense for this root (bad words, GPU index out of range, ...)."""


USAGE = ("driver loaded|unloaded, fabricmanager running|stopped, gpu N lost|ok|reset, xid N CODE [GI CI], "
         "ecc-dbe N COUNT, library missing|present")


@dataclass
class ControlState:
    """The whole content of a `control` file."""

    driver_loaded: bool = True
    fabricmanager: str | None = None  # "running" / "stopped"; None where the machine has no NVSwitch
    lost: set[int] = field(default_factory=set)


def read_control(root: str | os.PathLike[str]) -> ControlState:
    """Parse a root's control file (missing → defaults)."""
    state = ControlState()
    try:
        text = (Path(root) / "control").read_text()
    except FileNotFoundError:
        return state
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] == "driver":
            state.driver_loaded = words[1] != "unloaded"
        elif len(words) >= 2 and words[0] == "fabricmanager":
            state.fabricmanager = words[1]
        elif len(words) >= 3 and words[0] == "gpu" and words[1].isdigit() and words[2] == "lost":
            state.lost.add(int(words[1]))
    return state


def save_control(root: str | os.PathLike[str], state: ControlState) -> None:
    """Rewrite the control file atomically."""
    simmachine.write_control(Path(root), driver_loaded=state.driver_loaded, fabricmanager=state.fabricmanager,
                             lost=state.lost)


def reset_gpu_mig(root: str | os.PathLike[str], machine: dict, gpu: int) -> None:
    """A GPU reset as the driver sees it for MIG: the pending MIG mode becomes current and the GPU's GPU
    and compute instances are gone. Rewrites the root's `mig` file (see native/mig.c) atomically."""
    path = Path(root) / "mig"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        lines = []
    modes: dict[int, tuple[int, int]] = {}
    kept: list[str] = []
    for raw in lines:
        words = raw.split()
        if len(words) >= 4 and words[0] == "mode" and all(w.isdigit() for w in words[1:4]):
            modes[int(words[1])] = (int(words[2]), int(words[3]))
        elif len(words) >= 2 and words[0] in ("gi", "ci") and words[1].isdigit() and int(words[1]) != gpu:
            kept.append(raw)
    g = machine["gpus"][gpu]
    if g.get("mig_mode") is not None:
        _, pending = modes.get(gpu, (g["mig_mode"]["current"], g["mig_mode"]["pending"]))
        modes[gpu] = (pending, pending)
    out = ["# MIG state of the simulated driver (gpufleet GPU simulator); rewritten by libnvidia-ml"]
    out += [f"mode {i} {cur} {pend}" for i, (cur, pend) in sorted(modes.items())]
    atomic_write(path, "\n".join(out + kept) + "\n")


def mig_compute_instances(root: str | os.PathLike[str], gpu: int) -> set[tuple[int, int]]:
    """(GPU-instance id, compute-instance id) of the GPU's compute instances, from the root's `mig` file."""
    try:
        lines = (Path(root) / "mig").read_text().splitlines()
    except FileNotFoundError:
        return set()
    found = set()
    for raw in lines:
        words = raw.split()
        if len(words) < 4 or words[0] != "ci" or not all(w.isdigit() for w in words[1:4]):
            continue
        if int(words[1]) == gpu:
            found.add((int(words[2]), int(words[3])))
    return found


def append_event(root: str | os.PathLike[str], kind: str, gpu: int, value: int,
                 mig: tuple[int, int] | None = None) -> None:
    """Append one event line (`xid GPU CODE [GI CI]` / `ecc-dbe GPU COUNT`) in a single write()."""
    where = f" {mig[0]} {mig[1]}" if mig else ""
    line = f"{kind} {gpu} {value}{where}\n".encode()
    fd = os.open(Path(root) / "events", os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def _int(word: str, what: str) -> int:
    try:
        value = int(word, 0)
    except ValueError:
        raise InjectError(f"{what} must be an integer, got {word!r}") from None
    if value < 0:
        raise InjectError(f"{what} must not be negative, got {value}")
    return value


def _gpu(word: str, machine: dict) -> int:
    n = _int(word, "GPU index")
    if n >= len(machine["gpus"]):
        raise InjectError(f"GPU {n} does not exist: {machine['name']} has GPUs 0-{len(machine['gpus']) - 1}")
    return n


def _choice(words: list[str], options: tuple[str, str]) -> str:
    if len(words) != 2 or words[1] not in options:
        raise InjectError(f"usage: {words[0]} {'|'.join(options)}")
    return words[1]


def inject(root: str | os.PathLike[str], words: list[str]) -> str:
    """Apply one injection (e.g. `["gpu", "3", "lost"]`) to a sim root; returns a one-line summary."""
    root = Path(root)
    m = simmachine.load_machine(root)
    if not words:
        raise InjectError(f"nothing to inject; one of: {USAGE}")
    state = read_control(root)
    what = words[0]
    if what == "driver":
        loaded = _choice(words, ("loaded", "unloaded")) == "loaded"
        state.driver_loaded = loaded
        save_control(root, state)
        simmachine.set_driver_files(root, m, loaded)
        return f"driver {'loaded' if loaded else 'unloaded'}"
    if what == "fabricmanager":
        fm = _choice(words, ("running", "stopped"))
        if not m.get("fabricmanager_required"):
            raise InjectError(f"{m['name']} has no NVSwitches: fabricmanager has no effect there")
        state.fabricmanager = fm
        save_control(root, state)
        return f"fabricmanager {fm}"
    if what == "gpu":
        if len(words) != 3 or words[2] not in ("lost", "ok", "reset"):
            raise InjectError("usage: gpu N lost|ok|reset")
        n = _gpu(words[1], m)
        if words[2] == "reset":
            # nvidia-smi -r: a pending MIG mode applies, MIG instances are gone, a lost GPU stays lost.
            reset_gpu_mig(root, m, n)
            return f"gpu {n} reset"
        if words[2] == "lost":
            state.lost.add(n)
            save_control(root, state)
            # A GPU that falls off the bus shows up as XID 79 to whoever watches events.
            append_event(root, "xid", n, 79)
        else:
            state.lost.discard(n)
            save_control(root, state)
        return f"gpu {n} {words[2]}"
    if what in ("xid", "ecc-dbe"):
        if not (len(words) == 3 or (what == "xid" and len(words) == 5)):
            raise InjectError(f"usage: {what} N {'CODE [GI CI]' if what == 'xid' else 'COUNT'}")
        n = _gpu(words[1], m)
        value = _int(words[2], "XID code" if what == "xid" else "error count")
        mig = None
        if len(words) == 5:
            # An XID inside a MIG device: its GPU- and compute-instance ids, which must exist.
            mig = (_int(words[3], "GPU instance id"), _int(words[4], "compute instance id"))
            if mig not in mig_compute_instances(root, n):
                raise InjectError(f"GPU {n} has no compute instance {mig[1]} in GPU instance {mig[0]}")
        append_event(root, what, n, value, mig)
        return f"{what} {n} {value}" + (f" (GI {mig[0]} CI {mig[1]})" if mig else "")
    if what == "library":
        present = _choice(words, ("missing", "present")) == "present"
        try:
            simmachine.set_library_files(root, present)
        except FileNotFoundError as e:
            raise InjectError(str(e)) from None
        return f"library {'present' if present else 'missing'}"
    raise InjectError(f"unknown injection {what!r}; one of: {USAGE}")
