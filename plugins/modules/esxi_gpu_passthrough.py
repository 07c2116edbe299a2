#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: give an ESXi VM its NVIDIA GPUs by PCI passthrough."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: esxi_gpu_passthrough
short_description: Pass NVIDIA GPUs through to a vSphere VM and apply the VM settings they need
version_added: "0.1.0"
description:
  - Connects to vCenter or a standalone ESXi host, finds the VM and the host it is registered on.
  - Enables passthrough for the requested GPUs on the host when needed and reports whether the host
    must be rebooted to activate it. The module never reboots a host.
  - Attaches the GPUs to the VM, either by host PCI address (DirectPath I/O) or by vendor/device id
    (Dynamic DirectPath I/O, vSphere 7 and later).
  - Sets EFI firmware, EFI Secure Boot as asked, reserves all guest memory, checks that the guest has
    at least 1.5 times the GPUs' total memory, sets C(pciPassthru.use64bitMMIO=TRUE) and
    C(pciPassthru.64bitMMIOSizeGB) to the smallest power of two that is at least twice the GPUs'
    total memory, and C(hypervisor.cpuid.v0=FALSE) only when O(hide_hypervisor=true).
  - Changes that need the VM powered off are made only when it is off, or when
    O(allow_power_off=true); otherwise the module fails and lists them.
  - This module has been tested against VMware's vCenter simulator (govmomi's vcsim, extended with GPU
    hosts) and an in-process stand-in for the vSphere API, not against a live vCenter or ESXi host.
author:
  - gpufleet contributors (@gpufleet)
requirements:
  - pyvmomi >= 8.0.1
options:
  hostname:
    description:
      - vCenter or ESXi host name or address.
      - Falls back to the E(VMWARE_HOST) environment variable.
    type: str
    required: true
  username:
    description:
      - User to log in as. Falls back to E(VMWARE_USER).
    type: str
    required: true
  password:
    description:
      - Password of O(username). Falls back to E(VMWARE_PASSWORD). Never logged or returned.
    type: str
    required: true
  port:
    description:
      - Port of the vSphere API. Falls back to E(VMWARE_PORT).
    type: int
    default: 443
  protocol:
    description:
      - Protocol of the vSphere API. Real vCenter and ESXi hosts speak C(https) only; C(http) is for API
        simulators such as govmomi's vcsim, which the module's tests run against.
      - Falls back to E(VMWARE_PROTOCOL).
    type: str
    choices: [https, http]
    default: https
  validate_certs:
    description:
      - Verify the server's TLS certificate. Falls back to E(VMWARE_VALIDATE_CERTS).
    type: bool
    default: true
  name:
    description:
      - Name of the VM. Mutually exclusive with O(uuid).
    type: str
  uuid:
    description:
      - BIOS UUID or instance UUID of the VM. Mutually exclusive with O(name).
    type: str
  datacenter:
    description:
      - Datacenter to search the VM in.
    type: str
  folder:
    description:
      - VM folder to search the VM in, as an inventory path (C(/DC1/vm/gpu)) or relative to the
        O(datacenter)'s VM folder (C(gpu)).
    type: str
  gpus:
    description:
      - GPUs to give the VM. Each item names a GPU by host PCI address (O(gpus[].pci_id)) or by
        model (O(gpus[].device_id)), with its memory.
    type: list
    elements: dict
    required: true
    suboptions:
      pci_id:
        description:
          - Host PCI address of the GPU for DirectPath I/O, for example C(0000:3b:00.0).
        type: str
      vendor_id:
        description:
          - PCI vendor id for Dynamic DirectPath I/O. A string is read as hexadecimal (C("10de")),
            an integer as is.
        type: raw
        default: "10de"
      device_id:
        description:
          - PCI device id for Dynamic DirectPath I/O, for example C("20b5") (A100 80GB PCIe). A string
            is read as hexadecimal, an integer as is.
        type: raw
      memory_gb:
        description:
          - Memory of this GPU in GB; drives the MMIO size and the guest memory check.
        type: int
        required: true
  secure_boot:
    description:
      - Whether EFI Secure Boot is on. Off by default, as the NVIDIA runfile driver's kernel
        module is unsigned.
    type: bool
    default: false
  hide_hypervisor:
    description:
      - Set C(hypervisor.cpuid.v0=FALSE), hiding the hypervisor from the guest. Only for consumer
        (GeForce) GPUs whose older drivers refuse to load in a VM. When false the setting is left as
        it is.
    type: bool
    default: false
  mmio_size_gb:
    description:
      - Override the computed C(pciPassthru.64bitMMIOSizeGB).
    type: int
  adjust_memory:
    description:
      - Raise the VM's memory to 1.5 times the GPUs' total memory (rounded up to a whole GB) when it
        is lower, instead of failing.
    type: bool
    default: false
  exclusive:
    description:
      - Remove PCI passthrough devices (DirectPath or Dynamic DirectPath) that are not listed in
        O(gpus). vGPU devices are never touched.
    type: bool
    default: false
  allow_power_off:
    description:
      - Shut the VM down (cleanly when VMware Tools runs, else power off) to apply changes that need
        it off, then power it on again.
    type: bool
    default: false
  shutdown_timeout:
    description:
      - Seconds to wait for a clean guest shutdown before powering off.
    type: int
    default: 300
  task_timeout:
    description:
      - Seconds to wait for each vSphere task (reconfigure, power off, power on).
    type: int
    default: 600
