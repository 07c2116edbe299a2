"""Build the simulated `libnvidia-ml.so.1` from `native/` against NVIDIA's real `nvml.h`.

The header is $GPUFLEET_NVML_H, else the one PyPI's `nvidia-nvml-dev` installs (the newest NVML API,
the harness extra depends on it), else Debian's /usr/include/nvml.h.

The library lands in a cache keyed by a hash of the sources, the header and the compiler command:
`${GPUFLEET_CACHE:-~/.cache/gpufleet}/sim/<hash>/libnvidia-ml.so.1`. A cached build is reused, so
calling `build_library()` from every test session costs one stat.

    python -m gpufleet_harness.sim.build        # prints the library path
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

NATIVE_DIR = Path(__file__).resolve().parent / "native"
DEFAULT_HEADER = Path("/usr/include/nvml.h")
# PyPI package with NVIDIA's current nvml.h (it lands in site-packages/nvidia/cu<N>/include/).
NVML_DEV_PACKAGE = "nvidia-nvml-dev"
LIBRARY_NAME = "libnvidia-ml.so.1"
CFLAGS = ["-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-std=gnu11"]
# Libraries it links: a shared object may leave symbols undefined, so a missing one would only show when a
# program without them loaded (libm's exp, lround) opens the library; they are part of the build key.
LIBS = ["-lpthread", "-lm"]
# Only NVML's names are exported; internal helpers stay local.
VERSION_SCRIPT = "{\n  global: nvml*;\n  local: *;\n};\n"


class BuildError(RuntimeError):
    """The simulator cannot be built here; the message names the missing piece."""


def cache_dir() -> Path:
    """Root of gpufleet's build cache."""
    base = os.environ.get("GPUFLEET_CACHE")
    return Path(base) if base else Path.home() / ".cache" / "gpufleet"


def packaged_header() -> Path | None:
    """nvml.h of the installed PyPI package `nvidia-nvml-dev` (NVIDIA's current header), if any."""
    try:
        dist = importlib.metadata.distribution(NVML_DEV_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or []:
        if f.name == "nvml.h":
            path = Path(str(dist.locate_file(f)))
            if path.is_file():
                return path
    return None


def find_header() -> Path:
    """nvml.h to compile against, the first of: $GPUFLEET_NVML_H, the `nvidia-nvml-dev` package's header,
    /usr/include/nvml.h (Debian libnvidia-ml-dev)."""
    explicit = os.environ.get("GPUFLEET_NVML_H")
    header = Path(explicit) if explicit else (packaged_header() or DEFAULT_HEADER)
    if not header.is_file():
        raise BuildError(f"{header} not found: NVIDIA's NVML header is needed to build the GPU simulator; "
                         f"pip install {NVML_DEV_PACKAGE} (the harness extra) or "
                         "apt-get install libnvidia-ml-dev (Debian non-free)")
    return header


def find_compiler() -> str:
    """The C compiler: $CC or cc."""
    cc = os.environ.get("CC", "cc")
    path = shutil.which(cc)
    if not path:
        raise BuildError(f"no C compiler ({cc!r} not on PATH): apt-get install gcc")
    return path


def _sources() -> list[Path]:
    return sorted(p for p in NATIVE_DIR.iterdir() if p.suffix in (".c", ".h", ".py"))


def _gen_stubs_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("gpufleet_sim_gen_stubs", NATIVE_DIR / "gen_stubs.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def build_key(cc: str, header: Path) -> str:
    """Hash of everything the library depends on."""
    h = hashlib.sha256()
    for p in [*_sources(), header]:
        h.update(p.name.encode() + b"\0" + p.read_bytes() + b"\0")
    h.update(" ".join([cc, *CFLAGS, *LIBS]).encode())
    return h.hexdigest()[:16]


def build_library(*, force: bool = False, quiet: bool = True) -> Path:
    """Build (or reuse) the simulated libnvidia-ml.so.1; returns its path."""
    header = find_header()
    cc = find_compiler()
    out_dir = cache_dir() / "sim" / build_key(cc, header)
    lib = out_dir / LIBRARY_NAME
    if lib.is_file() and not force:
        return lib
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # Build in a private directory and rename it into place: concurrent builders (parallel test
    # sessions) never see a half-written library, and the loser of the race just discards its copy.
    work = Path(tempfile.mkdtemp(prefix=".build-", dir=out_dir.parent))
    try:
        sources = [p for p in _sources() if p.suffix == ".c"]
        stub_text, _ = _gen_stubs_module().stubs_source(
            header.read_text(errors="replace"), [p.read_text() for p in sources])
        (work / "stubs.c").write_text(stub_text)
        (work / "exports.map").write_text(VERSION_SCRIPT)
        cmd = [cc, *CFLAGS, f"-I{header.parent}", f"-I{NATIVE_DIR}", "-o", str(work / LIBRARY_NAME),
               *map(str, sources), str(work / "stubs.c"),
               f"-Wl,-soname,{LIBRARY_NAME}", f"-Wl,--version-script={work / 'exports.map'}", *LIBS]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise BuildError(f"compiling the GPU simulator failed:\n{' '.join(cmd)}\n{proc.stderr}")
        if not quiet and proc.stderr:
            sys.stderr.write(proc.stderr)
        if force and out_dir.exists():
            shutil.rmtree(out_dir, ignore_errors=True)
        try:
            work.rename(out_dir)
        except OSError:
            if not lib.is_file():
                raise
    finally:
        if work.exists():
            shutil.rmtree(work, ignore_errors=True)
    return lib


def main(argv: list[str] | None = None) -> int:
    """Build and print the library path; exit 1 with the reason if it cannot be built."""
    args = sys.argv[1:] if argv is None else argv
    try:
        print(build_library(force="--force" in args, quiet=False))
    except BuildError as e:
        print(f"gpufleet sim build: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
