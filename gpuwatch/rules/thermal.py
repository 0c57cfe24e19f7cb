"""Thermal rules: near the slowdown threshold, heading there, throttled for heat, hotter than peers.

Every threshold is relative to the GPU's own limits, never a fixed 85 °C: the headroom to the HW
slowdown threshold comes from the T.Limit margin where the GPU reports one (Hopper and newer print
only T.Limit thresholds, captures/linux-x86_64__nvidia-h200__590.48.01.txt: slowdown at T.Limit
−2 °C), and from the absolute threshold otherwise (RTX 2080 SUPER: slowdown 97 °C).
"""

from __future__ import annotations

import bisect
import math

from gpuwatch.model import FastSample, Observation, slowdown_headroom
from gpuwatch.rules.base import GpuRule, RuleConfig, Window, needs
from gpuwatch.rules.common import counter_share, counters, gpu_label, reasons_active, sample_share

THERMAL_REASONS: tuple[str, ...] = ("hw_thermal_slowdown", "sw_thermal_slowdown")
# Cumulative counters that count thermal throttle time (gpuwatch_clocks_event_seconds_total{reason}).
THERMAL_COUNTERS: tuple[str, ...] = ("thermal", "hw_thermal_slowdown", "sw_thermal_slowdown")


# ------------------------------------------------------------------------------------ overheating


