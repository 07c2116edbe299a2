"""The gpufleet.nvidia collection artifact: ``gpufleet release collection DIR``.

The checkout is the collection, but some of its module_utils are links into ``src/gpufleet`` (one copy of the
discovery, handoff and extender code). ``ansible-galaxy collection build`` keeps a link whose target lies
inside the collection as a link, so built from the checkout the artifact would carry ``src/`` and links into
it. The release build copies the files git knows (tracked, and untracked ones not ignored) into a staging
directory, dereferencing every link, leaves ``src/`` out and builds there. ``tests/sanity`` stays in (the
ignore file ansible-test reads); the rest of ``tests/`` is left out as galaxy.yml says.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from gpufleet_harness.release.images import REPO, BuildError

KEEP_TESTS = "sanity"  # the one directory of tests/ the artifact carries


def _files(repo: Path) -> list[str]:
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    ).stdout
    return sorted({f for f in out.decode().split("\0") if f})


def stage(repo: Path, dest: Path) -> Path:
    """A copy of the collection in ``dest`` with every link replaced by the file it points at."""
    for rel in _files(repo):
        if rel.startswith("src/"):
            continue
        source = repo / rel
        if not source.exists():  # deleted in the work tree, or a dangling link
            continue
        if source.is_symlink() and not source.resolve().is_relative_to(repo.resolve()):
            raise BuildError(f"collection: {rel} links outside the checkout ({source.resolve()})")
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target)  # follows links
    galaxy = yaml.safe_load((dest / "galaxy.yml").read_text())
    ignore = [p for p in galaxy.get("build_ignore") or [] if p != "tests"]
    ignore += sorted(f"tests/{p.name}" for p in (dest / "tests").iterdir() if p.name != KEEP_TESTS)
    galaxy["build_ignore"] = [*ignore, "src"]
    (dest / "galaxy.yml").write_text(yaml.safe_dump(galaxy, sort_keys=False))
    return dest


def build(out: Path, repo: Path = REPO) -> Path:
    """Build the artifact into ``out``; return its path."""
    galaxy = yaml.safe_load((repo / "galaxy.yml").read_text())
    out.mkdir(parents=True, exist_ok=True)
    artifact = out / f"{galaxy['namespace']}-{galaxy['name']}-{galaxy['version']}.tar.gz"
    tool = Path(sys.executable).parent / "ansible-galaxy"
    with tempfile.TemporaryDirectory(prefix="gpufleet-collection-") as tmp:
        staged = stage(repo, Path(tmp) / "nvidia")
        proc = subprocess.run(
            [
                str(tool) if tool.exists() else "ansible-galaxy",
                "collection",
                "build",
                "--force",
                "--output-path",
                str(out.resolve()),
                str(staged),
            ],
            capture_output=True,
            text=True,
            check=False,
        )
    if proc.returncode != 0 or not artifact.is_file():
        raise BuildError(
            f"collection: ansible-galaxy collection build exited {proc.returncode}: "
            f"{(proc.stderr or proc.stdout).strip()[-1500:]}"
        )
    return artifact


def build_wheel(out: Path, repo: Path = REPO) -> Path:
    """The gpufleet wheel (the checkout's setuptools, no network) into ``out``."""
    import gpufleet

    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "--wheel-dir",
            str(out),
            str(repo),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    wheel = out / f"gpufleet-{gpufleet.__version__}-py3-none-any.whl"
    if proc.returncode != 0 or not wheel.is_file():
        raise BuildError(f"wheel: pip wheel exited {proc.returncode}: {proc.stderr.strip()[-1500:]}")
    return wheel
