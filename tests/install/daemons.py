"""Private container runtimes and a registry for the image tests: containerd, dockerd and Debian's
docker-registry, each on its own socket or loopback port under a directory of its own, stopped (and the
directory removed) when the test is done, even when it fails."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpufleet_harness.cluster.process import free_ports


def _need(binary: str, package: str) -> str:
    path = shutil.which(binary)
    if not path:
        raise AssertionError(
            f"{binary} is missing: apt-get install {package} (scripts/bootstrap installs it)"
        )
    return path


def _wait(what: str, probe: object, proc: subprocess.Popen[bytes], log: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not probe():  # type: ignore[operator]
        if proc.poll() is not None:
            raise AssertionError(f"{what} exited {proc.returncode}: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not answer in {timeout:.0f} s: {log.read_text()[-2000:]}")
        time.sleep(0.2)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)


@contextlib.contextmanager
def _daemon(argv: list[str], workdir: Path, what: str, ready: object) -> Iterator[subprocess.Popen[bytes]]:
    log = workdir / "daemon.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            cwd=workdir,
        )
    try:
        _wait(what, ready, proc, log)
        yield proc
    finally:
        _stop(proc)


@dataclass
class Containerd:
    address: str
    ctr: str

    def images(self) -> dict[str, str]:
        """ref → target digest in namespace k8s.io."""
        out = subprocess.run(
            [self.ctr, "--address", self.address, "--namespace", "k8s.io", "images", "ls"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return {f[0]: f[2] for f in (line.split() for line in out.splitlines()[1:]) if len(f) >= 3}


@contextlib.contextmanager
def containerd() -> Iterator[Containerd]:
    """containerd without its CRI plugin, its root, state and socket in a new directory under /tmp (a unix
    socket path must stay short)."""
    binary, ctr = _need("containerd", "containerd"), _need("ctr", "containerd")
    work = Path(tempfile.mkdtemp(prefix="gf-ctd-", dir="/tmp"))
    try:
        address = str(work / "c.sock")
        (work / "config.toml").write_text(
            f'version = 2\nroot = "{work}/root"\nstate = "{work}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{address}"\n[ttrpc]\n  address = "{address}.ttrpc"\n'
            '[debug]\n  address = ""\n[metrics]\n  address = ""\n'
        )
        probe = Containerd(address, ctr)

        def ready() -> bool:
            return subprocess.run([ctr, "--address", address, "version"], capture_output=True).returncode == 0

        with _daemon([binary, "--config", str(work / "config.toml")], work, "containerd", ready):
            yield probe
    finally:
        # overlay snapshots may still be mounted below root until containerd has gone
        subprocess.run(["umount", "-R", "-l", str(work / "root")], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Docker:
    host: str
    client: str

    def image_id(self, ref: str) -> str | None:
        proc = subprocess.run(
            [self.client, "image", "inspect", "--format", "{{.Id}}", ref],
            capture_output=True,
            text=True,
            env={**os.environ, "DOCKER_HOST": self.host},
            check=False,
        )
        return proc.stdout.strip() if proc.returncode == 0 else None


@contextlib.contextmanager
def dockerd() -> Iterator[Docker]:
    """dockerd with its own data root, exec root and socket, no bridge and no iptables rules."""
    binary, client = _need("dockerd", "docker.io"), _need("docker", "docker.io")
    work = Path(tempfile.mkdtemp(prefix="gf-dkd-", dir="/tmp"))
    try:
        host = f"unix://{work}/d.sock"
        (work / "daemon.json").write_text("{}\n")
        argv = [
            binary,
            "--data-root",
            f"{work}/data",
            "--exec-root",
            f"{work}/exec",
            "--pidfile",
            f"{work}/pid",
            "-H",
            host,
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
            "--ip6tables=false",
            "--config-file",
            f"{work}/daemon.json",
        ]
        docker = Docker(host, client)

        def ready() -> bool:
            env = {**os.environ, "DOCKER_HOST": host}
            return subprocess.run([client, "version"], capture_output=True, env=env).returncode == 0

        with _daemon(argv, work, "dockerd", ready):
            yield docker
    finally:
        subprocess.run(["umount", "-R", "-l", str(work / "data")], capture_output=True, check=False)
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class Registry:
    address: str  # 127.0.0.1:<port>

    def catalog(self) -> list[str]:
        with urllib.request.urlopen(f"http://{self.address}/v2/_catalog", timeout=10) as response:
            return list(json.load(response)["repositories"])

    def manifest_digest(self, repository: str, tag: str) -> str:
        request = urllib.request.Request(
            f"http://{self.address}/v2/{repository}/manifests/{tag}",
            method="HEAD",
            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"},
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            return str(response.headers["Docker-Content-Digest"])


@contextlib.contextmanager
def registry() -> Iterator[Registry]:
    """Debian's docker-registry (the distribution project's registry) on a free loopback port, plain HTTP."""
    binary = _need("docker-registry", "docker-registry")
    work = Path(tempfile.mkdtemp(prefix="gf-reg-"))
    try:
        (port,) = free_ports(1)
        (work / "config.yml").write_text(
            "version: 0.1\nlog: {level: warn}\n"
            f"storage: {{filesystem: {{rootdirectory: {work}/data}}}}\nhttp: {{addr: 127.0.0.1:{port}}}\n"
        )

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/", timeout=2) as response:
                    return response.status == 200
            except OSError:
                return False

        with _daemon([binary, "serve", str(work / "config.yml")], work, "docker-registry", ready):
            yield Registry(f"127.0.0.1:{port}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
