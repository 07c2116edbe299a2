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
    path to C(imports). The main config is otherwise left as it is.
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
"""

# Ansible modules keep their documentation above the imports.
import os
import re
import shutil
import tempfile

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.nvidia.plugins.module_utils.files import atomic_write

# Where the CRI runtime settings live, by config version.
CRI_PLUGIN = {2: 'plugins."io.containerd.grpc.v1.cri"', 3: 'plugins."io.containerd.cri.v1.runtime"'}
# Any of these in disabled_plugins leaves containerd without a CRI service ("cri" is version 1's short ID,
# Docker CE's containerd.io ships it; 2.x's CRI service needs both of its cri.v1 plugins).
CRI_PLUGIN_IDS = (
    "cri", "io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images",
)
# Config versions each containerd major loads: 2.x migrates version 2 on every start.
ACCEPTED_VERSIONS = {1: (2,), 2: (2, 3)}
HEADER = re.compile(r"^\s*\[([^\[\]]+)\]\s*$")
IMPORTS = re.compile(r"^imports\s*=\s*\[(.*)\]\s*$")
MANAGED = "# Managed by gpufleet (role nvidia_container_toolkit): regenerated each run; edit config.toml.\n"


def normalize(name):
    return name.strip().replace("'", '"')


def in_table(name, prefix):
    return name == prefix or name.startswith(prefix + ".")


def containerd_version(module, binary):
    rc, out, err = module.run_command([binary, "--version"])
    found = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if rc != 0 or not found:
        module.fail_json(msg=f"cannot run '{binary} --version': {(err or out).strip()}")
    return found.group(0), int(found.group(1))


def dump(module, binary, path):
    rc, out, err = module.run_command([binary, "--config", path, "config", "dump"])
    return rc, out, err.strip()


def top_level_end(lines):
    """Index of the first table header (top-level keys live above it)."""
    for index, line in enumerate(lines):
        if HEADER.match(line) or line.lstrip().startswith("[["):
            return index
    return len(lines)


def without_imports(text):
    lines = text.splitlines(True)
    end = top_level_end(lines)
    return "".join(line for i, line in enumerate(lines) if not (i < end and IMPORTS.match(line.strip())))


def top_level_list(text, key):
    """The strings of a top-level TOML array (either quote style), e.g. disabled_plugins."""
    lines = text.splitlines()
    for line in lines[: top_level_end(lines)]:
        found = re.match(rf"^\s*{key}\s*=\s*\[(.*)\]\s*$", line)
        if found:
            return [a or b for a, b in re.findall(r'"([^"]*)"|\'([^\']*)\'', found.group(1))]
    return []


def in_tables(lines):
    """(table, line) for each line that is not a table header: the normalized name of the table the line
    belongs to (None before the first header)."""
    current = None
    for line in lines:
        header = HEADER.match(line)
        if header:
            current = normalize(header.group(1))
            continue
        yield current, line


def table_value(dumped, table, key):
    """A string value of one table in a config dump, whichever quote style the dump uses."""
    for current, line in in_tables(dumped.splitlines()):
        found = re.match(rf"^\s*{key}\s*=\s*(?:\"([^\"]*)\"|'([^']*)')", line)
        if current == table and found:
            return found.group(1) if found.group(1) is not None else found.group(2)
    return None


def config_version_of(text):
    lines = text.splitlines()
    for line in lines[: top_level_end(lines)]:
        found = re.match(r"^\s*version\s*=\s*(\d+)", line)
        if found:
            return int(found.group(1))
    return 1


def cri_section(dumped, plugin):
    """Lines of the CRI plugin's tables in a config dump, in order."""
    region, inside = [], False
    for line in dumped.splitlines():
        header = HEADER.match(line)
        if header:
            inside = in_table(normalize(header.group(1)), plugin)
        if inside:
            region.append(line)
    return region


