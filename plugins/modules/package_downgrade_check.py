#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: refuse to move an installed newer build of a driver branch back to an older one."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: package_downgrade_check
short_description: Refuse to move an installed newer build of a package branch back, unless asked
version_added: "0.1.0"
description:
  - Reads the installed versions of the named packages (and, on Debian and Ubuntu, of every installed binary
    package built from the named source packages) from the package database, and compares each one whose
    upstream version belongs to O(branch) with O(version), the version the calling role is about to install.
  - An installed build newer than O(version) would be moved back by the install that follows (the roles pin
    their packages at an exact version with apt priority 1001 or C(dnf install) of that version). A host that
    took a distribution's security update of the driver (Debian 12's C(bookworm-security) carries
    535.309.01 while C(bookworm) has 535.261.03) must not silently lose it.
  - Fails, before anything is changed, naming the packages, both versions and the variables that change the
    outcome, unless O(allow) is true. Builds of another branch never count (a branch change is a deliberate
    move of its own).
  - Compares upstream versions only (C(535.309.01-0+deb12u1) is 535.309.01), so another Debian revision of
    the same upstream version is not a downgrade.
  - Never changes the target.
author:
  - gpufleet contributors (@gpufleet)
options:
  version:
    description: The upstream version the caller is about to install, e.g. C(535.309.01).
    type: str
    required: true
  branch:
    description: The branch whose builds count; empty takes the first dot-separated field of O(version).
    type: str
    default: ""
  packages:
    description: Package names whose installed build is checked (those not installed are skipped).
    type: list
    elements: str
    default: []
  sources:
    description:
      - Debian source package names; every installed binary package built from one of them is checked too
        (C(nvidia-graphics-drivers) covers C(nvidia-alternative), C(nvidia-kernel-support), ...). Read with
        dpkg only.
    type: list
    elements: str
    default: []
  installed:
    description:
      - Installed versions to check instead of asking the package database, a mapping of package (or program)
        name to version (a driver a runfile installed, whose version C(nvidia-installer --version) tells).
    type: dict
  package_manager:
    description: Which database to read; C(auto) takes dpkg when C(dpkg-query) is there, else rpm.
    type: str
    choices: [auto, dpkg, rpm]
    default: auto
  admindir:
    description: dpkg's database directory.
    type: path
    default: /var/lib/dpkg
  allow:
    description: Report newer builds without failing (the operator asked to move back).
    type: bool
    default: false
  allow_variable:
    description: The variable that sets O(allow), named in the failure.
    type: str
    default: allow
  version_variable:
    description: The variable that sets O(version), named in the failure.
    type: str
    default: version
attributes:
  check_mode:
    description: Reads only, so runs the same in check mode.
    support: full
  diff_mode:
    description: Changes nothing, so there is no diff.
    support: none
notes:
  - Checked in the collection's tests against dpkg's own database format (C(dpkg-query --admindir)) and, in
    the molecule scenario C(nvidia_driver), against Debian's real 535.261.03 and 535.309.01 packages.
"""

EXAMPLES = r"""
- name: Refuse to move a newer build of the driver's branch back
  gpufleet.nvidia.package_downgrade_check:
    version: "{{ nvidia_driver_version }}"
    branch: "{{ nvidia_driver_branch }}"
    packages: [nvidia-kernel-dkms, nvidia-smi, libnvidia-ml1]
    sources: [nvidia-graphics-drivers, nvidia-open-gpu-kernel-modules]
    allow: "{{ nvidia_driver_allow_downgrade }}"
    allow_variable: nvidia_driver_allow_downgrade (gpufleet_driver_allow_downgrade)
    version_variable: nvidia_driver_version (gpufleet_driver_version)
"""

RETURN = r"""
newer:
  description: The installed packages of the branch whose version is newer than O(version).
  type: list
  elements: dict
  returned: always
  sample: [{package: nvidia-smi, installed: 535.309.01-0+deb12u1, upstream: 535.309.01}]
checked:
  description: Every installed package that was compared, with its installed version.
  type: dict
  returned: always
  sample: {nvidia-smi: 535.309.01-0+deb12u1, libnvidia-ml1: 535.309.01-0+deb12u1}
newest:
  description: The newest upstream version of the branch installed (null when none is).
  type: str
  returned: always
  sample: 535.309.01
msg:
  description: What was found.
  type: str
  returned: always
"""

import os
import re
import shutil

# Ansible modules keep their documentation above the imports.
from ansible.module_utils.basic import AnsibleModule

# dpkg states in which a package's files of that version are on disk (db:Status-Abbrev, second letter):
# installed, unpacked, half-configured, half-installed, triggers awaited, triggers pending.
_ON_DISK = set("iUFHWt")


def upstream(version: str) -> str:
    """535.309.01-0+deb12u1 -> 535.309.01; 3:535.261.03 -> 535.261.03 (epoch and revision dropped)."""
    without_epoch = version.split(":", 1)[-1]
    return without_epoch.rsplit("-", 1)[0] if "-" in without_epoch else without_epoch


def version_key(version: str) -> tuple[int, ...]:
    """NVIDIA's versions are dotted numbers (535.309.01): compare them field by field, as numbers."""
    return tuple(int(part) for part in re.findall(r"\d+", version))


