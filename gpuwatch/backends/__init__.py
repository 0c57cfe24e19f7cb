"""Backends: where GPU readings come from (NVML, a simulated node, a recorded trace)."""
