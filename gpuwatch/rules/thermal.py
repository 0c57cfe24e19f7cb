"""Thermal rules: near the slowdown threshold, heading there, throttled for heat, hotter than peers.

Every threshold is relative to the GPU's own limits, never a fixed 85 °C: the headroom to the HW
slowdown threshold comes from the T.Limit margin where the GPU reports one (Hopper and newer print
only T.Limit thresholds, captures/linux-x86_64__nvidia-h200__590.48.01.txt: slowdown at T.Limit
−2 °C), and from the absolute threshold otherwise (RTX 2080 SUPER: slowdown 97 °C).
"""

from __future__ import annotations

import math
import statistics

from gpuwatch.model import FastSample, Observation, SlowSample
from gpuwatch.rules.base import Rule, RuleConfig, Window, needs

THERMAL_REASONS: tuple[str, ...] = ("hw_thermal_slowdown", "sw_thermal_slowdown")
# Cumulative counters that count thermal throttle time (gpuwatch_clocks_event_seconds_total{reason}).
THERMAL_COUNTERS: tuple[str, ...] = ("thermal", "hw_thermal_slowdown", "sw_thermal_slowdown")


def gpu_label(window: Window, uuid: str) -> str:
    """"GPU 3" (the NVML index), for summaries."""
    state = window.gpu(uuid)
    return f"GPU {state.identity.index}" if state is not None else uuid


def slowdown_headroom(fast: FastSample | None, slow: SlowSample | None) -> tuple[float | None, float | None]:
    """(degrees left before HW slowdown, the slowdown temperature in °C); (None, None) if unknown.

    Prefers the T.Limit margin (margin − slowdown T.Limit threshold) where the GPU has one, else
    the absolute slowdown threshold minus the current temperature.
    """
    if fast is None or slow is None or fast.temperature_celsius is None:
        return None, None
    temp = fast.temperature_celsius
    margin = fast.temperature_margin_celsius
    tlimit = slow.temperature_margin_threshold_celsius.get("slowdown")
    if margin is not None and tlimit is not None:
        headroom = margin - tlimit
        return headroom, temp + headroom
    slowdown = slow.temperature_threshold_celsius.get("slowdown")
    if slowdown is None:
        return None, None
    return slowdown - temp, slowdown


def counter_share(window: Window, uuid: str, reasons: tuple[str, ...], seconds: float) -> float | None:
    """Largest share of the last ``seconds`` that any of the ``reasons`` counters counted.

    From the cumulative clocks_event_seconds counters (NVML violation / throttle time), so nothing
    that happened between two polls is missed. None when no counter has two readings.
    """
    series = window.series(uuid, seconds)
    best: float | None = None
    for reason in reasons:
        points = [(t, s.clocks_event_seconds[reason]) for t, s in series if reason in s.clocks_event_seconds]
        if len(points) < 2:
            continue
        (t0, v0), (t1, v1) = points[0], points[-1]
        if t1 <= t0 or v1 < v0:  # a counter reset (driver reload): nothing to say this window
            continue
        share = min(1.0, (v1 - v0) / (t1 - t0))
        best = share if best is None else max(best, share)
    return best


def sample_share(window: Window, uuid: str, reasons: tuple[str, ...], seconds: float,
                 unless: tuple[str, ...] = ()) -> float | None:
    """Share of the fast samples of the last ``seconds`` with any of ``reasons`` active (and none
    of ``unless``); None without samples."""
    series = window.series(uuid, seconds)
    if not series:
        return None
    hits = 0
    for _, sample in series:
        active = sample.clocks_event_active
        if any(active.get(r, False) for r in reasons) and not any(active.get(r, False) for r in unless):
            hits += 1
    return hits / len(series)


# ------------------------------------------------------------------------------------ overheating


