"""Fan rules: a fan that does not turn, does not follow its target, or is at its limit.

Only evaluated on GPUs with their own fans (``needs("fan")``): passively cooled data-center GPUs
(H100/H200 SXM, T4, ...) have none that NVML can see, and their cooling failures show up in the
thermal rules instead (``thermal_outlier``). NVML's fan speed is the *intended* speed on many
boards (nvml.md §3: "a blocked fan still reports its target"), so RPM, where the GPU has it, is
the reading that says whether a fan turns.
"""

from __future__ import annotations

import functools

from gpuwatch.model import FanReading, FastSample, Observation, slowdown_headroom
from gpuwatch.rules.base import GpuRule, RuleConfig, Window, needs
from gpuwatch.rules.common import gpu_label, median


def _pct(ratio: float | None) -> str:
    return "?" if ratio is None else f"{ratio * 100:.0f}%"


def _stopped(fan: FanReading, config: RuleConfig) -> bool | None:
    """RPM where measured (the physical truth), else the reported speed; None: no reading."""
    if fan.speed_rpm is not None:
        return fan.speed_rpm <= config.params["stalled_rpm"]
    if fan.speed_ratio is not None:
        return fan.speed_ratio <= config.params["stalled_ratio"]
    return None


def _fan_stalled(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None or not fast.fans:
        return None
    headroom, _ = slowdown_headroom(fast, window.slow(uuid))
    warm = headroom is not None and headroom <= config.params["warm_margin_celsius"]
    quiet: Observation | None = None
    for fan in fast.fans:
        stopped = _stopped(fan, config)
        if stopped is None:
            continue
        commanded = fan.target_speed_ratio is not None and fan.target_speed_ratio >= config.params["min_target_ratio"]
        value = fan.speed_rpm if fan.speed_rpm is not None else fan.speed_ratio
        threshold = config.params["stalled_rpm"] if fan.speed_rpm is not None else config.params["stalled_ratio"]
        if stopped and (commanded or warm):
            rpm = "" if fan.speed_rpm is None else f" ({fan.speed_rpm:.0f} RPM)"
            if commanded:
                why = f"while the driver asks for {_pct(fan.target_speed_ratio)}"
            else:
                why = f"while the GPU is at {fast.thermal.temperature_celsius:.0f} °C, {headroom:.0f} °C below slowdown"
            return Observation(True, value, threshold,
                               f"{gpu_label(window, uuid)} fan {fan.fan} at {_pct(fan.speed_ratio)}{rpm} {why}")
        if quiet is None:
            quiet = Observation(False, value, threshold, functools.partial(_fan_text, window, uuid, fan))
    return quiet


def _fan_text(window: Window, uuid: str, fan: FanReading) -> str:
    return f"{gpu_label(window, uuid)} fan {fan.fan} at {_pct(fan.speed_ratio)}"


def _tracking_text(window: Window, uuid: str, fan: FanReading, median: float, seconds: float) -> str:
    return (f"{_fan_text(window, uuid, fan)} while its target is {_pct(fan.target_speed_ratio)} (median gap "
            f"{median * 100:+.0f} points over {seconds:.0f} s)")


def _deviation(sample: FastSample, fan_index: int) -> float | None:
    for fan in sample.fans:
        if fan.fan == fan_index and fan.speed_ratio is not None and fan.target_speed_ratio is not None:
            return fan.speed_ratio - fan.target_speed_ratio
    return None


def _fan_not_tracking(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None or not fast.fans:
        return None
    history = window.samples(uuid, config.params["window_seconds"])
    result: Observation | None = None
    for fan in fast.fans:
        if fan.speed_ratio is None or fan.target_speed_ratio is None:
            continue
        deviations = [d for d in (_deviation(s, fan.fan) for s in history) if d is not None]
        if not deviations:
            continue
        # The median over the window: a single odd reading neither starts nor ends an episode.
        middle = median(deviations)
        stopped = _stopped(fan, config)  # a stopped fan is fan_stalled's business
        active = abs(middle) > config.params["deviation_ratio"] and not stopped
        obs = Observation(active, abs(middle), config.params["deviation_ratio"],
                          functools.partial(_tracking_text, window, uuid, fan, middle, config.params["window_seconds"]))
        if active:
            return obs
        if result is None or (obs.value or 0) > (result.value or 0):
            result = obs
    return result


def _fan_at_max(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None or not fast.fans:
        return None
    headroom, slowdown = slowdown_headroom(fast, window.slow(uuid))
    if headroom is None:
        return None
    wanted = [f.target_speed_ratio if f.target_speed_ratio is not None else f.speed_ratio for f in fast.fans]
    demands = [d for d in wanted if d is not None]
    if not demands:
        return None
    demand = min(demands)  # every fan at its maximum
    active = demand >= config.params["max_ratio"] and headroom <= config.params["margin_celsius"]
    return Observation(
        active, headroom, config.params["margin_celsius"],
        lambda: f"{gpu_label(window, uuid)} fans at {_pct(demand)} and the GPU at "
                f"{fast.thermal.temperature_celsius:.0f} °C, {headroom:.0f} °C below its {slowdown:.0f} °C "
                "slowdown threshold",
    )


RULES: tuple[GpuRule, ...] = (
    GpuRule(
        id="fan_stalled",
        severity="critical",
        hold_seconds=10.0,
        clear_seconds=30.0,
        condition="A fan is stopped (RPM, or speed where RPM is not reported, near zero) while the driver "
                  "asks it to spin or the GPU is warm.",
        evaluate=_fan_stalled,
        params={"stalled_rpm": 200.0, "stalled_ratio": 0.05, "min_target_ratio": 0.25,
                "warm_margin_celsius": 30.0},
        applies=needs("fan"),
    ),
    GpuRule(
        id="fan_not_tracking",
        severity="warning",
        hold_seconds=90.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="A turning fan's speed stays far from the speed the driver is driving it toward "
                  "(median gap over the window above the threshold).",
        evaluate=_fan_not_tracking,
        params={"deviation_ratio": 0.20, "window_seconds": 30.0, "stalled_rpm": 200.0, "stalled_ratio": 0.05},
        applies=needs("fan", "fan_target"),
        lookback={"window_seconds": "fast"},
    ),
    GpuRule(
        id="fan_at_max",
        severity="warning",
        hold_seconds=60.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="Every fan is driven at its maximum and the GPU is still within a few degrees of its "
                  "slowdown temperature: the cooling is at its limit.",
        evaluate=_fan_at_max,
        params={"max_ratio": 0.95, "margin_celsius": 10.0},
        applies=needs("fan"),
    ),
)
