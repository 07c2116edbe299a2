"""Where the node and cluster services find the Kubernetes API: the one rule both follow.

A kubeconfig path when one is given; else the pod's service account (in-cluster); else the default
kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``), for a service run by hand or by systemd on a node.
"""

from __future__ import annotations

from typing import Any


def api_client(kubeconfig: str = "") -> Any:
    """A ``kubernetes.client.ApiClient`` configured by that rule (its own Configuration, not the global)."""
    from kubernetes import client, config

    configuration = client.Configuration()
    if kubeconfig:
        config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)
        except config.ConfigException:
            config.load_kube_config(client_configuration=configuration)
    return client.ApiClient(configuration)
