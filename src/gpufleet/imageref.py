"""Container image references as containerd stores them.

``ctr`` takes only fully qualified references, while pods, docker and CRI accept short ones
(``busybox:1``, ``nvidia/cuda:12``). The runtime suite's ``ctr run`` and the test lab's image import both
need the name CRI would look the image up by.
"""

from __future__ import annotations


def qualified(image: str) -> str:
    """The fully qualified name of ``image`` (CRI and docker normalize references the same way):
    ``docker.io`` and ``library/`` added where missing, references with a registry host kept as they are."""
    first, _, rest = image.partition("/")
    if not rest:
        return f"docker.io/library/{image}"
    if "." in first or ":" in first or first == "localhost":
        return image
    return f"docker.io/{image}"
