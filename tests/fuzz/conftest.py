"""The fuzz tests reuse the device plugin's test helpers and import the Ansible collection's module_utils."""

from __future__ import annotations

import sys
from pathlib import Path

_TESTS = Path(__file__).resolve().parents[1]
# dp_helpers (fake kubelet, plugin process, sim roots) lives with the device plugin's tests; the collection
# is importable as ansible_collections.gpufleet.nvidia through the link `make bootstrap` makes in .cache.
for _path in (_TESTS / "deviceplugin", _TESTS.parent / ".cache" / "collections"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))
