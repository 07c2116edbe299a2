#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Documentation of gpufleet.nvidia.check_variables; the work is its action plugin (controller side)."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: check_variables
short_description: Refuse gpufleet variables that the inventory sets and nothing reads (misspellings)
version_added: "0.1.0"
description:
  - Reads every host's variables as the inventory and C(-e) give them (untemplated) and reports each name
    with a gpufleet prefix (C(gpufleet_), C(esxi_), or a role's name and C(_), such as C(nvidia_driver_)) that
    no role or playbook of the collection reads, with the closest known name.
  - Known names come from the collection's files when the task runs, one source, namely every option of the
    roles' C(meta/argument_specs.yml) and key of their C(defaults/main.yml), and every prefixed name that
    C(site.yml), C(playbooks/) or the roles' tasks, handlers, templates, defaults and vars read, less those
    they assign themselves (C(vars), C(register), C(set_fact), a role's C(vars/)), whose inventory value
    would be overridden.
  - A name that another value of the inventory reads (a helper such as C(gpufleet_lab_sim_env)) is not
    reported.
  - Runs on the controller only and changes nothing; check mode is supported.
author: gpufleet contributors (@gpufleet)
options:
  hosts:
    description:
      - Hosts whose variables are read; unset, every host of the inventory. C(localhost) is always added
        (for C(-e)).
    type: list
    elements: str
  mode:
    description:
      - C(fail) fails the task naming each variable; C(warn) prints the same as a warning and goes on;
        C(ignore) checks nothing. playbooks/check-variables.yml passes C(gpufleet_unknown_variables).
    type: str
    choices: [fail, warn, ignore]
    default: fail
  allowed:
    description:
      - Further names to accept (an operator's or a test scenario's own variables with a gpufleet prefix).
        playbooks/check-variables.yml passes C(gpufleet_unknown_variables_allowed); a string is split at
        commas.
    type: list
    elements: str
    default: []
attributes:
  check_mode:
    description: Runs in check mode as it does otherwise (it only reads).
    support: full
  diff_mode:
    description: Changes nothing, so there is no diff.
    support: none
notes:
  - A misspelled prefix (C(nvidia_drivr_version)) is not a gpufleet name and is not checked.
"""

EXAMPLES = r"""
- name: Refuse misspelled gpufleet variables before anything is touched
  gpufleet.nvidia.check_variables:
    mode: "{{ gpufleet_unknown_variables | default('fail') }}"
  run_once: true
"""

RETURN = r"""
unknown:
  description: One entry per unknown name.
  returned: always
  type: list
  elements: dict
  sample:
    - name: gpufleet_driver_verison
      hosts: [dgx-01.example.com]
      suggestion: gpufleet_driver_version
      assigned_in: null
known:
  description: How many names are known.
  returned: always
  type: int
hosts:
  description: How many hosts' variables were read.
  returned: always
  type: int
"""
