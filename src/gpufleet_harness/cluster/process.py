"""Daemons the test cluster (and the rest of the harness) starts: spawn with a log file, wait until healthy,
stop for sure.

Every daemon is started in its own session (so a stop reaches helpers it forked, such as the real
process behind ``nsenter``) and with ``PR_SET_PDEATHSIG``, so a test run that is killed outright does
not leave an apiserver behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")
_PR_SET_PDEATHSIG = 1


class ClusterError(RuntimeError):
    """A test-cluster (or other harness) component failed to start or to become healthy; the message points
    at its log."""


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the Python process that started it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


class Daemon:
    """A long-running child process with its own log file and a reliable :meth:`stop`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str | os.PathLike[str]],
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        stop_signal: int = signal.SIGTERM,
        stop_timeout: float = 10.0,
    ) -> None:
        self.name = name
        self.argv = [str(a) for a in argv]
        self.log_path = log_path
        self.stop_signal = stop_signal
        self.stop_timeout = stop_timeout
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.info("started %s pid=%d log=%s", name, self.proc.pid, log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        """Raise :class:`ClusterError` with the log tail if the process has exited."""
        if self.proc.poll() is not None:
            raise ClusterError(
                f"{self.name} exited with {self.proc.returncode}; log {self.log_path}:\n{self.tail()}"
            )

    def tail(self, lines: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        """Signal the whole session and wait until all of it is gone; SIGKILL it after ``stop_timeout``.

        Waiting for the group, not just the leader, matters for ``nsenter``-wrapped daemons: nsenter dies
        at once on SIGTERM while the daemon behind it is still shutting down cleanly.
        """
        if _group_alive(self.proc.pid):
            _signal_group(self.proc.pid, self.stop_signal)
            deadline = time.monotonic() + self.stop_timeout
            while _group_alive(self.proc.pid) and time.monotonic() < deadline:
                self.proc.poll()  # reap the leader so it stops counting as a member
                time.sleep(0.05)
            if _group_alive(self.proc.pid):
                log.warning("%s did not stop within %.0fs, killing", self.name, self.stop_timeout)
                _signal_group(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        log.info("stopped %s (exit %s)", self.name, self.proc.returncode)


def _group_alive(pgid: int) -> bool:
    """True while any process (zombies included) is left in process group ``pgid``."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except OSError as err:
        if err.errno != errno.ESRCH:
            raise


def wait_for(
    what: str,
    probe: Callable[[], T | None],
    timeout: float,
    *,
    interval: float = 0.1,
    alive: Callable[[], None] | None = None,
) -> T:
    """Poll ``probe`` until it returns something truthy; ``alive`` may raise to give up early."""
    deadline = time.monotonic() + timeout
    while True:
        result = probe()
        if result:
            return result
        if alive is not None:
            alive()
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that are free on ``host`` right now (held open together while chosen)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


_INSECURE = ssl.create_default_context()
_INSECURE.check_hostname = False
_INSECURE.verify_mode = ssl.CERT_NONE


def _http_get(url: str, token: str | None, ca_file: Path | None) -> tuple[int, bytes] | None:
    """(status, body) of a GET of ``url``, or None when it does not answer."""
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=str(ca_file)) if ca_file else _INSECURE
    try:
        with urllib.request.urlopen(request, timeout=2, context=context) as response:
            return response.status, response.read()
    except (urllib.error.URLError, OSError):
        return None


def http_ok(url: str, *, token: str | None = None, ca_file: Path | None = None) -> bool:
    """True when ``url`` answers 200 with body ``ok`` (Kubernetes health endpoints)."""
    got = _http_get(url, token, ca_file)
    return got is not None and got[0] == 200 and got[1].strip() == b"ok"


def http_found(url: str, *, token: str | None = None, ca_file: Path | None = None) -> bool:
    """True when ``url`` answers 200 (an API object that exists)."""
    got = _http_get(url, token, ca_file)
    return got is not None and got[0] == 200


def run(argv: Sequence[str | os.PathLike[str]], **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run a short command, raising :class:`ClusterError` with its output when it fails."""
    args = [str(a) for a in argv]
    proc = subprocess.run(args, capture_output=True, text=True, check=False, **kwargs)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise ClusterError(
            f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
        )
    return proc  # type: ignore[no-any-return]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created if needed) for the duration of the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
