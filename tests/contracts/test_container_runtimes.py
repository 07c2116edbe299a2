"""nvidia_container_toolkit against container runtimes as fleets have them.

containerd: each distribution's real binary, with the tomlkit the distribution packages (the module edits
config.toml with it on the host): Debian's containerd 1.6 (bookworm, python3-tomlkit 0.11.7), 1.7 (trixie,
0.13.2) and 2.1 (sid, 0.13.3), Ubuntu's 2.2.1 (jammy-updates with 0.9.2, noble-updates with 0.12.4, both
universe), and EL 9's tomlkit (EPEL 9 packages 0.11.4; here the PyPI wheel of that release, as EPEL is not
reachable) with containerd 1.7 (Debian's binary: EL hosts run Docker CE's containerd.io, not downloadable
here). Each binary runs standalone for `containerd --config F config dump` (no daemon), which judges every
config the module writes: a fresh host, the distribution's own config.toml (Ubuntu ships none: its
`containerd config default`), version-2 and version-3 site configs, Docker CE's CRI-disabled config, and
every TOML shape containerd accepts (one-line and multi-line arrays, inline tables, dotted and quoted keys in
either quote style, comments, import patterns, relative imports).

Records: fixtures/container_runtimes-artifacts.json holds the Debian packages the matrix last ran against
(suite, version, pool path, sha256; `python tests/contracts/test_container_runtimes.py` re-resolves them from
the signed archive indexes), EL 9's wheel, and Docker CE's and CRI-O's configs (documented, not downloaded).
fixtures/container_runtimes-ubuntu.json holds Ubuntu's packages with their `containerd config default`
output (`python tests/contracts/refresh.py` re-records it): when Ubuntu's archive does not answer, the
Ubuntu binaries cannot run and their tests say so as skips, and the recorded output is checked instead.
"""

from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import textwrap
import tomllib
import urllib.error
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

# contractlib beside this file; labstack in tests/k8s_modules (tests/conftest.py adds it under pytest;
# refresh.py imports this file without it).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "k8s_modules"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import contractlib
from contractlib import REPO, real, role_says, validate_entry
from labstack import ensure_collection_link

ROLE = REPO / "roles/nvidia_container_toolkit"
MODULE = REPO / "plugins/modules/nvidia_containerd_runtime.py"
FACTS = Path(__file__).resolve().parent / "facts/container_runtimes.yaml"
ARTIFACTS = Path(__file__).resolve().parent / "fixtures/container_runtimes-artifacts.json"
UBUNTU = Path(__file__).resolve().parent / "fixtures/container_runtimes-ubuntu.json"
THIS = "tests/contracts/test_container_runtimes.py"
NVIDIA = "/usr/bin/nvidia-container-runtime"
DOCKER_CE = "docker-ce containerd.io /etc/containerd/config.toml"
# The role's default drop-in and the pattern containerd 2.2's `config default` imports.
ROLE_DROP_IN = "/etc/containerd/conf.d/99-nvidia.toml"
UBUNTU_SUITES = {"ubuntu-22.04": ("jammy", "jammy-updates"), "ubuntu-24.04": ("noble", "noble-updates")}
SITE_V2 = textwrap.dedent("""\
    # site config: a Kubernetes node's
    version = 2

    [plugins."io.containerd.grpc.v1.cri"]
      sandbox_image = "registry.example.internal/pause:3.9"
      [plugins."io.containerd.grpc.v1.cri".cni]
        bin_dir = "/usr/lib/cni"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true
""")
SITE_V3 = textwrap.dedent("""\
    version = 3

    [plugins.'io.containerd.cri.v1.images'.pinned_images]
      sandbox = 'registry.example.internal/pause:3.9'
    [plugins.'io.containerd.cri.v1.runtime'.cni]
      bin_dirs = ['/usr/lib/cni']
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        SystemdCgroup = true
""")


def artifacts() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(ARTIFACTS.read_text())
    return data


def ubuntu_recorded() -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = json.loads(UBUNTU.read_text())["facts"]
    return records


def records() -> dict[str, dict[str, Any]]:
    """Each host of the matrix (a distribution) -> its containerd package and tomlkit."""
    return {r["distribution"]: r for r in [*artifacts()["containerd"], *ubuntu_recorded()]}


HOSTS = sorted(records())


# The collection's module_utils, importable as on a controller (the role's filter plugins import them too).
sys.path.insert(0, str(ensure_collection_link()))
from ansible_collections.gpufleet.nvidia.plugins.module_utils import containerd_config  # noqa: E402


def _filters() -> dict[str, Callable[..., Any]]:
    """The role's filter plugins, as the controller loads them."""
    sys.path.insert(0, str(ROLE / "filter_plugins"))
    try:
        import runtime_config
    finally:
        sys.path.pop(0)
    filters: dict[str, Callable[..., Any]] = runtime_config.FilterModule().filters()
    return filters


FILTERS = _filters()

# --- the real binaries and each distribution's tomlkit ------------------------------------------------------


def _archive(record: dict[str, Any]) -> real.Archive:
    return real.Archive.ubuntu() if record["archive"] == "ubuntu" else real.Archive.debian()


def _stanza(record: dict[str, Any]) -> real.Stanza:
    fields = {
        "Package": record["package"],
        "Version": record["version"],
        "Filename": record["pool"],
        "SHA256": record["sha256"],
    }
    return real.Stanza(_archive(record), record["suite"], record["component"], fields)


def _extract(deb: Path, into: Path, members: dict[str, str]) -> None:
    """The .deb's `members` (path in the package -> name under `into`), unpacked once (cached)."""
    partial = into.with_name(f"{into.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    present = real.deb_members(deb)
    wanted = {m: n for m, n in members.items() if m.rstrip("/") in present}
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(partial), *(f".{m}" for m in wanted)], input=data, check=True)
    for member, name in wanted.items():
        (partial / member.lstrip("/")).rename(partial / name)
    try:
        partial.replace(into)
    except OSError:  # another process unpacked the same package first
        shutil.rmtree(partial, ignore_errors=True)


def newest(archive: real.Archive, suites: tuple[str, ...], component: str, package: str) -> real.Stanza:
    """The newest `package` of `suites` now, from their gpgv-verified InRelease and Packages indexes."""
    found = real.versions([s for suite in suites for s in real.packages(archive, suite, component)], package)
    if not found:
        raise real.ArchiveError(f"{archive.name} {'/'.join(suites)} {component}: no package {package}")
    return found[-1]


