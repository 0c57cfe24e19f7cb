"""The daemon's current state as a JSON document (served at /api/v1/status, read by `gpuwatch check`).

Documented in docs/status-api.md. Built from a snapshot only: no backend call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gpuwatch.model import SEVERITIES, Anomaly, NodeSnapshot

API_VERSION = 1


def _anomaly(a: Anomaly) -> dict[str, Any]:
    return {
        "rule": a.rule, "severity": a.severity, "gpu": a.gpu, "uuid": a.uuid, "since": a.since_wall,
        "value": a.value, "threshold": a.threshold, "summary": a.summary,
    }


def fresh(snap: NodeSnapshot, now: float, fast_bound: float) -> bool:
    tier = snap.tiers["fast"]
    return tier.last_completed_monotonic is not None and now - tier.last_completed_monotonic <= fast_bound


def status_document(snap: NodeSnapshot, now: float, staleness: Callable[[str], float]) -> dict[str, Any]:
    fast_bound = staleness("fast")
    order = {s: i for i, s in enumerate(SEVERITIES)}
    firing = sorted((a for a in snap.anomalies if a.firing),
                    key=lambda a: (order.get(a.severity, 9), a.rule, int(a.gpu) if a.gpu else -1))
    is_fresh = fresh(snap, now, fast_bound)
    if not snap.backend_up or not is_fresh:
        status = "unknown"
    elif any(a.severity == "critical" for a in firing):
        status = "critical"
    elif any(a.severity == "warning" for a in firing):
        status = "warning"
    else:
        status = "ok"
    polls = {}
    for name, tier in snap.tiers.items():
        polls[name] = {
            "success": tier.success,
            "last_completed": tier.last_completed_wall,
            "age_seconds": None if tier.last_completed_monotonic is None else round(now - tier.last_completed_monotonic, 3),
            "duration_seconds": tier.duration_seconds,
            "staleness_bound_seconds": staleness(name),
        }
    by_gpu: dict[str, list[str]] = {}
    for a in firing:
        if a.uuid is not None:
            by_gpu.setdefault(a.uuid, []).append(a.rule)
    gpus = []
    for state in snap.gpus:
        sample = state.fast if state.up and state.fast_monotonic is not None and \
            now - state.fast_monotonic <= fast_bound else None
        gpus.append({
            "gpu": str(state.identity.index),
            "uuid": state.identity.uuid,
            "name": state.identity.name,
            "pci_bus_id": state.identity.pci_bus_id,
            "up": state.up,
            "temperature_celsius": None if sample is None else sample.temperature_celsius,
            "power_watts": None if sample is None else sample.power_watts,
            "utilization_ratio": None if sample is None else sample.utilization_ratio.get("gpu"),
            "anomalies": by_gpu.get(state.identity.uuid, []),
        })
    return {
        "api_version": API_VERSION,
        "status": status,
        "generated_at": snap.taken_wall,
        "backend": {"name": snap.backend, "up": snap.backend_up, "reason": snap.backend_reason},
        "driver": None if snap.driver is None else {
            "driver_version": snap.driver.driver_version, "nvml_version": snap.driver.nvml_version,
            "cuda_driver_version": snap.driver.cuda_driver_version},
        "fresh": is_fresh,
        "polls": polls,
        "gpus": gpus,
        "anomalies": [_anomaly(a) for a in firing],
    }
