"""Systemd test-host images built with debootstrap and imported into podman, cached by content key.

An image is named ``localhost/gpufleet-testhost:<suite>`` and labelled with the key of what went into it
(suite, mirror, package list, builder revision; for Ubuntu also its apt sources). A build is skipped when the
image with that key exists.

Debian suites come from this machine's Debian mirror. Ubuntu suites (``UBUNTU_SUITES``) come from Ubuntu's
archive, which CI may not reach: only opt-in scenarios use them (gpufleet_harness.testhosts.molecule).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import lzma
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from gpufleet_harness.testhosts.podman import podman, podman_env
from gpufleet_harness.testhosts.workspace import require_tools, state_dir

IMAGE_REPOSITORY = "localhost/gpufleet-testhost"
KEY_LABEL = "io.gpufleet.testhost.key"
# Bump when the build steps below change in a way the key does not capture.
BUILDER_REVISION = 3
# sudo: playbooks use become, as on real fleets.
DEFAULT_INCLUDE = ("systemd", "systemd-sysv", "python3", "dbus", "ca-certificates", "sudo")
DEBIAN_SUITES = ("bookworm", "trixie")
DEFAULT_MIRROR = "http://deb.debian.org/debian"
# Ubuntu releases a test host can run, and Ubuntu's archive (GPUFLEET_UBUNTU_MIRROR overrides it).
UBUNTU_SUITES = ("jammy", "noble")
UBUNTU_MIRROR = "http://archive.ubuntu.com/ubuntu"
# debootstrap's script for every Ubuntu release since 7.10; Debian 12's debootstrap names no release after
# kinetic (no noble link), so Ubuntu suites are always bootstrapped with it.
UBUNTU_DEBOOTSTRAP_SCRIPT = Path("/usr/share/debootstrap/scripts/gutsy")
# A stock Ubuntu server's apt sources: all four components of the release, -updates and -security pockets.
# The NVIDIA driver packages are in restricted, their current builds only in -updates/-security.
UBUNTU_COMPONENTS = ("main", "restricted", "universe", "multiverse")
UBUNTU_POCKETS = ("", "-updates", "-security")
# Debian's ubuntu-keyring (trixie; bookworm-backports) installs Ubuntu's archive keyring here.
UBUNTU_KEYRING = Path("/usr/share/keyrings/ubuntu-archive-keyring.gpg")
# Ubuntu Archive Automatic Signing Keys (2012, 2018): without UBUNTU_KEYRING, only these keys are taken from
# the ubuntu-keyring package downloaded from the archive (a fingerprint cannot be forged, the download can).
UBUNTU_ARCHIVE_KEYS = (
    "790BC7277767219C42C86F933B4FE6ACC0B21F32",
    "F6ECB3762474EDA9D21B7022871920D1991BC93C",
)
ARCHIVE_TIMEOUT = 10.0


class ArchiveUnreachableError(RuntimeError):
    """The archive an image is built from (and its test hosts install from) does not answer."""


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


def ubuntu_mirror() -> str:
    """Ubuntu's archive, or the mirror GPUFLEET_UBUNTU_MIRROR names."""
    return (os.environ.get("GPUFLEET_UBUNTU_MIRROR") or UBUNTU_MIRROR).rstrip("/")


def is_ubuntu(suite: str) -> bool:
    return suite in UBUNTU_SUITES


@dataclass(frozen=True)
class ImageSpec:
    """What a test-host image is built from. The mirror defaults to Ubuntu's archive for an Ubuntu suite,
    else to this machine's Debian mirror."""

    suite: str
    mirror: str = ""
    include: tuple[str, ...] = DEFAULT_INCLUDE

    def __post_init__(self) -> None:
        if not self.mirror:
            object.__setattr__(self, "mirror", ubuntu_mirror() if is_ubuntu(self.suite) else apt_mirror())

    @property
    def name(self) -> str:
        return f"{IMAGE_REPOSITORY}:{self.suite}"

    @property
    def ubuntu(self) -> bool:
        return is_ubuntu(self.suite)

    def sources_list(self) -> str:
        """The image's /etc/apt/sources.list (Ubuntu: a stock server's; Debian keeps debootstrap's)."""
        if not self.ubuntu:
            return ""
        components = " ".join(UBUNTU_COMPONENTS)
        return "".join(f"deb {self.mirror} {self.suite}{pocket} {components}\n" for pocket in UBUNTU_POCKETS)

    def key(self) -> str:
        content: dict[str, object] = {
            "suite": self.suite,
            "mirror": self.mirror,
            "include": sorted(self.include),
            "rev": BUILDER_REVISION,
        }
        # Only Ubuntu images have more: Debian images keep their keys (and so their cached images).
        if self.ubuntu:
            content["sources"] = self.sources_list()
        blob = json.dumps(content, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def require_archive(spec: ImageSpec, timeout: float = ARCHIVE_TIMEOUT) -> None:
    """Raise ArchiveUnreachableError unless the spec's archive answers for its suite (its Release file)."""
    url = f"{spec.mirror}/dists/{spec.suite}/Release"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=timeout):
            pass
    except (OSError, ValueError) as err:
        what = "Ubuntu archive" if spec.ubuntu else "archive"
        raise ArchiveUnreachableError(
            f"the {what} {spec.mirror} does not answer from this machine ({url}: {err})"
        ) from err


def _gpg(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["gpg", "--homedir", str(home), "--batch", "--quiet", "--no-autostart", *args],
        check=True,
        capture_output=True,
        text=True,
    )


