"""The EL (RHEL / Rocky / Alma 8 and 9) names the roles rely on, and the dnf steps they share.

No EL repository is reachable from CI, so tests/contracts/facts/el.yaml records each name from NVIDIA's
documentation ("documented, not downloaded"). These tests hold the roles to those facts on their own, without
the contract framework: each role's defaults and RedHat vars are rendered by Ansible's own templating, the way
a play on an EL host would see them. The shared role gpufleet_dnf (version locks, repositories per CPU
architecture) runs for real through ansible-playbook on localhost, with a stand-in `dnf` that keeps its locks
in a file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible.parsing.dataloader import DataLoader
from ansible.template import Templar, trust_as_template

REPO = Path(__file__).resolve().parents[2]
ROLES = REPO / "roles"
FACTS = Path(__file__).resolve().parent / "facts" / "el.yaml"
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"

KINDS = {"package", "dkms-module", "unit", "unit-flag", "path", "repo", "key", "config-format",
         "module-stream"}
EL_FACTS = {
    "el8": {"distribution": "RedHat", "os_family": "RedHat", "distribution_major_version": "8",
            "distribution_version": "8.10", "architecture": "x86_64"},
    "el9": {"distribution": "RedHat", "os_family": "RedHat", "distribution_major_version": "9",
            "distribution_version": "9.6", "architecture": "x86_64"},
}
# Role -> (its variable mapping ansible_facts.architecture to the repository directory, what aarch64 gets).
ARCH_TABLES = {
    "nvidia_driver": ("nvidia_driver_rhel_repo_arches", "sbsa"),
    "nvidia_fabricmanager": ("nvidia_fabricmanager_repo_arches", "sbsa"),
    "nvidia_cuda_toolkit": ("nvidia_cuda_toolkit_repo_arches", "sbsa"),
    "nvidia_container_toolkit": ("nvidia_container_toolkit_rpm_arches", "aarch64"),
}


def _trusted(value: Any) -> Any:
    if isinstance(value, str):
        return trust_as_template(value)
    if isinstance(value, list):
        return [_trusted(v) for v in value]
    if isinstance(value, dict):
        return {k: _trusted(v) for k, v in value.items()}
    return value


def role_vars(role: str, distribution: str, overrides: dict[str, Any] | None = None,
              arch: str = "x86_64") -> Templar:
    """What a play on that EL host sees (defaults < vars/main.yml < vars/RedHat.yml < overrides)."""
    variables: dict[str, Any] = {}
    for name in ("defaults/main.yml", "vars/main.yml", "vars/RedHat.yml"):
        path = ROLES / role / name
        if path.exists():
            variables.update(yaml.safe_load(path.read_text()) or {})
    variables.update(overrides or {})
    variables["ansible_facts"] = {**EL_FACTS[distribution], "architecture": arch}
    return Templar(loader=DataLoader(), variables=_trusted(variables))


def render(role: str, distribution: str, name: str, overrides: dict[str, Any] | None = None,
           arch: str = "x86_64") -> Any:
    return role_vars(role, distribution, overrides, arch).template(trust_as_template("{{ " + name + " }}"))


def scalars(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for v in value.values() for s in scalars(v)]
    if isinstance(value, list):
        return [s for v in value for s in scalars(v)]
    return [str(value)]


def load_facts() -> list[dict[str, Any]]:
    return yaml.safe_load(FACTS.read_text())


def fact_id(fact: dict[str, Any]) -> str:
    extra = ",".join(f"{k}={v}" for k, v in (fact.get("vars") or {}).items())
    name = f"{fact['role']}:{fact['distribution']}:{fact['variable']}={fact['value']}"
    return name + (f"[{extra}]" if extra else "")


# -- the facts file ---------------------------------------------------------------------------------------


def test_every_el_fact_is_documented_with_its_source() -> None:
    problems = []
    for index, fact in enumerate(load_facts()):
        where = f"el.yaml[{index}] {fact.get('variable')}"
        missing = {"role", "variable", "distribution", "kind", "value", "checked", "source"} - fact.keys()
        if missing:
            problems.append(f"{where}: missing {sorted(missing)}")
            continue
        if fact["distribution"] not in EL_FACTS:
            problems.append(f"{where}: distribution {fact['distribution']} is not el8 or el9")
        if fact["kind"] not in KINDS:
            problems.append(f"{where}: kind {fact['kind']} is not one of {sorted(KINDS)}")
        if fact["checked"] != "documented":
            problems.append(f"{where}: EL facts cannot be downloaded here, checked must be documented")
        if not re.search(r"\S+ https://\S+", str(fact["source"])):
            problems.append(f"{where}: source must name the page and its URL, got {fact['source']!r}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("fact", load_facts(), ids=fact_id)
def test_role_still_says_the_documented_name(fact: dict[str, Any]) -> None:
    variable = str(fact["variable"])
    if variable.endswith(".yml"):
        text = (ROLES / fact["role"] / variable).read_text()
        assert str(fact["value"]) in text, f"roles/{fact['role']}/{variable} no longer says {fact['value']!r}"
        return
    rendered = render(fact["role"], fact["distribution"], variable, fact.get("vars"))
    assert str(fact["value"]) in scalars(rendered), (
        f"{fact['role']} {variable} on {fact['distribution']} is {rendered!r}; documented: {fact['value']!r} "
        f"({fact['source']})"
    )


# -- names that follow a setting --------------------------------------------------------------------------


# What EL 8 and 9 install when the inventory sets no driver version: each role's own vars/RedHat.yml, not the
# `default('535.261.03')` of its defaults/main.yml. Not verified against NVIDIA's rhel repositories
# (docs/roles.md).
EL_DEFAULT = {"branch": "535", "version": "535.261.03"}
DEFAULT_VARIABLES = {
    "nvidia_driver": ("nvidia_driver_branch", "nvidia_driver_version"),
    "nvidia_mps": ("nvidia_mps_branch", "nvidia_mps_driver_version"),
    "nvidia_fabricmanager": ("nvidia_fabricmanager_branch", "nvidia_fabricmanager_version"),
}


@pytest.mark.parametrize("distribution", sorted(EL_FACTS))
@pytest.mark.parametrize("role", sorted(DEFAULT_VARIABLES))
def test_el_default_driver_is_explicit_in_the_roles_redhat_vars(role: str, distribution: str) -> None:
    own = yaml.safe_load((ROLES / role / "vars" / "RedHat.yml").read_text())
    assert own.get(f"{role}_os_default_branch") == EL_DEFAULT["branch"], f"{role}/vars/RedHat.yml"
    assert own.get(f"{role}_os_default_version") == EL_DEFAULT["version"], f"{role}/vars/RedHat.yml"
    branch, version = DEFAULT_VARIABLES[role]
    assert str(render(role, distribution, branch)) == EL_DEFAULT["branch"]
    assert render(role, distribution, version) == EL_DEFAULT["version"]
    # the inventory still wins
    assert render(role, distribution, version, {"gpufleet_driver_version": "535.309.01"}) == "535.309.01"


def test_roles_doc_names_the_el_default_as_not_verified() -> None:
    paragraphs = (REPO / "docs/roles.md").read_text().split("\n\n")
    section = " ".join(next(p for p in paragraphs if p.startswith("**EL's default.**")).split())
    assert f"branch {EL_DEFAULT['branch']} / {EL_DEFAULT['version']}" in section
    assert "**not verified** against NVIDIA's rhel repositories" in section
    assert "the downgrade check reads rpm and refuses to move it back" in section


@pytest.mark.parametrize(
    ("modules", "branch", "version", "stream", "kmod", "dkms"),
    [
        ("proprietary", "535", "535.261.03", "535-dkms", "kmod-nvidia-latest-dkms", "nvidia"),
        ("open", "535", "535.261.03", "535-open", "kmod-nvidia-open-dkms", "nvidia-open"),
        ("open", "570", "570.133.20", "570-open", "kmod-nvidia-open-dkms", "nvidia-open"),
        ("open", "570", "570.148.08", "570-open", "kmod-nvidia-open-dkms", "nvidia"),
        ("open", "580", "580.126.20", "580-open", "kmod-nvidia-open-dkms", "nvidia"),
        ("proprietary", "580", "580.126.20", "580-dkms", "kmod-nvidia-latest-dkms", "nvidia"),
    ],
)
def test_kernel_module_flavour_picks_stream_package_and_dkms_name(
    modules: str, branch: str, version: str, stream: str, kmod: str, dkms: str
) -> None:
    settings = {"nvidia_driver_kernel_modules": modules, "nvidia_driver_branch": branch,
                "nvidia_driver_version": version}
    assert render("nvidia_driver", "el9", "nvidia_driver_module_stream", settings) == stream
    packages = render("nvidia_driver", "el9", "nvidia_driver_os_packages", settings)
    assert kmod in packages and len([p for p in packages if p.startswith("kmod-")]) == 1
    assert render("nvidia_driver", "el9", "nvidia_driver_dkms_module", settings) == dkms


@pytest.mark.parametrize(
    ("branch", "package", "other"),
    [("535", "nvidia-fabric-manager", "nvidia-fabricmanager"),
     ("570", "nvidia-fabric-manager", "nvidia-fabricmanager"),
     ("580", "nvidia-fabricmanager", "nvidia-fabric-manager"),
     ("590", "nvidia-fabricmanager", "nvidia-fabric-manager")],
)
def test_fabric_manager_package_follows_the_r580_rename(branch: str, package: str, other: str) -> None:
    settings = {"nvidia_fabricmanager_branch": branch, "nvidia_fabricmanager_version": f"{branch}.1.2"}
    assert render("nvidia_fabricmanager", "el9", "nvidia_fabricmanager_package", settings) == package
    assert render("nvidia_fabricmanager", "el9", "nvidia_fabricmanager_rhel_other_package", settings) == other
    spec = render("nvidia_fabricmanager", "el9", "nvidia_fabricmanager_package_spec", settings)
    assert spec == f"{package}-{branch}.1.2-1"


@pytest.mark.parametrize("role", sorted(ARCH_TABLES))
@pytest.mark.parametrize("distribution", sorted(EL_FACTS))
def test_repository_directory_follows_the_cpu_architecture(role: str, distribution: str) -> None:
    table, aarch64_dir = ARCH_TABLES[role]
    assert render(role, distribution, table) == {"x86_64": "x86_64", "aarch64": aarch64_dir}


def test_driver_installs_on_every_architecture_nvidias_el_repository_serves() -> None:
    assert render("nvidia_driver", "el9", "nvidia_driver_supported_architectures") == ["x86_64", "aarch64"]


def test_nvidia_repository_definition_is_nvidias_own_file_and_id() -> None:
    for role, file_var, id_var in (
        ("nvidia_driver", "nvidia_driver_rhel_repo_file", "nvidia_driver_rhel_repo_id"),
        ("nvidia_fabricmanager", "nvidia_fabricmanager_rhel_repo_file", "nvidia_fabricmanager_rhel_repo_id"),
        ("nvidia_cuda_toolkit", "nvidia_cuda_toolkit_rhel_repo_file", "nvidia_cuda_toolkit_rhel_repo_id"),
    ):
        assert render(role, "el9", file_var, arch="aarch64") == "cuda-rhel9"
        assert render(role, "el9", id_var, arch="aarch64") == "cuda-rhel9-sbsa"
        assert render(role, "el8", id_var) == "cuda-rhel8-x86_64"


# -- gpufleet_dnf through ansible-playbook ----------------------------------------------------------------

FAKE_DNF = r'''#!PYTHON
"""Stand-in for `dnf versionlock list|add|delete`: the locks live in $FAKE_DNF_LOCKS, one per line; each
add and delete is logged to $FAKE_DNF_LOG."""
import os, re, sys
locks_file, log_file = os.environ["FAKE_DNF_LOCKS"], os.environ["FAKE_DNF_LOG"]
args = [a for a in sys.argv[1:] if a != "-q"]
locks = open(locks_file).read().split() if os.path.exists(locks_file) else []
if args[:2] == ["versionlock", "list"]:
    print("\n".join(locks))
    sys.exit(0)
if args[:3] == ["module", "list", "nvidia-driver"]:
    print(open(os.environ["FAKE_DNF_MODULES"]).read())
    sys.exit(0)
if args[:3] == ["module", "info", args[2] if len(args) > 2 else ""] and args[2].startswith("nvidia-driver:"):
    builds = {"535": ["535.247.01", "535.261.03"], "580": ["580.126.20"]}.get(args[2].split(":")[1][:3], [])
    for build in builds:
        print("Name             : nvidia-driver\nStream           : " + args[2].split(":")[1])
        print("Artifacts        : cuda-drivers-3:" + build + "-1.x86_64")
        print("                 : nvidia-driver-3:" + build + "-1.el9.x86_64")
        print("                 : nvidia-driver-cuda-3:" + build + "-1.el9.x86_64\n")
    sys.exit(0)
if args == ["list", "dkms"]:
    print("Installed Packages\ndkms.noarch    3.1.8-1.el9    @epel")
    sys.exit(0)
if args[:2] in (["-y", "module"],):
    open(log_file, "a").write(" ".join(args) + "\n")
    sys.exit(0)
if args[:2] == ["versionlock", "delete"]:
    locks.remove(args[2])
elif args[:2] == ["versionlock", "add"]:
    spec = args[2]
    if ":" in spec.rsplit("-", 1)[1]:  # name-epoch:version, as NVIDIA's driver RPMs are locked
        name, rest = spec.rsplit("-", 1)
        rest += "-1.el9"
    else:  # name-version-release
        name, version, release = spec.rsplit("-", 2)
        rest = "0:" + version + "-" + release
    locks.append(name + "-" + rest + ".*")
else:
    sys.exit("fake dnf: unexpected " + " ".join(sys.argv[1:]))
open(locks_file, "w").write("\n".join(locks) + "\n")
open(log_file, "a").write(" ".join(args) + "\n")
'''


# rpm -q --qf '%{NAME}\t%{VERSION}\n' NAME...: as rpm answers it, from FAKE_RPM_INSTALLED (a JSON object of
# name -> version); "package NAME is not installed" and exit 1 for the others.
FAKE_RPM = '''#!PYTHON
import json, os, sys
args = sys.argv[1:]
if args[:2] != ["-q", "--qf"] or not args[2].startswith("%{NAME}") or "%{VERSION}" not in args[2]:
    sys.exit("fake rpm: unexpected " + " ".join(args))
installed = json.loads(os.environ.get("FAKE_RPM_INSTALLED") or "{}")
missing = 0
for name in args[3:]:
    if name in installed:
        print(name + "\t" + installed[name])
    else:
        print("package " + name + " is not installed")
        missing += 1
sys.exit(1 if missing else 0)
'''


@pytest.fixture
def dnf(tmp_path: Path) -> dict[str, Path]:
    """A `dnf` on PATH that keeps version locks in a file and logs what it was asked to do, and an `rpm` that
    answers the installed versions of FAKE_RPM_INSTALLED."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for name, text in (("dnf", FAKE_DNF), ("rpm", FAKE_RPM)):
        script = bindir / name
        script.write_text(text.replace("PYTHON", sys.executable, 1))
        script.chmod(0o755)
    return {"bin": bindir, "locks": tmp_path / "locks", "log": tmp_path / "dnf.log",
            "modules": tmp_path / "modules"}


