# Copyright: (c) 2026, gpufleet contributors
# Apache License 2.0 (see LICENSE)
"""Options documented once for gpufleet's Kubernetes modules (gpu_device_plugin, gpu_scheduler_extender).

- ``gpufleet.nvidia.k8s``: how the module reaches the API server; the argument spec is ``CONNECTION_ARGS``
  in plugins/module_utils/k8s_client.py.
- ``gpufleet.nvidia.k8s.workload``: the in-cluster deployment's namespace, pull policy and network; the
  argument spec is ``WORKLOAD_ARGS`` in plugins/module_utils/k8s_module.py.
"""

from __future__ import annotations


class ModuleDocFragment:
    """Documentation fragments; a module names them under ``extends_documentation_fragment``."""

    DOCUMENTATION = r"""
options:
  kubeconfig:
    description:
      - Path of the kubeconfig file on the host that runs the module. Default the first file of E(KUBECONFIG)
        that exists, then C(~/.kube/config).
      - Not read when O(host) and O(api_key) are given.
    type: path
  context:
    description: Context of the kubeconfig to use; default its current context.
    type: str
  host:
    description: API server URL, used with O(api_key) instead of a kubeconfig (the two go together).
    type: str
  api_key:
    description: Bearer token for O(host). Never logged.
    type: str
  ca_cert:
    description:
      - CA bundle that signed the API server's certificate (with O(host), or to override the kubeconfig's).
    type: path
  validate_certs:
    description: Verify the API server's certificate.
    type: bool
    default: true
  request_timeout:
    description: Seconds per API request.
    type: int
    default: 30
"""

    WORKLOAD = r"""
options:
  namespace:
    description: Namespace of the namespaced objects.
    type: str
    default: gpufleet-system
  create_namespace:
    description:
      - Create O(namespace) if it is missing (an existing namespace is never adopted).
      - With O(state=absent) the namespace is deleted only if gpufleet created it and it holds nothing else
        (another gpufleet deployment, anyone's workloads); otherwise it is reported as V(skipped) with what it
        still holds.
    type: bool
    default: true
  image_pull_policy:
    description: The container's imagePullPolicy.
    type: str
    choices: [Always, IfNotPresent, Never]
    default: IfNotPresent
  host_network:
    description: Run the pods in the node's network namespace.
    type: bool
    default: false
  node_names:
    description:
      - Names of the nodes the pods may run on (a required node affinity on the Node's C(metadata.name)), in
        addition to any node selector; V([]) puts no such limit.
      - Role C(gpufleet_kubernetes) sets it, when there is no registry, to the nodes role C(gpufleet_images)
        imported the image on, so that no pod lands on a node that would have to pull it.
    type: list
    elements: str
    default: []
"""
