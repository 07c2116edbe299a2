"""GPU-memory sharing: the device plugin's half of the extender hand-off (docs/handoff.md)."""
