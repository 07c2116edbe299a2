"""gpufleet.imageref: the names containerd stores images under (the runtime suite's ``ctr run``, the lab)."""

from __future__ import annotations

import pytest

from gpufleet.imageref import qualified


@pytest.mark.parametrize(("image", "stored"), [
    ("gpufleet-lab/pause:1", "docker.io/gpufleet-lab/pause:1"),
    ("busybox:1", "docker.io/library/busybox:1"),
    ("nvcr.io/nvidia/cuda:12.2.2-base-ubuntu22.04", "nvcr.io/nvidia/cuda:12.2.2-base-ubuntu22.04"),
    ("localhost/x:1", "localhost/x:1"),
    ("registry:5000/x:1", "registry:5000/x:1"),
])  # fmt: skip
def test_image_references_qualified_as_cri_stores_them(image: str, stored: str) -> None:
    assert qualified(image) == stored
