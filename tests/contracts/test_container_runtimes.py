"""nvidia_container_toolkit against container runtimes as fleets have them.

containerd: Debian's real 1.6 (bookworm), 1.7 (trixie) and 2.1 (sid) binaries, each run standalone for
`containerd --config F config dump` (no daemon), which judges every config the module writes: a fresh host,
Debian's own config.toml, a version-2 site config, a version-3 config, Docker CE's CRI-disabled config.
Docker CE's config and CRI-O's packaged configs are recorded from their sources (documented, not downloaded)
in fixtures/container_runtimes-artifacts.json; so are the containerd packages the matrix last ran against
(suite, version, pool path, sha256). `python tests/contracts/test_container_runtimes.py` re-resolves the
packages from the signed archive indexes and rewrites that record.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import tomllib
import urllib.error
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import contractlib
from contractlib import REPO, real, role_says, validate_entry
from labstack import ensure_collection_link

ROLE = REPO / "roles/nvidia_container_toolkit"
MODULE = REPO / "plugins/modules/nvidia_containerd_runtime.py"
FACTS = Path(__file__).resolve().parent / "facts/container_runtimes.yaml"
ARTIFACTS = Path(__file__).resolve().parent / "fixtures/container_runtimes-artifacts.json"
THIS = "tests/contracts/test_container_runtimes.py"
VERSIONS = ("1.6", "1.7", "2.1")
NVIDIA = "/usr/bin/nvidia-container-runtime"
DOCKER_CE = "docker-ce containerd.io /etc/containerd/config.toml"
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


# --- the real binaries ------------------------------------------------------------------------------------


def _unpack(deb: Path, into: Path) -> None:
    partial = into.with_name(f"{into.name}.{os.getpid()}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    # One pass of dpkg-deb and tar (real.deb_file would read the 40 MB archive once per file).
    members = ["./usr/bin/containerd", "./etc/containerd/config.toml"]
    data = subprocess.run(["dpkg-deb", "--fsys-tarfile", str(deb)], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(partial), *members], input=data, check=True)
    for member in members:
        (partial / member).rename(partial / Path(member).name)
    try:
        partial.replace(into)
    except OSError:  # another process unpacked the same package first
        shutil.rmtree(partial, ignore_errors=True)


def _fetch_recorded(record: dict[str, Any]) -> Path:
    """The recorded .deb from the archive's pool, checked against its recorded sha256 (a signed index's)."""
    fields = {
        "Package": record["package"],
        "Version": record["version"],
        "Filename": record["pool"],
        "SHA256": record["sha256"],
    }
    return real.download(real.Stanza(real.Archive.debian(), record["suite"], record["component"], fields))


def resolve_live(record: dict[str, Any]) -> dict[str, Any]:
    """The suite's newest containerd now, from its gpgv-verified InRelease and Packages index."""
    stanza = real.versions(
        real.packages(real.Archive.debian(), record["suite"], record["component"]), record["package"]
    )[-1]
    return {**record, "version": stanza.version, "pool": stanza.filename, "sha256": stanza.sha256}


def binary_dir(record: dict[str, Any]) -> Path:
    """/usr/bin/containerd and /etc/containerd/config.toml of the recorded package, unpacked once (cached)."""
    unpacked = real.state_dir() / "archives" / f"containerd-{record['sha256']}"
    if not unpacked.exists():
        try:
            deb = _fetch_recorded(record)
        except real.ArchiveError:
            # sid drops superseded packages from its pool: test the suite's current one instead.
            record.update(resolve_live(record))
            return binary_dir(record)
        _unpack(deb, unpacked)
    return unpacked


# Module scope: under xdist, tests/conftest.py keeps this file's tests on one worker, so one process unpacks.
@pytest.fixture(scope="module")
def binaries() -> dict[str, Path]:
    return {r["containerd"]: binary_dir(r) for r in artifacts()["containerd"]}


@pytest.fixture(params=VERSIONS)
def ctr(request: pytest.FixtureRequest, binaries: dict[str, Path], tmp_path: Path) -> Containerd:
    return Containerd(request.param, binaries[request.param], tmp_path)