def _overheating(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    slow = window.slow(uuid)
    if fast is None or slow is None:
        return None
    label = gpu_label(window, uuid)
    headroom, slowdown = slowdown_headroom(fast, slow)
    memory_max = slow.temperature_threshold_celsius.get("memory_max")
    memory = fast.memory_temperature_celsius
    memory_headroom = None if memory_max is None or memory is None else memory_max - memory
    if headroom is None and memory_headroom is None:
        return None
    gpu_hot = headroom is not None and headroom <= config["margin_celsius"]
    memory_hot = memory_headroom is not None and memory_headroom <= config["memory_margin_celsius"]
    if memory_hot and not gpu_hot:
        return Observation(True, memory_headroom, config["memory_margin_celsius"],
                           f"{label} memory at {memory:.0f} °C, {memory_headroom:.0f} °C below its "
                           f"{memory_max:.0f} °C maximum")
    if headroom is None:
        return Observation(False, memory_headroom, config["memory_margin_celsius"],
                           f"{label} memory at {memory:.0f} °C, {memory_headroom:.0f} °C below its maximum")
    return Observation(gpu_hot, headroom, config["margin_celsius"],
                       f"{label} at {fast.temperature_celsius:.0f} °C, {headroom:.0f} °C below its "
                       f"{slowdown:.0f} °C slowdown threshold")


# ------------------------------------------------------------------------------------ runaway


def _block_means(points: list[tuple[float, float]], start: float, width: float) -> list[float] | None:
    blocks: list[list[float]] = [[], [], []]
    for t, value in points:
        k = min(2, int((t - start) // width))
        if k >= 0:
            blocks[k].append(value)
    if any(len(b) < 2 for b in blocks):
        return None
    return [sum(b) / len(b) for b in blocks]


def project_seconds_to(target: float, now_value: float, means: list[float], spacing: float) -> float:
    """Seconds until a rising temperature reaches ``target`` (math.inf: it will not).

    ``means`` are the averages of three consecutive blocks ``spacing`` seconds apart. A rise that
    slows down (second step smaller than the first) is taken for a first-order approach to a
    steady state, which Aitken's Δ² extrapolation estimates: if that lies below ``target`` the GPU
    is just warming up to its new plateau. A rise that does not slow down is extrapolated linearly.
    """
    a, b, c = means
    d1, d2 = b - a, c - b
    if d2 <= 0:
        return math.inf
    if now_value >= target:
        return 0.0
    if 0 < d2 < d1:
        ratio = d2 / d1
        plateau = c + d2 * d2 / (d1 - d2)
        if plateau <= target:
            return math.inf
        tau = -spacing / math.log(ratio)
        return tau * math.log((plateau - now_value) / (plateau - target))
    return (target - now_value) / (d2 / spacing)


def _thermal_runaway(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    headroom, slowdown = slowdown_headroom(fast, window.slow(uuid))
    if fast is None or headroom is None or slowdown is None:
        return None
    span = config["window_seconds"]
    points = [(t, s.temperature_celsius) for t, s in window.series(uuid, span) if s.temperature_celsius is not None]
    means = _block_means(points, window.now - span, span / 3) if points else None
    if means is None:
        return None  # not enough history yet
    spacing = span / 3
    rate = (means[2] - means[1]) / spacing * 60.0  # °C per minute, over the last two blocks
    temp = fast.temperature_celsius
    label = gpu_label(window, uuid)
    seconds = math.inf
    if rate >= config["min_rate_celsius_per_minute"]:
        seconds = project_seconds_to(slowdown, temp, means, spacing)
    active = headroom <= config["watch_margin_celsius"] and seconds <= config["horizon_seconds"]
    if math.isinf(seconds):
        text = (f"{label} at {temp:.0f} °C ({rate:+.1f} °C/min), not heading past its {slowdown:.0f} °C "
                "slowdown threshold")
        value = None
    else:
        text = (f"{label} at {temp:.0f} °C rising {rate:.1f} °C/min: projected to reach its {slowdown:.0f} °C "
                f"slowdown threshold in {seconds / 60:.1f} min")
        value = seconds
    return Observation(active, value, config["horizon_seconds"], text)


# ------------------------------------------------------------------------------------ throttling


def _thermal_throttling(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None:
        return None
    active_now = [r for r in THERMAL_REASONS if fast.clocks_event_active.get(r, False)]
    span = config["window_seconds"]
    share = counter_share(window, uuid, THERMAL_COUNTERS, span)
    if share is None:  # no counters on this GPU: the share of polls with a thermal reason set
        share = sample_share(window, uuid, THERMAL_REASONS, span)
    label = gpu_label(window, uuid)
    share_text = "" if share is None else f"; clocks held down for heat {share * 100:.0f}% of the last {span:.0f} s"
    if active_now:
        return Observation(True, share if share is not None else 1.0, config["min_share"],
                           f"{label} thermal slowdown active ({', '.join(active_now)}){share_text}")
    active = share is not None and share >= config["min_share"]
    return Observation(active, share, config["min_share"],
                       f"{label} no thermal slowdown now{share_text}")


# ------------------------------------------------------------------------------------ outlier


def _thermal_outlier(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    state = window.gpu(uuid)
    if fast is None or state is None or fast.power_watts is None or fast.temperature_celsius is None:
        return None
    power, temp = fast.power_watts, fast.temperature_celsius
    tolerance = max(config["power_tolerance_ratio"] * power, config["power_tolerance_watts"])
    temps = []
    for other, sample in window.peers(uuid):
        peer = window.gpu(other)
        if peer is None or peer.identity.name != state.identity.name:
            continue  # another model has other thermals
        if sample.power_watts is None or sample.temperature_celsius is None:
            continue
        if abs(sample.power_watts - power) <= tolerance:
            temps.append(sample.temperature_celsius)
    if len(temps) < config["min_peers"]:
        return None  # nothing comparable to say
    median = statistics.median(temps)
    delta = temp - median
    return Observation(
        delta >= config["delta_celsius"], delta, config["delta_celsius"],
        f"{gpu_label(window, uuid)} at {temp:.0f} °C, {delta:+.0f} °C from the median of {len(temps)} peers "
        f"drawing about the same power ({power:.0f} W)",
    )


RULES: tuple[Rule, ...] = (
    Rule(
        id="overheating",
        scope="gpu",
        severity="critical",
        hold_seconds=20.0,
        clear_seconds=60.0,
        condition="The GPU is within a few °C of its own HW slowdown threshold (T.Limit margin where "
                  "reported), or the memory within a few °C of its maximum operating temperature.",
        evaluate=_overheating,
        params={"margin_celsius": 5.0, "memory_margin_celsius": 5.0},
    ),
    Rule(
        id="thermal_runaway",
        scope="gpu",
        severity="warning",
        hold_seconds=20.0,
        clear_seconds=60.0,
        condition="The temperature, already within the watch margin of slowdown, rises fast enough to "
                  "reach the slowdown threshold within the horizon (and is not levelling off below it).",
        evaluate=_thermal_runaway,
        params={"window_seconds": 60.0, "horizon_seconds": 180.0, "watch_margin_celsius": 15.0,
                "min_rate_celsius_per_minute": 1.0},
    ),
    Rule(
        id="thermal_throttling",
        scope="gpu",
        severity="warning",
        hold_seconds=20.0,
        clear_seconds=60.0,
        condition="HW or SW thermal slowdown is active, or the thermal throttle-time counters grew by "
                  "at least the given share of the window.",
        evaluate=_thermal_throttling,
        params={"window_seconds": 60.0, "min_share": 0.10},
        applies=needs("clocks_event_reasons"),
    ),
    Rule(
        id="thermal_outlier",
        scope="gpu",
        severity="warning",
        hold_seconds=300.0,
        clear_seconds=120.0,
        condition="The GPU runs clearly hotter than the median of at least two peers of the same model "
                  "drawing about the same power (a cooling failure where NVML sees no fan).",
        evaluate=_thermal_outlier,
        params={"delta_celsius": 15.0, "power_tolerance_ratio": 0.15, "power_tolerance_watts": 25.0,
                "min_peers": 2.0},
        applies=needs("power"),
    ),
)
