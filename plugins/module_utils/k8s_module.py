# Copyright: gpufleet contributors
# Apache License 2.0 (see the repository's pyproject.toml)
"""What gpufleet's Kubernetes modules share around ``AnsibleModule``: the in-cluster deployment's common
options, the check for the kubernetes library, the check of a service's config file by the service's own
loader, and connect-then-reconcile with the objects reported even when it fails part way.

The connection options are ``CONNECTION_ARGS`` in k8s_client; both sets are documented once, in the doc
fragments ``gpufleet.nvidia.k8s`` and ``gpufleet.nvidia.k8s.workload`` (plugins/doc_fragments/k8s.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ansible.module_utils.basic import missing_required_lib
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_apply import ApplyResult
from ansible_collections.gpufleet.nvidia.plugins.module_utils.k8s_client import (
    HAS_KUBERNETES,
    KUBERNETES_IMPORT_ERROR,
    ConnectionOptions,
    Kube,
    KubeError,
)

# Options of the namespaced workload each module deploys (merged into its argument_spec).
WORKLOAD_ARGS: dict[str, dict[str, Any]] = {
    "namespace": {"type": "str", "default": "gpufleet-system"},
    "create_namespace": {"type": "bool", "default": True},
    "image_pull_policy": {
        "type": "str",
        "default": "IfNotPresent",
        "choices": ["Always", "IfNotPresent", "Never"],
    },
    "host_network": {"type": "bool", "default": False},
    "node_names": {"type": "list", "elements": "str", "default": []},
}


def required_image(params: Mapping[str, Any], what: str, error: type[Exception]) -> str:
    """``image``, which has no default (no registry holds a tag of gpufleet's): ``error`` naming the option
    and where the reference comes from when it is empty."""
    image = str(params.get("image") or "")
    if not image and params.get("state", "present") == "present":  # removing names no image
        raise error(
            f"image is required to deploy the {what}: the digest reference role gpufleet_images gives "
            "(playbooks/images.yml, gpufleet_images_dir), or an image of your own in a registry the nodes "
            "pull from (docs/install.md)"
        )
    return image


def node_names_affinity(names: list[str]) -> dict[str, Any]:
    """The pods' affinity that keeps them on the nodes named (``node_names``; the nodes an image was imported
    on when there is no registry): a required node affinity on the Node's ``metadata.name`` field, which is
    the node's name itself (a label such as kubernetes.io/hostname can differ from it). The API server allows
    one value per ``matchFields`` requirement, so each node is a term of its own (terms are ORed)."""
    terms = [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [name]}]}
        for name in sorted(set(map(str, names)))
    ]
    return {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}


T = TypeVar("T")


def config_text(doc: Mapping[str, Any]) -> str:
    """The YAML file a module deploys for a service's settings ``doc`` (a ConfigMap's data): keys sorted,
    so the same settings give the same text, and the pods' config hash changes only with them."""
    import yaml

    return str(yaml.safe_dump(dict(doc), sort_keys=True))


def checked_config(
    doc: Mapping[str, Any],
    load: Callable[[str], T],
    refused: type[Exception],
    error: type[Exception],
    invalid: str,
) -> T:
    """What the service's own loader (linked into module_utils, docs/architecture.md) makes of the file
    ``config_text(doc)``, given the text: no file is written. When the loader refuses it (raising
    ``refused``, its error class), ``error`` with ``invalid`` ("settings are invalid") and the loader's
    message, which names each setting."""
    try:
        return load(config_text(doc))
    except refused as exc:
        raise error(f"{invalid}: {exc}") from None


def require_kubernetes(module: Any) -> None:
    """Fail the module, as Ansible's own modules do, when the kubernetes library cannot be imported."""
    if not HAS_KUBERNETES:
        module.fail_json(msg=missing_required_lib("kubernetes"), exception=KUBERNETES_IMPORT_ERROR)


def reconcile_or_fail(
    module: Any,
    reconcile: Callable[[Kube, Mapping[str, Any], bool], ApplyResult],
    result: dict[str, Any],
    errors: tuple[type[Exception], ...] = (),
) -> tuple[Kube, ApplyResult]:
    """Connect with the module's connection options and run ``reconcile`` (apply or delete the objects).

    ``result`` gets ``changed`` and ``objects``. A :class:`KubeError` or one of ``errors`` fails the module
    with its message and the objects handled before the failure.
    """
    params = module.params
    try:
        kube = Kube(ConnectionOptions.from_params(params))
        applied = reconcile(kube, params, module.check_mode)
    except (KubeError, *errors) as exc:
        partial = getattr(exc, "partial", None)
        if partial is not None:
            result["changed"], result["objects"] = partial.changed, partial.objects()
        module.fail_json(msg=str(exc), **result)
        raise  # not reached: fail_json exits
    result["changed"], result["objects"] = applied.changed, applied.objects()
    return kube, applied
