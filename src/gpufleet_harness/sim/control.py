"""Failure injection into a sim root: the `control` file, the `events` log and host-tree side effects.

The C library re-reads `control` whenever it changes (one stat() per NVML call) and event sets read
`events` as it grows, so injections reach processes that are already running.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.files import atomic_write
from gpufleet_harness.sim import machine as simmachine
from gpufleet_harness.sim import workload


class InjectError(ValueError):
    """An injection that makes no sense for this root (bad words, GPU index out of range, ...)."""


USAGE = ("driver loaded|unloaded|hang [SECONDS], fabricmanager running|stopped, gpu N lost|ok|reset, "
         "gpu N hang [SECONDS], xid N CODE [GI CI], "
         "ecc-dbe N COUNT, library missing|present, load N [util U] [memory-util U] [encoder U] [decoder U] "
         "[pid P] [memory MIB] [name NAME] [seconds S] [kind compute|membound], idle N|all, "
         "clock SECONDS|+SECONDS|real")
# The options of `load`, each followed by its value: option → (keyword of workload.start, type).
LOAD_OPTIONS: dict[str, tuple[str, type]] = {
    "util": ("util", int), "memory-util": ("mem_util", int), "encoder": ("enc", int), "decoder": ("dec", int),
    "pid": ("pid", int), "memory": ("memory_mib", int), "name": ("name", str), "seconds": ("seconds", float),
    "kind": ("kind", str),
}


@dataclass
class ControlState:
    """The whole content of a `control` file."""

    driver_loaded: bool = True
    fabricmanager: str | None = None  # "running" / "stopped"; None where the machine has no NVSwitch
    lost: set[int] = field(default_factory=set)
    # hung GPUs → until when (CLOCK_REALTIME ms; 0: until released): their calls do not return meanwhile
    hung: dict[int, int] = field(default_factory=dict)
    driver_hung: int | None = None  # likewise every call of the library; None: not hung
    clock_ms: int | None = None  # the frozen sim clock (ms since boot); None: the real CLOCK_BOOTTIME


def read_control(root: str | os.PathLike[str]) -> ControlState:
    """Parse a root's control file (missing → defaults)."""
    state = ControlState()
    try:
        text = (Path(root) / "control").read_text()
    except FileNotFoundError:
        return state
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] == "driver" and words[1] == "hung":
            state.driver_hung = _until(words[2:])
        elif len(words) >= 2 and words[0] == "driver":
            state.driver_loaded = words[1] != "unloaded"
        elif len(words) >= 2 and words[0] == "fabricmanager":
            state.fabricmanager = words[1]
        elif len(words) >= 3 and words[0] == "gpu" and words[1].isdigit() and words[2] == "lost":
            state.lost.add(int(words[1]))
        elif len(words) >= 3 and words[0] == "gpu" and words[1].isdigit() and words[2] == "hung":
            state.hung[int(words[1])] = _until(words[3:])
        elif len(words) == 2 and words[0] == "clock" and words[1].isdigit():
            state.clock_ms = int(words[1])
    return state


def _until(words: list[str]) -> int:
    """A `hung` line's deadline: its ms word, 0 (until released) when absent or unreadable, as the library."""
    return int(words[0]) if words and words[0].isdigit() else 0


def save_control(root: str | os.PathLike[str], state: ControlState) -> None:
    """Rewrite the control file atomically."""
    simmachine.write_control(Path(root), driver_loaded=state.driver_loaded, fabricmanager=state.fabricmanager,
                             lost=state.lost, clock_ms=state.clock_ms, hung=state.hung,
                             driver_hung=state.driver_hung)


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
    if what == "driver" and len(words) >= 2 and words[1] == "hang":
        if not state.driver_loaded:
            raise InjectError("driver hang: the driver is unloaded, so every call already fails at once; "
                              "`driver loaded` first")
        state.driver_hung, summary = _hang(words[2:], "driver", "driver loaded")
        save_control(root, state)
        return f"driver hung {summary}"
    if what == "driver":
        loaded = _choice(words, ("loaded", "unloaded")) == "loaded"
        state.driver_loaded = loaded
        state.driver_hung = None  # either way a call answers again: the driver is back, or gone
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
        if len(words) not in (3, 4) or words[2] not in ("lost", "ok", "reset", "hang") or (
                len(words) == 4 and words[2] != "hang"):
            raise InjectError("usage: gpu N lost|ok|reset|hang [SECONDS]")
        n = _gpu(words[1], m)
        if words[2] == "hang":
            state.hung[n], summary = _hang(words[3:], f"gpu {n}", f"gpu {n} ok")
            save_control(root, state)
            return f"gpu {n} hung {summary}"
        if words[2] == "reset":
            # nvidia-smi -r: a pending MIG mode applies, MIG instances are gone, a lost GPU stays lost.
            reset_gpu_mig(root, m, n)
            return f"gpu {n} reset"
        if words[2] == "lost":
            state.lost.add(n)
            state.hung.pop(n, None)  # a GPU off the bus fails its calls at once, the hung one too
            save_control(root, state)
            # A GPU that falls off the bus shows up as XID 79 to whoever watches events.
            append_event(root, "xid", n, 79)
        else:
            state.lost.discard(n)
            state.hung.pop(n, None)
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
    if what == "load":
        return _load(root, m, words)
    if what == "idle":
        if len(words) != 2:
            raise InjectError("usage: idle N|all")
        gpu = None if words[1] == "all" else _gpu(words[1], m)
        stopped = workload.stop(root, gpu=gpu)
        where = "every GPU" if gpu is None else f"GPU {gpu}"
        return f"{where} idle ({len(stopped)} workload{'s' if len(stopped) != 1 else ''} stopped)"
    if what == "clock":
        return _clock(root, state, words)
    if what == "library":
        present = _choice(words, ("missing", "present")) == "present"
        try:
            simmachine.set_library_files(root, present)
        except FileNotFoundError as e:
            raise InjectError(str(e)) from None
        return f"library {'present' if present else 'missing'}"
    raise InjectError(f"unknown injection {what!r}; one of: {USAGE}")


