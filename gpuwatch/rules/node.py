"""Node rules: the backend is down, collection has stalled, GPUs are missing.

The engine also runs on a timer (``Engine.evaluate(snapshot, now, wall)``), so collection_stalled
fires while a poll hangs in NVML and no new snapshot arrives.
"""

from __future__ import annotations

from gpuwatch.model import Observation
from gpuwatch.rules.base import Rule, RuleConfig, Window


def _backend_down(window: Window, config: RuleConfig) -> Observation:
    latest = window.latest
    if latest.backend_up:
        return Observation(False, 1.0, 1.0, lambda: f"backend {latest.backend} up")
    return Observation(True, 0.0, 1.0, f"backend {latest.backend} down: {latest.backend_reason or 'unknown reason'}")


def _collection_stalled(window: Window, config: RuleConfig) -> Observation | None:
    tier = window.latest.tiers.get("fast")
    if tier is None:
        return None
    limit = config["staleness_factor"] * window.fast_staleness
    now, completed, since = window.now, tier.last_completed_monotonic, tier.in_flight_since
    if completed is not None:
        age = now - completed
    elif since is not None:
        age = now - since
    else:
        return None  # not started

    def summary() -> str:
        text = f"last fast poll completed {age:.0f} s ago" if completed is not None else "no fast poll completed yet"
        if since is not None:
            text += f"; one has been running for {now - since:.0f} s (NVML call hung?)"
        return text

    return Observation(age > limit, age, limit, summary)


def _gpu_missing(window: Window, config: RuleConfig) -> Observation | None:
    latest = window.latest
    expected = window.expected_gpus
    if not latest.backend_up or expected <= 0:
        return None  # backend_down covers a backend that sees nothing

    def summary() -> str:
        names = "".join(f"; GPU {s.identity.index} ({s.identity.uuid}) gone" for s in latest.gpus if not s.visible)
        return f"{latest.visible_gpus} GPUs visible, {expected} expected{names}"

    return Observation(latest.visible_gpus < expected, float(latest.visible_gpus), float(expected), summary)


RULES: tuple[Rule, ...] = (
    Rule(
        id="backend_down",
        scope="node",
        severity="critical",
        hold_seconds=10.0,
        clear_seconds=30.0,
        condition="The backend (NVML) cannot be used: library or driver missing, driver/library "
                  "mismatch, or no GPU visible at all.",
        evaluate=_backend_down,
    ),
    Rule(
        id="collection_stalled",
        scope="node",
        severity="critical",
        hold_seconds=20.0,
        clear_seconds=30.0,
        condition="No fast poll has completed for longer than staleness_factor × the fast staleness "
                  "bound (a poll hangs in NVML: wedged driver).",
        evaluate=_collection_stalled,
        params={"staleness_factor": 1.0},
    ),
    Rule(
        id="gpu_missing",
        scope="node",
        severity="critical",
        hold_seconds=10.0,
        clear_seconds=30.0,
        condition="The last discovery found fewer GPUs than expected (rules.expected_gpus, else the "
                  "most seen since start).",
        evaluate=_gpu_missing,
    ),
)
