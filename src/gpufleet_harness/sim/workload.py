"""Workloads on the simulated GPUs: what makes the simulator's counters move.

A workload is a record in the sim root's ``workloads/state`` file: on which GPU, from when to when (sim
clock, ms since boot), how busy (GPU, memory-copy, encoder and decoder utilization), the process it stands
for (pid, name, GPU memory), and its kind: ``compute`` (matrix products, which meet the power cap) or
``membound`` (a memset loop: memory 100 % busy, below the cap, clocks at their maximum). The C library
reads the file (one ``stat()`` per call, re-read when it changes) and derives every moving reading from the
records and the time, so no daemon runs and every process reading one sim root sees the same GPU
(native/load.c; docs/simulator.md, "Workloads").

Writers (``gpufleet sim inject ROOT load ...``, the GPU burner in pods) rewrite the file atomically under an
``flock`` on ``workloads/lock``. ``workloads/`` is a directory so that the lab's container runtime can give
GPU containers a writable bind mount of it inside the read-only sim root.

The instantaneous power of a GPU is a step function of its records (``power_at``); NVML's power reading
is its one-second average and the energy counter its integral. Energy is the one reading that must never
go backwards, across processes too, so it is computed in integers (mW x ms = µJ) by the same rule here
and in C; ``fold`` uses it to keep the file short: the records of a GPU that has been idle for a minute
become one ``settled`` line holding the energy they added (and a ``counters`` line with the time idle and
held by the power cap and the PCIe bytes until then), without changing any reading.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import re
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from gpufleet.files import atomic_write

DIR = "workloads"
STATE = "state"
LOCK = "lock"
HEADER = (
    "# Workloads on the simulated GPUs (gpufleet GPU simulator); rewritten atomically under flock(lock).\n"
    "# load ID GPU START_MS END_MS UTIL MEM_UTIL ENC DEC PID MEMORY_MIB GI CI NAME KIND  (END -1: running)\n"
    "# settled GPU AT_MS EXTRA_UJ  (energy above idle of the folded records, up to AT_MS)\n"
    "# counters GPU AT_MS IDLE_MS CAPPED_MS TX_BYTES RX_BYTES  (since boot, up to a settled line's AT_MS)\n"
)
NO_END = -1
NO_INSTANCE = -1
LINGER_MS = 2500  # after its last workload a GPU keeps its clocks up this long (recorded: ~2.5 s at 125 W)
SETTLE_MS = 60_000  # a GPU idle this long has cooled down: its records may be folded
FOLD_AFTER = 16  # records per GPU before a writer folds them
STOP_GRACE_MS = 500  # a stop takes effect this far ahead of the real clock (see `stop`)
# What the driver adds per CUDA context on top of the process's own memory: 8.8125 MiB (recorded on two
# H200s: v1 used 2271084544 B = reserved 615.0625 MiB + process 1542 MiB + 8.8125 MiB; dmon's fb 1139 MiB with
# a process of 1130 MiB).
CONTEXT_KIB = 9024
COMPUTE, MEMBOUND = "compute", "membound"
KINDS = (COMPUTE, MEMBOUND)
# How far from idle to the cap a 100 % memory-bound load draws (recorded: 522.9 W on the H200, whose idle is
# 79.6 W and cap plateau 691.6 W), in 1/10000.
MEMBOUND_SHARE = 7244
# PCIe traffic (KB/s) per % busy of each kind, on top of the idle driver traffic (recorded: matrix products
# ~7.5 MB/s TX, ~15 MB/s RX; a memset loop 15-17 / 38-39 MB/s); load.c's PCIE_*_PER_UTIL*.
PCIE_PER_UTIL = {COMPUTE: (70, 145), MEMBOUND: (150, 384)}
MAX_RECORDS = 4096  # a state file beyond this is not one the writers made
_NAME = re.compile(r"[^A-Za-z0-9._:+/@=-]")
MAX_NAME = 63  # the library keeps 64 bytes of a name


class WorkloadError(ValueError):
    """A workload that cannot be registered (unknown GPU, not enough free memory, bad values)."""


@dataclass(frozen=True)
class Load:
    """One workload record."""

    id: int
    gpu: int
    start_ms: int
    end_ms: int = NO_END  # NO_END: running until stopped
    util: int = 100
    mem_util: int = 25
    enc: int = 0
    dec: int = 0
    pid: int = 0
    memory_mib: int = 0
    gi: int = NO_INSTANCE  # a MIG device's GPU- and compute-instance ids, else NO_INSTANCE
    ci: int = NO_INSTANCE
    name: str = "burn"
    kind: str = COMPUTE

    def active(self, t: int) -> bool:
        return self.start_ms <= t and (self.end_ms == NO_END or t < self.end_ms)

    def line(self) -> str:
        return (f"load {self.id} {self.gpu} {self.start_ms} {self.end_ms} {self.util} {self.mem_util} "
                f"{self.enc} {self.dec} {self.pid} {self.memory_mib} {self.gi} {self.ci} {self.name} "
                f"{self.kind}")


@dataclass(frozen=True)
class Counters:
    """What a GPU's counters had counted since boot: ms idle, ms held by the power cap, PCIe bytes."""

    idle_ms: int = 0
    capped_ms: int = 0
    tx_bytes: int = 0
    rx_bytes: int = 0


