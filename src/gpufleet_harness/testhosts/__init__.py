"""Test hosts for the roles: podman configuration, debootstrap systemd images, a signed local APT repo.

Everything here needs root, podman (with runc), debootstrap, dpkg-deb and gpg. State lives under one
directory (``GPUFLEET_HOSTLAB``, default ``./.lab/hosts``) so nothing is written outside the workspace.
"""
