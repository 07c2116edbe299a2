"""Validation of GPU hosts and Kubernetes GPU nodes: runs the testinfra suites in ``validation/`` against
an expectations file and reports JSON, JUnit XML and a per-host table (see docs/validation.md)."""
