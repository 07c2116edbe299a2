"""apt_source_lookup run as Ansible runs it, with the host's real apt as the judge of what it accepts.

Each case lays out an /etc/apt of the shape GPU images have (cuda-keyring's .list, NVIDIA's documented
nvidia-container-toolkit.list, deb822 .sources, Debian's own sources), asks the module, and checks with
`apt-get update --print-uris` (no network) that following its answer leaves a configuration apt loads.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from labstack import ensure_collection_link

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "plugins/modules/apt_source_lookup.py"
CUDA = "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64"
TOOLKIT = "https://nvidia.github.io/libnvidia-container/stable/deb/amd64"
# What `dpkg -i cuda-keyring_1.1-1_all.deb` leaves (NVIDIA's CUDA installation guide, Debian network repo).
CUDA_KEYRING_LIST = f"deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] {CUDA}/ /\n"
# NVIDIA's container toolkit install guide, after its sed: the literal $(ARCH) is apt's to expand.
TOOLKIT_LIST = (
    "deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] "
    "https://nvidia.github.io/libnvidia-container/stable/deb/$(ARCH) /\n"
)
# What ansible.builtin.deb822_repository writes for the roles (signed_by a URL: a key in /etc/apt/keyrings).
OWN_CUDA = textwrap.dedent(f"""\
    X-Repolib-Name: nvidia-cuda
    Types: deb
    URIs: {CUDA}
    Suites: /
    Signed-By: /etc/apt/keyrings/nvidia-cuda.asc
