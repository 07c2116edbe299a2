"""What a release of gpufleet is made of, built from a checkout: the service images as OCI archives, the
Ansible collection artifact and the wheel (``gpufleet release``; docs/install.md)."""
