"""What the driver-side roles assume beyond single names: defaults that agree and install, the flavour
switch, persistence mode, and that every package-naming variable has a fact (Debian and Ubuntu)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import contractlib
import jinja2
import pytest
from contractlib import note_reading, role_vars

DEBIAN_FAMILY = ("debian-12", "debian-13", "ubuntu-22.04", "ubuntu-24.04")
# Role -> its Debian/Ubuntu vars files' variables that name nothing inside a package (tables that other
# variables pick from, commands of dpkg itself, the CUDA repository's URL parts are covered as documented).
NOT_NAMES = {
    "nvidia_driver": {
        "nvidia_driver_os_defaults",
        "nvidia_driver_os_default_branch",
        "nvidia_driver_os_default_version",
        "nvidia_driver_kernel_module_packages",
        "nvidia_driver_dkms_modules",
    },
    "nvidia_fabricmanager": {
        "nvidia_fabricmanager_os_defaults",
        "nvidia_fabricmanager_os_default_branch",
        "nvidia_fabricmanager_os_default_version",
        "nvidia_fabricmanager_os_manage_repo",
        "nvidia_fabricmanager_package_spec",
        "nvidia_fabricmanager_version_query",
    },
    "nvidia_mps": {
        "nvidia_mps_os_defaults",
        "nvidia_mps_os_default_branch",
        "nvidia_mps_os_default_version",
        "nvidia_mps_package_spec",
    },
    "nvidia_cuda_toolkit": {
        "nvidia_cuda_toolkit_os_defaults",
        "nvidia_cuda_toolkit_os_default_series",
        "nvidia_cuda_toolkit_os_default_version",
    },
    "gpu_host_prep": set(),
}
SUPPORTED = {
    "nvidia_fabricmanager": ("debian-12", "ubuntu-22.04", "ubuntu-24.04"),
    "nvidia_cuda_toolkit": ("debian-12", "ubuntu-22.04", "ubuntu-24.04"),
}


@pytest.mark.parametrize("role", sorted(NOT_NAMES))
def test_every_package_naming_variable_has_a_fact(role: str) -> None:
    facts = contractlib.load_facts()
    missing = []
    for distro in SUPPORTED.get(role, DEBIAN_FAMILY):
        rv = role_vars(role, distro)
        os_file = contractlib.ROLES / role / "vars" / rv.distribution.vars_files()[0]
        names = {
            name
            for name in (contractlib.read_yaml(os_file) or {})
            if name not in NOT_NAMES[role] and rv.get(name) not in ([], "", None)
        }
        covered = {f.variable for f in facts if f.role == role and f.distribution == distro}
        missing += [f"{distro}: {name}" for name in sorted(names - covered)]
    assert not missing, f"role {role}: variables naming real things without a facts entry: {missing}"


@pytest.mark.parametrize("distro", DEBIAN_FAMILY)
def test_driver_defaults_agree_across_roles(distro: str) -> None:
    """nvidia_driver, nvidia_fabricmanager and nvidia_mps agree on the driver when the inventory is silent."""
    driver = role_vars("nvidia_driver", distro)
    mps = role_vars("nvidia_mps", distro)
    wanted = (str(driver.get("nvidia_driver_branch")), str(driver.get("nvidia_driver_version")))
    assert (str(mps.get("nvidia_mps_branch")), str(mps.get("nvidia_mps_driver_version"))) == wanted
    if distro in SUPPORTED["nvidia_fabricmanager"]:
        fm = role_vars("nvidia_fabricmanager", distro)
        assert (
            str(fm.get("nvidia_fabricmanager_branch")),
            str(fm.get("nvidia_fabricmanager_version")),
        ) == wanted


@pytest.mark.parametrize("distro", DEBIAN_FAMILY)
def test_inventory_branch_and_version_override_the_distribution_default(distro: str) -> None:
    rv = role_vars("nvidia_driver", distro, gpufleet_driver_branch="570", gpufleet_driver_version="570.1.2")
    assert (str(rv.get("nvidia_driver_branch")), rv.get("nvidia_driver_version")) == ("570", "570.1.2")


@pytest.mark.parametrize(
    ("branch", "flavour"), [("535", "proprietary"), ("550", "proprietary"), ("560", "open"), ("580", "open")]
)
def test_kernel_module_default_follows_the_branch(branch: str, flavour: str) -> None:
    rv = role_vars("nvidia_driver", "ubuntu-22.04", gpufleet_driver_branch=branch)
    assert rv.get("nvidia_driver_kernel_modules") == flavour


@pytest.mark.parametrize(
    ("distro", "flavour", "package", "module"),
    [
        ("debian-12", "proprietary", "nvidia-kernel-dkms", "nvidia-current"),
        ("debian-13", "open", "nvidia-open-kernel-dkms", "nvidia-current-open"),
        ("ubuntu-22.04", "proprietary", "nvidia-dkms-580-server", "nvidia-srv"),
        ("ubuntu-24.04", "open", "nvidia-dkms-580-server-open", "nvidia"),
    ],
)
def test_flavour_picks_its_dkms_package_and_module(
    distro: str, flavour: str, package: str, module: str
) -> None:
    rv = role_vars("nvidia_driver", distro, nvidia_driver_kernel_modules=flavour)
    packages = rv.get("nvidia_driver_os_packages")
    assert packages[0] == package and rv.get("nvidia_driver_dkms_module") == module
    other = {"open": "proprietary", "proprietary": "open"}[flavour]
    assert rv.get("nvidia_driver_kernel_module_packages")[other] not in packages


@pytest.mark.parametrize(
    ("distro", "probe"),
    [
        (
            "debian-12",
            {
                "archive": "debian",
                "suite": "bookworm",
                "component": "contrib",
                "package": "nvidia-persistenced",
            },
        ),
        (
            "debian-13",
            {
                "archive": "debian",
                "suite": "trixie",
                "component": "contrib",
                "package": "nvidia-persistenced",
            },
        ),
        (
            "ubuntu-22.04",
            {
                "archive": "ubuntu",
                "suite": "jammy-updates",
                "component": "restricted",
                "package": "nvidia-compute-utils-580-server",
                "version": "580.178.04",
            },
        ),
        (
            "ubuntu-24.04",
            {
                "archive": "ubuntu",
                "suite": "noble-updates",
                "component": "restricted",
                "package": "nvidia-compute-utils-580-server",
                "version": "580.178.04",
            },
        ),
    ],
)
def test_persistence_dropin_turns_persistence_mode_on(distro: str, probe: dict[str, str]) -> None:
    """The drop-in runs the package's own binary as the package's own user, without --no-persistence-mode."""
    facts = [
        f
        for f in contractlib.load_facts()
        if f.role == "nvidia_driver"
        and f.distribution == distro
        and f.probe
        and f.probe.get("read") == "exec-start"
        and f.probe["package"] == probe["package"]
    ]
    assert facts, f"facts/nvidia_driver.yaml has no exec-start probe of {probe['package']} for {distro}"
    reading, how = contractlib.reading_for(facts[0])
    note_reading(how)
    shipped = reading.value.split()
    command = [str(a) for a in role_vars("nvidia_driver", distro).get("nvidia_driver_persistenced_command")]
    assert command[0] == shipped[0], f"the package's unit runs {shipped[0]}, the drop-in {command[0]}"
    assert command[command.index("--user") + 1] == shipped[shipped.index("--user") + 1]
    assert "--no-persistence-mode" not in command
    template = (
        contractlib.ROLES / "nvidia_driver" / "templates" / "nvidia-persistenced-override.conf.j2"
    ).read_text()
    assert "ExecStart=\nExecStart={{ nvidia_driver_persistenced_command | join(' ') }}" in template


# The persistence daemon's unit as each distribution ships it: Debian's from its own source package (read
# here), Ubuntu's from nvidia-compute-utils-<branch>-server (the facts' `text` probes, recorded for CI).
DEBIAN_PERSISTENCED = {
    "debian-12": ("bookworm", "/lib/systemd/system/nvidia-persistenced.service"),
    "debian-13": ("trixie", "/usr/lib/systemd/system/nvidia-persistenced.service"),
}


def _persistenced_unit(distro: str) -> tuple[str, str]:
    """(the unit's path, its text) in the package the role installs it from."""
    if distro in DEBIAN_PERSISTENCED:
        suite, path = DEBIAN_PERSISTENCED[distro]
        probe = {"archive": "debian", "suite": suite, "component": "contrib",
                 "package": "nvidia-persistenced", "read": "text", "path": path}  # fmt: skip
        reading, how = contractlib.read_live(probe), "downloaded"
    else:
        (fact,) = [
            f for f in contractlib.load_facts()
            if f.distribution == distro and f.kind == "unit-setting" and f.probe and f.probe["read"] == "text"
        ]  # fmt: skip
        reading, how = contractlib.reading_for(fact)
        path = fact.probe["path"]
    note_reading(how)
    assert reading.value.startswith(("[Unit]", "#")), f"{distro}: {path} is not in {reading.package}"
    return path, str(reading.value)


def _systemctl_enable(root: Path) -> tuple[bool, str]:
    """systemctl's own offline `enable` on a root with the unit (and the drop-in): whether it linked the unit
    into multi-user.target.wants, and what it said."""
    done = subprocess.run(["systemctl", f"--root={root}", "enable", "nvidia-persistenced.service"],
                          capture_output=True, text=True, check=False)  # fmt: skip
    link = root / "etc/systemd/system/multi-user.target.wants/nvidia-persistenced.service"
    return link.is_symlink(), done.stdout + done.stderr


@pytest.mark.skipif(shutil.which("systemctl") is None, reason="needs systemctl (systemd's own unit loader)")
@pytest.mark.parametrize("distro", DEBIAN_FAMILY)
def test_persistence_dropin_makes_the_packages_unit_start_at_boot(distro: str, tmp_path: Path) -> None:
    """Enabling the package's unit with the role's drop-in links it into multi-user.target.wants, so the
    daemon starts at every boot. Ubuntu's unit alone cannot be enabled (no [Install] section; only udev's
    71-nvidia.rules starts it, and StopWhenUnneeded=true stops it again); Debian's can, and keeps that."""
    path, text = _persistenced_unit(distro)
    root = tmp_path / "root"
    (root / "etc/systemd/system").mkdir(parents=True)
    unit = root / path.lstrip("/")
    unit.parent.mkdir(parents=True, exist_ok=True)
    unit.write_text(text)
    alone, said = _systemctl_enable(root)
    if distro.startswith("ubuntu"):
        assert not alone and "no installation config" in said, f"{distro}: {said}"
        assert "StopWhenUnneeded=true" in text.splitlines()
    else:
        assert alone, f"{distro}: Debian's unit no longer enables by itself: {said}"
    shutil.rmtree(root / "etc/systemd/system/multi-user.target.wants", ignore_errors=True)

    rv = role_vars("nvidia_driver", distro)
    template = (contractlib.ROLES / "nvidia_driver" / "templates" / "nvidia-persistenced-override.conf.j2")
    names = ("nvidia_driver_persistenced_command", "nvidia_driver_persistenced_wanted_by")
    environment = jinja2.Environment(undefined=jinja2.StrictUndefined)
    rendered = environment.from_string(template.read_text()).render(
        ansible_managed="gpufleet", **{name: rv.get(name) for name in names}
    )
    dropin = root / str(rv.get("nvidia_driver_persistenced_dropin")).lstrip("/")
    dropin.parent.mkdir(parents=True)
    dropin.write_text(rendered)
    linked, said = _systemctl_enable(root)
    assert linked, f"{distro}: with the drop-in, systemctl enable did not link the unit: {said}"
    assert "StopWhenUnneeded=false" in rendered.splitlines()