""")

pytestmark = pytest.mark.skipif(shutil.which("apt-get") is None, reason="needs apt-get (Debian or Ubuntu)")


def etc_apt(tmp_path: Path, files: dict[str, str], sources_list: str = "") -> Path:
    root = tmp_path / "etc-apt"
    (root / "sources.list.d").mkdir(parents=True)
    (root / "sources.list").write_text(sources_list)
    for name, text in files.items():
        (root / "sources.list.d" / name).write_text(text)
    return root


def lookup(root: Path, **args: Any) -> dict[str, Any]:
    argfile = root.parent / "args.json"
    argfile.write_text(
        json.dumps({"ANSIBLE_MODULE_ARGS": {"etc_apt": str(root), "architecture": "amd64", **args}})
    )
    env = {**os.environ, "PYTHONPATH": str(ensure_collection_link())}
    proc = subprocess.run(
        [sys.executable, str(MODULE), str(argfile)], capture_output=True, text=True, env=env, check=False
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def apt_accepts(root: Path) -> tuple[bool, str]:
    """Whether apt loads these sources (its own parser; --print-uris fetches nothing)."""
    state = root.parent / "apt-state"
    (state / "lists/partial").mkdir(parents=True, exist_ok=True)
    (state / "cache/archives/partial").mkdir(parents=True, exist_ok=True)
    options = {
        "Dir::Etc::SourceList": root / "sources.list",
        "Dir::Etc::SourceParts": root / "sources.list.d",
        "Dir::State::Lists": state / "lists",
        "Dir::Cache": state / "cache",
        "Dir::Cache::pkgcache": "",
        "Dir::Cache::srcpkgcache": "",
    }
    argv = (
        ["apt-get"] + [a for k, v in options.items() for a in ("-o", f"{k}={v}")] + ["update", "--print-uris"]
    )
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    accepted = proc.returncode == 0 and "E: " not in proc.stderr + proc.stdout
    return accepted, proc.stderr.strip()


def test_cuda_keyring_definition_is_reused_and_a_second_one_would_break_apt(tmp_path: Path) -> None:
    root = etc_apt(tmp_path, {"cuda-debian12-x86_64.list": CUDA_KEYRING_LIST})
    result = lookup(root, uri=CUDA, own_file=str(root / "sources.list.d/nvidia-cuda.sources"))
    assert result["reuse"] is True and not result.get("failed"), result
    assert result["files"] == [str(root / "sources.list.d/cuda-debian12-x86_64.list")]
    assert result["signed_by"] == "/usr/share/keyrings/cuda-archive-keyring.gpg"
    assert "already defined" in result["msg"]
    assert apt_accepts(root)[0]
    # What the roles did before: their own definition beside it. apt refuses both.
    (root / "sources.list.d/nvidia-cuda.sources").write_text(OWN_CUDA)
    accepted, error = apt_accepts(root)
    assert not accepted and "Conflicting values set for option Signed-By" in error


def test_a_conflict_already_on_the_host_is_named_with_its_files_and_nothing_changes(tmp_path: Path) -> None:
    root = etc_apt(
        tmp_path, {"cuda-debian12-x86_64.list": CUDA_KEYRING_LIST, "nvidia-cuda.sources": OWN_CUDA}
    )
    before = {p.name: p.read_text() for p in (root / "sources.list.d").iterdir()}
    result = lookup(root, uri=CUDA, own_file=str(root / "sources.list.d/nvidia-cuda.sources"))
    assert result["failed"] is True
    assert "cuda-debian12-x86_64.list:1 has /usr/share/keyrings/cuda-archive-keyring.gpg" in result["msg"]
    assert "nvidia-cuda.sources:1 has /etc/apt/keyrings/nvidia-cuda.asc" in result["msg"]
    assert "nothing was changed" in result["msg"]
    assert {p.name: p.read_text() for p in (root / "sources.list.d").iterdir()} == before
    assert not apt_accepts(root)[0], "apt agrees these conflict"


def test_documented_toolkit_list_with_arch_variable_is_reused(tmp_path: Path) -> None:
    root = etc_apt(tmp_path, {"nvidia-container-toolkit.list": TOOLKIT_LIST})
    result = lookup(root, uri=TOOLKIT, own_file=str(root / "sources.list.d/nvidia-container-toolkit.sources"))
    assert result["reuse"] is True
    assert result["signed_by"] == "/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg"
    assert apt_accepts(root)[0]


def test_deb822_definition_with_an_inline_key_and_http_scheme_is_reused(tmp_path: Path) -> None:
    stanza = textwrap.dedent(f"""\
        # cloud image's NVIDIA repository
        Types: deb
        URIs: {CUDA.replace("https://", "http://")}/
        Suites: /
        Signed-By:
         -----BEGIN PGP PUBLIC KEY BLOCK-----
         .
         mQINBGJYmlEBEAC6nJmeqByeReM+MSy4palACCnfOg4pOxffrrkldxz4jrDOZNK4
         -----END PGP PUBLIC KEY BLOCK-----
    """)
    root = etc_apt(tmp_path, {"cuda.sources": stanza})
    result = lookup(root, uri=CUDA)
    assert result["reuse"] is True and result["signed_by"] == "inline key"
    assert result["definitions"][0]["line"] == 2


def test_disabled_or_source_only_definitions_are_not_reused(tmp_path: Path) -> None:
    disabled = OWN_CUDA.replace("Types: deb", "Enabled: no\nTypes: deb")
    source_only = f"deb-src {CUDA} /\n"
    root = etc_apt(tmp_path, {"old.sources": disabled, "src.list": source_only})
    result = lookup(root, uri=CUDA)
    assert result["reuse"] is False and result["files"] == [] and result["signed_by"] is None
    assert len(result["definitions"]) == 2


def test_own_file_alone_is_not_reused(tmp_path: Path) -> None:
    root = etc_apt(tmp_path, {"nvidia-cuda.sources": OWN_CUDA})
    result = lookup(root, uri=CUDA + "/", own_file=str(root / "sources.list.d/nvidia-cuda.sources"))
    assert result["reuse"] is False and result["definitions"][0]["own"] is True
    assert "not defined outside" in result["msg"]


def test_debian_mirror_without_non_free_is_extended_with_the_same_signed_by(tmp_path: Path) -> None:
    debian = textwrap.dedent("""\
        Types: deb
        URIs: http://deb.debian.org/debian
        Suites: bookworm bookworm-updates
        Components: main
        Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
    """)
    root = etc_apt(tmp_path, {"debian.sources": debian})
    args = dict(
        uri="http://deb.debian.org/debian/",
        suites=["bookworm", "bookworm-updates"],
        components=["contrib", "non-free", "non-free-firmware"],
    )
    result = lookup(root, **args)
    assert (
        result["reuse"] is False and result["signed_by"] == "/usr/share/keyrings/debian-archive-keyring.gpg"
    )
    assert "without all of" in result["msg"]
    # The role's definition with the Signed-By the host uses: apt loads both.
    ours = debian.replace("main", " ".join(args["components"]))
    (root / "sources.list.d/debian-nonfree-nvidia.sources").write_text(ours)
    assert apt_accepts(root)[0]
    (root / "sources.list.d/debian.sources").write_text(
        debian.replace("main", "main contrib non-free non-free-firmware")
    )
    assert (
        lookup(root, **args, own_file=str(root / "sources.list.d/debian-nonfree-nvidia.sources"))["reuse"]
        is True
    )


def test_classic_sources_list_without_signed_by_gives_an_empty_signed_by(tmp_path: Path) -> None:
    root = etc_apt(tmp_path, {}, sources_list="deb http://deb.debian.org/debian bookworm main  # stock\n")
    result = lookup(root, uri="http://deb.debian.org/debian", suites=["bookworm"], components=["contrib"])
    assert result["reuse"] is False and result["signed_by"] == ""
    assert result["files"] == [str(root / "sources.list")]


def test_trusted_conflict_is_refused_as_apt_refuses_it(tmp_path: Path) -> None:
    trusted = f"deb [trusted=yes] {CUDA} /\n"
    root = etc_apt(tmp_path, {"a.list": trusted, "b.list": CUDA_KEYRING_LIST})
    result = lookup(root, uri=CUDA)
    assert result["failed"] is True and "Trusted differs" in result["msg"]
    assert not apt_accepts(root)[0]