@dataclass(frozen=True)
class Settled:
    """A GPU's folded history: the energy above idle its records added up to `at_ms`, and its counters then
    (None: a file of an older writer, read as an idle GPU since boot)."""

    gpu: int
    at_ms: int
    extra_uj: int
    counters: Counters | None = None

    def line(self) -> str:
        text = f"settled {self.gpu} {self.at_ms} {self.extra_uj}"
        if self.counters is not None:
            c = self.counters
            text += f"\ncounters {self.gpu} {self.at_ms} {c.idle_ms} {c.capped_ms} {c.tx_bytes} {c.rx_bytes}"
        return text


@dataclass
class State:
    """The whole content of a state file."""

    next_id: int = 1
    loads: list[Load] = field(default_factory=list)
    settled: dict[int, Settled] = field(default_factory=dict)

    def text(self) -> str:
        lines = [f"next {self.next_id}"]
        lines += [s.line() for _, s in sorted(self.settled.items())]
        lines += [ld.line() for ld in self.loads]
        return HEADER + "\n".join(lines) + "\n"


def parse(text: str) -> State:
    """A state file's records; what is not a record (comments, garbage) is skipped, as the library does."""
    state = State()
    counters: dict[tuple[int, int], Counters] = {}
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        try:
            if len(words) == 2 and words[0] == "next":
                state.next_id = max(state.next_id, int(words[1]))
            elif len(words) == 4 and words[0] == "settled":
                s = Settled(int(words[1]), int(words[2]), int(words[3]))
                state.settled[s.gpu] = s
            elif len(words) == 7 and words[0] == "counters":
                n = [int(w) for w in words[1:]]
                if min(n) >= 0:
                    counters[(n[0], n[1])] = Counters(*n[2:])
            elif len(words) in (14, 15) and words[0] == "load":
                n = [int(w) for w in words[1:13]]
                # no kind (an older writer's line) or one this version does not know: compute, as in C
                kind = MEMBOUND if words[14:] == [MEMBOUND] else COMPUTE
                state.loads.append(Load(n[0], n[1], n[2], n[3], n[4], n[5], n[6], n[7], n[8], n[9], n[10],
                                        n[11], words[13], kind))
        except ValueError:
            continue
    state.next_id = max([state.next_id, *(ld.id + 1 for ld in state.loads)])
    for gpu, s in state.settled.items():
        if (gpu, s.at_ms) in counters:  # the library takes a counters line only at its settled instant
            state.settled[gpu] = replace(s, counters=counters[(gpu, s.at_ms)])
    return state