def resolve_live(record: dict[str, Any], suites: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The record with the newest package its suite (or `suites`) offers now."""
    stanza = newest(_archive(record), suites or (record["suite"],), record["component"], record["package"])
    return {
        **record,
        "suite": stanza.suite,
        "version": stanza.version,
        "pool": stanza.filename,
        "sha256": stanza.sha256,
    }


def _download(record: dict[str, Any]) -> Path:
    try:
        return real.download(_stanza(record))
    except real.ArchiveError:
        if record["archive"] == "ubuntu" or record["suite"] != "sid":
            raise
        # sid drops superseded packages from its pool: test the suite's current one instead.
        record.update(resolve_live(record))
        return real.download(_stanza(record))


def containerd_dir(record: dict[str, Any]) -> Path:
    """/usr/bin/containerd and, where the package ships one, /etc/containerd/config.toml."""
    unpacked = real.state_dir() / "archives" / f"containerd-{record['sha256']}"
    if not unpacked.exists():
        members = {"/usr/bin/containerd": "containerd", "/etc/containerd/config.toml": "config.toml"}
        _extract(_download(record), unpacked, members)
    return unpacked


def tomlkit_path(record: dict[str, Any]) -> Path:
    """What PYTHONPATH needs for the distribution's tomlkit: its package's dist-packages, or EL 9's wheel."""
    if record["archive"] == "pypi":
        wheel = real.state_dir() / "archives" / record["file"]
        if not wheel.exists():
            with tempfile.TemporaryDirectory() as scratch:
                argv = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                        "--dest", scratch, f"{record['package']}=={record['version']}"]  # fmt: skip
                got = subprocess.run(argv, capture_output=True, text=True, check=False)
                assert got.returncode == 0, f"pip could not download {record['file']} from PyPI: {got.stderr}"
                downloaded = Path(scratch) / record["file"]
                digest = hashlib.sha256(downloaded.read_bytes()).hexdigest()
                assert digest == record["sha256"], (
                    f"{record['file']}: sha256 {digest}, recorded {record['sha256']}"
                )
                shutil.move(str(downloaded), wheel)
        return wheel
    unpacked = real.state_dir() / "archives" / f"tomlkit-{record['sha256']}"
    if not unpacked.exists():
        _extract(_download(record), unpacked, {"/usr/lib/python3/dist-packages/": "dist-packages"})
    return unpacked / "dist-packages"


@dataclass(frozen=True)
class Host:
    """One distribution's containerd binary and tomlkit."""

    distribution: str
    containerd: str  # "1.6", "2.2": the version the module's behaviour depends on
    binary: Path
    stock_config: str  # the package's config.toml, else the binary's `config default` (Ubuntu ships none)
    tomlkit: Path
    tomlkit_version: str

    @property
    def major(self) -> int:
        return int(self.containerd.split(".")[0])


def _unreachable(record: dict[str, Any], err: object) -> str:
    return (
        f"{record['distribution']}: Ubuntu's archive ({real.Archive.ubuntu().mirror}) did not answer "
        f"({err}); its containerd cannot run here, and "
        "test_ubuntu_config_default_has_what_the_module_relies_on checks the recorded "
        "`containerd config default` instead"
    )


def _unpacked(record: dict[str, Any]) -> bool:
    """Whether the host's containerd and tomlkit are already unpacked here (no archive needed)."""
    archives = real.state_dir() / "archives"
    return (archives / f"containerd-{record['sha256']}").exists() and (
        archives / f"tomlkit-{record['tomlkit']['sha256']}"
    ).exists()


@cache
def host(distribution: str) -> Host:
    """The host, downloaded and unpacked once (cached on disk). Ubuntu's, when its archive does not answer:
    a skip naming what is missing (CI must not depend on that archive; its recording is checked instead)."""
    record = records()[distribution]
    binary_record = records()[record["binary_of"]] if "binary_of" in record else record
    if record["archive"] == "ubuntu" and not _unpacked(record) and not contractlib.ubuntu_live():
        pytest.skip(_unreachable(record, "no answer to a HEAD of jammy-updates/InRelease"))
    try:
        unpacked = containerd_dir(binary_record)
        library = tomlkit_path(record["tomlkit"])
    except (real.ArchiveError, urllib.error.URLError) as err:
        if record["archive"] == "ubuntu":
            pytest.skip(_unreachable(record, err))
        raise
    binary = unpacked / "containerd"
    packaged = unpacked / "config.toml"
    stock = (
        packaged.read_text()
        if packaged.exists()
        else subprocess.run(
            [str(binary), "config", "default"], capture_output=True, text=True, check=True
        ).stdout
    )
    env = {**os.environ, "PYTHONPATH": str(library)}
    said = subprocess.run([sys.executable, "-c", "import tomlkit; print(tomlkit.__version__)"],
                          capture_output=True, text=True, env=env, check=True).stdout.strip()  # fmt: skip
    assert said == contractlib.upstream(record["tomlkit"]["version"]), f"{library} is tomlkit {said}"
    return Host(distribution, binary_record["containerd"], binary, stock, library, said)


@pytest.fixture
def ctr(request: pytest.FixtureRequest, tmp_path: Path) -> Containerd:
    return Containerd(host(request.param), tmp_path)


