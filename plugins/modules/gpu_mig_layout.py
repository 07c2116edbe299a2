#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: apply a named MIG layout (mig-parted's config format) to the host's GPUs."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_mig_layout
short_description: Apply a named MIG layout to the NVIDIA GPUs of the host
version_added: "0.1.0"
description:
  - Applies one layout of a MIG config in the format of NVIDIA's MIG Partition Editor (mig-parted),
    C(version) V(v1) with C(mig-configs), to the GPUs of the host it runs on, through NVML (pynvml).
  - Validates the whole config, the layout name and, for every GPU the layout covers, the profiles, their
    counts and a placement of the instances before any GPU is touched; any problem fails the task and
    nothing is changed.
  - Only GPUs whose MIG mode or instances differ from the layout are changed. For each of them it destroys
    the existing compute and GPU instances, sets the MIG mode, resets the GPU with
    C(nvidia-smi --gpu-reset -i N) where the mode change stays pending (Ampere), and creates one GPU
    instance per wanted MIG device with one compute instance spanning it.
  - Refuses, changing nothing, while processes run on a GPU that would change.
  - Does not drain, cordon or label a Kubernetes node; M(gpufleet.nvidia.gpu_mig_node) does, and the role
    C(gpufleet.nvidia.nvidia_mig) runs both and installs a boot unit that re-applies the layout.
  - GPU-facing behaviour has been tested against gpufleet's NVML simulator, not against real GPUs.
  - A profile the GPU does not offer fails the task naming the profiles it offers.
author:
  - gpufleet contributors (@gpufleet)
requirements:
  - python >= 3.8 on the target
  - nvidia-ml-py (pynvml) on the target
  - nvidia-smi on the target's PATH when a GPU reset is needed
options:
  config_file:
    description:
      - Path on the target of a mig-parted config file (YAML).
    type: path
  config:
    description:
      - The mig-parted config itself, as a mapping with C(version) and C(mig-configs).
    type: dict
  layout:
    description:
      - Name of the layout in C(mig-configs) to apply, for instance V(all-1g.10gb) or V(all-disabled).
    type: str
    required: true
attributes:
  check_mode:
    description: Reports per GPU what would change, and changes nothing.
    support: full
  diff_mode:
    description: Shows per GPU the MIG mode and the GPU instances (profile names) before and after.
    support: full
notes:
  - NVML is reached through C(libnvidia-ml.so.1) as the dynamic loader finds it, so set E(LD_LIBRARY_PATH)
    through the play's C(environment) when the library is not in a standard place (as on simulated hosts).
  - Profiles are checked against the GPU's own table, NVML's GPU-instance profiles and their placements
    (answered with MIG on or off); where NVML lists none, against gpufleet's tables for A100/A800 40GB
    and 80GB, H100/H800 80GB and the H200 (as a real H200 listed them).
seealso:
  - name: NVIDIA MIG Partition Editor
    description: The config format.
    link: https://github.com/NVIDIA/mig-parted
"""

EXAMPLES = r"""
- name: Slice every A100-80GB into seven 1g.10gb devices
  gpufleet.nvidia.gpu_mig_layout:
    config_file: /etc/nvidia-mig-manager/config.yaml
    layout: all-1g.10gb

- name: A custom layout per GPU index
  gpufleet.nvidia.gpu_mig_layout:
    layout: custom
    config:
      version: v1
      mig-configs:
        custom:
          - devices: [0, 1]
            mig-enabled: true
            mig-devices: {"3g.40gb": 2}
          - devices: [2]
            mig-enabled: false
"""

RETURN = r"""
gpus:
  description: One entry per GPU the layout covers, in index order.
  returned: always
  type: list
  elements: dict
  contains:
    index:
      description: NVML index.
      type: int
      sample: 0
    uuid:
      description: GPU UUID.
      type: str
      sample: GPU-6a3f0e1c-5b2d-4c8e-9f10-2b3c4d5e6f70
    model:
      description: Model as NVML names it.
      type: str
      sample: NVIDIA A100-SXM4-80GB
    changed:
      description: Whether the GPU was (in check mode, would be) changed.
      type: bool
      sample: true
    actions:
      description: What was (or would be) done, in order.
      type: list
      elements: str
      sample: ["destroy 2 GPU instance(s)", "enable MIG", "reset GPU", "create 7 GPU instance(s)"]
    reset:
      description: Whether the GPU was reset (in check mode, whether a reset may be needed is not known).
      type: bool
      sample: true
    before:
      description: MIG mode and GPU instances (profile names, by placement) before.
      type: dict
      sample: {"mig": "disabled", "instances": []}
    after:
      description: MIG mode and GPU instances after (in check mode, as wanted).
      type: dict
      sample: {"mig": "enabled", "instances": ["1g.10gb", "1g.10gb"]}
"""

import contextlib
import traceback

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.nvidia.plugins.module_utils.mig_layout import (
    LayoutError,
    load_layouts,
    run_layout,
)

try:
    import pynvml

    HAS_PYNVML = True
    PYNVML_IMPORT_ERROR = None
except ImportError:
    HAS_PYNVML = False
    PYNVML_IMPORT_ERROR = traceback.format_exc()


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            "config_file": {"type": "path"},
            "config": {"type": "dict"},
            "layout": {"type": "str", "required": True},
        },
        mutually_exclusive=[("config_file", "config")],
        required_one_of=[("config_file", "config")],
        supports_check_mode=True,
    )
    params = module.params
    if not HAS_PYNVML:
        module.fail_json(
            msg="pynvml (nvidia-ml-py) is not installed for the target's Python",
            exception=PYNVML_IMPORT_ERROR,
        )
    try:
        layouts = load_layouts(params["layout"], params["config_file"], params["config"])
    except LayoutError as exc:
        module.fail_json(msg=str(exc))

    def reset(index: int) -> None:
        smi = module.get_bin_path("nvidia-smi", required=True)
        rc, out, err = module.run_command([smi, "--gpu-reset", "-i", str(index)])
        if rc != 0:
            raise LayoutError(f"GPU {index}: nvidia-smi --gpu-reset failed (rc {rc}): {(out + err).strip()}")

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        module.fail_json(msg=f"NVML init: {exc}")
    result: dict = {"changed": False, "gpus": []}
    try:
        run_layout(pynvml, layouts, params["layout"], result, check_mode=module.check_mode, reset=reset)
    except LayoutError as exc:
        result.pop("diff", None)
        module.fail_json(msg=str(exc), **result)
    except pynvml.NVMLError as exc:
        result.pop("diff", None)
        module.fail_json(msg=f"NVML: {exc}", exception=traceback.format_exc(), **result)
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()
    if not module._diff:
        result.pop("diff", None)
    module.exit_json(**result)


if __name__ == "__main__":
    main()
