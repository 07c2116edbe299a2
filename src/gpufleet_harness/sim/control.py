"""Failure injection into a sim root: the `control` file, the `events` log and host-tree side effects.

The C library re-reads `control` whenever it changes (one stat() per NVML call) and event sets read
`events` as it grows, so injections reach processes that are already running.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet_harness.sim import machine as simmachine


class InjectError(ValueError):
    """An injection that makes no sense for this root (bad words, GPU index out of range, ...)."""


USAGE = ("driver loaded|unloaded, fabricmanager running|stopped, gpu N lost|ok, xid N CODE, "
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


def append_event(root: str | os.PathLike[str], kind: str, gpu: int, value: int) -> None:
    """Append one event line (`xid GPU CODE` / `ecc-dbe GPU COUNT`) in a single write()."""
    line = f"{kind} {gpu} {value}\n".encode()
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
        if len(words) != 3 or words[2] not in ("lost", "ok"):
            raise InjectError("usage: gpu N lost|ok")
        n = _gpu(words[1], m)
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
        if len(words) != 3:
            raise InjectError(f"usage: {what} N {'CODE' if what == 'xid' else 'COUNT'}")
        n = _gpu(words[1], m)
        value = _int(words[2], "XID code" if what == "xid" else "error count")
        append_event(root, what, n, value)
        return f"{what} {n} {value}"
    if what == "library":
        present = _choice(words, ("missing", "present")) == "present"
        try:
            simmachine.set_library_files(root, present)
        except FileNotFoundError as e:
            raise InjectError(str(e)) from None
        return f"library {'present' if present else 'missing'}"
    raise InjectError(f"unknown injection {what!r}; one of: {USAGE}")