# -- the sim clock --------------------------------------------------------------------------------------


def frozen_clock_ms(root: str | os.PathLike[str]) -> int | None:
    """The frozen sim time of `control`'s ``clock MS`` line, None when the sim follows the real clock."""
    try:
        text = (Path(root) / "control").read_text()
    except FileNotFoundError:
        return None
    found = None
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) == 2 and words[0] == "clock" and words[1].lstrip("-").isdigit():
            found = int(words[1])
    return found


def real_clock_ms() -> int:
    """The host's CLOCK_BOOTTIME in ms: one clock for every process and container of the host."""
    return time.clock_gettime_ns(time.CLOCK_BOOTTIME) // 1_000_000


def now_ms(root: str | os.PathLike[str]) -> int:
    """The sim time of `root`: its frozen clock, else the real one (the library uses the same rule)."""
    frozen = frozen_clock_ms(root)
    return real_clock_ms() if frozen is None else frozen


# -- the model the library implements (energy part, exactly) -------------------------------------------


@dataclass(frozen=True)
class Params:
    """A GPU's power model (machine.json `load`; derived from its power fields when a root predates it)."""

    idle_mw: int
    cap_mw: int  # the power cap's plateau: a capped GPU settles here (recorded: 691 of 700 W)
    full_mw: int  # what a 100 % load would draw without the cap
    linger_mw: int  # after a workload, before the clocks drop (recorded: 125 W)
    linger_ms: int = LINGER_MS
    membound_mw: int | None = None  # what a 100 % memory-bound load draws; None: derived (membound_of)
    pcie_tx_kbps: int = 0  # the idle driver traffic over PCIe
    pcie_rx_kbps: int = 0


def membound_of(idle_mw: int, cap_mw: int) -> int:
    return idle_mw + (cap_mw - idle_mw) * MEMBOUND_SHARE // 10000