def _hang(words: list[str], what: str, release: str) -> tuple[int, str]:
    """`... hang [SECONDS]`: the control line's deadline (CLOCK_REALTIME ms, 0: until released) and how long.
    Real time, not the sim clock: a hung call holds up its caller's thread in real time."""
    if not words:
        return 0, f"until released ({release})"
    try:
        seconds = float(words[0])
    except ValueError:
        raise InjectError(f"{what} hang: seconds must be a number, got {words[0]!r}") from None
    if not 0 < seconds < 1e9:
        raise InjectError(f"{what} hang: seconds must be more than 0, got {words[0]!r}")
    return int(time.time() * 1000 + seconds * 1000), f"for {seconds:g} s (or until {release})"


def _load(root: Path, machine: dict, words: list[str]) -> str:
    """`load N [option value]...`: a workload on GPU N from now (see workload.start)."""
    if len(words) < 2 or len(words) % 2:
        raise InjectError(f"usage: load N [{'|'.join(LOAD_OPTIONS)} VALUE]...")
    gpu = _gpu(words[1], machine)
    kwargs: dict = {}
    for option, value in zip(words[2::2], words[3::2], strict=True):
        if option not in LOAD_OPTIONS:
            raise InjectError(f"load: unknown option {option!r}; one of: {', '.join(LOAD_OPTIONS)}")
        key, kind = LOAD_OPTIONS[option]
        if kind is int:
            kwargs[key] = _int(value, option)
        elif kind is float:
            try:
                kwargs[key] = float(value)
            except ValueError:
                raise InjectError(f"{option} must be a number, got {value!r}") from None
        else:
            kwargs[key] = value
    try:
        load = workload.start(root, gpu, **kwargs)
    except workload.WorkloadError as e:
        raise InjectError(str(e)) from None
    seconds = (load.end_ms - load.start_ms) / 1000
    until = "until stopped" if load.end_ms == workload.NO_END else f"for {seconds:g} s"
    return (f"load {load.id} on GPU {gpu}: {load.util} % busy ({load.kind}), pid {load.pid} ({load.name}), "
            f"{load.memory_mib} MiB, {until}")


def _clock(root: Path, state: ControlState, words: list[str]) -> str:
    """`clock SECONDS|+SECONDS|real`: freeze the sim clock at SECONDS since boot, step it, or follow the
    host's. A frozen clock only moves forward: readings already taken would otherwise change."""
    if len(words) != 2:
        raise InjectError("usage: clock SECONDS|+SECONDS|real")
    if words[1] == "real":
        state.clock_ms = None
        save_control(root, state)
        return "clock real"
    text = words[1]
    try:
        seconds = float(text.lstrip("+"))
    except ValueError:
        raise InjectError(f"clock: seconds since boot, +seconds or real, got {text!r}") from None
    if not 0 <= seconds < 1e12:
        raise InjectError(f"clock: seconds must be 0 or more, got {text!r}")
    ms = round(seconds * 1000)
    if text.startswith("+"):
        ms += workload.now_ms(root) if state.clock_ms is None else state.clock_ms
    elif state.clock_ms is not None and ms < state.clock_ms:
        raise InjectError(f"clock: the sim clock stands at {state.clock_ms / 1000:g} s and only moves "
                          f"forward, asked {seconds:g} s")
    state.clock_ms = ms
    save_control(root, state)
    return f"clock {ms / 1000:g} s"