attributes:
  check_mode:
    description: Reads the VM and host, reports what would change, calls nothing that changes state.
    support: full
  diff_mode:
    description: Returns the managed settings before and after.
    support: full
notes:
  - In check mode, newly enabled host passthrough is assumed to need a host reboot.
  - A host reboot, when reported, is left to the operator (maintenance mode first).
  - Not run against a live vCenter or ESXi host yet; see docs/esxi.md for what is verified against
    vcsim and what only against the test stand-in.
"""

EXAMPLES = r"""
- name: Ensure the VM has its two A100s by PCI address
  gpufleet.nvidia.esxi_gpu_passthrough:
    hostname: vcenter.example.com
    username: automation@vsphere.local
    password: "{{ vault_vcenter_password }}"
    datacenter: DC1
    name: gpu-worker-01
    gpus:
      - pci_id: "0000:3b:00.0"
        memory_gb: 80
      - pci_id: "0000:d8:00.0"
        memory_gb: 80
    allow_power_off: true
  delegate_to: localhost

- name: Ensure a consumer GPU by model (Dynamic DirectPath), credentials from VMWARE_* variables
  gpufleet.nvidia.esxi_gpu_passthrough:
    uuid: 4213a5e1-0c8e-4b4a-9f6e-2b1d3f5c7a90
    gpus:
      - device_id: "1e07"
        memory_gb: 11
    hide_hypervisor: true
    adjust_memory: true
  delegate_to: localhost
"""

RETURN = r"""
changes:
  description: Human-readable changes made (or, in check mode, that would be made).
  returned: always
  type: list
  elements: str
  sample: ["attach GPU 0000:3b:00.0 (DirectPath I/O)", "pciPassthru.64bitMMIOSizeGB = 256 (was None)"]
host_reboot_required:
  description:
    - The host must be rebooted before some requested GPUs can be used (passthrough enabled, not active).
  returned: always
  type: bool
deferred:
  description: GPUs that could not be attached yet because their host passthrough is not active.
  returned: always
  type: list
  elements: str
power_cycled:
  description: Whether the module shut the VM down and started it again.
  returned: always
  type: bool
total_gpu_memory_gb:
  description: Sum of O(gpus[].memory_gb).
  returned: always
  type: int
  sample: 160
mmio_size_gb:
  description: Value for C(pciPassthru.64bitMMIOSizeGB).
  returned: always
  type: int
  sample: 512
required_memory_mb:
  description: Minimum guest memory, 1.5 times the GPUs' total memory.
  returned: always
  type: int
  sample: 245760
diff:
  description: Managed settings before and after.
  returned: always
  type: dict
