#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: NVIDIA GPU, NVSwitch, driver and host facts, with or without a driver."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_facts
short_description: Gather NVIDIA GPU, NVSwitch, driver and host facts
version_added: "0.1.0"
description:
  - Discovers NVIDIA GPUs and NVSwitches on the target and returns them as the fact C(gpufleet_gpu).
  - Before a driver is installed the facts come from sysfs (PCI vendor, device and class, NUMA node,
    bound driver) and a table of known GPU models; C(source) is then C(sysfs).
  - When the NVIDIA driver is loaded and the Python on the target has C(pynvml) (nvidia-ml-py), the facts
    come from NVML (C(source=nvml)), with UUIDs, exact memory, compute capability, persistence and MIG mode,
    NVLinks, the GPU connection matrix of C(nvidia-smi topo -m), and GPU fabric state on Hopper.
  - Without pynvml on the target (a node's system Python) the other facts come from sysfs and the
    connection matrix from running C(nvidia-smi topo -m), found on the module's E(PATH).
  - Also reports what host preparation needs to know, such as whether nouveau is loaded, Secure Boot,
    the hypervisor, and whether the kernel module and userspace driver versions differ.
  - Reads the kernel log of the current boot (C(/dev/kmsg), else C(/var/log/kern.log); without blocking, at
    most 16 MiB and 2 seconds) and returns the NVIDIA driver's error lines (NVRM, Xid) as C(kernel_log_errors).
    In a VMware guest it also returns C(vm_config_problems), the signs of a VM configured wrong for its GPUs
    (for instance a 64-bit MMIO window too small for their memory), each with the likely cause and the fix.
  - Reading C(/dev/kmsg) needs root where C(kernel.dmesg_restrict) is 1 (use C(become)); when no log can be
    read, C(kernel_log_unreadable) says why and the other facts are unaffected.
  - Never changes the target. Runs the same under check mode.
  - GPU-facing behaviour has been tested against gpufleet's NVML simulator, not against real GPUs.
author:
  - gpufleet contributors (@gpufleet)
requirements:
  - python >= 3.8 on the target
  - nvidia-ml-py (pynvml) on the target for NVML facts; without it the facts come from sysfs
options:
  host_root:
    description:
      - Read C(/sys), C(/proc), C(/dev) and C(/var/log) under this directory instead of C(/), to inspect a
        mounted or simulated host.
      - Defaults to the E(GPUFLEET_HOST_ROOT) environment variable of the module, or C(/).
    type: path
  nvml:
    description:
      - Query NVML when it is available. With V(false) the facts always come from sysfs.
    type: bool
    default: true
  topology:
    description:
      - Build the GPU connection matrix (one NVML query per GPU pair; without pynvml one run of
        C(nvidia-smi topo -m)).
    type: bool
    default: true
  kernel_log:
    description:
      - Read the kernel log for C(kernel_log_errors) and C(vm_config_problems). With V(false) both are empty
        and C(kernel_log_unreadable) is V(not read).
    type: bool
    default: true
attributes:
  check_mode:
    description: Can run in check mode and return the same facts.
    support: full
  diff_mode:
    description: Changes nothing, so there is no diff.
    support: none
  facts:
    description: Returns its result as the fact C(gpufleet_gpu).
    support: full
notes:
  - NVML is reached through C(libnvidia-ml.so.1) as the dynamic loader finds it, so set E(LD_LIBRARY_PATH)
    through the play's C(environment) when the library is not in a standard place (as on simulated hosts).
seealso:
  - name: NVML API reference
    description: The library the NVML facts come from.
    link: https://docs.nvidia.com/deploy/nvml-api/
"""

EXAMPLES = r"""
- name: Gather GPU facts
  gpufleet.nvidia.gpu_facts:

- name: Install fabricmanager only where NVSwitches need it
  ansible.builtin.debug:
    msg: "{{ inventory_hostname }} needs nvidia-fabricmanager"
  when: ansible_facts.gpufleet_gpu.fabricmanager_required

- name: Stop a VMware guest whose VM configuration keeps its GPUs from working
  ansible.builtin.assert:
    that: ansible_facts.gpufleet_gpu.vm_config_problems | length == 0
    fail_msg: "{{ ansible_facts.gpufleet_gpu.vm_config_problems | map(attribute='fix') | unique | list }}"

- name: Gather GPU facts from sysfs only, as before a driver is installed
  gpufleet.nvidia.gpu_facts:
    nvml: false

- name: Gather GPU facts of a simulated host
  gpufleet.nvidia.gpu_facts:
    host_root: /tmp/gpufleet-sim/dgx-a100/host
  environment:
    GPUFLEET_SIM_ROOT: /tmp/gpufleet-sim/dgx-a100
    LD_LIBRARY_PATH: /tmp/gpufleet-sim/dgx-a100/lib
"""

RETURN = r"""
ansible_facts:
  description: Facts added to the host.
  returned: always
  type: dict
  contains:
    gpufleet_gpu:
      description: GPU, NVSwitch, driver and host facts.
      returned: always
      type: dict
      contains:
        source:
          description: Where the GPU facts come from, V(nvml) or V(sysfs).
          type: str
          sample: nvml
        nvml_error:
          description: Why NVML was not used (no pynvml, no library, driver not loaded, ...); null with NVML.
          type: str
          sample: "NVML init: Driver Not Loaded"
        host_root:
          description: The directory C(/sys), C(/proc) and C(/dev) were read under.
          type: str
          sample: /
        gpu_count:
          description: Number of GPUs.
          type: int
          sample: 8
        gpu_models:
          description: Number of GPUs of each model.
          type: dict
          sample: {"NVIDIA A100-SXM4-80GB": 8}
        gpus:
          description: One entry per GPU, in NVML index order (PCI bus order from sysfs).
          type: list
          elements: dict
          contains:
            index:
              description: NVML index (from sysfs, the position in PCI bus order).
              type: int
              sample: 0
            uuid:
              description: GPU UUID; null from sysfs.
              type: str
              sample: GPU-6a3f0e1c-5b2d-4c8e-9f10-2b3c4d5e6f70
            model:
              description: Model name as NVML reports it; from sysfs, looked up by PCI device ID.
              type: str
              sample: NVIDIA A100-SXM4-80GB
            memory_mib:
              description: Total memory in MiB; from sysfs, the model's nominal size; null when unknown.
              type: int
              sample: 81920
            pci_bus_id:
              description: PCI address in sysfs form.
              type: str
              sample: "0000:07:00.0"
            pci_device_id:
              description: 16-bit PCI device ID.
              type: str
              sample: "0x20b2"
            numa_node:
              description: NUMA node of the GPU's PCI device; null where the platform gives none.
              type: int
              sample: 0
            compute_capability:
              description: CUDA compute capability.
              type: str
              sample: "8.0"
            architecture:
              description: GPU architecture.
              type: str
              sample: Ampere
            kernel_driver:
              description:
                - Kernel driver bound to the PCI device (V(nvidia), V(vfio-pci), V(nouveau)); null if none.
              type: str
              sample: nvidia
            minor:
              description: N of C(/dev/nvidiaN); null from sysfs.
              type: int
              sample: 0
            persistence_mode:
              description: Whether persistence mode is on; null from sysfs.
              type: bool
              sample: true
            mig_mode:
              description: MIG mode (C(current), C(pending)); null where MIG is not supported or from sysfs.
              type: dict
              sample: {"current": false, "pending": false}
            nvlinks:
              description: NVLinks the GPU has.
              type: int
              sample: 12
            nvlinks_active:
              description: NVLinks that are up.
              type: int
              sample: 12
            fabric_state:
              description: NVSwitch fabric registration (Hopper and later), e.g. V(completed), V(not-started).
              type: str
              sample: completed
            lost:
              description: Whether NVML reports the GPU lost (fallen off the bus).
              type: bool
              sample: false
        nvswitch_count:
          description: NVSwitches found on the PCI bus or at the far end of NVLinks.
          type: int
          sample: 6
        fabricmanager_required:
          description: Whether the host has NVSwitches and so needs nvidia-fabricmanager.
          type: bool
          sample: true
        fabric_symptoms:
          description:
            - Signs that nvidia-fabricmanager is not running or failed (inactive switch links, fabric state).
          type: list
          elements: str
          sample: ["GPU 0: 12 of 12 NVLinks to NVSwitches inactive"]
        kernel_log_source:
          description:
            - The kernel log read, as a path on the host (under O(host_root)), V(/dev/kmsg) or V(/var/log/kern.log).
            - Null when neither could be read.
          type: str
          sample: /dev/kmsg
        kernel_log_unreadable:
          description: Why no kernel log was read, per path tried; null when one was.
          type: str
          sample: "/dev/kmsg: Operation not permitted; /var/log/kern.log: Permission denied"
        kernel_log_truncated:
          description: Whether lines may be missing (log larger than the read limit, or records overwritten).
          type: bool
          sample: false
        kernel_log_errors:
          description:
            - The NVIDIA driver's lines of the current boot that report a failure, Xid events among them.
            - Distinct lines in the order first logged, at most the last 100. Any host.
          type: list
          elements: str
          sample: ["NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)", "NVRM: None of the NVIDIA devices were initialized."]
        vm_config_problems:
          description:
            - On a VMware guest with GPUs, the signs in its kernel log and boot mode that the VM is configured
              wrong for them; empty when none are seen, and always empty on other hosts.
            - One entry per symptom and GPU.
          type: list
          elements: dict
          contains:
            symptom:
              description:
                - V(gpu_bar_unassigned) (a GPU memory window got no address; BIOS firmware or a 64-bit MMIO window
                  too small), V(bios_firmware) (GPUs of more than 16 GB in a BIOS-booted VM),
                  V(gpu_init_failed) (C(RmInitAdapter failed)), V(gpu_fell_off_bus) (Xid 79),
                  V(gpu_no_interrupts), V(iommu_fault) (a virtual IOMMU blocked the GPU).
              type: str
              sample: gpu_bar_unassigned
            gpu:
              description: PCI address of the GPU concerned; null when the evidence names none.
              type: str
              sample: "0000:0b:00.0"
            evidence:
              description: The kernel log line (or host fact) that shows it.
              type: str
              sample: "NVRM: BAR1 is 0M @ 0x0 (PCI:0000:0b:00.0)"
            likely_cause:
              description: What in the VM's configuration most likely causes it.
              type: str
              sample: "The GPU's BAR1 (its large, 64-bit memory aperture) does not fit the VM's 64-bit MMIO window: ..."
            fix:
              description: What to change, in vSphere terms.
              type: str
              sample: "Power the VM off and set: firmware EFI, pciPassthru.use64bitMMIO = TRUE, pciPassthru.64bitMMIOSizeGB = 128 ..."
        driver_loaded:
          description: Whether the nvidia kernel module is loaded (or NVML answered).
          type: bool
          sample: true
        driver_version_kernel:
          description: Version of the loaded nvidia kernel module.
          type: str
          sample: 535.261.03
        driver_version_userspace:
          description: Version of the userspace driver (libnvidia-ml) as NVML reports it.
          type: str
          sample: 535.261.03
        driver_version_mismatch:
          description: Whether kernel module and userspace driver differ (a reboot or module reload is due).
          type: bool
          sample: false
        cuda_driver_version:
          description: Highest CUDA version the driver supports.
          type: str
          sample: "12.2"
        nvml_version:
          description: NVML library version.
          type: str
          sample: 12.535.261.03
        nouveau_loaded:
          description: Whether the nouveau module is loaded (it must go before the NVIDIA driver loads).
          type: bool
          sample: false
        boot_mode:
          description: Firmware boot mode, V(uefi) or V(bios).
          type: str
          sample: uefi
        secure_boot:
          description:
            - Whether UEFI Secure Boot is on (unsigned kernel modules will not load); null if unknown.
          type: bool
          sample: false
        hypervisor:
          description:
            - Hypervisor the host runs under (V(vmware), V(kvm), V(qemu), V(hyperv), V(xen), V(unknown)).
            - Null on bare metal.
          type: str
          sample: vmware
        virtualized:
          description: Whether the host is a virtual machine.
          type: bool
          sample: true
        kernel_release:
          description: Release of the running kernel.
          type: str
          sample: 6.1.0-28-amd64
        device_nodes:
          description: NVIDIA device nodes under C(/dev).
          type: list
          elements: str
          sample: ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm"]
        topology:
          description:
            - GPU connection matrix as C(nvidia-smi topo -m) shows it, from NVML; where the target's Python
              lacks pynvml, from the output of C(nvidia-smi topo -m) itself (C(topology_source)). Null when
              neither answers (no driver loaded, or O(topology=false)).
            - C(matrix[i][j]) is V(X), V(NV<n>) (NVLinks, direct or through NVSwitches), V(PIX), V(PXB),
              V(PHB), V(NODE), V(SYS) or V(N/A), for the GPUs listed in C(gpus) by index.
          type: dict
          sample: {"gpus": [0, 1], "matrix": [["X", "NODE"], ["NODE", "X"]]}
        topology_source:
          description: Where C(topology) came from, V(nvml) or V(nvidia-smi); null without a topology.
          type: str
          sample: nvidia-smi
        topology_error:
          description: Why C(nvidia-smi topo -m) gave no matrix when NVML was not usable; null otherwise.
          type: str
          sample: "nvidia-smi is not on PATH"
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.nvidia.plugins.module_utils.gpu.facts import discover


def main() -> None:
    """Parse arguments, discover, return the facts."""
    module = AnsibleModule(
        argument_spec={
            "host_root": {"type": "path"},
            "nvml": {"type": "bool", "default": True},
            "topology": {"type": "bool", "default": True},
            "kernel_log": {"type": "bool", "default": True},
        },
        supports_check_mode=True,
    )
    params = module.params
    try:
        facts = discover(
            params["host_root"],
            use_nvml=params["nvml"],
            with_topology=params["topology"],
            with_kernel_log=params["kernel_log"],
        )
    except OSError as exc:
        module.fail_json(msg=f"cannot read the host under {params['host_root'] or '/'}: {exc}")
    module.exit_json(changed=False, ansible_facts={"gpufleet_gpu": facts.to_dict()})


if __name__ == "__main__":
    main()
