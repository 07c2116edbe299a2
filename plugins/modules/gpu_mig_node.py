#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: a Kubernetes node's MIG layout labels, with cordon and GPU-pod eviction around a change."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_mig_node
short_description: Label a Kubernetes node with its MIG layout and state, cordoning and draining its GPU pods around a change
version_added: "0.1.0"
description:
  - Sets the node labels NVIDIA's MIG manager uses, C(nvidia.com/mig.config) (the wanted layout, O(layout)) and
    C(nvidia.com/mig.config.state) (O(state)), so tools written for the GPU Operator read the node the same way.
  - With O(state=pending) and O(drain), cordons the node (unless it is cordoned already) and evicts, through the
    Eviction API, every pod on it that requests or limits a GPU resource (O(gpu_resources)), then waits until
    they are gone. DaemonSet and mirror pods are left running and reported in RV(left_running). Pods without GPU
    resources keep running. A PodDisruptionBudget that refuses an eviction is retried until O(drain_timeout).
  - The cordon is remembered in the annotation C(gpufleet.io/mig-cordoned). O(state=success) uncordons the node
    only when that annotation is there (a node an operator cordoned stays cordoned) and removes it;
    O(state=failed) leaves the node cordoned.
  - Run it where the kubeconfig is, usually the controller (C(delegate_to=localhost)), around
    M(gpufleet.nvidia.gpu_mig_layout) on the node; the role C(gpufleet.nvidia.nvidia_mig) does.
  - Tested against kube-apiserver 1.37 (Eviction C(policy/v1), used from 1.22) and 1.20 (C(policy/v1beta1)).
author:
  - gpufleet contributors (@gpufleet)
requirements:
  - kubernetes (the Python client)
extends_documentation_fragment:
  - gpufleet.nvidia.k8s
options:
  name:
    description: Name of the Kubernetes node.
    type: str
    required: true
  layout:
    description: The layout name, the value of C(nvidia.com/mig.config).
    type: str
    required: true
  state:
    description:
      - The value of C(nvidia.com/mig.config.state). V(pending) before a change (and the drain, with O(drain)),
        V(success) after it (and the uncordon), V(failed) when it failed (the node stays cordoned).
    type: str
    choices: [pending, success, failed]
    required: true
  drain:
    description: With O(state=pending), cordon the node and evict its GPU pods.
    type: bool
    default: false
  gpu_resources:
    description:
      - Resource name prefixes that make a pod a GPU pod (in any container's requests or limits).
    type: list
    elements: str
    default: ["nvidia.com/gpu", "nvidia.com/mig-", "gpufleet.io/gpu"]
  drain_timeout:
    description: Seconds to wait for the evictions to be accepted and the evicted pods to be gone.
    type: int
    default: 300
attributes:
  check_mode:
    description: Reports the label and cordon changes and the pods it would evict, and changes nothing.
    support: full
  diff_mode:
    description: Shows the two labels and whether the node is unschedulable, before and after.
    support: full
seealso:
  - module: gpufleet.nvidia.gpu_mig_layout
  - name: NVIDIA MIG manager (mig-parted, deployments/gpu-operator)
    description: The labels and states this module writes.
    link: https://github.com/NVIDIA/mig-parted
"""

EXAMPLES = r"""
- name: Mark the node pending and move its GPU pods off it
  gpufleet.nvidia.gpu_mig_node:
    name: gpu-node-1
    layout: all-1g.10gb
    state: pending
    drain: true
    kubeconfig: ~/.kube/config
  delegate_to: localhost

- name: Mark the layout applied and uncordon the node
  gpufleet.nvidia.gpu_mig_node:
    name: gpu-node-1
    layout: all-1g.10gb
    state: success
  delegate_to: localhost
"""

RETURN = r"""
node:
  description: The node's name.
  returned: success
  type: str
  sample: gpu-node-1
evicted:
  description: Pods evicted (in check mode, that would be), as namespace/name.
  returned: always
  type: list
  elements: str
  sample: ["default/train-7f9c"]
left_running:
  description: GPU pods left running because a DaemonSet owns them or they are mirror pods.
  returned: always
  type: list
  elements: str
  sample: ["gpufleet-system/gpufleet-device-plugin-x2k4p"]
before:
  description: The two labels (those present) and whether the node was unschedulable.
  returned: success
  type: dict
  sample: {"labels": {"nvidia.com/mig.config": "all-disabled", "nvidia.com/mig.config.state": "success"}, "unschedulable": false}
after:
  description: The same after the change (in check mode, as it would be).
  returned: success
  type: dict
  sample: {"labels": {"nvidia.com/mig.config": "all-1g.10gb", "nvidia.com/mig.config.state": "pending"}, "unschedulable": true}
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import (
    CONNECTION_ARGS,
    ConnectionOptions,
    Kube,
    KubeError,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_mig_node import (
    DEFAULT_GPU_RESOURCES,
    STATES,
    reconcile,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_module import require_kubernetes


def main() -> None:
    module = AnsibleModule(
        argument_spec={
            **CONNECTION_ARGS,
            "name": {"type": "str", "required": True},
            "layout": {"type": "str", "required": True},
            "state": {"type": "str", "required": True, "choices": list(STATES)},
            "drain": {"type": "bool", "default": False},
            "gpu_resources": {"type": "list", "elements": "str", "default": list(DEFAULT_GPU_RESOURCES)},
            "drain_timeout": {"type": "int", "default": 300},
        },
        supports_check_mode=True,
    )
    require_kubernetes(module)
    kube = None
    try:
        kube = Kube(ConnectionOptions.from_params(module.params))
        result = reconcile(kube, module.params, module.check_mode)
    except KubeError as exc:
        partial = exc.partial if isinstance(exc.partial, dict) else {"changed": False}
        module.fail_json(msg=str(exc), **partial)
    finally:
        if kube is not None:
            kube.close()
    if module._diff:
        result["diff"] = {"before": result["before"], "after": result["after"]}
    module.exit_json(**result)


if __name__ == "__main__":
    main()
