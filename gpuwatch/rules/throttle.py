"""Power and clock rules: power brake, unexplained HW slowdown, running at the power cap, a worn power-smoothing
circuit.

The clock-event reason bits are sampled once a poll, and HW slowdown "may also flash briefly
during P-state/clock changes" (nvml.md §5), so these rules look at the share of a window rather
than at one sample; where the GPU has the cumulative throttle-time counters they are used too,
since they miss nothing between two polls.
"""

from __future__ import annotations

from gpuwatch.model import FastSample, Observation
from gpuwatch.rules.base import GpuRule, RuleConfig, Window, needs
from gpuwatch.rules.common import counter_share, counters, gpu_label, reasons_active, sample_share

_POWER_BRAKE = ("hw_power_brake_slowdown",)


def _power_brake(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None:
        return None
    span = config.params["window_seconds"]
    share = counter_share(window, uuid, _POWER_BRAKE, span)
    if share is None:
        share = sample_share(window, uuid, "power_brake", span)
    now = fast.clocks.clocks_event_active.get("hw_power_brake_slowdown", False)
    active = now or (share is not None and share >= config.params["min_share"])

    def summary() -> str:
        share_text = "" if share is None else f", {share * 100:.0f}% of the last {span:.0f} s"
        state = "active" if now else "not active now"
        return f"{gpu_label(window, uuid)} HW power brake {state}{share_text}{_clock_text(fast)}"

    return Observation(active, share if share is not None else float(now), config.params["min_share"], summary)


def _clock_text(fast: FastSample) -> str:
    clock = fast.clocks.clock_hertz.get("graphics")
    return "" if clock is None else f"; graphics clock {clock / 1e6:.0f} MHz"


def _hw_slowdown(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None:
        return None
    span = config.params["window_seconds"]
    share = sample_share(window, uuid, "hw_slowdown", span)
    if share is None:
        return None
    return Observation(share >= config.params["min_share"], share, config.params["min_share"],
                       lambda: f"{gpu_label(window, uuid)} HW slowdown (neither thermal nor power brake) in "
                               f"{share * 100:.0f}% of the polls of the last {span:.0f} s{_clock_text(fast)}")


def _power_capped(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None:
        return None
    span = config.params["window_seconds"]
    share = sample_share(window, uuid, "sw_power_cap", span)
    if share is None:
        return None

    def summary() -> str:
        slow = window.slow(uuid)
        limit = None if slow is None else slow.power.power_limit_watts.get("enforced")
        power = fast.power.power_watts
        draw = "" if power is None else f" at {power:.0f} W"
        cap = "" if limit is None else f" of its {limit:.0f} W limit"
        return (f"{gpu_label(window, uuid)} power-capped{draw}{cap} in {share * 100:.0f}% of the polls "
                f"of the last {span:.0f} s")

    return Observation(share >= config.params["min_share"], share, config.params["min_share"], summary)


def _power_smoothing_worn(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    if slow is None:
        return None
    left = slow.power.power_smoothing_lifetime_ratio
    if left is None:
        return None
    limit = config.params["min_lifetime_ratio"]
    return Observation(left < limit, left, limit,
                       lambda: f"{gpu_label(window, uuid)} power-smoothing circuitry at {left * 100:.0f}% of its "
                               f"lifetime (warning below {limit * 100:.0f}%)")


RULES: tuple[GpuRule, ...] = (
    GpuRule(
        id="power_brake",
        severity="warning",
        hold_seconds=10.0,
        clear_seconds=60.0,
        condition="The external HW power brake (PSU or BMC assertion) holds the clocks down now, or "
                  "held them down for at least the given share of the window.",
        evaluate=_power_brake,
        params={"window_seconds": 30.0, "min_share": 0.10},
        applies=needs("clocks_event_reasons"),
        lookback={"window_seconds": "fast"},
        predicates={**counters(*_POWER_BRAKE), "power_brake": reasons_active(_POWER_BRAKE)},
    ),
    GpuRule(
        id="hw_slowdown",
        severity="warning",
        hold_seconds=30.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="HW slowdown without HW thermal slowdown or power brake (fast-trigger over-power or "
                  "unknown) in at least half of the polls of the window.",
        evaluate=_hw_slowdown,
        params={"window_seconds": 30.0, "min_share": 0.5},
        applies=needs("clocks_event_reasons"),
        lookback={"window_seconds": "fast"},
        predicates={"hw_slowdown": reasons_active(("hw_slowdown",),
                                                  unless=("hw_thermal_slowdown", "hw_power_brake_slowdown"))},
    ),
    GpuRule(
        id="power_capped",
        severity="info",
        hold_seconds=60.0,
        clear_seconds=120.0,
        every_seconds=10.0,
        condition="SW power capping holds the clocks down in at least half of the polls of the window "
                  "(normal at full load).",
        evaluate=_power_capped,
        params={"window_seconds": 60.0, "min_share": 0.5},
        applies=needs("clocks_event_reasons"),
        lookback={"window_seconds": "fast"},
        predicates={"sw_power_cap": reasons_active(("sw_power_cap",))},
    ),
    GpuRule(
        id="power_smoothing_worn",
        severity="warning",
        hold_seconds=0.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="The power-smoothing circuitry of a Blackwell board reports less than min_lifetime_ratio of its "
                  "lifetime left (the driver's XID 164 'low lifetime' comes near the end, XID 165 when it is "
                  "exhausted and power smoothing stops).",
        evaluate=_power_smoothing_worn,
        params={"min_lifetime_ratio": 0.10},
        applies=needs("power_smoothing"),
    ),
)