def play(tmp_path: Path, tasks: list[dict[str, Any]], arch: str = "x86_64", check: bool = False,
         dnf: dict[str, Path] | None = None, installed: dict[str, str] | None = None,
         ) -> subprocess.CompletedProcess[str]:
    """Run tasks on localhost through ansible-playbook from the repository root (ansible.cfg applies)."""
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([{
        "name": "gpufleet_dnf on a pretend EL host", "hosts": "localhost", "gather_facts": False,
        "vars": {"ansible_facts": {**EL_FACTS["el9"], "architecture": arch}}, "tasks": tasks,
    }]))
    env = {**os.environ, "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0",
           "ANSIBLE_LOCALHOST_WARNING": "0", "ANSIBLE_INVENTORY_UNPARSED_WARNING": "0"}
    if dnf:
        env |= {"PATH": f"{dnf['bin']}:{env['PATH']}", "FAKE_DNF_LOCKS": str(dnf["locks"]),
                "FAKE_DNF_LOG": str(dnf["log"]), "FAKE_DNF_MODULES": str(dnf["modules"]),
                "FAKE_RPM_INSTALLED": json.dumps(installed or {})}
    argv = [str(ANSIBLE_PLAYBOOK), "-i", "localhost,", "-c", "local",
            "-e", json.dumps({"ansible_python_interpreter": sys.executable}), str(playbook)]
    if check:
        argv.append("--check")
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def changed(result: subprocess.CompletedProcess[str]) -> int:
    match = re.search(r"localhost\s*:\s*ok=\d+\s+changed=(\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    return int(match.group(1))


def dnf_step(entry: str, **variables: Any) -> dict[str, Any]:
    return {"name": f"gpufleet_dnf {entry}", "vars": variables,
            "ansible.builtin.include_role": {"name": "gpufleet_dnf", "tasks_from": entry}}


CUDA_SBSA = "https://developer.download.nvidia.com/compute/cuda/repos/rhel9/sbsa"
CUDA_X86 = "https://developer.download.nvidia.com/compute/cuda/repos/rhel9/x86_64"


def test_unknown_architecture_is_refused_naming_the_supported_ones(tmp_path: Path) -> None:
    result = play(tmp_path, [dnf_step("repo", gpufleet_dnf_repo_manage=False)], arch="ppc64le")
    assert result.returncode != 0
    assert "CPU architecture ppc64le" in result.stdout, result.stdout
    assert "supported: x86_64, aarch64" in result.stdout, result.stdout


def test_repository_url_of_another_architecture_is_refused(tmp_path: Path) -> None:
    result = play(tmp_path, [dnf_step(
        "repo", gpufleet_dnf_repo_url_var="nvidia_driver_rhel_repo_url",
        gpufleet_dnf_repo_id="cuda-rhel9-sbsa", gpufleet_dnf_repo_file="cuda-rhel9",
        gpufleet_dnf_repo_baseurl=CUDA_X86, gpufleet_dnf_repo_dir=str(tmp_path))], arch="aarch64")
    assert result.returncode != 0
    assert f"nvidia_driver_rhel_repo_url is {CUDA_X86}" in result.stdout, result.stdout
    assert "whose directory is sbsa" in result.stdout, result.stdout
    assert not list(tmp_path.glob("*.repo")), "nothing is written when the URL is refused"


def test_repository_definition_for_aarch64_is_written_as_nvidia_writes_it(tmp_path: Path) -> None:
    step = dnf_step(
        "repo", gpufleet_dnf_repo_id="cuda-rhel9-sbsa", gpufleet_dnf_repo_file="cuda-rhel9",
        gpufleet_dnf_repo_description="cuda-rhel9-sbsa", gpufleet_dnf_repo_baseurl=CUDA_SBSA,
        gpufleet_dnf_repo_gpgkey=f"{CUDA_SBSA}/D42D0685.pub", gpufleet_dnf_repo_dir=str(tmp_path))
    first = play(tmp_path, [step], arch="aarch64")
    assert first.returncode == 0, first.stdout + first.stderr
    written = (tmp_path / "cuda-rhel9.repo").read_text()
    assert "[cuda-rhel9-sbsa]" in written
    assert f"baseurl = {CUDA_SBSA}" in written and f"gpgkey = {CUDA_SBSA}/D42D0685.pub" in written
    assert "gpgcheck = 1" in written and "repo_gpgcheck = 0" in written
    assert changed(play(tmp_path, [step], arch="aarch64")) == 0, "a second run changes nothing"


def test_stale_locks_are_released_and_locks_at_the_wanted_version_kept(
    tmp_path: Path, dnf: dict[str, Path]
) -> None:
    dnf["locks"].write_text("\n".join([
        "nvidia-fabric-manager-0:535.261.03-1.*",
        "nvidia-fabric-manager-devel-0:535.261.03-1.*",
        "nvidia-driver-3:580.126.20-1.el9.*",
        "nvidia-driver-cuda-3:535.261.03-1.el9.*",
        "kernel-0:5.14.0-570.12.1.el9_6.*",
    ]) + "\n")
    release = [
        dnf_step("versionlock-release", gpufleet_dnf_version="580.126.20-1",
                 gpufleet_dnf_packages=["nvidia-fabricmanager", "nvidia-fabric-manager"]),
        dnf_step("versionlock-release", gpufleet_dnf_packages=["nvidia-driver", "nvidia-driver-cuda"],
                 gpufleet_dnf_version="580.126.20"),
    ]
    result = play(tmp_path, release, dnf=dnf)
    assert result.returncode == 0, result.stdout + result.stderr
    assert dnf["log"].read_text().splitlines() == [
        "versionlock delete nvidia-fabric-manager-0:535.261.03-1.*",
        "versionlock delete nvidia-driver-cuda-3:535.261.03-1.el9.*",
    ]
    assert dnf["locks"].read_text().split() == [
        "nvidia-fabric-manager-devel-0:535.261.03-1.*",
        "nvidia-driver-3:580.126.20-1.el9.*",
        "kernel-0:5.14.0-570.12.1.el9_6.*",
    ]
    assert changed(play(tmp_path, release, dnf=dnf)) == 0, "nothing stale is left to release"


def test_hold_adds_missing_locks_once(tmp_path: Path, dnf: dict[str, Path]) -> None:
    dnf["locks"].write_text("nvidia-driver-3:580.126.20-1.el9.*\n")
    hold = [
        dnf_step("versionlock-hold", gpufleet_dnf_packages=["nvidia-driver", "nvidia-driver-cuda"],
                 gpufleet_dnf_version="580.126.20", gpufleet_dnf_epoch="3:"),
        dnf_step("versionlock-hold", gpufleet_dnf_packages=["nvidia-container-toolkit"],
                 gpufleet_dnf_version="1.17.8-1"),
    ]
    result = play(tmp_path, hold, dnf=dnf)
    assert result.returncode == 0, result.stdout + result.stderr
    assert dnf["log"].read_text().splitlines() == [
        "versionlock add nvidia-driver-cuda-3:580.126.20",
        "versionlock add nvidia-container-toolkit-1.17.8-1",
    ]
    assert changed(play(tmp_path, hold, dnf=dnf)) == 0, "every lock is already there"


def test_release_of_all_versions_and_check_mode(tmp_path: Path, dnf: dict[str, Path]) -> None:
    dnf["locks"].write_text("libnvidia-container1-0:1.17.8-1.*\nnvidia-container-toolkit-0:1.17.8-1.*\n")
    release_all = [dnf_step("versionlock-release", gpufleet_dnf_packages=["nvidia-container-toolkit"],
                            gpufleet_dnf_version="")]
    assert play(tmp_path, release_all, dnf=dnf, check=True).returncode == 0
    assert not dnf["log"].exists(), "check mode releases nothing"
    assert play(tmp_path, release_all, dnf=dnf).returncode == 0
    assert dnf["locks"].read_text().split() == ["libnvidia-container1-0:1.17.8-1.*"]



# -- the driver's module stream (nvidia_driver package-RedHat.yml up to its dnf install) ------------------

MODULES = """cuda-rhel9-x86_64
Name           Stream             Profiles                    Summary
nvidia-driver  latest             default [d], fm, ks, src    Nvidia driver for latest branch
nvidia-driver  latest-dkms        default [d], fm, ks         Nvidia driver for latest-dkms branch
nvidia-driver  535-dkms{e535}     default [d], fm, ks         Nvidia driver for 535-dkms branch
nvidia-driver  535-open           default [d], fm, ks, src    Nvidia driver for 535-open branch
nvidia-driver  580-dkms{e580}     default [d], fm, ks         Nvidia driver for 580-dkms branch
nvidia-driver  580-open           default [d], fm, ks, src    Nvidia driver for 580-open branch

Hint: [d]efault, [e]nabled, [x]disabled, [i]nstalled
"""


def driver_up_to_install(tmp_path: Path, dnf: dict[str, Path], enabled: str,
                         installed: dict[str, str] | None = None, **settings: str,
                         ) -> subprocess.CompletedProcess[str]:
    """nvidia_driver's RedHat package tasks with `enabled` the stream dnf reports as enabled ("" for none)."""
    dnf["modules"].write_text(MODULES.format(e535=" [d][e]" if enabled == "535-dkms" else "",
                                             e580=" [e]" if enabled == "580-dkms" else ""))
    role = {"nvidia_driver_manage_repo": False, **settings}
    return play(tmp_path, [
        {"name": "Settle the package lists", "vars": role,
         "ansible.builtin.include_role": {"name": "nvidia_driver", "tasks_from": "setup"}},
        {"name": "Install from packages", "vars": role,
         "ansible.builtin.include_role": {"name": "nvidia_driver", "tasks_from": "package-RedHat"}},
    ], dnf=dnf, installed=installed)


def module_commands(dnf: dict[str, Path]) -> list[str]:
    lines = dnf["log"].read_text().splitlines() if dnf["log"].exists() else []
    return [line for line in lines if " module " in f" {line} "]


@pytest.mark.parametrize(
    ("enabled", "settings", "command"),
    [
        ("", {}, "-y module enable nvidia-driver:535-dkms"),
        ("535-dkms", {}, None),
        ("535-dkms", {"nvidia_driver_kernel_modules": "open"},
         "-y module switch-to nvidia-driver:535-open --allowerasing --disableplugin=versionlock"),
        ("535-dkms", {"nvidia_driver_branch": "580", "nvidia_driver_version": "580.126.20"},
         "-y module switch-to nvidia-driver:580-open --allowerasing --disableplugin=versionlock"),
    ],
    ids=["none-enabled", "same-stream", "to-open", "branch-change"],
)
def test_driver_stream_is_enabled_or_switched_before_the_install(
    tmp_path: Path, dnf: dict[str, Path], enabled: str, settings: dict[str, str], command: str | None
) -> None:
    result = driver_up_to_install(tmp_path, dnf, enabled, **settings)
    # This machine has no dnf Python bindings: the run ends at the install, after the stream step.
    assert "Ensure the driver packages are installed at exactly that version" in result.stdout, result.stdout
    assert module_commands(dnf) == ([command] if command else [])


def test_driver_branch_without_a_stream_is_refused_naming_the_offered_ones(
    tmp_path: Path, dnf: dict[str, Path]
) -> None:
    result = driver_up_to_install(tmp_path, dnf, "535-dkms", nvidia_driver_branch="590",
                                  nvidia_driver_version="590.48.01",
                                  nvidia_driver_kernel_modules="proprietary")
    assert result.returncode != 0
    assert "stream 590-dkms" in result.stdout, result.stdout
    offered = "offered: latest, latest-dkms, 535-dkms, 535-open, 580-dkms, 580-open"
    assert offered in result.stdout, result.stdout
    assert module_commands(dnf) == []


def test_driver_version_missing_from_the_stream_is_refused_naming_the_offered_ones(
    tmp_path: Path, dnf: dict[str, Path]
) -> None:
    result = driver_up_to_install(tmp_path, dnf, "535-dkms", nvidia_driver_version="535.999.01")
    assert result.returncode != 0
    assert "nvidia-driver 535.999.01 is not in the module stream 535-dkms" in result.stdout, result.stdout
    assert "(offered: 535.247.01, 535.261.03)" in result.stdout, result.stdout
    assert module_commands(dnf) == []


def test_newer_installed_build_of_the_branch_is_not_moved_back(tmp_path: Path,
                                                              dnf: dict[str, Path]) -> None:
    """rpm says nvidia-driver 535.309.01 is installed, 535.261.03 is asked for: refused before any dnf."""
    installed = {"nvidia-driver": "535.309.01", "kmod-nvidia-latest-dkms": "535.309.01"}
    result = driver_up_to_install(tmp_path, dnf, "535-dkms", installed=installed)
    assert result.returncode != 0
    assert "kmod-nvidia-latest-dkms, nvidia-driver at 535.309.01" in result.stdout, result.stdout
    assert "nvidia_driver_allow_downgrade (or gpufleet_driver_allow_downgrade): true" in result.stdout
    assert module_commands(dnf) == [] and not dnf["log"].exists()
    allowed = driver_up_to_install(tmp_path, dnf, "535-dkms", installed=installed,
                                   nvidia_driver_allow_downgrade="true")
    assert "Ensure the driver packages are installed at exactly" in allowed.stdout, allowed.stdout
