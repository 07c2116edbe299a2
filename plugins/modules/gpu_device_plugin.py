#!/usr/bin/python
# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Ansible module: deploy gpufleet's Kubernetes device plugin and wait until the nodes advertise their GPUs."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: gpu_device_plugin
short_description: Deploy gpufleet's NVIDIA device plugin and wait for the GPUs to appear on the nodes
version_added: "0.1.0"
description:
  - Deploys gpufleet's Kubernetes device plugin (C(python -m gpufleet.deviceplugin)) as a DaemonSet and waits
    until the rollout is done B(and) every target node reports the expected number of devices in its
    capacity and allocatable.
  - "DaemonSet mode manages, in this order: the namespace (O(create_namespace)), a ServiceAccount, a
    least-privilege ClusterRole and ClusterRoleBinding, a ConfigMap with the plugin's configuration file, and
    the DaemonSet (node selector, tolerations, hostPath C(/var/lib/kubelet/device-plugins) and the host's
    C(/dev))."
  - "RBAC follows what the configuration makes the plugin call: node labels (the default) need nodes
    C(get) and C(patch); GPU-memory sharing (C(sharing.mode=memory)) also needs pods C(list), C(get) and
    C(patch) for the hand-off with the scheduler extender; with neither, no role is created and the pod
    gets no service account token."
  - "Named configurations (C(configs) in O(plugin_config), docs/deviceplugin.md): one DaemonSet serves a mixed
    fleet, and a node label (C(configs.label), default C(nvidia.com/device-plugin.config)) picks each node's
    configuration. RBAC then adds nodes C(list) and C(watch) (the plugin watches its own Node) and, in a Role
    in the namespace C(default), events C(create) (its events on the node); a named configuration with
    GPU-memory sharing adds the pod rules. O(node_configs) sets the label on nodes before the DaemonSet is
    applied, and the capacity wait expects on each node what the configuration its label picks serves (no
    label - C(configs.default); an unknown name - the one the plugin keeps, with a warning)."
  - In systemd mode the plugin runs as a systemd unit on each GPU node, installed by the
    C(gpufleet.nvidia.gpufleet_kubernetes) role with builtin modules (virtualenv, config file, unit). This
    module then manages only the node labels of O(node_configs) and waits for the nodes' capacity.
  - When a node falls short the module fails naming the node and why, in this order - no such node, no
    plugin pod on it (and why not - node selector, an untolerated taint, node not Ready), the pod is not
    ready (waiting reason, crash, last log lines), the plugin is not registered with the kubelet, it
    advertises a different count than expected, or some devices are unhealthy.
  - Objects are compared field by field with what is wanted and patched only where they differ, so a second
    run reports no change. Check mode reports what would change without writing. With C(--diff) the managed
    fields of each changed object are shown before and after.
  - Only objects labelled C(app.kubernetes.io/managed-by=gpufleet) are ever deleted.
author:
  - gpufleet contributors (@gpufleet)
requirements:
  - kubernetes (the Python client) on the host that runs the module, usually the controller
  - PyYAML
extends_documentation_fragment:
  - gpufleet.nvidia.k8s
  - gpufleet.nvidia.k8s.workload
