"""Where test-host state lives and which host tools it needs."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

# Debian packages that provide the tools below (what CI has to apt-get install).
HOST_PACKAGES = ("podman", "runc", "slirp4netns", "debootstrap", "gnupg", "dpkg")
REQUIRED_TOOLS = {
    "podman": "podman",
    "runc": "runc",
    "slirp4netns": "slirp4netns",
    "debootstrap": "debootstrap",
    "gpg": "gnupg",
    "dpkg-deb": "dpkg",
}


class MissingToolError(RuntimeError):
    """A host tool the test hosts need is not installed."""


def state_dir() -> Path:
    """The directory holding every piece of test-host state (images' build trees, repo, configs)."""
    root = Path(os.environ.get("GPUFLEET_HOSTLAB") or Path.cwd() / ".lab" / "hosts")
    root.mkdir(parents=True, exist_ok=True)
    return root.resolve()


def missing_tools() -> list[str]:
    """Names of required tools not on PATH, each with the Debian package that provides it."""
    return [f"{tool} (apt package {pkg})" for tool, pkg in REQUIRED_TOOLS.items() if not shutil.which(tool)]


def require_tools() -> None:
    """Raise MissingToolError naming every missing tool and the apt command that installs them."""
    missing = missing_tools()
    if missing:
        raise MissingToolError(
            "test hosts need: "
            + ", ".join(missing)
            + f"; install with: apt-get install -y {' '.join(HOST_PACKAGES)}"
        )
