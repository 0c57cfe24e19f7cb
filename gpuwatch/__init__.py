"""gpuwatch: per-node NVIDIA GPU monitor (NVML poller, anomaly rules, Prometheus exporter)."""

__version__ = "0.1.0"
