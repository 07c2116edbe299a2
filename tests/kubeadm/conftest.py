"""The kubeadm cluster tests (marker ``kubeadm``) are opt-in: CI's budget cannot afford their podman hosts.

CI builds 1.37 and runs the test cluster on it; these tests run when asked for, with ``-m kubeadm`` or
``GPUFLEET_KUBEADM=1``; otherwise they are deselected (pytest reports them as such, never as passed or
skipped). The pure tests of this folder always run. The deselection is tests/conftest.py's (``OPT_IN``).
"""

from __future__ import annotations

import pytest

from gpufleet_harness.cluster.k8s_build import ensure_k8s
from gpufleet_harness.cluster.k8s_cache import BuildError, K8sArtifacts

VERSION = "1.37.2"


@pytest.fixture(scope="module")
def artifacts() -> K8sArtifacts:
    """Kubernetes 1.37 from its Go modules (built into the shared cache on first use: ~half an hour)."""
    try:
        return ensure_k8s(VERSION)
    except BuildError as err:
        pytest.fail(f"Kubernetes {VERSION} is not built and cannot be: {err}")