def dpkg_installed(
    module: AnsibleModule, admindir: str, packages: list[str], sources: list[str]
) -> dict[str, str]:
    """Installed version of each package named, or built from a source named (dpkg's database)."""
    # dpkg-query answers an empty list, exit 0, for a directory without a database: look first.
    if not os.path.isfile(os.path.join(admindir, "status")):
        module.fail_json(msg=f"dpkg-query could not read the package database in {admindir}: no status file")
    fmt = "${db:Status-Abbrev}\\t${Package}\\t${Version}\\t${source:Package}\\n"
    rc, out, err = module.run_command(["dpkg-query", f"--admindir={admindir}", "-W", f"-f={fmt}"])
    if rc != 0:
        module.fail_json(msg=f"dpkg-query could not read the package database in {admindir}: {err.strip()}")
    found = {}
    for line in out.splitlines():
        fields = line.split("\t")
        if len(fields) != 4:
            continue
        status, name, version, source = fields
        if len(status) < 2 or status[1] not in _ON_DISK or not version:
            continue
        if name in packages or source in sources:
            found[name] = version
    return found


def rpm_installed(module: AnsibleModule, packages: list[str]) -> dict[str, str]:
    """Installed version of each package named (rpm's database; epoch and release dropped by the query)."""
    if not packages:
        return {}
    rc, out, err = module.run_command(["rpm", "-q", "--qf", "%{NAME}\\t%{VERSION}\\n", *packages])
    found = {}
    for line in out.splitlines():
        fields = line.split("\t")
        # Not installed: "package NAME is not installed" (and rc 1): no tab, skipped.
        if len(fields) == 2 and fields[0] in packages:
            found[fields[0]] = fields[1]
    if rc != 0 and not found and "is not installed" not in out + err:
        module.fail_json(msg=f"rpm -q could not read the package database: {(out + err).strip()}")
    return found


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            version=dict(type="str", required=True),
            branch=dict(type="str", default=""),
            packages=dict(type="list", elements="str", default=[]),
            sources=dict(type="list", elements="str", default=[]),
            installed=dict(type="dict"),
            package_manager=dict(type="str", choices=["auto", "dpkg", "rpm"], default="auto"),
            admindir=dict(type="path", default="/var/lib/dpkg"),
            allow=dict(type="bool", default=False),
            allow_variable=dict(type="str", default="allow"),
            version_variable=dict(type="str", default="version"),
        ),
        supports_check_mode=True,
    )
    p = module.params
    target = upstream(p["version"])
    if not version_key(target):
        module.fail_json(msg=f"version {p['version']!r} ({p['version_variable']}) has no version number")
    branch = p["branch"] or target.split(".")[0]

    if p["installed"] is not None:
        installed = {str(k): str(v) for k, v in p["installed"].items() if v}
    else:
        manager = p["package_manager"]
        if manager == "auto":
            manager = "dpkg" if shutil.which("dpkg-query") else "rpm"
        if manager == "dpkg":
            installed = dpkg_installed(module, p["admindir"], p["packages"], p["sources"])
        else:
            installed = rpm_installed(module, p["packages"])

    checked = {
        name: version for name, version in installed.items() if upstream(version).split(".")[0] == branch
    }
    newer = [
        {"package": name, "installed": version, "upstream": upstream(version)}
        for name, version in sorted(checked.items())
        if version_key(upstream(version)) > version_key(target)
    ]
    ups = sorted({upstream(v) for v in checked.values()}, key=version_key)
    newest = ups[-1] if ups else None
    result = {"changed": False, "newer": newer, "checked": checked, "newest": newest}
    if not newer:
        result["msg"] = f"no installed build of branch {branch} is newer than {target}" + (
            f" (installed: {', '.join(ups)})" if ups else " (none installed)"
        )
        module.exit_json(**result)
    by_version: dict[str, list[str]] = {}
    for item in newer:
        by_version.setdefault(item["installed"], []).append(item["package"])
    found = "; ".join(f"{', '.join(names)} at {version}" for version, names in sorted(by_version.items()))
    if p["allow"]:
        result["msg"] = f"moving branch {branch} back to {target} as asked ({p['allow_variable']}): {found}"
        module.exit_json(**result)
    module.fail_json(
        msg=(
            f"a newer build of branch {branch} is installed than {target}, the version {p['version_variable']} "
            f"asks for: {found}. Installing {target} would move the host back (a distribution's security "
            f"update is such a newer build). Nothing was changed. Set {p['version_variable']} to {newest} "
            f"(or leave it unset where the default follows the distribution's newest build), or set "
            f"{p['allow_variable']}: true to move back to {target} on purpose."
        ),
        **result,
    )


if __name__ == "__main__":
    main()
