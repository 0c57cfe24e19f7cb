"""gpuwatch: per-node NVIDIA GPU monitor (NVML poller, anomaly rules, Prometheus exporter)."""

from gpuwatch.deferred import deferred as _deferred

__version__ = "0.1.0"

# pathlib imports urllib.parse (for Path.as_uri), which imports ipaddress for URLs with a bracketed host:
# 0.3 MB of resident memory in a daemon that parses no such URL (a configured [IPv6]:port is checked by
# gpuwatch.config, which imports ipaddress then). It is imported on first use (gpuwatch.deferred).
with _deferred("ipaddress"):
    import urllib.parse  # noqa: F401