class Containerd:
    """One host's real containerd and tomlkit, and a scratch /etc/containerd for the module."""

    def __init__(self, on: Host, tmp_path: Path) -> None:
        self.host = on
        self.binary = on.binary
        self.stock_config = on.stock_config
        self.config = tmp_path / "config.toml"
        self.drop_in = tmp_path / "conf.d/99-nvidia.toml"
        self.major = on.major
        self.pythonpath = f"{on.tomlkit}{os.pathsep}{ensure_collection_link()}"

    def run(self, check: bool = False, **args: Any) -> dict[str, Any]:
        params = {
            "config": str(self.config),
            "drop_in": str(self.drop_in),
            "containerd": str(self.binary),
            **args,
        }
        argfile = self.config.parent / "args.json"
        argfile.write_text(
            json.dumps(
                {"ANSIBLE_MODULE_ARGS": {**params, "_ansible_check_mode": check, "_ansible_diff": True}}
            )
        )
        env = {**os.environ, "PYTHONPATH": self.pythonpath}
        proc = subprocess.run(
            [sys.executable, str(MODULE), str(argfile)], capture_output=True, text=True, env=env, check=False
        )
        assert proc.stdout.strip(), f"the module printed nothing: {proc.stderr[-2000:]}"
        result: dict[str, Any] = json.loads(proc.stdout)
        return result

    def dump(self) -> str:
        done = subprocess.run(
            [str(self.binary), "--config", str(self.config), "config", "dump"],
            capture_output=True,
            text=True,
            check=False,
        )
        assert done.returncode == 0, f"containerd {self.host.containerd} refuses {self.config}: {done.stderr}"
        return done.stdout

    def parsed(self) -> dict[str, Any]:
        return tomllib.loads(self.dump())

    @property
    def plugin(self) -> str:
        """The plugin holding the CRI runtimes in this binary's dumps."""
        return containerd_config.CRI_RUNTIME_PLUGINS[3 if self.major >= 2 else 2]

    def cri(self) -> dict[str, Any]:
        """The CRI runtime section of the merged config, whatever the version."""
        return dict(self.parsed()["plugins"][self.plugin])

    def nvidia(self) -> dict[str, Any]:
        runtime: dict[str, Any] = self.cri()["containerd"]["runtimes"]["nvidia"]
        return runtime

    def without_nvidia(self, dumped: dict[str, Any]) -> dict[str, Any]:
        """A parsed dump less what the module adds (the runtime, the default's name, the import)."""
        rest = copy.deepcopy(dumped)
        rest.pop("imports", None)
        containerd = rest["plugins"][self.plugin]["containerd"]
        containerd.pop("default_runtime_name", None)
        containerd["runtimes"].pop("nvidia", None)
        return rest


def assert_offers_nvidia(ctr: Containerd, systemd_cgroup: bool = False) -> None:
    dumped = ctr.dump()
    containerd = tomllib.loads(dumped)["plugins"][ctr.plugin]["containerd"]
    nvidia = containerd["runtimes"]["nvidia"]
    assert containerd["default_runtime_name"] == "nvidia"
    assert nvidia["runtime_type"] == "io.containerd.runc.v2"
    assert nvidia["options"]["BinaryName"] == NVIDIA
    assert nvidia["options"]["SystemdCgroup"] is systemd_cgroup
    # What tasks/verify.yml reads from the same dump on a host.
    seen = FILTERS["containerd_cri_runtime"](dumped, "nvidia")
    assert seen["runtime"]["options"]["BinaryName"] == NVIDIA and seen["default_runtime_name"] == "nvidia"


def assert_only_nvidia_added(ctr: Containerd, before: dict[str, Any]) -> None:
    """The merged config is the operator's, setting for setting, plus the nvidia runtime."""
    assert ctr.without_nvidia(ctr.parsed()) == ctr.without_nvidia(before)


# --- the matrix -------------------------------------------------------------------------------------------

every_host = pytest.mark.parametrize("ctr", HOSTS, indirect=True)


@every_host
def test_fresh_host_gets_a_config_that_imports_the_drop_in(ctr: Containerd) -> None:
    result = ctr.run()
    assert result["changed"] and result["cri_enabled"], result
    assert result["config_version"] == (3 if ctr.major >= 2 else 2)
    assert ctr.config.read_text().startswith(f"version = {result['config_version']}\nimports = ")
    assert_offers_nvidia(ctr)
    assert ctr.run()["changed"] is False


@every_host
def test_the_distributions_own_config_keeps_its_settings_and_a_backup(ctr: Containerd) -> None:
    ctr.config.write_text(ctr.stock_config)
    before = ctr.parsed()
    result = ctr.run()
    assert result["changed"] and result["config_version"] == tomllib.loads(ctr.stock_config)["version"], (
        result
    )
    assert_offers_nvidia(ctr)
    assert_only_nvidia_added(ctr, before)
    assert [Path(b).read_text() for b in result["backups"]] == [ctr.stock_config]
    second = ctr.run()
    assert second["changed"] is False and second["backups"] == []


@every_host
def test_version_2_site_config_keeps_systemd_cgroup_sandbox_and_cni(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V2)
    result = ctr.run()
    assert result["changed"] and result["config_version"] == 2, result
    assert_offers_nvidia(ctr, systemd_cgroup=True)
    cri = ctr.cri()
    assert cri["containerd"]["runtimes"]["runc"]["options"]["SystemdCgroup"] is True
    if ctr.major >= 2:
        sandbox = ctr.parsed()["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"]
        assert sandbox == "registry.example.internal/pause:3.9" and cri["cni"]["bin_dirs"] == ["/usr/lib/cni"]
    else:
        assert (
            cri["sandbox_image"] == "registry.example.internal/pause:3.9"
            and cri["cni"]["bin_dir"] == "/usr/lib/cni"
        )
    assert ctr.drop_in.read_text().splitlines()[1] == "version = 2", "a drop-in in the main config's version"
    assert ctr.run()["changed"] is False


@every_host
def test_version_3_config_is_taken_by_containerd_2_and_refused_untouched_by_1x(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V3)
    result = ctr.run()
    if ctr.major < 2:
        assert result["failed"] and "loads version 2" in result["msg"] and "left untouched" in result["msg"]
        assert ctr.config.read_text() == SITE_V3 and not ctr.drop_in.exists()
        return
    assert result["changed"] and result["config_version"] == 3, result
    assert_offers_nvidia(ctr, systemd_cgroup=True)
    assert ctr.parsed()["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"].endswith(
        "pause:3.9"
    )
    assert ctr.run()["changed"] is False


@every_host
def test_docker_ce_containerd_without_cri_is_left_alone_and_says_so(ctr: Containerd) -> None:
    docker = artifacts()["documented"][DOCKER_CE]["text"]
    ctr.config.write_text(docker)
    ctr.dump()  # the real binary loads Docker CE's file (version 1, migrated)
    result = ctr.run()
    assert result.get("failed") is None and result["changed"] is False, result
    assert (
        result["cri_enabled"] is False and "left alone" in result["msg"] and str(ctr.config) in result["msg"]
    )
    assert ctr.config.read_text() == docker and not ctr.drop_in.exists()


@every_host
def test_check_mode_shows_the_diff_a_real_run_writes_and_writes_nothing(ctr: Containerd) -> None:
    ctr.config.write_text(ctr.stock_config)
    result = ctr.run(check=True)
    assert result["changed"] is True
    assert ctr.config.read_text() == ctr.stock_config and not ctr.drop_in.exists()
    previewed = {d["after_header"]: d["after"] for d in result["diff"]}
    ctr.run()
    assert previewed == {str(ctr.config): ctr.config.read_text(), str(ctr.drop_in): ctr.drop_in.read_text()}


