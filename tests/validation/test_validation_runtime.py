"""The runtime suite against a real dockerd 20.10 with an ``nvidia`` runtime entry, then without it.

NVIDIA's container toolkit is not installable here, so the ``nvidia`` runtime is a stand-in that does the
toolkit's part for simulated GPUs: for ``create`` it adds the sim root and its library to the bundle's
mounts and environment (as nvidia-container-runtime's hook mounts the driver), then execs runc. The check
itself is the suite's, unchanged: ``docker info`` lists the runtime, and ``nvidia-smi -L`` in a container
started with ``--runtime nvidia`` lists the host's GPUs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from validation_run import validate

from gpufleet_harness.cluster.images import IMPORT_CHANGES, LabImage, ensure_lab_image
from gpufleet_harness.cluster.process import Daemon, wait_for

pytestmark = pytest.mark.root

STANDIN = """#!{python} -IS
# nvidia runtime stand-in (tests only): the toolkit's job for simulated GPUs, then runc.
import json, os, sys
args = sys.argv[1:]
if "create" in args or "run" in args:
    bundle = next((args[i + 1] for i, a in enumerate(args) if a in ("--bundle", "-b")), None)
    bundle = bundle or next((a.split("=", 1)[1] for a in args if a.startswith("--bundle=")), None)
    if bundle:
        path = os.path.join(bundle, "config.json")
        spec = json.load(open(path))
        env = spec["process"].get("env", [])
        if any(e.startswith("NVIDIA_VISIBLE_DEVICES=") for e in env):
            for src in {mounts!r}:
                spec.setdefault("mounts", []).append(
                    {{"destination": src, "type": "bind", "source": src, "options": ["rbind", "ro"]}})
            env += {env!r}
            json.dump(spec, open(path + ".tmp", "w"))
            os.replace(path + ".tmp", path)
os.execv({runc!r}, [{runc!r}] + args)
"""


class Dockerd:
    """A private dockerd (own data, exec root and socket; no bridge, no iptables) with a reloadable config."""

    def __init__(self, base: Path, runtimes: dict[str, Any]) -> None:
        self.base = base
        self.socket = base / "docker.sock"
        self.config = base / "daemon.json"
        self.write(runtimes)
        argv = ["dockerd", f"--config-file={self.config}"]
        self.daemon = Daemon("dockerd[validation]", argv, base / "dockerd.log", stop_timeout=20)
        wait_for("dockerd", self.answers, 60, alive=self.daemon.check)

    def answers(self) -> bool:
        return self.cli("version", check=False).returncode == 0

    def write(self, runtimes: dict[str, Any]) -> None:
        config = {
            "data-root": str(self.base / "data"),
            "exec-root": str(self.base / "exec"),
            "pidfile": str(self.base / "docker.pid"),
            "hosts": [f"unix://{self.socket}"],
            "bridge": "none",
            "iptables": False,
            "ip-masq": False,
            "cgroup-parent": "/gpufleet-validation-docker",
            "deprecated-key-path": str(self.base / "key.json"),
            "shutdown-timeout": 1,
            "runtimes": runtimes,
        }
        self.config.write_text(json.dumps(config))

    def reload(self, runtimes: dict[str, Any]) -> None:
        """Rewrite the config and SIGHUP: dockerd reloads its runtimes without a restart."""
        self.write(runtimes)
        os.kill(int((self.base / "docker.pid").read_text()), signal.SIGHUP)
        names = set(runtimes)
        builtin = {"runc", "io.containerd.runc.v2", "io.containerd.runtime.v1.linux"}
        wait_for("dockerd to reload its runtimes", lambda: set(self.runtimes()) - builtin == names, 20)

    def runtimes(self) -> list[str]:
        out = self.cli("info", "--format", "{{json .Runtimes}}").stdout
        return sorted(json.loads(out or "{}"))

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        docker = "/usr/bin/docker" if Path("/usr/bin/docker").exists() else "docker"
        proc = subprocess.run(
            [docker, "-H", f"unix://{self.socket}", *args],
            capture_output=True,
            text=True,
            check=False,
            timeout=300,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"docker {' '.join(args)}: {proc.stderr}")
        return proc

    def stop(self) -> None:
        ids = self.cli("ps", "-aq", check=False).stdout.split()
        if ids:
            self.cli("rm", "-f", *ids, check=False)
        self.daemon.stop()


@pytest.fixture
def dockerd(
    sim_root: Callable[[str], Path], sim_lib: Path
) -> Iterator[tuple[Dockerd, dict[str, Any], LabImage]]:
    if os.geteuid() != 0 or not shutil.which("dockerd") or not shutil.which("runc"):
        pytest.fail("the runtime suite test needs root, dockerd and runc (docker.io, runc)")
    root = sim_root("dgx-a100")
    base = Path(tempfile.mkdtemp(prefix="gfv-", dir="/tmp"))  # short: containerd's socket paths are limited
    standin = base / "nvidia-runtime"
    env = [f"GPUFLEET_SIM_ROOT={root}", f"LD_LIBRARY_PATH={root / 'lib'}"]
    env.append(f"GPUFLEET_HOST_ROOT={root / 'host'}")
    standin.write_text(
        STANDIN.format(
            python=sys.executable, mounts=[str(root), str(sim_lib.parent)], env=env, runc=shutil.which("runc")
        )
    )
    standin.chmod(0o755)
    runtimes = {"nvidia": {"path": str(standin)}}
    daemon = Dockerd(base, runtimes)
    image = ensure_lab_image()
    try:
        daemon.cli("import", *IMPORT_CHANGES, str(image.tarball), image.name)
        yield daemon, runtimes, image
    finally:
        daemon.stop()
        for cgroup in Path("/sys/fs/cgroup").glob("*/gpufleet-validation-docker"):
            for child in sorted(cgroup.rglob("*"), key=lambda p: -len(p.parts)):
                if child.is_dir():
                    child.rmdir()
            cgroup.rmdir()
        shutil.rmtree(base, ignore_errors=True)


def test_runtime_suite_passes_with_the_nvidia_runtime_and_fails_naming_it_when_removed(
    dockerd: tuple[Dockerd, dict[str, Any], LabImage], tmp_path: Path
) -> None:
    daemon, runtimes, image = dockerd
    host = {
        "connection": "local://",
        "runtime": "docker",
        "docker_host": f"unix://{daemon.socket}",
        "runtime_image": image.name,
        "gpu_count": 8,
    }
    started = time.monotonic()
    good = validate({"hosts": {"docker-host": host}}, tmp_path / "good", "runtime")
    assert good.rc == 0, good.proc.stdout[-3000:]
    assert good.report["hosts"]["docker-host"] == {"runtime": "PASS 2/2"}
    assert time.monotonic() - started < 120

    daemon.reload({})
    bad = validate({"hosts": {"docker-host": host}}, tmp_path / "bad", "runtime")
    assert bad.rc == 1
    assert bad.message("docker-host", "nvidia_runtime_configured").startswith(
        "docker-host: docker has no 'nvidia' runtime (runtimes: "
    )
    assert "run the nvidia_container_toolkit role" in bad.message("docker-host", "nvidia_runtime_configured")
    assert bad.message("docker-host", "nvidia_smi_in_container").startswith(
        "docker-host: nvidia-smi in a docker container exited 125:"
    )
    daemon.reload(runtimes)