options:
  state:
    description:
      - V(present) deploys and waits; V(absent) deletes the DaemonSet-mode objects (and waits until they are gone
        when O(wait) is set).
    type: str
    choices: [present, absent]
    default: present
  mode:
    description:
      - V(daemonset) runs the plugin as a DaemonSet managed by this module.
      - V(systemd) means the plugin runs as a systemd unit on the nodes (installed by the gpufleet_kubernetes
        role); the module only waits for O(expected_gpus).
    type: str
    choices: [daemonset, systemd]
    default: daemonset
  name:
    description: Name of every object (ServiceAccount, ClusterRole, ClusterRoleBinding, ConfigMap, DaemonSet).
    type: str
    default: gpufleet-device-plugin
  image:
    description:
      - Device plugin image (built from C(deploy/deviceplugin/Containerfile) by C(gpufleet release images)).
        Required to deploy the DaemonSet; there is no default, as no registry holds a gpufleet tag.
      - Role C(gpufleet_kubernetes) passes the digest reference role C(gpufleet_images) gives, the image ID
        C(sha256:...) of the imported archive without a registry, C(<registry>/gpufleet/device-plugin@sha256:...)
        with one.
    type: str
  command:
    description: Overrides the image's entrypoint. The arguments are always C(--config /etc/gpufleet/config.yaml).
    type: list
    elements: str
  plugin_config:
    description:
      - The plugin's configuration file (C(deploy/deviceplugin/config.example.yaml) lists every key), stored in
        the ConfigMap. C(version) defaults to V(v1).
      - C(host_root) is set from O(host_root); C(socket_dir) and C(node_name) are the deployment's and may not be
        given.
      - Changing it rolls the DaemonSet (its pods carry the configuration's hash).
      - It is read by the plugin's own loader (which the collection carries) before anything is written, in
        either mode and state, and what that loader reads decides the resources waited for, the RBAC and the
        mounts.
      - C(configs) holds named configurations (C(label), C(default), C(named)); see O(node_configs).
    type: dict
    default: {}
  node_selector:
    description: Labels a node must have to run the plugin (the DaemonSet's nodeSelector).
    type: dict
    default: {}
  tolerations:
    description:
      - The pods' tolerations. Default tolerates C(nvidia.com/gpu:NoSchedule) and C(CriticalAddonsOnly).
    type: list
    elements: dict
  priority_class_name:
    description: The pods' priorityClassName; an empty string sets none.
    type: str
    default: system-node-critical
  runtime_class_name:
    description:
      - The plugin pods' runtimeClassName (NVIDIA's chart calls it C(runtimeClassName)); an empty string sets
        none.
      - The image has no NVML of its own and gets it from the host through the NVIDIA container runtime. Set
        this (usually to V(nvidia), see O(runtime_class)) where nvidia is not the nodes' default runtime.
    type: str
    default: ""
  runtime_class:
    description:
      - A C(node.k8s.io/v1) RuntimeClass this module creates (V(present), in both modes) and deletes
        (V(absent)). GPU pods that name it run with the runtime handler of that name, the GPU Operator's way
        when runc stays the default runtime (C(nvidia_container_toolkit_default_runtime=false)).
      - An existing RuntimeClass of that name that gpufleet did not create is left as it is, and never
        deleted. The handler of an existing one cannot change (the API server refuses it).
      - Not given - no RuntimeClass is created or deleted.
    type: dict
    suboptions:
      name:
        description: The RuntimeClass's name, which pods give as C(runtimeClassName).
        type: str
        default: nvidia
      handler:
        description: The runtime handler - containerd's C(runtimes.<handler>), CRI-O's C(runtimes) entry.
        type: str
        default: nvidia
      node_selector:
        description:
          - C(scheduling.nodeSelector) - labels a node must have to run pods that name the RuntimeClass (in a
            mixed fleet, keeps them off nodes without the handler, such as dockershim nodes).
        type: dict
        default: {}
  resources:
    description:
      - The container's resources.
      - Default requests 100m CPU and 64Mi memory and limits memory to 128Mi. Allocate is on the start path of
        every GPU pod, and under CPU contention the request is the plugin's share; no CPU limit, whose
        throttling would add latency.
    type: dict
  host_root:
    description:
      - Where the host's C(/dev) (and C(/sys), C(/proc)) are, as a path on the node; mounted at the same path.
      - Other than V(/) only for simulated GPUs (gpufleet's GPU simulator) or a mounted host tree.
    type: path
    default: /
  env:
    description: Extra environment variables of the plugin container (besides C(NODE_NAME)).
    type: dict
    default: {}
  extra_volumes:
    description: Extra hostPath volumes mounted into the plugin container.
    type: list
    elements: dict
    default: []
    suboptions:
      name:
        description: Volume name.
        type: str
        required: true
      host_path:
        description: Path on the node.
        type: path
        required: true
      mount_path:
        description: Path in the container; default the same as O(extra_volumes[].host_path).
        type: path
      read_only:
        description: Mount read-only.
        type: bool
        default: true
  expected_gpus:
    description:
      - Node name to number of GPUs, e.g. from each host's C(gpufleet_gpu.gpu_count) fact. The module waits until
        each of these nodes reports that many devices (times the replicas with time-slicing; any positive number
        of GiB with GPU-memory sharing) in capacity and allocatable. With named configurations, the sharing mode
        and resource are those of the configuration the node's label picks, read again at every poll.
      - Empty in DaemonSet mode - every node the DaemonSet runs on must report some. Required in systemd mode with
        O(wait).
    type: dict
    default: {}
  node_configs:
    description:
      - Node name to the name of its named configuration (one of C(configs.named) in O(plugin_config)), set as
        the node's C(configs.label) label before the plugin is deployed. An unknown name fails the module
        before anything is written.
      - A null or empty name removes the label, but only if this module set it and it still has the value the
        module set (recorded in the node annotation C(gpufleet.io/device-plugin.config-label)); a label set by
        someone else is left alone. Nodes not listed are not touched.
      - With O(state=absent), every listed node loses the label this module set.
    type: dict
    default: {}
  wait:
    description: Wait for the rollout and the capacity (V(present)) or for the objects to be gone (V(absent)).
    type: bool
    default: true
  wait_timeout:
    description: Seconds for each wait.
    type: int
    default: 300
attributes:
  check_mode:
    description: Reports what would be created, changed or deleted without writing; does not wait.
    support: full
  diff_mode:
    description: Shows the managed fields of each changed object before and after.
    support: full
notes:
  - Runs against the Kubernetes API, so it normally runs once on the controller (C(delegate_to), C(run_once)).
  - Quantities in O(resources) should be given as the API server writes them back (C(100m), C(64Mi)), else every
    run reports a change.
  - Tested against Kubernetes 1.37 (API server and kubelet built from its Go modules, on containerd 1.6 CRI v1),
    with simulated GPUs; also runs against 1.20. The plugin's hostPath volumes need a namespace that Pod
    Security admission lets run C(privileged) pods.
  - Under C(mig.strategy) V(single) or V(mixed) the capacity wait asks each node for a positive count of the GPU
    resource, not one per GPU, as what a node advertises depends on its MIG layout. Settings overridden with
    O(env) are not followed.
seealso:
  - module: gpufleet.nvidia.gpu_scheduler_extender
  - name: Device plugin documentation
    description: docs/deviceplugin.md in the gpufleet repository.
    link: https://gpufleet.example/gpufleet/docs/deviceplugin.md
"""

EXAMPLES = r"""
- name: Deploy the device plugin on the GPU nodes and wait for their GPUs
  gpufleet.nvidia.gpu_device_plugin:
    kubeconfig: /etc/kubernetes/admin.conf
    # pushed by role gpufleet_images (gpufleet_images_registry); the digest is the one its images.json names
    image: registry.example.com/gpufleet/device-plugin@sha256:3b1f0c5e2d4a6b8c9e0f1a2b3c4d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6
    node_selector:
      gpufleet.io/gpu-node: "true"
    expected_gpus:
      dgx-01: 8
      t4-07: 2
  delegate_to: localhost
  run_once: true

- name: GPU-memory sharing on nodes labelled for it
  gpufleet.nvidia.gpu_device_plugin:
    name: gpufleet-device-plugin-mem
    node_selector:
      gpufleet.io/gpu-sharing: memory
    plugin_config:
      sharing:
        mode: memory
  delegate_to: localhost
  run_once: true

- name: One DaemonSet for a mixed fleet, each node's configuration picked by its label
  gpufleet.nvidia.gpu_device_plugin:
    plugin_config:
      configs:
        default: training
        named:
          training: {}
          inference:
            sharing:
              mode: time-slicing
              time_slicing:
                replicas: 4
    node_configs:
      dgx-01: training
      t4-07: inference
    expected_gpus:
      dgx-01: 8
      t4-07: 2
  delegate_to: localhost
  run_once: true

- name: Wait for plugins installed as systemd units to register
  gpufleet.nvidia.gpu_device_plugin:
    mode: systemd
    expected_gpus: "{{ dict(groups['gpu_nodes'] | zip(groups['gpu_nodes'] | map('extract', hostvars, ['ansible_facts', 'gpufleet_gpu', 'gpu_count']))) }}"
  delegate_to: localhost
  run_once: true

- name: Nodes where runc stays the default runtime - GPU pods (and the plugin's) name the RuntimeClass nvidia
  gpufleet.nvidia.gpu_device_plugin:
    runtime_class:
      name: nvidia
      handler: nvidia
    runtime_class_name: nvidia
  delegate_to: localhost
  run_once: true
- name: Remove the device plugin
  gpufleet.nvidia.gpu_device_plugin:
    state: absent
  delegate_to: localhost
  run_once: true
"""

RETURN = r"""
changed:
  description: Whether an object was (or, in check mode, would be) created, patched or deleted.
  returned: always
  type: bool
  sample: false
resource:
  description: The extended resource the plugin advertises (with named configurations, that of C(configs.default)).
  returned: always
  type: str
  sample: nvidia.com/gpu
objects:
  description: Every managed object and what happened to it.
  returned: always
  type: list
  elements: dict
  contains:
    kind:
      description: Object kind (V(Node) for the configuration label of O(node_configs); V(RuntimeClass) for
        O(runtime_class)).
      type: str
      sample: DaemonSet
    name:
      description: Object name.
      type: str
      sample: gpufleet-device-plugin
    namespace:
      description: Namespace; null for cluster-scoped objects.
      type: str
      sample: gpufleet-system
    action:
      description: V(created), V(updated), V(unchanged), V(deleted), V(absent) (nothing to delete) or V(skipped)
        (not managed by gpufleet, left alone).
      type: str
      sample: unchanged
    note:
      description: Why an object was skipped.
      type: str
      returned: when action is skipped
  sample:
    - {"kind": "DaemonSet", "name": "gpufleet-device-plugin", "namespace": "gpufleet-system", "action": "created"}
nodes:
  description:
    - Per waited-for node, the resource's capacity and allocatable once they matched.
    - With named configurations also the configuration the node's label picks (C(config)) and its resource
      (C(resource)).
  returned: when state is present, wait is true and not in check mode
  type: dict
  sample: {"dgx-01": {"capacity": 8, "allocatable": 8}}
diff:
  description: Before/after of each changed object's managed fields (with C(--diff)).
  returned: when diff mode is on
  type: list
  elements: dict
"""

from ansible.module_utils.basic import AnsibleModule
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import CONNECTION_ARGS, KubeError
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_deviceplugin import (
    ARGUMENT_SPEC,
    ParameterError,
    load_config,
    plugin_config,
    reconcile,
    wait_ready,
)
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_module import (
    reconcile_or_fail,
    require_kubernetes,
)


def main() -> None:
    """Parse arguments, apply or delete, wait, report."""
    module = AnsibleModule(argument_spec={**ARGUMENT_SPEC, **CONNECTION_ARGS}, supports_check_mode=True)
    require_kubernetes(module)
    params = module.params
    result: dict = {"changed": False, "objects": [], "nodes": {}}
    waits = params["state"] == "present" and params["wait"] and not module.check_mode
    try:
        result["resource"] = load_config(plugin_config(params)).advertised().resource
    except ParameterError as exc:
        module.fail_json(msg=str(exc), **result)
    if params["mode"] == "systemd" and not waits and not params["node_configs"] and not params["runtime_class"]:
        module.exit_json(**result)  # in systemd mode only node labels and the RuntimeClass are this module's
    kube, applied = reconcile_or_fail(module, reconcile, result, (ParameterError,))
    if module._diff:
        result["diff"] = applied.diffs()
    if waits:
        try:
            result["nodes"], warnings = wait_ready(kube, params)
        except (KubeError, ParameterError) as exc:
            module.fail_json(msg=str(exc), **result)
        for warning in warnings:
            module.warn(warning)
    kube.close()
    module.exit_json(**result)


if __name__ == "__main__":
    main()