def _fetch_ubuntu_keyring(spec: ImageSpec, dest: Path) -> None:
    """Ubuntu's archive signing keys (UBUNTU_ARCHIVE_KEYS only) from the archive's ubuntu-keyring package."""
    index_url = f"{spec.mirror}/dists/{spec.suite}/main/binary-amd64/Packages.xz"
    with urllib.request.urlopen(index_url, timeout=60) as response:
        index = lzma.decompress(response.read()).decode(errors="replace")
    match = re.search(r"^Package: ubuntu-keyring\n(?:.+\n)*?Filename: (\S+)", index, re.MULTILINE)
    if not match:
        raise RuntimeError(f"{index_url} lists no ubuntu-keyring package")
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        deb = work / "ubuntu-keyring.deb"
        with urllib.request.urlopen(f"{spec.mirror}/{match.group(1)}", timeout=60) as response:
            deb.write_bytes(response.read())
        subprocess.run(["dpkg-deb", "-x", str(deb), str(work / "x")], check=True, capture_output=True)
        home = work / "gnupg"
        home.mkdir(mode=0o700)
        _gpg(home, "--import", str(work / "x" / UBUNTU_KEYRING.relative_to("/")))
        listing = _gpg(home, "--with-colons", "--list-keys").stdout.splitlines()
        # A primary key's fingerprint is the fpr line right after its pub line.
        primaries = [
            b.split(":")[9]
            for a, b in itertools.pairwise(listing)
            if a.startswith("pub:") and b.startswith("fpr:")
        ]
        wanted = [fpr for fpr in primaries if fpr in UBUNTU_ARCHIVE_KEYS]
        if not wanted:
            raise RuntimeError(
                f"the ubuntu-keyring package from {spec.mirror} holds none of Ubuntu's archive signing keys "
                f"({', '.join(UBUNTU_ARCHIVE_KEYS)}); it holds {', '.join(primaries) or 'no key'}"
            )
        keys = subprocess.run(
            ["gpg", "--homedir", str(home), "--batch", "--no-autostart", "--export", *wanted],
            check=True,
            capture_output=True,
        ).stdout
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".partial")
    partial.write_bytes(keys)
    partial.replace(dest)


def ubuntu_keyring(spec: ImageSpec) -> Path:
    """The keyring debootstrap checks Ubuntu's archive with: the system's (Debian's ubuntu-keyring package)
    or, without it, Ubuntu's archive signing keys taken from the archive's own ubuntu-keyring package (by
    their fingerprints, UBUNTU_ARCHIVE_KEYS) and kept in the state dir."""
    if UBUNTU_KEYRING.exists():
        return UBUNTU_KEYRING
    cached = state_dir() / "keyrings" / UBUNTU_KEYRING.name
    if not cached.exists():
        try:
            _fetch_ubuntu_keyring(spec, cached)
        except (OSError, subprocess.CalledProcessError, lzma.LZMAError, RuntimeError) as err:
            raise RuntimeError(
                f"no Ubuntu archive keyring: {UBUNTU_KEYRING} is missing (Debian's package ubuntu-keyring, "
                "in trixie and bookworm-backports: `apt-get install -t bookworm-backports ubuntu-keyring` "
                f"with backports enabled) and taking the keys from {spec.mirror} failed: {err}"
            ) from err
    return cached


def image_key(name: str, label: str = KEY_LABEL) -> str | None:
    """The content key ``label`` of a local image, or None when the image does not exist."""
    result = podman("image", "inspect", "--format", "{{json .Labels}}", name, check=False)
    if result.returncode != 0:
        return None
    labels = json.loads(result.stdout.strip() or "null") or {}
    return labels.get(label)


def _debootstrap(spec: ImageSpec, rootfs: Path) -> None:
    # Ubuntu: debootstrap checks the archive with Ubuntu's keys and fetches main only (all the included
    # packages are there); _finish_rootfs then writes the stock sources.list.
    ubuntu = [f"--keyring={ubuntu_keyring(spec)}", "--components=main"] if spec.ubuntu else []
    script = [str(UBUNTU_DEBOOTSTRAP_SCRIPT)] if spec.ubuntu else []
    subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            *ubuntu,
            f"--include={','.join(spec.include)}",
            spec.suite,
            str(rootfs),
            spec.mirror,
            *script,
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
# gpufleet test host PID 1 (gpufleet_harness.testhosts.images): own name=systemd cgroup, then systemd.
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


def _finish_rootfs(rootfs: Path, spec: ImageSpec | None = None) -> None:
    if spec is not None and spec.ubuntu:
        (rootfs / "etc/apt/sources.list").write_text(spec.sources_list())
        # podman mounts its own resolv.conf: a file, not systemd-resolved's stub link into a /run it replaces.
        resolv = rootfs / "etc/resolv.conf"
        if resolv.is_symlink():
            resolv.unlink()
            resolv.write_text("")
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
    if spec.ubuntu:
        require_archive(spec)
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
        _finish_rootfs(rootfs, spec)
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


@contextmanager
def scratch_host(
    prefix: str, *options: str, command: tuple[str, ...] = (), boot: bool = False, release: str = "bookworm"
) -> Iterator[str]:
    """A test-host container of its own for a test: ``podman run -d`` of the ``release`` image under a unique
    name starting with ``prefix``, with ``options`` and ``command``; with ``boot``, systemd as PID 1
    (``--systemd=always``) and the host booted (running or degraded) before the name is yielded. Removed at
    the end, also when the test fails."""
    image = build_image(ImageSpec(release))
    name = f"{prefix}-{os.urandom(4).hex()}"
    try:
        podman(
            "run", "-d", "--name", name, *(["--systemd=always"] if boot else []), *options, image, *command
        )
        deadline = time.monotonic() + 120
        while boot:
            state = podman("exec", name, "systemctl", "is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"test host {name} did not boot in 120 s (systemd says {state or 'nothing'})"
                )
            time.sleep(0.5)
        yield name
    finally:
        podman("rm", "-f", "-t", "0", name, check=False)
