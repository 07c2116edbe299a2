"""image_archive's refusals tell the operator how to make what is missing: the command they name is one the
real `gpufleet release` parser takes, and the gpufleet_images_dir they name is where that command writes the
archives (the directory build_images gets)."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest
from modrun import run_module

from gpufleet_harness.release import cli as release_cli
from gpufleet_harness.release import images as release_images

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "plugins/modules/image_archive.py"


def test_a_missing_images_dir_names_the_images_and_a_command_that_builds_them_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "nothing-here"
    empty.mkdir()
    names = ["device-plugin", "extender"]
    result = run_module(MODULE, tmp_path, images_dir=str(empty), names=names, push=False)
    assert result.get("failed"), result
    msg = result["msg"]
    assert "device-plugin and extender image(s)" in msg and str(empty / "images.json") in msg

    command = re.search(r"`(gpufleet release [^`]+)`", msg)
    assert command, msg
    argv = shlex.split(command.group(1))
    out = tmp_path / "dist"
    argv = [str(out) if a == "OUT" else a for a in argv]
    # the hint after the command: "... and set gpufleet_images_dir=<where it wrote them> (docs/install.md)"
    images_dir = re.search(r"and set gpufleet_images_dir=(\S+) \(", msg[command.end() :])
    assert images_dir, msg
    expected = Path(images_dir.group(1).replace("OUT", str(out)))

    # the real parser of `gpufleet release`, and where its run puts the images
    parser = argparse.ArgumentParser(prog="gpufleet")
    release_cli.register(parser.add_subparsers())
    args = parser.parse_args(argv[1:])
    built: list[Path] = []
    monkeypatch.setattr(release_images, "build", lambda dest, services: built.append(dest) or {})
    assert args.func(args) == 0
    assert built == [expected], (built, msg)
