"""The GPU simulator: fixtures, the NVML library built from C, failure injection."""