@every_host
def test_absent_takes_back_import_and_drop_in(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V2)
    ctr.run()
    preview = ctr.run(state="absent", check=True)
    assert preview["changed"] is True and {d["before_header"] for d in preview["diff"]} == {
        str(ctr.config),
        str(ctr.drop_in),
    }
    assert ctr.drop_in.exists()
    assert ctr.run(state="absent")["changed"] is True
    assert ctr.config.read_text() == SITE_V2 and not ctr.drop_in.exists()
    assert "nvidia" not in ctr.cri()["containerd"]["runtimes"]
    assert ctr.run(state="absent")["changed"] is False


@every_host
def test_main_config_only_gains_the_import(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V2)
    ctr.run()
    assert ctr.config.read_text() == SITE_V2.replace(
        "version = 2\n", f'version = 2\nimports = ["{ctr.drop_in}"]\n'
    )


@every_host
def test_existing_imports_are_kept(ctr: Containerd) -> None:
    other = ctr.config.parent / "other.toml"
    other.write_text("version = 2\n")
    ctr.config.write_text(f'version = 2\nimports = ["{other}"]\n')
    ctr.run()
    assert f'imports = ["{other}", "{ctr.drop_in}"]' in ctr.config.read_text()
    assert ctr.nvidia()["options"]["BinaryName"] == NVIDIA


@every_host
def test_site_edit_after_the_first_run_reaches_the_merged_config(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V2)
    ctr.run()
    old_drop_in = ctr.drop_in.read_text()
    ctr.config.write_text(ctr.config.read_text().replace("pause:3.9", "pause:3.10"))
    result = ctr.run()  # 1.x: the drop-in carries the CRI section again; 2.x merges, nothing to carry
    if ctr.major >= 2:
        sandbox = ctr.parsed()["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"]
        assert result["changed"] is False
    else:
        sandbox = ctr.cri()["sandbox_image"]
        assert [Path(b).read_text() for b in result["backups"]] == [old_drop_in], "the old drop-in is kept"
    assert sandbox == "registry.example.internal/pause:3.10"


@every_host
def test_not_the_default_runtime_when_asked(ctr: Containerd) -> None:
    ctr.run(set_default=False)
    assert ctr.cri()["containerd"]["default_runtime_name"] == "runc"
    assert ctr.nvidia()["options"]["BinaryName"] == NVIDIA


@every_host
def test_cdi_is_turned_on_where_containerd_has_it_and_nothing_else_moves(ctr: Containerd) -> None:
    """containerd 1.7 ships enable_cdi = false (the kubelet's CDI device names then fail the container),
    2.x true, 1.6 has no CDI: auto turns it on through the drop-in where it exists, enabled insists."""
    ctr.config.write_text(ctr.stock_config)
    before = ctr.parsed()
    cdi_before = {k: v for k, v in before["plugins"][ctr.plugin].items() if k in containerd_config.CDI_KEYS}
    result = ctr.run(cdi="auto")
    assert not result.get("failed"), result
    supported = "enable_cdi" in cdi_before
    assert supported is (ctr.host.containerd.split(".")[:2] != ["1", "6"]), (ctr.host.containerd, cdi_before)
    cri = ctr.cri()
    if supported:
        dirs = ["/etc/cdi", "/var/run/cdi"]
        assert result["cdi"] == {"supported": True, "enabled": True, "spec_dirs": dirs}
        assert cri["enable_cdi"] is True and cri["cdi_spec_dirs"] == dirs
        assert "CDI on (/etc/cdi, /var/run/cdi)" in result["msg"]
    else:
        assert result["cdi"] == {"supported": False, "enabled": False, "spec_dirs": []}
        assert "no CDI in this containerd" in result["msg"] and "enable_cdi" not in ctr.drop_in.read_text()
        refused = ctr.run(cdi="enabled")
        assert refused["failed"] and f"containerd {ctr.host.containerd}" in refused["msg"]
        assert "has no CDI support" in refused["msg"]
        assert "nvidia_container_toolkit_containerd_cdi" in refused["msg"]
    # the operator's other settings are all still there
    after = ctr.parsed()
    for dumped in (after, before):
        for key in containerd_config.CDI_KEYS:
            dumped["plugins"][ctr.plugin].pop(key, None)
    assert ctr.without_nvidia(after) == ctr.without_nvidia(before)
    assert ctr.run(cdi="auto")["changed"] is False
    # other spec directories, and back to containerd's own setting without the module's keys
    moved = ctr.run(cdi="auto", cdi_spec_dirs=["/etc/cdi", "/run/cdi-gpufleet"])
    if supported:
        assert moved["changed"] and ctr.cri()["cdi_spec_dirs"] == ["/etc/cdi", "/run/cdi-gpufleet"]
        ctr.run(cdi="unchanged")
        assert ctr.cri()["enable_cdi"] is cdi_before["enable_cdi"]


@every_host
def test_invalid_toml_is_refused_with_the_parsers_line_and_left_untouched(ctr: Containerd) -> None:
    broken = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"\n'
    ctr.config.write_text(broken)
    result = ctr.run()
    assert result["failed"] and "is not valid TOML" in result["msg"] and "left untouched" in result["msg"]
    assert "line 2" in result["msg"], result["msg"]
    # The words molecule's side effect (and an operator's grep) look for.
    assert f"containerd cannot parse {ctr.config}, left untouched" in result["msg"]
    assert ctr.config.read_text() == broken and not ctr.drop_in.exists() and result["backups"] == []


@every_host
def test_a_key_defined_twice_is_refused_naming_the_row_and_left_untouched(ctr: Containerd) -> None:
    """What the regular expressions wrote (a second `imports`) is refused, with containerd's own words."""
    twice = 'version = 2\nimports = [\n  "/etc/containerd/a.toml",\n]\nimports = ["/etc/containerd/b.toml"]\n'
    ctr.config.write_text(twice)
    result = ctr.run()
    assert result["failed"] and "is not valid TOML" in result["msg"] and "imports" in result["msg"]
    assert "line 5" in result["msg"], f"no line: {result['msg']}"
    assert ctr.config.read_text() == twice and not ctr.drop_in.exists()


