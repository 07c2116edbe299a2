"""Running gpufleet's playbooks through ansible-runner: ``gpufleet provision``, ``gpufleet validate`` and
``gpufleet report`` (``cli``), the run itself and its outcome (``run``), the live display and the per-host
summary (``progress``)."""