def _overheating(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    slow = window.slow(uuid)
    if fast is None or slow is None:
        return None
    headroom, slowdown = slowdown_headroom(fast, slow)
    memory_max = slow.thermal.temperature_threshold_celsius.get("memory_max")
    memory = fast.thermal.memory_temperature_celsius
    memory_headroom = None if memory_max is None or memory is None else memory_max - memory
    if headroom is None and memory_headroom is None:
        return None
    gpu_hot = headroom is not None and headroom <= config.params["margin_celsius"]
    memory_hot = memory_headroom is not None and memory_headroom <= config.params["memory_margin_celsius"]
    if memory_hot and not gpu_hot:
        return Observation(True, memory_headroom, config.params["memory_margin_celsius"],
                           f"{gpu_label(window, uuid)} memory at {memory:.0f} °C, {memory_headroom:.0f} °C below its "
                           f"{memory_max:.0f} °C maximum")
    if headroom is None:
        return Observation(False, memory_headroom, config.params["memory_margin_celsius"],
                           lambda: f"{gpu_label(window, uuid)} memory at {memory:.0f} °C, {memory_headroom:.0f} °C "
                                   "below its maximum")
    return Observation(gpu_hot, headroom, config.params["margin_celsius"],
                       lambda: f"{gpu_label(window, uuid)} at {fast.thermal.temperature_celsius:.0f} °C, "
                               f"{headroom:.0f} °C below its {slowdown:.0f} °C slowdown threshold")


# ------------------------------------------------------------------------------------ runaway


def _temperature(sample: FastSample) -> float | None:
    return sample.thermal.temperature_celsius


def _block_means(window: Window, uuid: str, span: float) -> list[float] | None:
    """The mean temperature of each third of the last ``span`` seconds, oldest first; None unless
    each third has at least two readings. The thirds are found by bisection on the history's
    times and summed from its temperature column: no walk over the samples."""
    history = window.history(uuid)
    start, width = window.now - span, span / 3
    lo, end = history.index(start), history.end
    if lo == end:
        return None

    # The first sample of the second and of the third block: bisect_left(times, n, ..., key=block) for
    # block(t) = min(2, int((t - start) // width)), found without a key (about 1 µs a GPU less): bisected on the
    # times about the block's start, then stepped to where that key says it begins (rounding: a sample, or none).
    times, bounds, b = history.times, [], lo
    for n in (1, 2):
        low = b
        b = bisect.bisect_left(times, start + n * width, low, end)
        while b > low and (times[b - 1] - start) // width >= n:
            b -= 1
        while b < end and (times[b] - start) // width < n:
            b += 1
        bounds.append(b)
    b1, b2 = bounds
    temperatures = window.column(uuid, "temperature")
    means = []
    for a, b in ((lo, b1), (b1, b2), (b2, end)):
        values = temperatures[a:b]
        if None in values:
            values = [v for v in values if v is not None]
        if len(values) < 2:
            return None
        means.append(sum(values) / len(values))
    return means


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
    span = config.params["window_seconds"]
    means = _block_means(window, uuid, span)
    if means is None:
        return None  # not enough history yet
    spacing = span / 3
    rate = (means[2] - means[1]) / spacing * 60.0  # °C per minute, over the last two blocks
    temp = fast.thermal.temperature_celsius
    if temp is None:
        return None
    seconds = math.inf
    if rate >= config.params["min_rate_celsius_per_minute"]:
        seconds = project_seconds_to(slowdown, temp, means, spacing)
    active = headroom <= config.params["watch_margin_celsius"] and seconds <= config.params["horizon_seconds"]

    def summary() -> str:
        if math.isinf(seconds):
            return (f"{gpu_label(window, uuid)} at {temp:.0f} °C ({rate:+.1f} °C/min), not heading past its "
                    f"{slowdown:.0f} °C slowdown threshold")
        return (f"{gpu_label(window, uuid)} at {temp:.0f} °C rising {rate:.1f} °C/min: projected to reach its "
                f"{slowdown:.0f} °C slowdown threshold in {seconds / 60:.1f} min")

    return Observation(active, None if math.isinf(seconds) else seconds, config.params["horizon_seconds"], summary)


# ------------------------------------------------------------------------------------ throttling


def _thermal_throttling(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None:
        return None
    active_now = [r for r in THERMAL_REASONS if fast.clocks.clocks_event_active.get(r, False)]
    span = config.params["window_seconds"]
    share = counter_share(window, uuid, THERMAL_COUNTERS, span)
    if share is None:  # no counters on this GPU: the share of polls with a thermal reason set
        share = sample_share(window, uuid, "thermal_slowdown", span)

    def summary() -> str:
        share_text = "" if share is None else f"; clocks held down for heat {share * 100:.0f}% of the last {span:.0f} s"
        if active_now:
            return f"{gpu_label(window, uuid)} thermal slowdown active ({', '.join(active_now)}){share_text}"
        return f"{gpu_label(window, uuid)} no thermal slowdown now{share_text}"

    min_share = config.params["min_share"]
    if active_now:
        return Observation(True, share if share is not None else 1.0, min_share, summary)
    return Observation(share is not None and share >= min_share, share, min_share, summary)


# ------------------------------------------------------------------------------------ outlier


def _peers_by_model(window: Window) -> dict[str, tuple[list[float], list[float]]]:
    """Model name -> (power, temperature) of its GPUs with a fresh sample that has both, as two
    lists in ascending order of power. Once per evaluation, shared by every GPU's outlier check."""
    rows: dict[str, list[tuple[float, float]]] = {}
    for uuid, sample in window.fresh():
        power, temp = sample.power.power_watts, sample.thermal.temperature_celsius
        state = window.gpu(uuid)
        if power is not None and temp is not None and state is not None:
            rows.setdefault(state.identity.name, []).append((power, temp))
    result = {}
    for name, pairs in rows.items():
        pairs.sort(key=lambda pair: pair[0])
        result[name] = ([p for p, _ in pairs], [t for _, t in pairs])
    return result


def _sorted_temperatures(window: Window, name: str, lo: int, hi: int) -> list[float]:
    """The temperatures of ``name``'s GPUs lo..hi-1 (in order of power), sorted; once per range and
    evaluation (GPUs drawing about the same power usually share one)."""
    return window.memo(("thermal_outlier", name, lo, hi),
                       lambda w: sorted(w.memo("thermal_outlier", _peers_by_model)[name][1][lo:hi]))


def _median_without(values: list[float], value: float) -> float:
    """statistics.median of the sorted ``values`` less one occurrence of ``value`` (which they hold)."""
    skip = bisect.bisect_left(values, value)
    n = len(values) - 1

    def at(i: int) -> float:
        return values[i] if i < skip else values[i + 1]

    if n % 2 == 1:
        return at(n // 2)
    return (at(n // 2 - 1) + at(n // 2)) / 2


def _thermal_outlier(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    state = window.gpu(uuid)
    if fast is None or state is None or fast.power.power_watts is None or fast.thermal.temperature_celsius is None:
        return None
    power, temp = fast.power.power_watts, fast.thermal.temperature_celsius
    tolerance = max(config.params["power_tolerance_ratio"] * power, config.params["power_tolerance_watts"])
    # The peers of the same model (another model has other thermals) within the tolerance of this
    # GPU's power: a range of the model's GPUs sorted by power, this GPU included.
    powers, _ = window.memo("thermal_outlier", _peers_by_model)[state.identity.name]

    def gap(p: float) -> float:  # the difference that abs(p - power) <= tolerance compares
        return p - power

    lo = bisect.bisect_left(powers, -tolerance, key=gap)
    hi = bisect.bisect_right(powers, tolerance, lo, key=gap)
    peers = hi - lo - 1
    if peers < config.params["min_peers"] or peers < 1:
        return None  # nothing comparable to say
    median = _median_without(_sorted_temperatures(window, state.identity.name, lo, hi), temp)
    delta = temp - median
    return Observation(
        delta >= config.params["delta_celsius"], delta, config.params["delta_celsius"],
        lambda: f"{gpu_label(window, uuid)} at {temp:.0f} °C, {delta:+.0f} °C from the median of {peers} peers "
                f"drawing about the same power ({power:.0f} W)",
    )


RULES: tuple[GpuRule, ...] = (
    GpuRule(
        id="overheating",
        severity="critical",
        hold_seconds=20.0,
        clear_seconds=60.0,
        condition="The GPU is within a few °C of its own HW slowdown threshold (T.Limit margin where "
                  "reported), or the memory within a few °C of its maximum operating temperature.",
        evaluate=_overheating,
        params={"margin_celsius": 5.0, "memory_margin_celsius": 5.0},
    ),
    GpuRule(
        id="thermal_runaway",
        severity="warning",
        hold_seconds=20.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="The temperature, already within the watch margin of slowdown, rises fast enough to "
                  "reach the slowdown threshold within the horizon (and is not levelling off below it).",
        evaluate=_thermal_runaway,
        params={"window_seconds": 60.0, "horizon_seconds": 180.0, "watch_margin_celsius": 15.0,
                "min_rate_celsius_per_minute": 1.0},
        lookback={"window_seconds": "fast"},
        columns={"temperature": _temperature},
    ),
    GpuRule(
        id="thermal_throttling",
        severity="warning",
        hold_seconds=20.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="HW or SW thermal slowdown is active, or the thermal throttle-time counters grew by "
                  "at least the given share of the window.",
        evaluate=_thermal_throttling,
        params={"window_seconds": 60.0, "min_share": 0.10},
        applies=needs("clocks_event_reasons"),
        lookback={"window_seconds": "fast"},
        predicates={**counters(*THERMAL_COUNTERS), "thermal_slowdown": reasons_active(THERMAL_REASONS)},
    ),
    GpuRule(
        id="thermal_outlier",
        severity="warning",
        hold_seconds=300.0,
        clear_seconds=120.0,
        every_seconds=10.0,
        condition="The GPU runs clearly hotter than the median of at least two peers of the same model "
                  "drawing about the same power (a cooling failure where NVML sees no fan).",
        evaluate=_thermal_outlier,
        params={"delta_celsius": 15.0, "power_tolerance_ratio": 0.15, "power_tolerance_watts": 25.0,
                "min_peers": 2.0},
        applies=needs("power"),
    ),
)