@every_host
def test_a_version_1_config_is_refused_untouched(ctr: Containerd) -> None:
    v1 = '[plugins.cri]\n  sandbox_image = "registry.example.internal/pause:3.9"\n'
    ctr.config.write_text(v1)
    result = ctr.run()
    assert result["failed"] and "version 1" in result["msg"] and "left untouched" in result["msg"], result
    assert ctr.config.read_text() == v1 and not ctr.drop_in.exists()


def test_a_version_3_drop_in_would_have_lost_a_version_2_sites_settings(tmp_path: Path) -> None:
    """Why the drop-in follows the main config's version: containerd 2.1 ignores the v2 keys otherwise."""
    ctr = Containerd(host("debian-sid"), tmp_path)
    drop = tmp_path / "v3.toml"
    drop.write_text(
        'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd]\n  default_runtime_name = "x"\n'
    )
    ctr.config.write_text(SITE_V2.replace("version = 2\n", f'version = 2\nimports = ["{drop}"]\n'))
    runc = ctr.cri()["containerd"]["runtimes"]["runc"]["options"]
    assert runc["SystemdCgroup"] is False, (
        "containerd 2.1 changed how it merges mixed versions: revisit the module"
    )


def test_without_tomlkit_the_module_names_the_package_and_writes_nothing(tmp_path: Path) -> None:
    ctr = Containerd(host("debian-12"), tmp_path)
    missing = tmp_path / "no-tomlkit" / "tomlkit"
    missing.mkdir(parents=True)
    (missing / "__init__.py").write_text("raise ImportError(\"No module named 'tomlkit'\")\n")
    ctr.pythonpath = f"{missing.parent}{os.pathsep}{ensure_collection_link()}"
    ctr.config.write_text(SITE_V2)
    result = ctr.run()
    assert result["failed"] and "tomlkit" in result["msg"] and "python3-tomlkit" in result["msg"], result
    assert "nvidia_container_toolkit_python_packages" in result["msg"], result["msg"]
    assert ctr.config.read_text() == SITE_V2 and not ctr.drop_in.exists()


def test_the_module_and_its_module_utils_are_python_3_8_syntax() -> None:
    """They run on the host's Python: ansible-core 2.19 takes 3.8 to 3.13 there (EL 9 has 3.9, Ubuntu 22.04
    3.10); the matrix above runs them with this venv's."""
    utils = REPO / "plugins/module_utils/containerd_config.py"
    for path in (MODULE, utils):
        ast.parse(path.read_text(), str(path), feature_version=(3, 8))


# --- every TOML shape containerd accepts ----------------------------------------------------------------

SITE_V2_TABLES = SITE_V2.split("version = 2\n", 1)[1]
SITE_OTHER = {2: 'version = 2\n[debug]\n  level = "warn"\n', 3: "version = 3\n[debug]\n  level = 'warn'\n"}


@dataclass(frozen=True)
class Shape:
    """A main config in one TOML shape; `{other}` is an imported file of the site's (debug level warn),
    `{conf_d}` the drop-in's directory. `covered`: an imports entry already loads the drop-in."""

    name: str
    version: int
    text: str
    systemd_cgroup: bool = False
    covered: bool = False


SHAPES = [
    Shape(
        "one-line imports", 2, 'version = 2\nimports = ["{other}"]\n' + SITE_V2_TABLES, systemd_cgroup=True
    ),
    Shape(
        "multi-line imports",
        2,
        '# site\nversion = 2\nimports = [\n  "{other}",  # the site\'s own\n]\n' + SITE_V2_TABLES,
        systemd_cgroup=True,
    ),
    Shape(
        "single quotes",
        2,
        textwrap.dedent("""\
            version = 2
            imports = ['{other}']

            [plugins.'io.containerd.grpc.v1.cri']
              sandbox_image = 'registry.example.internal/pause:3.9'
            [plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.runc]
              runtime_type = 'io.containerd.runc.v2'
            [plugins.'io.containerd.grpc.v1.cri'.containerd.runtimes.runc.options]
              SystemdCgroup = true
        """),
        systemd_cgroup=True,
    ),
    Shape(
        "inline tables",
        2,
        textwrap.dedent("""\
            version = 2
            imports = ["{other}"]
            [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
              runtime_type = "io.containerd.runc.v2"
              options = { SystemdCgroup = true, BinaryName = "/usr/bin/runc" }
            [plugins."io.containerd.grpc.v1.cri".cni]
              bin_dir = "/usr/lib/cni"
        """),
        systemd_cgroup=True,
    ),
    Shape(
        "dotted keys",
        2,
        textwrap.dedent("""\
            version = 2
            imports = [ "{other}" ]
            plugins."io.containerd.grpc.v1.cri".sandbox_image = "registry.example.internal/pause:3.9"

            [plugins."io.containerd.grpc.v1.cri".containerd]
              runtimes.runc.runtime_type = "io.containerd.runc.v2"
              runtimes.runc.options.SystemdCgroup = true
        """),
        systemd_cgroup=True,
    ),
    Shape(
        "comments everywhere",
        2,
        textwrap.dedent("""\
            # containerd on the GPU nodes; imports = ["/etc/containerd/old.toml"] no more
            version = 2 # config version
            # imports = ["/etc/containerd/old.toml"]
            imports = [ # the site's drop-ins
              "{other}", # debug level
            ] # end of imports
            oom_score = -999 # keep containerd alive

            [plugins] # every plugin
              [plugins."io.containerd.grpc.v1.cri"] # CRI
                # the pause image from our mirror
                sandbox_image = "registry.example.internal/pause:3.9"  # pinned
        """),
    ),
    Shape(
        "keys after imports, no final newline",
        2,
        'imports = ["{other}"]\nversion = 2\noom_score = -999',
    ),
    Shape("relative import", 2, 'version = 2\nimports = ["conf.d/50-site.toml"]\n'),
    Shape("pattern that loads the drop-in", 2, 'version = 2\nimports = ["{conf_d}/*.toml"]\n', covered=True),
    Shape(
        "version 3, multi-line, mixed quotes",
        3,
        textwrap.dedent("""\
            version = 3
            imports = [
              '{other}',
            ]
            [plugins.'io.containerd.cri.v1.images'.pinned_images]
              sandbox = 'registry.example.internal/pause:3.9'
            [plugins."io.containerd.cri.v1.runtime".containerd.runtimes.runc.options]
              SystemdCgroup = true
        """),
        systemd_cgroup=True,
    ),
    Shape(
        "version 3, inline table under a dotted key",
        3,
        "version = 3\nimports = ['{other}']\n"
        "plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc = "
        "{ runtime_type = 'io.containerd.runc.v2', options = { SystemdCgroup = true } }\n",
        systemd_cgroup=True,
    ),
    Shape(
        "version 3, pattern that loads the drop-in",
        3,
        "version = 3\nimports = ['{conf_d}/*.toml']\n",
        covered=True,
    ),
]
SHAPE_CASES = [
    pytest.param(h, s, id=f"{h}:{s.name}")
    for h in HOSTS
    for s in SHAPES
    if s.version in containerd_config.ACCEPTED_VERSIONS[min(int(records()[h]["containerd"][0]), 2)]
]