def edit_section(region, plugin, name, set_default):
    """Drop an old runtime entry of this name and point default_runtime_name at it when asked."""
    runtime = f"{plugin}.containerd.runtimes.{name}"
    containerd_table = f"{plugin}.containerd"
    out, skip, current, seen_default = [], False, None, False
    for line in region:
        header = HEADER.match(line)
        if header:
            current = normalize(header.group(1))
            skip = in_table(current, runtime)
            if not skip and current == containerd_table:
                out.append(line)
                if set_default:
                    out.append(f'  default_runtime_name = "{name}"')
                    seen_default = True
                continue
        if skip:
            continue
        if set_default and current == containerd_table and re.match(r"^\s*default_runtime_name\s*=", line):
            continue
        out.append(line)
    if set_default and not seen_default:
        out += ["", f"[{containerd_table}]", f'  default_runtime_name = "{name}"']
    return out


def runc_systemd_cgroup(region, plugin):
    options = f"{plugin}.containerd.runtimes.runc.options"
    for current, line in in_tables(region):
        found = re.match(r"^\s*SystemdCgroup\s*=\s*(true|false)", line)
        if current == options and found:
            return found.group(1) == "true"
    return False


def render_drop_in(version, region, plugin, params, systemd_cgroup):
    runtime = "{}.containerd.runtimes.{}".format(plugin, params["runtime_name"])
    lines = [MANAGED.rstrip("\n"), f"version = {version}", ""]
    lines += region
    lines += [
        "",
        f"[{runtime}]",
        '  runtime_type = "io.containerd.runc.v2"',
        "  privileged_without_host_devices = false",
        "",
        f"[{runtime}.options]",
        '  BinaryName = "{}"'.format(params["binary"]),
        "  SystemdCgroup = %s" % ("true" if systemd_cgroup else "false"),
    ]
    return "\n".join(lines) + "\n"


def render_main(text, version, drop_in):
    if text is None:
        return f'version = {version}\nimports = ["{drop_in}"]\n'
    lines = text.splitlines(True)
    end = top_level_end(lines)
    for index in range(end):
        found = IMPORTS.match(lines[index].strip())
        if found:
            entries = re.findall(r'"([^"]*)"|\'([^\']*)\'', found.group(1))
            paths = [a or b for a, b in entries]
            if drop_in in paths:
                return text
            paths.append(drop_in)
            lines[index] = "imports = [{}]\n".format(", ".join(f'"{p}"' for p in paths))
            return "".join(lines)
    insert_at = 0
    for index in range(end):
        if re.match(r"^\s*version\s*=", lines[index]):
            insert_at = index + 1
    if insert_at and not lines[insert_at - 1].endswith("\n"):
        lines[insert_at - 1] += "\n"
    lines.insert(insert_at, f'imports = ["{drop_in}"]\n')
    return "".join(lines)


def remove_import(text, drop_in):
    lines = text.splitlines(True)
    for index in range(top_level_end(lines)):
        found = IMPORTS.match(lines[index].strip())
        if found:
            entries = re.findall(r'"([^"]*)"|\'([^\']*)\'', found.group(1))
            paths = [a or b for a, b in entries if (a or b) != drop_in]
            lines[index] = "imports = [{}]\n".format(", ".join(f'"{p}"' for p in paths)) if paths else ""
    return "".join(lines)


