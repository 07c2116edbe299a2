"""GPU telemetry in the device plugin's process: dcgm-exporter's series from NVML, attributed to pods
(docs/metrics.md). ``exporter.Telemetry`` runs it; ``fields`` names the series, ``pods`` finds the pods,
``collector`` keeps NVML's slowness off every request path."""