def _kept_in_order(original: str, edited: str) -> list[str]:
    """The lines of `original` (imports entries aside) that `edited` lost or moved."""
    lines = [
        line for line in original.splitlines() if not line.lstrip().startswith(("imports", '"', "'", "]"))
    ]
    remaining = iter(edited.splitlines())
    return [line for line in lines if not any(line == candidate for candidate in remaining)]


@pytest.mark.parametrize(("ctr", "shape"), SHAPE_CASES, indirect=["ctr"])
def test_every_shape_containerd_accepts_is_edited_as_toml(ctr: Containerd, shape: Shape) -> None:
    conf_d = ctr.drop_in.parent
    conf_d.mkdir()
    other = conf_d / "50-site.toml"
    other.write_text(SITE_OTHER[shape.version])
    text = shape.text.replace("{other}", str(other)).replace("{conf_d}", str(conf_d))
    ctr.config.write_text(text)
    before = ctr.parsed()  # the real binary takes the shape
    assert before["debug"]["level"] == "warn", "the site's import is loaded"

    result = ctr.run()
    assert result["changed"] and not result.get("failed"), result
    edited = ctr.config.read_text()
    assert_offers_nvidia(ctr, systemd_cgroup=shape.systemd_cgroup)
    assert_only_nvidia_added(ctr, before)
    if shape.covered:
        assert edited == text, "an imports pattern already loads the drop-in: config.toml stays as it is"
    else:
        assert _kept_in_order(text, edited) == [], f"config.toml lost or moved lines:\n{edited}"
        assert containerd_config.imports_of(tomllib.loads(edited))[-1] in (str(ctr.drop_in), ctr.drop_in.name)
    assert [Path(b).read_text() for b in result["backups"]] == ([] if shape.covered else [text])
    assert ctr.run()["changed"] is False, "a second run changes nothing"

    assert ctr.run(state="absent")["changed"] is True
    assert not ctr.drop_in.exists()
    assert ctr.without_nvidia(ctr.parsed()) == ctr.without_nvidia(before)
    assert "nvidia" not in ctr.cri()["containerd"]["runtimes"]
    assert _kept_in_order(text, ctr.config.read_text()) == []


# --- Ubuntu's containerd 2.2.1: the recorded `config default` ---------------------------------------------


@pytest.mark.parametrize("record", ubuntu_recorded(), ids=lambda r: r["distribution"])
def test_ubuntu_config_default_has_what_the_module_relies_on(record: dict[str, Any]) -> None:
    """Ubuntu's containerd 2.2.1 ships no config.toml; `containerd config default` is what operators write.

    Read from the live binary when Ubuntu's archive answers (and then it must equal the recording), else
    from the recording, so that CI without that archive still checks what the module relies on."""
    text = record["config_default"]
    if contractlib.ubuntu_live():
        live = host(record["distribution"]).stock_config
        assert live == text, (
            f"{record['distribution']}: `config default` changed: run tests/contracts/refresh.py"
        )
    parsed = tomllib.loads(text)
    assert parsed["version"] == 3 and parsed["disabled_plugins"] == []
    runtime = parsed["plugins"][containerd_config.CRI_RUNTIME_PLUGINS[3]]
    assert (
        runtime["containerd"]["default_runtime_name"] == "runc"
        and "runc" in runtime["containerd"]["runtimes"]
    )
    # 2.2 imports /etc/containerd/conf.d/*.toml by default, which loads the role's drop-in: the module then
    # leaves config.toml as it is.
    assert parsed["imports"] == ["/etc/containerd/conf.d/*.toml"]
    assert containerd_config.covers(parsed["imports"][0], ROLE_DROP_IN, "/etc/containerd")
    assert record["sha256"] and record["pool"].startswith("pool/main/c/") and record["url"].endswith(".deb")


def ubuntu_records() -> list[dict[str, Any]]:
    """Ubuntu's containerd 2.2 and python3-tomlkit now, each with its `containerd config default` output
    (refresh.py writes them to fixtures/container_runtimes-ubuntu.json)."""
    import datetime

    archive = real.Archive.ubuntu()
    recorded = []
    for distribution, (release, updates) in UBUNTU_SUITES.items():
        containerd = newest(archive, (updates, release), "main", "containerd")
        tomlkit = newest(archive, (updates, release), "universe", "python3-tomlkit")
        record: dict[str, Any] = {
            "distribution": distribution,
            "containerd": contractlib.upstream(containerd.version).rsplit(".", 1)[0],
            "archive": "ubuntu",
            "suite": containerd.suite,
            "component": "main",
            "package": "containerd",
            "version": containerd.version,
            "pool": containerd.filename,
            "sha256": containerd.sha256,
            "url": archive.url(containerd.filename),
            "recorded": datetime.date.today().isoformat(),
            "tomlkit": {
                "archive": "ubuntu",
                "suite": tomlkit.suite,
                "component": "universe",
                "package": "python3-tomlkit",
                "version": tomlkit.version,
                "pool": tomlkit.filename,
                "sha256": tomlkit.sha256,
            },
        }
        binary = containerd_dir(record) / "containerd"
        record["config_default"] = subprocess.run(
            [str(binary), "config", "default"], capture_output=True, text=True, check=True
        ).stdout
        recorded.append(record)
    return recorded


# --- facts ------------------------------------------------------------------------------------------------


def facts() -> list[dict[str, Any]]:
    entries: list[dict[str, Any]] = yaml.safe_load(FACTS.read_text())
    return entries


def test_facts_follow_the_contract_schema() -> None:
    problems = [p for i, e in enumerate(facts()) for p in validate_entry(e, f"{FACTS.name}[{i}]")]
    assert problems == []


