"""GPU discovery: the one place that talks to NVML (through pynvml) and to sysfs."""
