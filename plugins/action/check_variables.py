# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Action plugin of gpufleet.nvidia.check_variables: gpufleet variables the inventory or -e set and nothing
reads (see plugins/plugin_utils/variables.py and the module's documentation)."""

from __future__ import annotations

from typing import Any

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible_collections.gpufleet.nvidia.plugins.plugin_utils.variables import (
    describe,
    known_variables,
    unknown_variables,
)

MODES = ("fail", "warn", "ignore")
MODE_VARIABLE = "gpufleet_unknown_variables"
ALLOWED_VARIABLE = "gpufleet_unknown_variables_allowed"


class ActionModule(ActionBase):
    """Runs on the controller only; reads each host's variables raw, as the inventory and -e give them."""

    TRANSFERS_FILES = False
    _requires_connection = False
    _supports_check_mode = True

    def run(self, tmp: Any = None, task_vars: dict[str, Any] | None = None) -> dict[str, Any]:
        result = super().run(tmp, task_vars)
        task_vars = task_vars or {}
        args = self._task.args
        unsupported = sorted(set(args) - {"hosts", "mode", "allowed"})
        if unsupported:
            raise AnsibleActionFail(f"unsupported options {', '.join(unsupported)} (hosts, mode, allowed)")
        mode = str(args.get("mode", "fail"))
        if mode not in MODES:
            raise AnsibleActionFail(
                f"{MODE_VARIABLE} (mode) is {mode!r}; expected one of {', '.join(MODES)}"
            )
        hostvars = task_vars.get("hostvars")
        hosts = args.get("hosts")
        if hosts is None:
            hosts = list((task_vars.get("groups") or {}).get("all") or [])
        if isinstance(hosts, str):
            hosts = [hosts]
        # localhost: the extra vars (-e) even when the inventory lists no host
        names = list(dict.fromkeys([*(str(h) for h in hosts), "localhost"]))
        raw = {}
        for name in names:
            found = hostvars.raw_get(name) if hostvars is not None else {}
            if isinstance(found, dict):
                raw[name] = found
        allowed = args.get("allowed") or []
        if isinstance(allowed, str):  # -e gpufleet_unknown_variables_allowed=a,b
            allowed = [a.strip() for a in allowed.split(",") if a.strip()]
        if not isinstance(allowed, (list, tuple)):
            raise AnsibleActionFail(f"{ALLOWED_VARIABLE} (allowed) is {allowed!r}; expected a list of names")
        findings = unknown_variables(raw, allowed=[str(a) for a in allowed])
        result.update(changed=False, unknown=findings, known=len(known_variables()), hosts=len(raw))
        if not findings or mode == "ignore":
            result["msg"] = f"{len(raw)} hosts: every gpufleet variable set is one gpufleet reads"
            return result
        lines = [describe(f, every=raw) for f in findings]
        head = (
            f"{len(findings)} gpufleet variable(s) set in the inventory or with -e that gpufleet does not "
            "read (Ansible would ignore them without a word): " + "; ".join(lines) + ". Expected: the names "
            "in the roles' meta/argument_specs.yml and defaults, and those the playbooks read "
            f"(docs/roles.md, inventory/example). Fix the names, or set {MODE_VARIABLE}=warn to go on "
            "with a warning."
        )
        if mode == "warn":
            result["warnings"] = [*result.get("warnings", []), head]
            result["msg"] = head
            return result
        result["failed"] = True
        result["msg"] = head
        return result