"""

# Ansible modules keep DOCUMENTATION/EXAMPLES/RETURN above the imports, hence the noqa markers.
from ansible.module_utils.basic import AnsibleModule, env_fallback, missing_required_lib
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_plan import (
    HAS_PYVMOMI,
    GpuRequest,
    Options,
    PlanError,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_passthrough_reconcile import (
    Behaviour,
    PendingPowerOff,
    reconcile,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.esxi_vsphere import (
    Credentials,
    VmSelector,
    VSphereError,
    connect,
    disconnect,
)

ARGUMENT_SPEC = {
    "hostname": {"type": "str", "required": True, "fallback": (env_fallback, ["VMWARE_HOST"])},
    "username": {"type": "str", "required": True, "fallback": (env_fallback, ["VMWARE_USER"])},
    "password": {
        "type": "str",
        "required": True,
        "no_log": True,
        "fallback": (env_fallback, ["VMWARE_PASSWORD"]),
    },
    "port": {"type": "int", "default": 443, "fallback": (env_fallback, ["VMWARE_PORT"])},
    "protocol": {
        "type": "str",
        "choices": ["https", "http"],
        "default": "https",
        "fallback": (env_fallback, ["VMWARE_PROTOCOL"]),
    },
    "validate_certs": {
        "type": "bool",
        "default": True,
        "fallback": (env_fallback, ["VMWARE_VALIDATE_CERTS"]),
    },
    "name": {"type": "str"},
    "uuid": {"type": "str"},
    "datacenter": {"type": "str"},
    "folder": {"type": "str"},
    "gpus": {
        "type": "list",
        "elements": "dict",
        "required": True,
        "options": {
            "pci_id": {"type": "str"},
            "vendor_id": {"type": "raw", "default": "10de"},
            "device_id": {"type": "raw"},
            "memory_gb": {"type": "int", "required": True},
        },
        "mutually_exclusive": [["pci_id", "device_id"]],
        "required_one_of": [["pci_id", "device_id"]],
    },
    "secure_boot": {"type": "bool", "default": False},
    "hide_hypervisor": {"type": "bool", "default": False},
    "mmio_size_gb": {"type": "int"},
    "adjust_memory": {"type": "bool", "default": False},
    "exclusive": {"type": "bool", "default": False},
    "allow_power_off": {"type": "bool", "default": False},
    "shutdown_timeout": {"type": "int", "default": 300},
    "task_timeout": {"type": "int", "default": 600},
}


def _pci_id_number(value: object, what: str) -> int:
    """Read a PCI vendor/device id: strings are hexadecimal, integers are taken as they are."""
    if isinstance(value, bool):
        raise PlanError(f"{what} must be a hexadecimal string or an integer")
    if isinstance(value, int):
        number = value
    else:
        try:
            number = int(str(value).strip(), 16)
        except ValueError:
            raise PlanError(f"{what} {value!r} is not a hexadecimal PCI id") from None
    if not 0 <= number <= 0xFFFF:
        raise PlanError(f"{what} {value!r} is outside 0-ffff")
    return number


def options_from_params(params: dict) -> Options:
    """Turn validated module parameters into plan options."""
    gpus = tuple(
        GpuRequest(
            memory_gb=gpu["memory_gb"],
            pci_id=gpu["pci_id"],
            vendor_id=_pci_id_number(gpu["vendor_id"], "vendor_id"),
            device_id=None if gpu["device_id"] is None else _pci_id_number(gpu["device_id"], "device_id"),
        )
        for gpu in params["gpus"]
    )
    return Options(
        gpus=gpus,
        secure_boot=params["secure_boot"],
        hide_hypervisor=params["hide_hypervisor"],
        mmio_size_gb=params["mmio_size_gb"],
        adjust_memory=params["adjust_memory"],
        exclusive=params["exclusive"],
    )


def main() -> None:
    """Entry point: parse arguments, run the reconcile loop, report."""
    module = AnsibleModule(
        argument_spec=ARGUMENT_SPEC,
        required_one_of=[["name", "uuid"]],
        mutually_exclusive=[["name", "uuid"]],
        supports_check_mode=True,
    )
    if not HAS_PYVMOMI:
        module.fail_json(msg=missing_required_lib("pyvmomi"))
    params = module.params
    try:
        options = options_from_params(params)
    except PlanError as exc:
        module.fail_json(msg=str(exc))

    creds = Credentials(
        hostname=params["hostname"],
        username=params["username"],
        password=params["password"],
        port=params["port"],
        protocol=params["protocol"],
        validate_certs=params["validate_certs"],
    )
    selector = VmSelector(
        name=params["name"], uuid=params["uuid"], datacenter=params["datacenter"], folder=params["folder"]
    )
    behaviour = Behaviour(
        allow_power_off=params["allow_power_off"],
        check_mode=module.check_mode,
        shutdown_timeout=params["shutdown_timeout"],
        task_timeout=params["task_timeout"],
    )
    try:
        service_instance = connect(creds)
    except VSphereError as exc:
        module.fail_json(msg=str(exc))
    try:
        result = reconcile(service_instance, selector, options, behaviour)
    except PendingPowerOff as exc:
        module.fail_json(msg=str(exc), changes=exc.changes, changed=exc.changed)
    except (PlanError, VSphereError) as exc:
        module.fail_json(msg=str(exc))
    finally:
        disconnect(service_instance)
    for warning in result.pop("warnings"):
        module.warn(warning)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
