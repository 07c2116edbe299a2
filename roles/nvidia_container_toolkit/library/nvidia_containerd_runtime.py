#!/usr/bin/python
# Copyright: gpufleet contributors
# Apache-2.0
"""Merge an NVIDIA runtime into containerd's configuration through an imported drop-in file."""

from __future__ import annotations

DOCUMENTATION = r"""
module: nvidia_containerd_runtime
short_description: Add the NVIDIA runtime to containerd through a drop-in, keeping the existing CRI settings
description:
  - Writes a drop-in file that containerd loads through the C(imports) key of its main config, and adds that
    path to C(imports). The main config is otherwise left as it is.
  - containerd 1.x replaces a plugin's whole section when a drop-in sets any key of it, so the drop-in carries
    the CRI runtime section of the main config (as C(containerd config dump) renders it) plus the NVIDIA
    runtime. Settings such as C(SystemdCgroup), the sandbox image or CNI paths therefore survive.
  - Config version 2 for containerd 1.6/1.7, version 3 for containerd 2.x.
  - Every candidate is validated with C(containerd --config FILE config dump) before anything is written; a
    main config that does not parse fails the task and nothing is changed.
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
  nvidia_containerd_runtime:
    set_default: true
"""

RETURN = r"""
config_version:
  description: containerd config version written (2 or 3).
  type: int
  returned: always
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
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402

CRI_PLUGIN = {2: 'plugins."io.containerd.grpc.v1.cri"', 3: 'plugins."io.containerd.cri.v1.runtime"'}
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
    current = None
    for line in region:
        header = HEADER.match(line)
        if header:
            current = normalize(header.group(1))
            continue
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
    module.exit_json(**result)


def read(path):
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return handle.read()


def write(module, path, text, backups):
    if os.path.exists(path) and module.params["backup"]:
        backups.append(module.backup_local(path))
    directory = os.path.dirname(path)
    if not os.path.isdir(directory):
        os.makedirs(directory, 0o755)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".gpufleet-")
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(tmp, 0o644)
    module.atomic_move(tmp, path)


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
    version = 3 if major >= 2 else 2
    plugin = CRI_PLUGIN[version]
    main_text = read(params["config"])
    result = dict(changed=False, config_version=version, containerd_version=release, backups=[])
    if params["state"] == "absent":
        absent(module, params, result)

    if main_text is not None:
        rc, _out, err = dump(module, binary, params["config"])
        if rc != 0:
            module.fail_json(msg=f"containerd cannot parse {params['config']}, left untouched: {err}",
                             **result)
        found = config_version_of(main_text)
        if found != version:
            module.fail_json(
                msg=f"{params['config']} is containerd config version {found} but containerd {release} needs "
                f"version {version}; migrate it first",
                **result)

    workdir = tempfile.mkdtemp(prefix="gpufleet-containerd-")
    try:
        base = os.path.join(workdir, "base.toml")
        with open(base, "w") as handle:
            handle.write(without_imports(main_text) if main_text is not None else f"version = {version}\n")
        rc, dumped, err = dump(module, binary, base)
        if rc != 0:
            module.fail_json(msg=f"containerd cannot dump the base config: {err}", **result)
        region = cri_section(dumped, plugin)
        if not region:
            module.fail_json(msg=f"no [{plugin}] section in containerd's config dump", **result)
        systemd_cgroup = params["systemd_cgroup"]
        if systemd_cgroup is None:
            systemd_cgroup = runc_systemd_cgroup(region, plugin)
        region = edit_section(region, plugin, params["runtime_name"], params["set_default"])
        new_drop_in = render_drop_in(version, region, plugin, params, systemd_cgroup)
        new_main = render_main(main_text, version, params["drop_in"])

        # Validate the candidate pair before touching the real files.
        candidate_drop_in = os.path.join(workdir, "drop-in.toml")
        candidate_main = os.path.join(workdir, "config.toml")
        with open(candidate_drop_in, "w") as handle:
            handle.write(new_drop_in)
        with open(candidate_main, "w") as handle:
            handle.write(new_main.replace('"{}"'.format(params["drop_in"]), f'"{candidate_drop_in}"'))
        rc, merged, err = dump(module, binary, candidate_main)
        expected = "{}.containerd.runtimes.{}".format(plugin, params["runtime_name"])
        if rc != 0 or not any(
            header.group(1) and normalize(header.group(1)) == expected
            for header in (HEADER.match(line) for line in merged.splitlines()) if header
        ):
            problem = err or "runtime missing"
            module.fail_json(msg=f"the merged containerd config does not validate: {problem}", **result)
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
    if module._diff:
        result["diff"] = diffs
    module.exit_json(**result)


if __name__ == "__main__":
    main()
