"""The daemon's current state as a JSON document (served at /api/v1/status, read by `gpuwatch check`).

Documented in docs/status-api.md. Built from a snapshot only: no backend call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuwatch.model import SEVERITIES, Anomaly, NodeSnapshot

API_VERSION = 1


def _anomaly(a: Anomaly) -> dict[str, Any]:
    return {
        "rule": a.rule, "severity": a.severity, "gpu": a.gpu, "uuid": a.uuid, "since": a.since_wall,
        "value": a.value, "threshold": a.threshold, "summary": a.summary,
    }


def status_document(snap: NodeSnapshot, now: float, staleness: Callable[[str], float]) -> dict[str, Any]:
    fast_bound = staleness("fast")
    order = {s: i for i, s in enumerate(SEVERITIES)}
    firing = sorted((a for a in snap.anomalies if a.firing),
                    key=lambda a: (order.get(a.severity, 9), a.rule, int(a.gpu) if a.gpu else -1))
    is_fresh, _ = snap.collecting(now, fast_bound)
    if not is_fresh:
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
            "age_seconds": (None if tier.last_completed_monotonic is None
                            else round(now - tier.last_completed_monotonic, 3)),
            "duration_seconds": tier.duration_seconds,
            "staleness_bound_seconds": staleness(name),
        }
    by_gpu: dict[str, list[str]] = {}
    for a in firing:
        if a.uuid is not None:
            by_gpu.setdefault(a.uuid, []).append(a.rule)
    gpus = []
    for state in snap.gpus:
        sample = state.fresh_fast(now, fast_bound)
        gpus.append({
            "gpu": str(state.identity.index),
            "uuid": state.identity.uuid,
            "name": state.identity.name,
            "pci_bus_id": state.identity.pci_bus_id,
            "up": state.up,
            "temperature_celsius": None if sample is None else sample.thermal.temperature_celsius,
            "power_watts": None if sample is None else sample.power.power_watts,
            "utilization_ratio": None if sample is None else sample.utilization.utilization_ratio.get("gpu"),
            "anomalies": by_gpu.get(state.identity.uuid, []),
        })
    rules: dict[str, dict[str, Any]] = {}
    for a in snap.anomalies:  # every evaluated (rule, GPU) and node rule, firing or not
        entry = rules.setdefault(a.rule, {"rule": a.rule, "severity": a.severity, "evaluated": 0, "firing": 0,
                                          "onsets": snap.rule_onsets.get(a.rule, 0),
                                          "errors": snap.rule_errors.get(a.rule, 0)})
        entry["evaluated"] += 1
        entry["firing"] += a.firing
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
        "rules": sorted(rules.values(), key=lambda r: r["rule"]),
    }


@dataclass(frozen=True)
class Verdict:
    """What a reader of the status document concludes: `gpuwatch check` (its exit code and lines) and
    the Slurm drain/resume logic both take it from here, and both from the daemon's own ``status``."""

    status: str  # ok | warning | critical | unknown
    exit_code: int  # gpuwatch check: 0 ok or warning, 1 critical, 2 unknown
    detail: str = ""  # unknown: why; critical: the critical anomalies in one line
    critical: tuple[Mapping[str, Any], ...] = ()  # the firing anomalies, as in the document
    warnings: tuple[Mapping[str, Any], ...] = ()

    @property
    def healthy(self) -> bool:
        """No critical anomaly and the state is known (warnings do not count)."""
        return self.status in ("ok", "warning")


def where(anomaly: Mapping[str, Any]) -> str:
    """"GPU 3 xid_critical" or "backend_down" for a node-level anomaly."""
    gpu = anomaly.get("gpu")
    return f"GPU {gpu} {anomaly.get('rule')}" if gpu is not None else str(anomaly.get("rule"))


_ANOMALY_TEXTS = ("severity", "rule", "summary")


def _not_a_status(document: Any) -> str:
    """Why ``document`` is not a status document a verdict can read ("" when it is): the parts the verdict and
    its readers (gpuwatch check, the drain logic) use, each of the type this module writes."""
    if not isinstance(document, Mapping):
        return f"a JSON {type(document).__name__}, not an object"
    for key, kind in (("backend", Mapping), ("polls", Mapping)):
        if document.get(key) is not None and not isinstance(document[key], kind):
            return f"{key} is not an object"
    if document.get("status") in ("ok", "warning", "critical"):
        if not isinstance(document.get("gpus"), list):
            return "no list of gpus"
        anomalies = document.get("anomalies")
        if anomalies is not None and not isinstance(anomalies, list):
            return "anomalies is not a list"
        for a in anomalies or ():
            if not isinstance(a, Mapping) or not all(isinstance(a.get(k), str) for k in _ANOMALY_TEXTS):
                return "an anomaly without severity, rule and summary"
    return ""


def verdict(document: Mapping[str, Any] | None) -> Verdict:
    """The verdict on a status document (None: the daemon could not be read): unknown (exit 2) when
    the daemon does not answer, its backend is down or its data is stale; critical (exit 1) when a
    critical anomaly fires; else ok or warning (exit 0). docs/status-api.md."""
    if document is None:
        return Verdict("unknown", 2, detail="the daemon's status could not be read")
    problem = _not_a_status(document)
    if problem:  # another program on the port, a proxy's page, a version that spells it otherwise
        return Verdict("unknown", 2, detail=f"the answer is not gpuwatch's status document: {problem}")
    status = document.get("status")
    if status not in ("ok", "warning", "critical"):
        backend = document.get("backend") or {}
        if not backend.get("up", False):
            return Verdict("unknown", 2, detail=f"backend {backend.get('name')} down: {backend.get('reason')}")
        age = ((document.get("polls") or {}).get("fast") or {}).get("age_seconds")
        return Verdict("unknown", 2, detail=f"data is stale (last fast poll {age} s ago)")
    anomalies = document.get("anomalies") or ()
    critical = tuple(a for a in anomalies if a.get("severity") == "critical")
    warnings = tuple(a for a in anomalies if a.get("severity") == "warning")
    if critical:
        return Verdict("critical", 1, "; ".join(where(a) for a in critical), critical, warnings)
    return Verdict("warning" if warnings else "ok", 0, "", critical, warnings)