class Containerd:
    """One real containerd and a scratch /etc/containerd for the module."""

    def __init__(self, version: str, unpacked: Path, tmp_path: Path) -> None:
        self.version = version
        self.binary = unpacked / "containerd"
        self.stock_config = (unpacked / "config.toml").read_text()
        self.config = tmp_path / "config.toml"
        self.drop_in = tmp_path / "conf.d/99-nvidia.toml"
        self.major = int(version.split(".")[0])

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
        env = {**os.environ, "PYTHONPATH": str(ensure_collection_link())}
        proc = subprocess.run(
            [sys.executable, str(MODULE), str(argfile)], capture_output=True, text=True, env=env, check=False
        )
        assert proc.stdout.strip(), f"the module printed nothing: {proc.stderr[-2000:]}"
        result: dict[str, Any] = json.loads(proc.stdout)
        return result

    def dump(self) -> str:
        return subprocess.run(
            [str(self.binary), "--config", str(self.config), "config", "dump"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def parsed(self) -> dict[str, Any]:
        return tomllib.loads(self.dump())

    def cri(self) -> dict[str, Any]:
        """The CRI runtime section of the merged config, whatever the version."""
        plugins = self.parsed()["plugins"]
        return dict(
            plugins["io.containerd.cri.v1.runtime" if self.major >= 2 else "io.containerd.grpc.v1.cri"]
        )

    def nvidia(self) -> dict[str, Any]:
        runtime: dict[str, Any] = self.cri()["containerd"]["runtimes"]["nvidia"]
        return runtime


def assert_offers_nvidia(ctr: Containerd, systemd_cgroup: bool = False) -> None:
    cri = ctr.cri()
    assert cri["containerd"]["default_runtime_name"] == "nvidia"
    assert ctr.nvidia()["runtime_type"] == "io.containerd.runc.v2"
    assert ctr.nvidia()["options"]["BinaryName"] == NVIDIA
    assert ctr.nvidia()["options"]["SystemdCgroup"] is systemd_cgroup
    # What tasks/verify.yml reads from the same dump on a host.
    seen = FILTERS["containerd_cri_runtime"](ctr.dump(), "nvidia")
    assert seen["runtime"]["options"]["BinaryName"] == NVIDIA and seen["default_runtime_name"] == "nvidia"


# --- the matrix -------------------------------------------------------------------------------------------


def test_fresh_host_gets_a_config_that_imports_the_drop_in(ctr: Containerd) -> None:
    result = ctr.run()
    assert result["changed"] and result["cri_enabled"], result
    assert result["config_version"] == (3 if ctr.major >= 2 else 2)
    assert ctr.config.read_text().startswith(f"version = {result['config_version']}\nimports = ")
    assert_offers_nvidia(ctr)
    assert ctr.run()["changed"] is False


def test_debians_own_config_keeps_its_settings_and_a_backup(ctr: Containerd) -> None:
    ctr.config.write_text(ctr.stock_config)
    result = ctr.run()
    assert result["changed"] and result["config_version"] == 2, result
    assert_offers_nvidia(ctr)
    cni = ctr.cri()["cni"]
    assert "/usr/lib/cni" in (cni.get("bin_dirs") or [cni.get("bin_dir")])
    assert [Path(b).read_text() for b in result["backups"]] == [ctr.stock_config]
    second = ctr.run()
    assert second["changed"] is False and second["backups"] == []


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


def test_check_mode_reports_the_change_and_writes_nothing(ctr: Containerd) -> None:
    ctr.config.write_text(ctr.stock_config)
    result = ctr.run(check=True)
    assert result["changed"] is True and result["diff"]
    assert ctr.config.read_text() == ctr.stock_config and not ctr.drop_in.exists()


def test_absent_takes_back_import_and_drop_in(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V2)
    ctr.run()
    assert ctr.run(state="absent")["changed"] is True
    assert ctr.config.read_text() == SITE_V2 and not ctr.drop_in.exists()
    assert "nvidia" not in ctr.cri()["containerd"]["runtimes"]


def test_main_config_only_gains_the_import(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V2)
    ctr.run()
    assert ctr.config.read_text() == SITE_V2.replace(
        "version = 2\n", f'version = 2\nimports = ["{ctr.drop_in}"]\n'
    )


def test_existing_imports_are_kept(ctr: Containerd) -> None:
    other = ctr.config.parent / "other.toml"
    other.write_text("version = 2\n")
    ctr.config.write_text(f'version = 2\nimports = ["{other}"]\n')
    ctr.run()
    assert f'imports = ["{other}", "{ctr.drop_in}"]' in ctr.config.read_text()
    assert ctr.nvidia()["options"]["BinaryName"] == NVIDIA


def test_site_edit_after_the_first_run_reaches_the_merged_config(ctr: Containerd) -> None:
    ctr.config.write_text(SITE_V2)
    ctr.run()
    ctr.config.write_text(ctr.config.read_text().replace("pause:3.9", "pause:3.10"))
    ctr.run()  # 1.x: the drop-in carries the CRI section again; 2.x merges, nothing to carry
    if ctr.major >= 2:
        sandbox = ctr.parsed()["plugins"]["io.containerd.cri.v1.images"]["pinned_images"]["sandbox"]
    else:
        sandbox = ctr.cri()["sandbox_image"]
    assert sandbox == "registry.example.internal/pause:3.10"


def test_not_the_default_runtime_when_asked(ctr: Containerd) -> None:
    ctr.run(set_default=False)
    assert ctr.cri()["containerd"]["default_runtime_name"] == "runc"
    assert ctr.nvidia()["options"]["BinaryName"] == NVIDIA


def test_unparsable_config_fails_and_is_left_untouched(ctr: Containerd) -> None:
    broken = 'version = 2\n[plugins."io.containerd.grpc.v1.cri"\n'
    ctr.config.write_text(broken)
    result = ctr.run()
    assert result["failed"] and "cannot parse" in result["msg"] and "left untouched" in result["msg"]
    assert ctr.config.read_text() == broken and not ctr.drop_in.exists()


def test_a_version_3_drop_in_would_have_lost_a_version_2_sites_settings(
    binaries: dict[str, Path], tmp_path: Path
) -> None:
    """Why the drop-in follows the main config's version: containerd 2.1 ignores the v2 keys otherwise."""
    ctr = Containerd("2.1", binaries["2.1"], tmp_path)
    drop = tmp_path / "v3.toml"
    drop.write_text(
        'version = 3\n[plugins."io.containerd.cri.v1.runtime".containerd]\n  default_runtime_name = "x"\n'
    )
    ctr.config.write_text(SITE_V2.replace("version = 2\n", f'version = 2\nimports = ["{drop}"]\n'))
    runc = ctr.cri()["containerd"]["runtimes"]["runc"]["options"]
    assert runc["SystemdCgroup"] is False, (
        "containerd 2.1 changed how it merges mixed versions: revisit the module"
    )


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
    ids=lambda e: f"containerd {e['containerd']}:{e['value']}",
)
def test_each_downloaded_fact_holds_for_its_real_binary(
    entry: dict[str, Any], binaries: dict[str, Path], tmp_path: Path
) -> None:
    ctr = Containerd(entry["containerd"], binaries[entry["containerd"]], tmp_path)
    ctr.config.write_text(ctr.stock_config)
    dump = ctr.dump()
    version_line = dump.splitlines()[0] if dump.startswith("version") else ""
    if entry["value"].startswith("plugins."):
        plugin = entry["value"].split(".", 1)[1].strip('"')
        assert (
            plugin in tomllib.loads(dump)["plugins"]
            and "runtimes" in tomllib.loads(dump)["plugins"][plugin]["containerd"]
        )
    elif entry["value"] == "2: (2, 3)":
        assert ctr.stock_config.startswith("version = 2") and version_line == "version = 3"
    elif entry["value"] == "tomllib":
        ctr.run()
        assert f"BinaryName = '{NVIDIA}'" in ctr.dump(), "2.1 dumps single quotes (verify.yml must not grep)"
    else:
        pytest.fail(f"no check for fact {entry}")


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
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}

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
    """Re-resolve each suite's newest containerd from the signed indexes and rewrite the record."""
    data = artifacts()
    data["containerd"] = [resolve_live(r) for r in data["containerd"]]
    ARTIFACTS.write_text(json.dumps(data, indent=1) + "\n")
    for record in data["containerd"]:
        name = f"containerd {record['containerd']}"
        print(f"{name}: {record['suite']} {record['version']} sha256:{record['sha256']}")


if __name__ == "__main__":
    try:
        refresh()
    except (real.ArchiveError, urllib.error.URLError) as err:
        sys.exit(f"the Debian archive did not answer: {err}")