@pytest.mark.parametrize("entry", facts(), ids=lambda e: f"{e['distribution']}:{e['variable']}={e['value']}")
def test_the_role_still_says_each_fact(entry: dict[str, Any]) -> None:
    from contractlib import Fact

    says, where = role_says(Fact("container_runtimes", 0, entry))
    assert says, f"{entry['value']!r} is no longer in {where}"


@pytest.mark.parametrize(
    "entry",
    [e for e in facts() if e.get("probe_in") == THIS],
    ids=lambda e: f"{e['distribution']}:{e['value']}",
)
def test_each_downloaded_fact_holds_for_its_real_binary(entry: dict[str, Any], tmp_path: Path) -> None:
    """Each fact against the distribution's binary (Ubuntu's: its recorded `config default` when its archive
    does not answer; that output is what `config dump` makes of it)."""
    recorded = {r["distribution"]: r for r in ubuntu_recorded()}.get(entry["distribution"])
    ctr = None
    if recorded is not None and not contractlib.ubuntu_live():
        contractlib.note_reading("fixture")
        dump = recorded["config_default"]
    else:
        contractlib.note_reading("live" if recorded is not None else "downloaded")
        ctr = Containerd(host(entry["distribution"]), tmp_path)
        ctr.config.write_text(ctr.stock_config)
        dump = ctr.dump()
    parsed = tomllib.loads(dump)
    value = str(entry["value"])
    plugin_of_version = re.fullmatch(r'(\d): "([^"]+)"', value)
    if plugin_of_version:
        plugin = plugin_of_version.group(2)
        assert plugin in parsed["plugins"] and "runtimes" in parsed["plugins"][plugin]["containerd"]
        assert containerd_config.CRI_RUNTIME_PLUGINS[int(plugin_of_version.group(1))] == plugin
    elif value == "2: (2, 3)":
        assert ctr is not None and ctr.stock_config.startswith("version = 2") and parsed["version"] == 3
    elif value == "tomllib":
        assert ctr is not None
        ctr.run()
        assert f"BinaryName = '{NVIDIA}'" in ctr.dump(), "2.1 dumps single quotes (verify.yml must not grep)"
    elif value == ROLE_DROP_IN:
        assert any(containerd_config.covers(i, value, "/etc/containerd") for i in parsed["imports"]), parsed
    else:
        pytest.fail(f"no check for fact {entry}")


# --- the role's containerd tasks, through ansible-playbook --------------------------------------------------


def _containerd_play(tmp_path: Path, ctr: Containerd, **extra: Any) -> Path:
    """tasks/containerd.yml then tasks/verify.yml on localhost, against a scratch config and the real binary
    (PATH), restarts off: what the role does to containerd on a host, less the restart."""
    playbook = tmp_path / "containerd.yml"
    role_vars = {
        "nvidia_container_toolkit_containerd_config": str(ctr.config),
        "nvidia_container_toolkit_containerd_drop_in": str(ctr.drop_in),
        "nvidia_container_toolkit_restart_runtimes": False,
        "nvidia_container_toolkit_configure": ["containerd"],
        # Nothing installed on this machine: the venv running the module has tomlkit.
        "nvidia_container_toolkit_python_packages": [],
        **extra,
    }
    tasks = [
        {"ansible.builtin.include_role": {"name": "nvidia_container_toolkit", "tasks_from": name}}
        for name in ("containerd.yml", "verify.yml")
    ]
    play = {
        "hosts": "localhost",
        "gather_facts": True,
        "gather_subset": ["!all", "min"],  # os_family picks apt or dnf
        "connection": "local",
        "vars": role_vars,
        "tasks": tasks,
    }
    playbook.write_text(yaml.safe_dump([play]))
    return playbook


