"""The names of gpu-feature-discovery's labels that the plugin's configuration checks: GFD's domain, the
`labels.gfd` modes and GFD's spelling of a MIG profile. Standard library only: the collection links this
file (plugins/module_utils/deviceplugin), so the Kubernetes modules check a plugin configuration without
the package (docs/architecture.md). The labels themselves are computed in :mod:`.gfd`."""

from __future__ import annotations

DOMAIN = "nvidia.com"
MODES = ("auto", "on", "off")


def gfd_profile(profile: str) -> str:
    """A MIG profile as GFD names its resource and labels: `1g.18gb+me` → `1g.18gb.me` (a `+` is not
    allowed in a resource or label name)."""
    return profile.replace("+", ".")
