"""Fixtures for the ESXi passthrough tests. The lab itself (stand-in vSphere, helpers) is in esxi_lab.py."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

# Importing esxi_lab also puts the collection (ansible_collections.gpufleet.nvidia) on sys.path.
from esxi_lab import make_lab


@pytest.fixture
def lab_factory():
    """Factory for :class:`esxi_lab.Lab` objects."""
    return make_lab
