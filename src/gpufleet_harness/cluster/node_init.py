"""PID 1 of a test-cluster node's private mount + PID namespace (started by
:mod:`gpufleet_harness.cluster.node` via unshare).

It shadows host paths for everything that later joins the namespace with ``nsenter``:

* ``/var`` and ``/run`` become the node's own directories, so the kubelet's compile-time paths
  (``/var/lib/kubelet/device-plugins/kubelet.sock``, ``/run/containerd/containerd.sock``) and the runtime's
  state stay inside the cluster directory;
* files bind-mounted over ``vm.overcommit_memory``, ``kernel.panic`` and ``kernel.panic_on_oops`` absorb
  the kubelet's writes, so the host's sysctls stay as they are.

Then it reaps orphans until SIGTERM, when it asks every process of the namespace to stop, kills what
is left after a grace period, and exits (the kernel would kill the rest when PID 1 exits anyway).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# sysctl -> the value the kubelet insists on (pkg/kubelet/cm/container_manager_linux.go)
KUBELET_SYSCTLS = {"vm/overcommit_memory": "1", "kernel/panic": "10", "kernel/panic_on_oops": "1"}
GRACE_SECONDS = 3.0


def _bind(source: Path | str, target: str) -> None:
    subprocess.run(["mount", "--bind", str(source), target], check=True)


def prepare(root: Path) -> None:
    """Bind the node's var/run and the sysctl stand-ins (must run inside the new mount namespace)."""
    for name, value in KUBELET_SYSCTLS.items():
        stand_in = root / "sysctl" / name.replace("/", ".")
        stand_in.parent.mkdir(parents=True, exist_ok=True)
        stand_in.write_text(value + "\n")
        _bind(stand_in, f"/proc/sys/{name}")
    _bind(root / "var", "/var")
    _bind(root / "run", "/run")


def _others() -> list[int]:
    """PIDs in this PID namespace other than ourselves (our /proc is the namespace's)."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != 1]


def _reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass


def serve() -> None:
    """Reap orphans until SIGTERM/SIGINT, then stop the namespace's processes and return."""
    stop = False

    def on_signal(_signum: int, _frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    while not stop:
        _reap()
        time.sleep(0.5)
    # kill(-1) reaches every process in this PID namespace except PID 1; container processes that
    # ignore SIGTERM (a shell as a container's PID 1) get SIGKILL after the grace period.
    for sig, grace in ((signal.SIGTERM, GRACE_SECONDS), (signal.SIGKILL, 2.0)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(-1, sig)
        deadline = time.monotonic() + grace
        while _others() and time.monotonic() < deadline:
            _reap()
            time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m gpufleet_harness.cluster.node_init --root NODE_DIR --ready FILE``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, required=True, help="node directory holding var/, run/")
    parser.add_argument("--ready", type=Path, required=True, help="file to create once mounts are in place")
    args = parser.parse_args(argv)
    if os.getpid() != 1:
        print("node_init must run as PID 1 of a new PID namespace", file=sys.stderr)
        return 2
    prepare(args.root)
    args.ready.write_text("ready\n")
    print("node namespace ready", flush=True)
    serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
