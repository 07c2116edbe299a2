"""Systemd test-host images built with debootstrap and imported into podman, cached by content key.

An image is named ``localhost/gpufleet-testhost:<suite>`` and labelled with the key of what went into it
(suite, mirror, package list, builder revision). A build is skipped when the image with that key exists.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpufleet.testhosts.podman import podman, podman_env
from gpufleet.testhosts.workspace import require_tools, state_dir

IMAGE_REPOSITORY = "localhost/gpufleet-testhost"
KEY_LABEL = "io.gpufleet.testhost.key"
# Bump when the build steps below change in a way the key does not capture.
BUILDER_REVISION = 3
# sudo: playbooks use become, as on real fleets.
DEFAULT_INCLUDE = ("systemd", "systemd-sysv", "python3", "dbus", "ca-certificates", "sudo")
DEBIAN_SUITES = ("bookworm", "trixie")
DEFAULT_MIRROR = "http://deb.debian.org/debian"


def apt_mirror(sources_dir: Path = Path("/etc/apt/sources.list.d")) -> str:
    """The Debian mirror this machine's apt uses (first plain http URI of a deb822 source), or Debian's."""
    override = os.environ.get("GPUFLEET_DEBIAN_MIRROR")
    if override:
        return override.rstrip("/")
    for path in sorted(sources_dir.glob("*.sources")):
        for match in re.finditer(r"^URIs:\s*(\S+)", path.read_text(), re.MULTILINE):
            uri = match.group(1).rstrip("/")
            if uri.startswith("http://") and uri.endswith("/debian"):
                return uri
    return DEFAULT_MIRROR


@dataclass(frozen=True)
class ImageSpec:
    """What a test-host image is built from."""

    suite: str
    mirror: str = field(default_factory=apt_mirror)
    include: tuple[str, ...] = DEFAULT_INCLUDE

    @property
    def name(self) -> str:
        return f"{IMAGE_REPOSITORY}:{self.suite}"

    def key(self) -> str:
        blob = json.dumps(
            {
                "suite": self.suite,
                "mirror": self.mirror,
                "include": sorted(self.include),
                "rev": BUILDER_REVISION,
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def image_key(name: str, label: str = KEY_LABEL) -> str | None:
    """The content key ``label`` of a local image, or None when the image does not exist."""
    result = podman("image", "inspect", "--format", "{{json .Labels}}", name, check=False)
    if result.returncode != 0:
        return None
    labels = json.loads(result.stdout.strip() or "null") or {}
    return labels.get(label)


def _debootstrap(spec: ImageSpec, rootfs: Path) -> None:
    subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(spec.include)}",
            spec.suite,
            str(rootfs),
            spec.mirror,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )


# PID 1 of a test host. On a cgroup v1 machine podman's systemd mode mounts the whole name=systemd
# hierarchy over /sys/fs/cgroup/systemd, so every host's systemd would put its units in the *same*
# /system.slice at the machine's root, and stopping one host reached into the others' cgroups. A host that
# may mount (privileged, in its own cgroup namespace) swaps that for a fresh mount whose root is its own
# cgroup; any other host boots as before.
INIT_WRAPPER = "/usr/local/sbin/gpufleet-init"
INIT_WRAPPER_TEXT = """#!/bin/sh
# gpufleet test host PID 1 (gpufleet.testhosts.images): own name=systemd cgroup, then systemd.
d=/sys/fs/cgroup/systemd
if [ -d /sys/fs/cgroup/cpu ] && [ "$(stat -f -c %T "$d" 2>/dev/null)" = cgroupfs ] \\
        && grep -q ' - cgroup cgroup rw,name=systemd$' /proc/self/mountinfo \\
        && grep -q '^0::/$' /proc/self/cgroup && umount "$d/release_agent" 2>/dev/null; then
    while mountpoint -q "$d"; do umount -l "$d" || break; done
    mount -t cgroup -o rw,nosuid,nodev,noexec,none,name=systemd cgroup "$d" \\
        || echo "gpufleet-init: cannot mount the name=systemd hierarchy" >&2
fi
exec /sbin/init "$@"
"""


def _finish_rootfs(rootfs: Path) -> None:
    wrapper = rootfs / INIT_WRAPPER.lstrip("/")
    wrapper.parent.mkdir(parents=True, exist_ok=True)
    wrapper.write_text(INIT_WRAPPER_TEXT)
    wrapper.chmod(0o755)
    # Each container must generate its own machine-id (systemd does so when the file is empty).
    (rootfs / "etc/machine-id").write_text("")
    for stale in (rootfs / "var/cache/apt/archives").glob("*.deb"):
        stale.unlink()
    for lists in (rootfs / "var/lib/apt/lists").glob("*_Packages"):
        lists.unlink()
    # Units that make no sense in a container and only slow boot or degrade the host state.
    wants = rootfs / "etc/systemd/system"
    for unit in ("systemd-remount-fs.service", "getty@tty1.service", "systemd-firstboot.service"):
        link = wants / unit
        link.unlink(missing_ok=True)
        link.symlink_to("/dev/null")


def build_image(spec: ImageSpec, force: bool = False) -> str:
    """Build (or reuse) the image for ``spec`` and return its name."""
    require_tools()
    key = spec.key()
    if not force and image_key(spec.name) == key:
        return spec.name
    work = state_dir() / "rootfs"
    work.mkdir(exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=work, prefix=f"{spec.suite}-") as tmp:
        rootfs = Path(tmp) / "root"
        try:
            _debootstrap(spec, rootfs)
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(
                f"debootstrap {spec.suite} from {spec.mirror} failed: {exc.stderr[-2000:]}"
            ) from exc
        _finish_rootfs(rootfs)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        subprocess.run(
            [
                "podman",
                "import",
                "--change",
                f'CMD ["{INIT_WRAPPER}"]',
                "--change",
                "STOPSIGNAL SIGRTMIN+3",
                "--change",
                f"LABEL {KEY_LABEL}={key}",
                "-",
                spec.name,
            ],
            stdin=tar.stdout,
            check=True,
            capture_output=True,
            env=podman_env(),
        )
        tar.wait()
        shutil.rmtree(rootfs, ignore_errors=True)
    _record_build(spec, key, time.monotonic() - started)
    return spec.name


def _record_build(spec: ImageSpec, key: str, seconds: float) -> None:
    log = state_dir() / "image-builds.jsonl"
    with log.open("a") as fh:
        fh.write(json.dumps({"image": spec.name, "key": key, "seconds": round(seconds, 1)}) + "\n")