def derive_params(idle_mw: int, limit_mw: int) -> dict[str, int]:
    """The `load` entry machine.py writes for a GPU of this idle power and power limit."""
    cap = max(idle_mw, limit_mw * 988 // 1000)
    return {"idle_mw": idle_mw, "cap_mw": cap, "full_mw": idle_mw + (cap - idle_mw) * 4 // 3,
            "linger_mw": idle_mw + max(0, limit_mw - idle_mw) * 3 // 40, "linger_ms": LINGER_MS,
            "membound_mw": membound_of(idle_mw, cap)}


def params_of(gpu: dict[str, Any]) -> Params:
    """A machine.json GPU's Params."""
    doc = gpu.get("load") or derive_params(int(gpu["power_usage_mw"]), int(gpu["power_limit_mw"]))
    idle, cap = int(doc["idle_mw"]), int(doc["cap_mw"])
    pcie = gpu.get("pcie") or {}
    return Params(idle, cap, int(doc["full_mw"]), int(doc["linger_mw"]), int(doc.get("linger_ms", LINGER_MS)),
                  int(doc.get("membound_mw", membound_of(idle, cap))), int(pcie.get("tx_kbps", 0)),
                  int(pcie.get("rx_kbps", 0)))


def demand(p: Params, compute: int, membound: int) -> int:
    """What `compute` % of compute-bound and `membound` % of memory-bound work would draw without the cap
    (mW): each kind its share of the way from idle to its full draw, scaled down together beyond 100 %."""
    full_mb = membound_of(p.idle_mw, p.cap_mw) if p.membound_mw is None else p.membound_mw
    scale = max(100, compute + membound)
    return p.idle_mw + ((p.full_mw - p.idle_mw) * compute + (full_mb - p.idle_mw) * membound) // scale


def _tally(loads: Iterable[Load], t: int) -> tuple[bool, dict[str, int], int | None]:
    """(any load running, utilisation summed per kind, the latest end of a finished one) at `t`."""
    util = {COMPUTE: 0, MEMBOUND: 0}
    active, last_end = False, None
    for ld in loads:
        if ld.active(t):
            active = True
            util[ld.kind] += ld.util
        elif ld.end_ms != NO_END and ld.end_ms <= t:
            last_end = ld.end_ms if last_end is None else max(last_end, ld.end_ms)
    return active, util, last_end


def power_at(p: Params, loads: Iterable[Load], t: int) -> int:
    """Instantaneous power (mW) at `t` of a GPU running `loads` (its records only)."""
    active, util, last_end = _tally(loads, t)
    if active:
        return min(demand(p, util[COMPUTE], util[MEMBOUND]), p.cap_mw)
    if last_end is not None and t < last_end + p.linger_ms:
        return p.linger_mw
    return p.idle_mw


def breakpoints(p: Params, loads: Iterable[Load]) -> list[int]:
    """Where the instantaneous power may change."""
    points: set[int] = set()
    for ld in loads:
        points.add(ld.start_ms)
        if ld.end_ms != NO_END:
            points.update((ld.end_ms, ld.end_ms + p.linger_ms))
    return sorted(points)


def extra_energy_uj(p: Params, loads: list[Load], since: int, until: int) -> int:
    """Energy above idle (µJ) the GPU used from `since` to `until` (ms)."""
    if until <= since:
        return 0
    edges = [since, *(b for b in breakpoints(p, loads) if since < b < until), until]
    return sum((power_at(p, loads, a) - p.idle_mw) * (b - a) for a, b in itertools.pairwise(edges))


def _stretch(p: Params, loads: Iterable[Load], t: int) -> tuple[bool, bool, int, int]:
    """(idle, held by the cap, PCIe TX KB/s, RX KB/s) of a GPU at `t`: load.c's state_at, same integers."""
    active, util, last_end = _tally(loads, t)
    uc, um = util[COMPUTE], util[MEMBOUND]
    scale = max(100, uc + um)
    (tc, rc), (tm, rm) = PCIE_PER_UTIL[COMPUTE], PCIE_PER_UTIL[MEMBOUND]
    tx = p.pcie_tx_kbps + (tc * uc + tm * um) * 100 // scale
    rx = p.pcie_rx_kbps + (rc * uc + rm * um) * 100 // scale
    idle = not active and (last_end is None or t >= last_end + p.linger_ms)
    return idle, active and demand(p, uc, um) > p.cap_mw, tx, rx


def counters_at(p: Params, state: State, gpu: int, t: int) -> Counters:
    """What `gpu`'s counters have counted since boot at `t`, as the library computes them."""
    settled = state.settled.get(gpu)
    origin = settled.at_ms if settled else 0
    c = settled.counters if settled and settled.counters else Counters(
        origin, 0, p.pcie_tx_kbps * origin, p.pcie_rx_kbps * origin)
    loads = [ld for ld in state.loads if ld.gpu == gpu]
    if t <= origin:
        return c
    edges = [origin, *(b for b in breakpoints(p, loads) if origin < b < t), t]
    idle_ms, capped_ms, tx, rx = c.idle_ms, c.capped_ms, c.tx_bytes, c.rx_bytes
    for a, b in itertools.pairwise(edges):
        idle, capped, tx_kbps, rx_kbps = _stretch(p, loads, a)
        idle_ms += (b - a) if idle else 0
        capped_ms += (b - a) if capped else 0
        tx, rx = tx + tx_kbps * (b - a), rx + rx_kbps * (b - a)
    return Counters(idle_ms, capped_ms, tx, rx)


def energy_mj(p: Params, state: State, gpu: int, t: int) -> int:
    """nvmlDeviceGetTotalEnergyConsumption of `gpu` at `t`, as the library computes it."""
    settled = state.settled.get(gpu)
    origin, extra = (settled.at_ms, settled.extra_uj) if settled else (0, 0)
    loads = [ld for ld in state.loads if ld.gpu == gpu]
    return (p.idle_mw * t + extra + extra_energy_uj(p, loads, origin, t)) // 1000


def fold(state: State, params: dict[int, Params], now: int) -> None:
    """Fold the records of GPUs that have more than FOLD_AFTER of them and have been idle SETTLE_MS."""
    for gpu, p in params.items():
        loads = [ld for ld in state.loads if ld.gpu == gpu]
        if len(loads) <= FOLD_AFTER or any(ld.end_ms == NO_END for ld in loads):
            continue
        if max(ld.end_ms for ld in loads) + p.linger_ms + SETTLE_MS > now:
            continue
        before = state.settled.get(gpu)
        origin, extra = (before.at_ms, before.extra_uj) if before else (0, 0)
        state.settled[gpu] = Settled(gpu, now, extra + extra_energy_uj(p, loads, origin, now),
                                     counters_at(p, state, gpu, now))
        state.loads = [ld for ld in state.loads if ld.gpu != gpu]


# -- reading and writing a root's state -----------------------------------------------------------------


def state_path(root: str | os.PathLike[str]) -> Path:
    return Path(root) / DIR / STATE


def read_state(root: str | os.PathLike[str]) -> State:
    """A root's workload records (none when there is no state file)."""
    try:
        return parse(state_path(root).read_text())
    except FileNotFoundError:
        return State()


@contextmanager
def locked(root: str | os.PathLike[str]) -> Iterator[State]:
    """The state under the writers' lock; what the caller leaves in it is written back atomically."""
    directory = Path(root) / DIR
    if not directory.is_dir():
        raise WorkloadError(f"{directory} does not exist: materialize the sim root again (gpufleet sim "
                            "materialize) or, in a container, run with the GPUs' sim root mounted")
    fd = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        state = read_state(root)
        before = state.text()
        yield state
        if len(state.loads) > MAX_RECORDS:
            raise WorkloadError(f"{state_path(root)} would hold {len(state.loads)} workload records, more "
                                f"than {MAX_RECORDS}: stop some (gpufleet sim inject ROOT idle all)")
        if state.text() != before:
            atomic_write(state_path(root), state.text())
    finally:
        os.close(fd)


def _machine(root: str | os.PathLike[str]) -> dict[str, Any]:
    with open(Path(root) / "machine.json", "rb") as fh:
        doc: dict[str, Any] = json.load(fh)
    return doc


def machine_params(machine: dict[str, Any]) -> dict[int, Params]:
    return {i: params_of(g) for i, g in enumerate(machine["gpus"])}


def _percent(value: int, what: str) -> int:
    if not 0 <= value <= 100:
        raise WorkloadError(f"{what} must be 0-100 %, got {value}")
    return value


def free_mib(machine: dict[str, Any], state: State, gpu: int, t: int) -> int:
    """Memory (MiB) a new process could still allocate on `gpu` at `t`."""
    g = machine["gpus"][gpu]
    total = (int(g["memory"]["total"]) - int(g["memory"]["reserved"])) // (1 << 20)
    used_kib = sum(ld.memory_mib * 1024 + CONTEXT_KIB for ld in state.loads if ld.gpu == gpu and ld.active(t))
    return total - -(-used_kib // 1024)


def start(root: str | os.PathLike[str], gpu: int, *, util: int = 100, mem_util: int | None = None,
          enc: int = 0, dec: int = 0, pid: int | None = None, memory_mib: int = 0, name: str = "burn",
          seconds: float | None = None, mig: tuple[int, int] | None = None, kind: str = COMPUTE) -> Load:
    """Register a workload on `gpu` starting now (sim clock); it runs `seconds` or until stopped.

    `kind`: COMPUTE (matrix products) or MEMBOUND (a memset loop). `mem_util` defaults to a quarter of
    `util` for compute work (the recording's matrix products: 100 % GPU, 25 % memory) and to `util` for
    memory-bound work (the recorded memset loop: 100 % and 100 %); `mig`: the (GPU instance, compute
    instance) of a MIG device it runs in. Refused when the GPU has not `memory_mib` (plus a context's
    CONTEXT_KIB) free, as cudaMalloc would fail."""
    machine = _machine(root)
    if not 0 <= gpu < len(machine["gpus"]):
        last = len(machine["gpus"]) - 1
        raise WorkloadError(f"GPU {gpu} does not exist: {machine['name']} has GPUs 0-{last}")
    if kind not in KINDS:
        raise WorkloadError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    util = _percent(util, "util")
    if mem_util is None:
        mem_util = util if kind == MEMBOUND else util // 4
    mem_util = _percent(mem_util, "memory utilization")
    enc, dec = _percent(enc, "encoder utilization"), _percent(dec, "decoder utilization")
    if memory_mib < 0:
        raise WorkloadError(f"memory must not be negative, got {memory_mib} MiB")
    if seconds is not None and seconds <= 0:
        raise WorkloadError(f"seconds must be positive, got {seconds}")
    clean = _NAME.sub("_", name)[:MAX_NAME] or "burn"
    with locked(root) as state:
        t = now_ms(root)
        fold(state, machine_params(machine), t)
        free = free_mib(machine, state, gpu, t)
        if memory_mib + -(-CONTEXT_KIB // 1024) > free:
            raise WorkloadError(f"GPU {gpu} has {free} MiB free, the workload asks for {memory_mib} MiB "
                                f"(+{CONTEXT_KIB / 1024:g} MiB for its context): out of memory")
        gi, ci = mig if mig else (NO_INSTANCE, NO_INSTANCE)
        load = Load(state.next_id, gpu, t, NO_END if seconds is None else t + max(1, round(seconds * 1000)),
                    util, mem_util, enc, dec, os.getpid() if pid is None else pid, memory_mib, gi, ci, clean,
                    kind)
        state.next_id += 1
        state.loads.append(load)
    return load


def _end_time(root: str | os.PathLike[str]) -> int:
    # On the real clock a stop lands a little ahead, so no reader has already seen the load running past it
    # (its energy would then shrink); a frozen clock has no readers ahead of it.
    frozen = frozen_clock_ms(root)
    return real_clock_ms() + STOP_GRACE_MS if frozen is None else frozen


def stop(root: str | os.PathLike[str], *, ids: Iterable[int] | None = None,
         gpu: int | None = None) -> list[Load]:
    """End running workloads now: those with `ids`, or all on `gpu`, or all. Returns the ones stopped."""
    wanted = None if ids is None else set(ids)
    stopped = []
    with locked(root) as state:
        end = _end_time(root)
        kept = []
        for ld in state.loads:
            running = ld.end_ms == NO_END or ld.end_ms > end
            if running and (wanted is None or ld.id in wanted) and (gpu is None or ld.gpu == gpu):
                ld = replace(ld, end_ms=max(end, ld.start_ms))
                stopped.append(ld)
            kept.append(ld)
        state.loads = kept
    return stopped


def renew(root: str | os.PathLike[str], ids: Iterable[int], lease_ms: int) -> list[Load]:
    """Extend the named workloads to now + `lease_ms` (a burner's heartbeat). A record whose end has passed
    is not reopened, since that would rewrite readings already taken: the burner starts a new one."""
    wanted = set(ids)
    renewed = []
    with locked(root) as state:
        t = now_ms(root)
        out = []
        for ld in state.loads:
            if ld.id in wanted and (ld.end_ms == NO_END or ld.end_ms > t):
                ld = replace(ld, end_ms=max(ld.end_ms, t + lease_ms))
                renewed.append(ld)
            out.append(ld)
        state.loads = out
    return renewed
