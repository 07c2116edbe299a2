#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: find a repository's existing APT definitions before a role adds its own."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: apt_source_lookup
short_description: Find where an APT repository is already defined, and what apt would refuse
version_added: "0.1.0"
description:
  - Reads the APT source definitions of the target as apt does (C(sources.list), C(sources.list.d/*.list)
    one-line entries with their C([signed-by=...]) options, C(sources.list.d/*.sources) deb822 stanzas,
    C($(ARCH)) expanded) and returns those of one repository URI (C(http) and C(https) count as the same
    repository).
  - Many GPU images already define NVIDIA's repositories (C(cuda-keyring)'s
    C(/etc/apt/sources.list.d/cuda-<distro>-<arch>.list), NVIDIA's documented
    C(nvidia-container-toolkit.list)). A second definition of the same URI and suite with another
    C(Signed-By) keyring makes apt refuse every update ("Conflicting values set for option Signed-By").
    With RV(reuse) true the caller should use the existing definition instead of adding its own.
  - Fails, naming each file and line, when the definitions of the repository already conflict in a way apt
    refuses (two C(Signed-By) keyrings, or two C(Trusted) values, for one URI and suite). It changes nothing.
  - Never changes the target.
author:
  - gpufleet contributors (@gpufleet)
options:
  uri:
    description: The repository's URI, as the calling role would write it.
    type: str
    required: true
  suites:
    description: Suites the caller needs (C(/) for a flat repository).
    type: list
    elements: str
    default: ["/"]
  components:
    description: Components the caller needs in each suite; empty for a flat repository.
    type: list
    elements: str
    default: []
  own_file:
    description:
      - The file the calling role writes for this repository (for C(ansible.builtin.deb822_repository),
        C(/etc/apt/sources.list.d/<name>.sources)). It is reported but never counts as a definition to reuse;
        it does count when looking for conflicts.
    type: path
  architecture:
    description: Value of C($(ARCH)) in one-line entries; defaults to C(dpkg --print-architecture).
    type: str
  etc_apt:
    description: APT's configuration directory.
    type: path
    default: /etc/apt
attributes:
  check_mode:
    description: Reads only, so runs the same in check mode.
    support: full
  diff_mode:
    description: Changes nothing, so there is no diff.
    support: none
notes:
  - Checked against apt 2.6's own parser in the collection's tests (C(apt-get update --print-uris) on the
    resulting definitions).
"""

EXAMPLES = r"""
- name: Look for an existing definition of NVIDIA's CUDA repository
  gpufleet.nvidia.apt_source_lookup:
    uri: https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64
    own_file: /etc/apt/sources.list.d/nvidia-cuda.sources
  register: cuda_repo

- name: Add NVIDIA's CUDA repository only where the host has none
  ansible.builtin.deb822_repository:
    name: nvidia-cuda
    types: deb
    uris: https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64
    suites: ["/"]
    signed_by: https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/3bf863cc.pub
  when: not cuda_repo.reuse

- name: Look for Debian's mirror with the components the driver needs
  gpufleet.nvidia.apt_source_lookup:
    uri: http://deb.debian.org/debian
    suites: [bookworm, bookworm-updates]
    components: [main, contrib, non-free, non-free-firmware]
"""

RETURN = r"""
reuse:
  description: Definitions other than O(own_file) already cover every suite and component asked for.
  type: bool
  returned: always
files:
  description: Files of the enabled definitions other than O(own_file).
  type: list
  elements: str
  returned: always
  sample: [/etc/apt/sources.list.d/cuda-debian12-x86_64.list]
signed_by:
  description:
    - The Signed-By those definitions agree on (a path, C(inline key)); empty when they set none; null when
      there are none. A definition the caller adds for the same URI must use it, or apt refuses both.
  type: str
  returned: always
  sample: /usr/share/keyrings/cuda-archive-keyring.gpg
definitions:
  description: Every definition of the URI, enabled or not, with its file and line.
  type: list
  elements: dict
  returned: always
msg:
  description: What was found.
  type: str
  returned: always
"""

# Ansible modules keep their documentation above the imports.
from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.nvidia.plugins.module_utils.apt_sources import (
    lookup,
    read_definitions,
)


def main() -> None:
    module = AnsibleModule(
        argument_spec=dict(
            uri=dict(type="str", required=True),
            suites=dict(type="list", elements="str", default=["/"]),
            components=dict(type="list", elements="str", default=[]),
            own_file=dict(type="path"),
            architecture=dict(type="str"),
            etc_apt=dict(type="path", default="/etc/apt"),
        ),
        supports_check_mode=True,
    )
    params = module.params
    arch = params["architecture"]
    if not arch:
        rc, out, err = module.run_command(["dpkg", "--print-architecture"])
        if rc != 0:
            module.fail_json(msg=f"dpkg --print-architecture failed: {err.strip()}")
        arch = out.strip()
    found = lookup(
        read_definitions(params["etc_apt"], arch), params["uri"], params["suites"], params["components"],
        params["own_file"] or "", arch,
    )
    conflicts = found.pop("conflicts")
    if conflicts:
        module.fail_json(
            msg="apt refuses these definitions of {} as they stand; nothing was changed, remove or align "
            "one of them: {}".format(params["uri"], " | ".join(conflicts)),
            **found,
        )
    if found["reuse"]:
        msg = "{} is already defined in {}: using that definition".format(params["uri"], ", ".join(found["files"]))
    elif found["files"]:
        msg = "{} is defined in {} without all of {} {}".format(
            params["uri"], ", ".join(found["files"]), " ".join(params["suites"]), " ".join(params["components"]))
    else:
        msg = "{} is not defined outside {}".format(params["uri"], params["own_file"] or "the caller's file")
    module.exit_json(changed=False, msg=msg, **found)


if __name__ == "__main__":
    main()
