#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: merge an NVIDIA runtime into containerd's configuration through an imported drop-in."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: nvidia_containerd_runtime
short_description: Add the NVIDIA runtime to containerd through a drop-in, keeping the existing CRI settings
version_added: "0.1.0"
description:
  - Writes a drop-in file that containerd loads through the C(imports) key of its main config, and adds that
    path to C(imports) unless an entry there already loads it (a pattern such as C(/etc/containerd/conf.d/*.toml),
    which C(containerd config default) writes since 2.2). The main config is otherwise left as it is.
  - Both files are read and written as TOML with tomlkit, which keeps the operator's comments, quoting and
    layout; any shape of TOML containerd accepts (one-line or multi-line arrays, inline tables, dotted or quoted
    keys) is edited, not matched. A main config that is not valid TOML fails the task, naming the parser's
    error and line, and nothing is written.
  - containerd 1.x replaces a plugin's whole section when a drop-in sets any key of it, so there the drop-in
    carries the CRI runtime section of the main config (as C(containerd config dump) renders it) plus the
    NVIDIA runtime. Settings such as C(SystemdCgroup), the sandbox image or CNI paths therefore survive.
  - containerd 2.x merges a drop-in into the sections it extends, so there the drop-in holds only the NVIDIA
    runtime (and C(default_runtime_name)).
  - The drop-in is written in the main config's version, because containerd 2.x migrates each file by its own
    version and silently ignores version-2 keys of a main config that imports a version-3 file. containerd
    1.6/1.7 take version 2; containerd 2.x takes version 2 (migrated on load) or 3. Without a main config the
    module creates one, version 2 for containerd 1.x and 3 for 2.x.
  - A containerd whose CRI plugin is disabled (C(disabled_plugins) names C(cri) or one of the CRI plugin IDs,
    as Docker CE's C(containerd.io) package ships it) serves no Kubernetes pods; it is left alone, the task
    reports C(cri_enabled=false) and says so in C(msg), and nothing is changed.
  - Every candidate is validated with C(containerd --config FILE config dump) before anything is written; a
    main config that does not parse fails the task and nothing is changed.
requirements:
  - tomlkit (on the managed host, for the Python Ansible runs modules with; the role nvidia_container_toolkit
    installs the distribution's C(python3-tomlkit) first, see docs/roles.md)
author:
  - gpufleet contributors (@gpufleet)
options:
  state:
    description: C(absent) removes the drop-in and its C(imports) entry.
    type: str
    choices: [present, absent]
    default: present
  config:
    description: containerd's main config file.
    type: path
    default: /etc/containerd/config.toml
  drop_in:
    description: The drop-in file this module owns.
    type: path
    default: /etc/containerd/conf.d/99-nvidia.toml
  runtime_name:
    description: Name of the runtime entry.
    type: str
    default: nvidia
  binary:
    description: The NVIDIA container runtime executable.
    type: path
    default: /usr/bin/nvidia-container-runtime
  set_default:
    description: Make the runtime containerd's default CRI runtime.
    type: bool
    default: true
  systemd_cgroup:
    description: C(SystemdCgroup) for the runtime; unset copies the value of the runc runtime.
    type: bool
  containerd:
    description: containerd executable used to parse and dump configs.
    type: path
    default: containerd
  backup:
    description: Keep a timestamped copy of every file changed.
    type: bool
    default: true
  cdi:
    description:
      - containerd's CDI device injection (C(enable_cdi) and C(cdi_spec_dirs) of the CRI runtime plugin), which
        a kubelet's CDI device names from a device plugin's Allocate need (Kubernetes 1.28 and later).
      - V(enabled) writes C(enable_cdi = true) and O(cdi_spec_dirs) into the drop-in, and fails where containerd
        has no CDI (1.6 and older, whose config dump has no C(enable_cdi)). containerd 1.7 ships it off, 2.x on.
      - V(auto) does the same where containerd has CDI and leaves a containerd without it as it is (RV(cdi)
        says so).
      - V(unchanged) writes neither key.
    type: str
    choices: [auto, enabled, unchanged]
    default: unchanged
  cdi_spec_dirs:
    description: Where containerd looks for CDI specifications (containerd's own default).
    type: list
    elements: path
    default: [/etc/cdi, /var/run/cdi]
"""

EXAMPLES = r"""
- name: Ensure containerd knows the nvidia runtime and uses it by default
  gpufleet.nvidia.nvidia_containerd_runtime:
    set_default: true
"""

RETURN = r"""
msg:
  description: What was done, or why containerd was left alone.
  type: str
  returned: always
  sample: "containerd's CRI plugin is disabled in /etc/containerd/config.toml: left alone"
cri_enabled:
  description: Whether containerd serves CRI with this config; false means the config was left alone.
  type: bool
  returned: always
config_version:
  description: containerd config version of the drop-in (that of the main config; 2 or 3).
  type: int
  returned: when containerd serves CRI and the main config loads
containerd_version:
  description: Version reported by containerd.
  type: str
  returned: always
backups:
  description: Backup files made.
  type: list
  returned: always
cdi:
  description: CDI as the merged config dump has it; C(supported) false for a containerd without CDI.
  type: dict
  returned: when containerd serves CRI and state is present
  sample: {"supported": true, "enabled": true, "spec_dirs": ["/etc/cdi", "/var/run/cdi"]}
"""

# Ansible modules keep their documentation above the imports.
import os
import re
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule, missing_required_lib
from ansible_collections.gpufleet.nvidia.plugins.module_utils.containerd_config import (
    ACCEPTED_VERSIONS,
    CRI_PLUGIN_IDS,
    CRI_RUNTIME_PLUGINS,
    TOMLKIT_IMPORT_ERROR,
    ConfigError,
    config_version,
    cri_runtime,
    drop_in_text,
    imports_of,
    parse,
    plain,
    resolved_imports,
    with_import,
    with_imports,
    without_import,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.files import atomic_write

# Where the role says how tomlkit gets onto the host.
TOMLKIT_HINT = (
    "the role nvidia_container_toolkit installs it from the distribution's package "
    "(nvidia_container_toolkit_python_packages: python3-tomlkit; on EL 9 from EPEL; EL 8 has no package, "
    "install tomlkit for this interpreter yourself or point ansible_python_interpreter at one that has it)"
)


def containerd_version(module, binary):
    rc, out, err = module.run_command([binary, "--version"])
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if rc != 0 or not found:
        module.fail_json(msg=f"cannot run '{binary} --version': {(err or out).strip()}")
    return found.group(0), int(found.group(1))


def dump(module, binary, path):
    rc, out, err = module.run_command([binary, "--config", path, "config", "dump"])
    return rc, out, err.strip()


def fail(module, result, msg):
    """fail_json with ``msg`` and the other fields of ``result`` (its ``msg`` replaced)."""
    module.fail_json(msg=msg, **{key: value for key, value in result.items() if key != "msg"})


def read(path):
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return handle.read()


def write(module, path, text, backups):
    if os.path.exists(path) and module.params["backup"]:
        backups.append(module.backup_local(path))
    atomic_write(path, text, 0o644, move=module.atomic_move)


def scratch(workdir, name, text):
    path = os.path.join(workdir, name)
    with open(path, "w") as handle:
        handle.write(text)
    return path


def absent(module, params, result, main_text, config_dir):
    new_main = main_text
    if main_text is not None:
        name = params["config"]
        try:
            new_main = without_import(main_text, params["drop_in"], config_dir, name)
            loads = resolved_imports(imports_of(parse(new_main, name)), config_dir, params["drop_in"], None)
            candidate = with_imports(new_main, loads, name)
        except ConfigError as err:
            fail(module, result, f"{err}; left untouched")
        if new_main != main_text:
            workdir = tempfile.mkdtemp(prefix="gpufleet-containerd-")
            try:
                rc, _dumped, err = dump(module, params["containerd"], scratch(workdir, "config.toml", candidate))
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            if rc != 0:
                fail(module, result, f"{name} without the import does not validate, left untouched: {err}")
    diffs = []
    if new_main != main_text:
        result["changed"] = True
        diffs.append(dict(before_header=params["config"], after_header=params["config"], before=main_text,
                          after=new_main))
        if not module.check_mode:
            write(module, params["config"], new_main, result["backups"])
    if os.path.exists(params["drop_in"]):
        result["changed"] = True
        diffs.append(dict(before_header=params["drop_in"], after_header="/dev/null",
                          before=read(params["drop_in"]), after=""))
        if not module.check_mode:
            if params["backup"]:
                result["backups"].append(module.backup_local(params["drop_in"]))
            os.unlink(params["drop_in"])
    result["msg"] = "runtime {} removed from containerd".format(params["runtime_name"]) if result["changed"] \
        else "containerd had no runtime {} of this module".format(params["runtime_name"])
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


def check_main(module, params, result, binary, release, major, main_text):
    """The main config's version, after refusing one that is not TOML, does not load, has another version
    than this containerd loads, or leaves containerd without CRI (exits unchanged: nothing to do)."""
    rc, dumped, err = dump(module, binary, params["config"])
    try:
        document = parse(main_text, params["config"])
    except ConfigError as error:
        if rc != 0:
            fail(module, result, f"containerd cannot parse {params['config']}, left untouched: {error}; "
                 f"containerd {release} says: {err}")
        fail(module, result, f"{error} (containerd {release} loads it, tomlkit does not), left untouched")
    found = config_version(document)
    accepted = ACCEPTED_VERSIONS[major]
    wrong_version = (
        f"{params['config']} is containerd config version {found} but containerd {release} loads "
        f"version {' or '.join(map(str, accepted))}; migrate it first (containerd config migrate, "
        f"containerd 2.x), left untouched")
    if rc != 0:
        fail(module, result, wrong_version if found > max(accepted)
             else f"containerd cannot parse {params['config']}, left untouched: {err}")
    disabled = [p for p in plain(parse(dumped, "containerd config dump")).get("disabled_plugins", [])
                if p in CRI_PLUGIN_IDS]
    if disabled:
        result.update(
            cri_enabled=False,
            msg=f"containerd's CRI plugin is disabled in {params['config']} (disabled_plugins: "
            f"{', '.join(disabled)}), so this containerd serves no Kubernetes pods: left alone",
        )
        module.exit_json(**result)
    if found not in accepted:
        fail(module, result, wrong_version)
    return found


def main():
    module = AnsibleModule(
        argument_spec=dict(
            config=dict(type="path", default="/etc/containerd/config.toml"),
            drop_in=dict(type="path", default="/etc/containerd/conf.d/99-nvidia.toml"),
            runtime_name=dict(type="str", default="nvidia"),
            binary=dict(type="path", default="/usr/bin/nvidia-container-runtime"),
            set_default=dict(type="bool", default=True),
            systemd_cgroup=dict(type="bool"),
            containerd=dict(type="path", default="containerd"),
            backup=dict(type="bool", default=True),
            state=dict(type="str", choices=["present", "absent"], default="present"),
            cdi=dict(type="str", choices=["auto", "enabled", "unchanged"], default="unchanged"),
            cdi_spec_dirs=dict(type="list", elements="path", default=["/etc/cdi", "/var/run/cdi"]),
        ),
        supports_check_mode=True,
    )
    if TOMLKIT_IMPORT_ERROR is not None:
        module.fail_json(msg=f"{missing_required_lib('tomlkit')} ({TOMLKIT_HINT})",
                         exception=str(TOMLKIT_IMPORT_ERROR))
    params = module.params
    params["config"] = os.path.abspath(params["config"])
    params["drop_in"] = os.path.abspath(params["drop_in"])
    config_dir = os.path.dirname(params["config"])
    binary = params["containerd"]
    release, major = containerd_version(module, binary)
    major = min(major, 2)
    # containerd 2.x always dumps version 3; 1.x dumps version 2.
    dump_plugin = CRI_RUNTIME_PLUGINS[3 if major >= 2 else 2]
    main_text = read(params["config"])
    result = dict(changed=False, cri_enabled=True, containerd_version=release, backups=[], msg="")
    if params["state"] == "absent":
        absent(module, params, result, main_text, config_dir)

    version = 3 if major >= 2 else 2
    if main_text is not None:
        version = check_main(module, params, result, binary, release, major, main_text)
    result["config_version"] = version
    name = params["config"]
    own = {"name": params["runtime_name"], "binary": params["binary"], "set_default": params["set_default"]}

    workdir = tempfile.mkdtemp(prefix="gpufleet-containerd-")
    try:
        # What containerd makes of the host's configs without this module's drop-in.
        if main_text is None:
            base_text = f"version = {version}\n"
        else:
            base_text = with_imports(main_text, resolved_imports(
                imports_of(parse(main_text, name)), config_dir, params["drop_in"], None), name)
        rc, dumped, err = dump(module, binary, scratch(workdir, "base.toml", base_text))
        if rc != 0:
            fail(module, result, f"containerd cannot dump the base config: {err}")
        section = plain(parse(dumped, "containerd config dump")).get("plugins", {}).get(dump_plugin)
        if section is None:
            fail(module, result, f"no [plugins.\"{dump_plugin}\"] section in containerd's config dump")
        own["systemd_cgroup"] = params["systemd_cgroup"]
        if own["systemd_cgroup"] is None:
            runc = section.get("containerd", {}).get("runtimes", {}).get("runc", {})
            own["systemd_cgroup"] = runc.get("options", {}).get("SystemdCgroup", False) is True
        # CDI: the dump of a containerd that has it carries enable_cdi (1.7: false, 2.x: true)
        cdi_supported = "enable_cdi" in section
        if params["cdi"] == "enabled" and not cdi_supported:
            fail(module, result, f"containerd {release} has no CDI support (its CRI plugin {dump_plugin} has no "
                 "enable_cdi; CDI came with containerd 1.7): upgrade containerd, or set cdi to auto or unchanged "
                 "(role: nvidia_container_toolkit_containerd_cdi)")
        want_cdi = params["cdi"] == "enabled" or (params["cdi"] == "auto" and cdi_supported)
        cdi_dirs = list(params["cdi_spec_dirs"]) if want_cdi else None
        # 1.x replaces the CRI section with the drop-in's, so the drop-in carries all of it; 2.x merges.
        new_drop_in = drop_in_text(version, section if major < 2 else {}, own, cdi_dirs)
        if main_text is None:
            new_main = f"version = {version}\nimports = [\"{params['drop_in']}\"]\n"
        else:
            new_main = with_import(main_text, params["drop_in"], config_dir, name)

        # Validate the candidate pair before touching the real files.
        candidate = scratch(workdir, "drop-in.toml", new_drop_in)
        loads = resolved_imports(imports_of(parse(new_main, name)), config_dir, params["drop_in"], candidate)
        rc, merged, err = dump(module, binary, scratch(workdir, "config.toml", with_imports(new_main, loads, name)))
        if rc != 0:
            fail(module, result, f"the merged containerd config does not validate: {err}")
        found = cri_runtime(plain(parse(merged, "containerd config dump")), params["runtime_name"])
        binary_name = found["runtime"].get("options", {}).get("BinaryName")
        if binary_name != params["binary"]:
            fail(module, result, f"the merged containerd config does not carry the drop-in: runtime "
                 f"{params['runtime_name']} of {found['plugin']} has BinaryName {binary_name!r}, "
                 f"not {params['binary']!r}")
        merged_cri = plain(parse(merged, "containerd config dump")).get("plugins", {}).get(dump_plugin, {})
        result["cdi"] = {"supported": cdi_supported, "enabled": merged_cri.get("enable_cdi") is True,
                         "spec_dirs": merged_cri.get("cdi_spec_dirs", [])}
        if want_cdi and (not result["cdi"]["enabled"] or result["cdi"]["spec_dirs"] != cdi_dirs):
            fail(module, result, f"the merged containerd config does not turn CDI on: {dump_plugin} has "
                 f"enable_cdi {merged_cri.get('enable_cdi')!r}, cdi_spec_dirs {result['cdi']['spec_dirs']!r}")
    except ConfigError as error:
        fail(module, result, f"{error}; left untouched")
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    old_drop_in = read(params["drop_in"])
    diffs = []
    changes = ((params["drop_in"], old_drop_in, new_drop_in), (params["config"], main_text, new_main))
    for path, old, new in changes:
        if old != new:
            diffs.append(dict(before_header=path, after_header=path, before=old or "", after=new))
            result["changed"] = True
            if not module.check_mode:
                write(module, path, new, result["backups"])
    result["msg"] = "containerd {} (config version {}) offers runtime {}{}{}".format(
        release, version, params["runtime_name"], " as its default" if params["set_default"] else "",
        "; CDI on ({})".format(", ".join(cdi_dirs)) if want_cdi else
        "; no CDI in this containerd" if params["cdi"] == "auto" else "")
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