def absent(module, params, result):
    main_text = read(params["config"])
    new_main = remove_import(main_text, params["drop_in"]) if main_text is not None else None
    if new_main != main_text:
        result["changed"] = True
        if not module.check_mode:
            write(module, params["config"], new_main, result["backups"])
    if os.path.exists(params["drop_in"]):
        result["changed"] = True
        if not module.check_mode:
            if params["backup"]:
                result["backups"].append(module.backup_local(params["drop_in"]))
            os.unlink(params["drop_in"])
    result["msg"] = "runtime {} removed from containerd".format(params["runtime_name"]) if result["changed"] \
        else "containerd had no runtime {} of this module".format(params["runtime_name"])
    module.exit_json(**result)


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
        ),
        supports_check_mode=True,
    )
    params = module.params
    binary = params["containerd"]
    release, major = containerd_version(module, binary)
    major = min(major, 2)
    # containerd 2.x always dumps version 3; 1.x dumps version 2.
    dump_plugin = CRI_PLUGIN[3 if major >= 2 else 2]
    main_text = read(params["config"])
    result = dict(changed=False, cri_enabled=True, containerd_version=release, backups=[], msg="")
    if params["state"] == "absent":
        absent(module, params, result)

    version = 3 if major >= 2 else 2
    if main_text is not None:
        rc, dumped, err = dump(module, binary, params["config"])
        found = config_version_of(main_text)
        accepted = ACCEPTED_VERSIONS[major]
        wrong_version = (
            f"{params['config']} is containerd config version {found} but containerd {release} loads "
            f"version {' or '.join(map(str, accepted))}; migrate it first (containerd config migrate, "
            f"containerd 2.x), left untouched")
        if rc != 0:
            fail(module, result, wrong_version if found > max(accepted)
                 else f"containerd cannot parse {params['config']}, left untouched: {err}")
        disabled = [p for p in top_level_list(dumped, "disabled_plugins") if p in CRI_PLUGIN_IDS]
        if disabled:
            result.update(
                cri_enabled=False,
                msg=f"containerd's CRI plugin is disabled in {params['config']} (disabled_plugins: "
                f"{', '.join(disabled)}), so this containerd serves no Kubernetes pods: left alone",
            )
            module.exit_json(**result)
        if found not in accepted:
            fail(module, result, wrong_version)
        version = found
    result["config_version"] = version
    plugin = CRI_PLUGIN[version]

    workdir = tempfile.mkdtemp(prefix="gpufleet-containerd-")
    try:
        base = os.path.join(workdir, "base.toml")
        with open(base, "w") as handle:
            handle.write(without_imports(main_text) if main_text is not None else f"version = {version}\n")
        rc, dumped, err = dump(module, binary, base)
        if rc != 0:
            fail(module, result, f"containerd cannot dump the base config: {err}")
        region = cri_section(dumped, dump_plugin)
        if not region:
            fail(module, result, f"no [{dump_plugin}] section in containerd's config dump")
        systemd_cgroup = params["systemd_cgroup"]
        if systemd_cgroup is None:
            systemd_cgroup = runc_systemd_cgroup(region, dump_plugin)
        # 1.x replaces the CRI section with the drop-in's, so the drop-in carries all of it; 2.x merges.
        carried = region if major < 2 else []
        carried = edit_section(carried, plugin, params["runtime_name"], params["set_default"])
        new_drop_in = render_drop_in(version, carried, plugin, params, systemd_cgroup)
        new_main = render_main(main_text, version, params["drop_in"])

        # Validate the candidate pair before touching the real files.
        candidate_drop_in = os.path.join(workdir, "drop-in.toml")
        candidate_main = os.path.join(workdir, "config.toml")
        with open(candidate_drop_in, "w") as handle:
            handle.write(new_drop_in)
        with open(candidate_main, "w") as handle:
            handle.write(new_main.replace('"{}"'.format(params["drop_in"]), f'"{candidate_drop_in}"'))
        rc, merged, err = dump(module, binary, candidate_main)
        runtime = "{}.containerd.runtimes.{}".format(dump_plugin, params["runtime_name"])
        if rc != 0:
            fail(module, result, f"the merged containerd config does not validate: {err}")
        found = table_value(merged, runtime + ".options", "BinaryName")
        if found != params["binary"]:
            fail(module, result, f"the merged containerd config does not carry the drop-in: [{runtime}.options] "
                 f"has BinaryName {found!r}, not {params['binary']!r}")
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
    result["msg"] = "containerd {} (config version {}) offers runtime {}{}".format(
        release, version, params["runtime_name"], " as its default" if params["set_default"] else "")
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