def _converge(playbook: Path, tmp_path: Path, ctr: Containerd, *flags: str) -> str:
    env = {
        "PATH": f"{ctr.binary.parent}:{os.environ['PATH']}",
        "ANSIBLE_COLLECTIONS_PATH": str(ensure_collection_link()),
    }
    proc = contractlib.run_play(playbook, tmp_path, env, flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


def test_the_roles_containerd_tasks_converge_verify_and_preview(tmp_path: Path) -> None:
    ctr = Containerd(host("debian-12"), tmp_path / "etc")
    ctr.config.parent.mkdir()
    ctr.config.write_text(SHAPES[1].text.replace("{other}", str(tmp_path / "etc/other.toml")))
    (tmp_path / "etc/other.toml").write_text(SITE_OTHER[2])
    original = ctr.config.read_text()
    playbook = _containerd_play(tmp_path, ctr)

    preview = _converge(playbook, tmp_path, ctr, "--check", "--diff")
    assert "changed=1" in preview and f'+  "{ctr.drop_in}",' in preview, preview[-3000:]
    assert ctr.config.read_text() == original and not ctr.drop_in.exists()

    assert "changed=1" in _converge(playbook, tmp_path, ctr)
    assert_offers_nvidia(ctr, systemd_cgroup=True)
    assert "changed=0" in _converge(playbook, tmp_path, ctr), "a second converge changes nothing"


def test_check_mode_says_when_tomlkit_is_not_installed_yet(tmp_path: Path) -> None:
    """The package task, in check mode, with the real apt: the module cannot preview before tomlkit is in."""
    installed = subprocess.run(
        ["dpkg-query", "-W", "-f=${Status}", "python3-tomlkit"], capture_output=True, text=True, check=False
    ).stdout.startswith("install ok installed")
    ctr = Containerd(host("debian-12"), tmp_path / "etc")
    ctr.config.parent.mkdir()
    ctr.config.write_text(SITE_V2)
    playbook = _containerd_play(tmp_path, ctr, nvidia_container_toolkit_python_packages=["python3-tomlkit"])
    out = _converge(playbook, tmp_path, ctr, "--check")
    assert ("would be installed first" in out) is not installed, out[-2000:]
    assert ctr.config.read_text() == SITE_V2 and not ctr.drop_in.exists()


# --- CRI-O: the drop-in from CRI-O's packaged configs (documented) --------------------------------------


CRIO_CONFIGS = [k for k in artifacts()["documented"] if k.startswith("cri-o")]


@pytest.mark.parametrize("name", CRIO_CONFIGS)
def test_crio_nvidia_runtime_carries_the_base_runtimes_monitor(name: str) -> None:
    config = artifacts()["documented"][name]["text"]
    built = FILTERS["crio_nvidia_runtime"](config, NVIDIA)
    base = tomllib.loads(config)["crio"]["runtime"]["runtimes"]["crun"]
    assert built["base"] == "crun" and built["base_path"] == base["runtime_path"]
    table = built["table"]
    assert table["runtime_path"] == NVIDIA and table["monitor_path"] == base["monitor_path"]
    assert table["allowed_annotations"] == base["allowed_annotations"]
    assert table["runtime_type"] == ("pod" if base.get("runtime_type") == "pod" else "oci")
    assert FILTERS["nvidia_low_level_runtimes"](built["base_path"]) == [
        base["runtime_path"],
        "docker-runc",
        "runc",
        "crun",
    ]


def test_crio_base_choice_follows_nvidia_ctk_and_drops_platform_paths() -> None:
    config = textwrap.dedent("""\
        [crio.runtime]
        default_runtime = "nvidia"
        [crio.runtime.runtimes.nvidia]
        runtime_path = "/usr/bin/nvidia-container-runtime"
        [crio.runtime.runtimes.runc]
        runtime_path = "/usr/libexec/crio/runc"
        platform_runtime_paths = { "linux/arm64" = "/usr/libexec/crio/runc-arm64" }
        [crio.runtime.runtimes.crun]
        runtime_path = "/usr/libexec/crio/crun"
    """)
    built = FILTERS["crio_nvidia_runtime"](config, NVIDIA)
    assert built["base"] == "runc", "an nvidia default is skipped, then runc before crun"
    assert "platform_runtime_paths" not in built["table"]
    assert FILTERS["crio_nvidia_runtime"](config, NVIDIA, "crun")["base"] == "crun", "a recorded base is kept"
    rendered = "\n".join(f"{k} = {FILTERS['toml_value'](v)}" for k, v in built["table"].items())
    assert tomllib.loads(rendered) == built["table"]


def test_crio_drop_in_through_the_role_is_complete_and_stable(tmp_path: Path) -> None:
    """tasks/crio.yml with stand-ins for `crio config` (CRI-O's packaged config) and nvidia-ctk."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    config = artifacts()["documented"]["cri-o 10-crio.conf (packages from cri-o/packaging)"]["text"]
    (tmp_path / "crio.conf").write_text(config)
    python = sys.executable
    stand_ins = {
        # `crio config`: the packaged config merged with the role's drop-in, as CRI-O would merge them.
        "crio": textwrap.dedent(f"""\
            #!{python}
            from pathlib import Path
            text = Path("{tmp_path}/crio.conf").read_text()
            drop_in = Path("{tmp_path}/99-nvidia.conf")
            if drop_in.exists():
                ours = drop_in.read_text()
                if 'default_runtime = "nvidia"' in ours:
                    text = text.replace('default_runtime = "crun"', 'default_runtime = "nvidia"')
                text += "\\n" + ours[ours.index("[crio.runtime.runtimes.nvidia]"):]
            print(text)
        """),
        # nvidia-ctk config [--in-place --set key=a,b]: prints, or records, nvidia-container-runtime.runtimes.
        "nvidia-ctk": textwrap.dedent(f"""\
            #!{python}
            import json, sys
            from pathlib import Path
            state = Path("{tmp_path}/ctk-set")
            if "--set" in sys.argv:
                state.write_text(sys.argv[sys.argv.index("--set") + 1])
            elif state.exists():
                print("[nvidia-container-runtime]")
                print("runtimes = " + json.dumps(state.read_text().split("=", 1)[1].split(",")))
        """),
    }
    for name, text in stand_ins.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "localhost",
                    "gather_facts": False,
                    "connection": "local",
                    "vars": {
                        "nvidia_container_toolkit_crio_drop_in": str(tmp_path / "99-nvidia.conf"),
                        "nvidia_container_toolkit_backup_dir": str(tmp_path / "backup"),
                        "nvidia_container_toolkit_restart_runtimes": False,
                    },
                    "tasks": [
                        {
                            "ansible.builtin.include_role": {
                                "name": "nvidia_container_toolkit",
                                "tasks_from": "crio.yml",
                                "defaults_from": "main.yml",
                            }
                        }
                    ],
                }
            ]
        )
    )
    # The role's filters import the collection's module_utils: the collection is found, as on a controller.
    env = {
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "ANSIBLE_COLLECTIONS_PATH": str(ensure_collection_link()),
    }

    def converge() -> str:
        proc = contractlib.run_play(playbook, tmp_path, env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
        return proc.stdout

    assert "changed=2" in converge()
    drop_in = (tmp_path / "99-nvidia.conf").read_text()
    parsed = tomllib.loads(drop_in)
    assert parsed["crio"]["runtime"]["default_runtime"] == "nvidia"
    nvidia = parsed["crio"]["runtime"]["runtimes"]["nvidia"]
    assert nvidia == {
        "runtime_path": NVIDIA,
        "runtime_root": "/run/crun",
        "runtime_type": "pod",
        "monitor_path": "/usr/libexec/crio/conmonrs",
        "allowed_annotations": ["io.containers.trace-syscall"],
    }
    assert (tmp_path / "ctk-set").read_text().strip() == (
        "nvidia-container-runtime.runtimes=/usr/libexec/crio/crun,docker-runc,runc,crun"
    )
    assert "changed=0" in converge(), "the second run keeps crun as base although nvidia is now the default"
    assert (tmp_path / "99-nvidia.conf").read_text() == drop_in


# --- refresh ----------------------------------------------------------------------------------------------


def refresh() -> None:
    """Re-resolve each Debian suite's newest containerd and python3-tomlkit from the signed indexes and
    rewrite the record (EL 9's wheel is pinned by hand; Ubuntu's records are refresh.py's)."""
    data = artifacts()
    for record in data["containerd"]:
        if record["archive"] == "debian":
            record.update(resolve_live(record))
            record["tomlkit"] = resolve_live(record["tomlkit"])
    ARTIFACTS.write_text(json.dumps(data, indent=1) + "\n")
    for record in data["containerd"]:
        print(
            f"{record['distribution']}: containerd {record.get('version', record['containerd'])}, "
            f"tomlkit {record['tomlkit']['version']}"
        )


if __name__ == "__main__":
    try:
        refresh()
    except (real.ArchiveError, urllib.error.URLError) as err:
        sys.exit(f"the Debian archive did not answer: {err}")
