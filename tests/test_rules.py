"""Each rule on synthetic windows: its condition, its edge cases, and where it does not apply.

Windows are built directly from GpuStates and FastSamples (gpuwatch.testing builders, H200 values
from the captures unless a test says otherwise); a few tests feed sequences of snapshots through
the Engine to pin down what hold and clear do with flashes and noise.
"""

from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import pytest

from gpuwatch.groups import GpuHost, HostSample
from gpuwatch.model import (
    FEATURES,
    GpuState,
    NodeSnapshot,
    Observation,
    TierState,
    slowdown_headroom,
)
from gpuwatch.rules import all_rules
from gpuwatch.rules.base import GpuRule, NodeRule, Rule, UndeclaredSeries, Window, needs
from gpuwatch.rules.engine import Engine
from gpuwatch.rules.health import CRITICAL_XIDS
from gpuwatch.rules.settings import build_configs
from gpuwatch.rules.thermal import project_seconds_to
from gpuwatch.testing import H200_FEATURES, fan, fast_sample, identity, slow_sample

NOW = 5000.0
WALL = 1_700_000_000.0
RULES = {rule.id: rule for rule in all_rules()}
RTX_FEATURES = {f: f not in ("memory_temperature", "temperature_margin", "remapped_rows", "retired_pages")
                for f in FEATURES}
IDLE_EVENTS = {"gpu_idle": True, "sw_power_cap": False, "hw_slowdown": False, "sw_thermal_slowdown": False,
               "hw_thermal_slowdown": False, "hw_power_brake_slowdown": False}
BUSY_EVENTS = {**IDLE_EVENTS, "gpu_idle": False}


def uuid_of(index: int) -> str:
    return identity(index).uuid


def rtx_fast(temperature=65.0, speed=0.65, target=0.65, rpm=3120.0, **overrides):
    """A busy RTX 6000 Ada-like sample: one blower fan, absolute thresholds, no margin."""
    values = dict(temperature_celsius=temperature, memory_temperature_celsius=None,
                  temperature_margin_celsius=None, fans=(fan(0, speed, target, rpm),), power_watts=300.0,
                  utilization_ratio={"gpu": 1.0, "memory": 0.3, "encoder": 0.0, "decoder": 0.0},
                  clocks_event_active=dict(BUSY_EVENTS), clocks_event_seconds={})
    values.update(overrides)
    return fast_sample(**values)


def rtx_slow(**overrides):
    values = dict(temperature_threshold_celsius={"shutdown": 100.0, "slowdown": 95.0, "gpu_max": 90.0},
                  temperature_margin_threshold_celsius={}, remapped_rows={}, remapped_rows_pending=None,
                  remapped_rows_failed=None,
                  power_limit_watts={"enforced": 300.0, "default": 300.0, "min": 100.0, "max": 300.0},
                  pcie_link_generation={"current": 4, "max": 4}, pcie_link_width={"current": 16, "max": 16})
    values.update(overrides)
    return slow_sample(**values)


def h200_fast(temperature=52.0, **overrides):
    """A busy H200 (the capture under load: 52 °C, margin 35, 627 W)."""
    values = dict(temperature_celsius=temperature, temperature_margin_celsius=87.0 - temperature,
                  memory_temperature_celsius=41.0, power_watts=627.0,
                  utilization_ratio={"gpu": 1.0, "memory": 0.07, "encoder": 0.0, "decoder": 0.0},
                  clocks_event_active=dict(BUSY_EVENTS))
    values.update(overrides)
    return fast_sample(**values)


def gpu(index=0, fast=None, slow=None, *, features=None, up=True, age=0.0, slow_age=0.0, **overrides) -> GpuState:
    fast = h200_fast() if fast is None else fast
    slow = slow_sample() if slow is None else slow
    return GpuState(identity=identity(index, **overrides.pop("ident", {})),
                    features=dict(features or H200_FEATURES), up=up, fast=fast, fast_monotonic=NOW - age,
                    slow=slow, slow_monotonic=NOW - slow_age, **overrides)


def snapshot(*gpus: GpuState, backend_up=True, reason=None, tiers=None, visible=None) -> NodeSnapshot:
    if tiers is None:
        tiers = {"fast": TierState(True, 0.01, WALL, NOW), "slow": TierState(True, 0.01, WALL, NOW)}
    return NodeSnapshot(generation=1, backend="scripted", backend_up=backend_up, backend_reason=reason,
                        driver=None, gpus=tuple(gpus), tiers=tiers,
                        visible_gpus=sum(g.visible for g in gpus) if visible is None else visible,
                        taken_monotonic=NOW, taken_wall=WALL)


def window(snap: NodeSnapshot, history=None, now=None, expected=0) -> Window:
    """A window over ``snap``; ``history`` maps GPU index -> [(seconds before NOW, sample)]."""
    hist = {}
    for index, items in (history or {}).items():
        hist[uuid_of(index)] = sorted((NOW - ago, sample) for ago, sample in items)
    for state in snap.gpus:  # the latest sample is part of the history, as the engine keeps it
        if state.up and state.fast is not None:
            series = hist.setdefault(state.identity.uuid, [])
            if not series or series[-1][0] != state.fast_monotonic:
                series.append((state.fast_monotonic, state.fast))
    return Window(snap, hist, fast_staleness=6.0, expected_gpus=expected, now=now)


def evaluate(rule_id: str, win: Window, index: int | None = 0, **params) -> Observation | None:
    rule = RULES[rule_id]
    config = build_configs(list(RULES.values()), {rule_id: params} if params else None)[rule_id]
    win = win.for_rule(rule)  # as the engine passes it: the series the rule declares
    if rule.scope == "node":
        return rule.evaluate(win, config)
    return rule.evaluate(win, uuid_of(index), config)


def steady(sample, seconds=120, every=2.0):
    """The same sample every ``every`` seconds over the last ``seconds``."""
    return [(ago, sample) for ago in _agos(seconds, every)]


def _agos(seconds, every=2.0):
    return [seconds - i * every for i in range(int(seconds / every) + 1)]


# ---------------------------------------------------------------------------------------- catalogue


def test_every_rule_is_documented_with_sane_defaults():
    """Stable snake_case ids, one-sentence conditions, a known severity, non-negative hold/clear."""
    for rule in RULES.values():
        assert re.fullmatch(r"[a-z][a-z0-9]*(_[a-z0-9]+)*", rule.id), rule.id
        assert rule.scope in ("gpu", "node")
        assert rule.severity in ("critical", "warning", "info")
        assert rule.hold_seconds >= 0 and rule.clear_seconds >= 0
        assert rule.condition.endswith(".") and rule.condition.count(". ") == 0, rule.id
    assert RULES["power_capped"].severity == "info"
    assert {r.id for r in RULES.values() if r.scope == "node"} == {"backend_down", "collection_stalled",
                                                                    "gpu_missing", "node_power_budget",
                                                                    "node_power_over_budget"}


def test_docs_list_every_rule_with_its_defaults():
    """docs/rules.md has a row per rule with its severity, hold, clear and every, and names every parameter."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "rules.md").read_text()
    for rule in RULES.values():
        row = next((line for line in text.splitlines() if line.startswith(f"| `{rule.id}` |")), None)
        assert row is not None, rule.id
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == rule.severity, rule.id
        assert cells[4] == f"{rule.hold_seconds:g} s" and cells[5] == f"{rule.clear_seconds:g} s", rule.id
        assert cells[6] == (f"{rule.every_seconds:g} s" if rule.every_seconds else "each run"), rule.id
        for param in rule.params:
            assert f"`{param}`" in text, (rule.id, param)


def test_docs_say_which_look_back_parameters_rules_window_bounds():
    """docs/rules.md lists every look-back parameter with what it reads and what bounds it."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "rules.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| `")}
    for rule in RULES.values():
        for param, tier in rule.lookback.items():
            row = rows.get(f"`{rule.id}.{param}`")
            assert row is not None, (rule.id, param)
            assert f"{tier} samples" in row and f"{rule.params[param]:g}" in row, (rule.id, param)
            assert ("`rules.window`" in row) == (tier == "fast"), (rule.id, param)


def test_rules_that_need_a_reading_do_not_apply_where_it_is_unsupported():
    """No fan rules on a fanless H200, no retired pages on an H200, no remapped rows on an RTX 6000."""
    h200, rtx = gpu(0), gpu(0, rtx_fast(), rtx_slow(), features=RTX_FEATURES)
    for rule_id in ("fan_stalled", "fan_not_tracking", "fan_at_max", "retired_pages_pending"):
        assert not RULES[rule_id].applies(h200), rule_id
    for rule_id in ("fan_stalled", "fan_not_tracking", "fan_at_max"):
        assert RULES[rule_id].applies(rtx), rule_id
    for rule_id in ("row_remap_failed", "row_remap_pending"):
        assert RULES[rule_id].applies(h200) and not RULES[rule_id].applies(rtx)
    no_util = gpu(0, features={**H200_FEATURES, "utilization": False})  # MIG
    assert not RULES["pcie_link_degraded"].applies(no_util)


def test_engine_evaluates_fan_rules_only_on_gpus_with_fans():
    """On a node with one fanless and one fanned GPU, fan anomalies exist for the fanned one only."""
    snap = snapshot(gpu(0), gpu(1, rtx_fast(), rtx_slow(), features=RTX_FEATURES))
    anomalies = Engine(all_rules(), build_configs(all_rules(), None), 6.0).evaluate(snap)
    fan_gpus = {a.gpu for a in anomalies if a.rule.startswith("fan_")}
    assert fan_gpus == {"1"}


FAST_RULES = ("fan_stalled", "fan_not_tracking", "fan_at_max", "overheating", "thermal_runaway",
              "thermal_throttling", "thermal_outlier", "power_brake", "hw_slowdown", "power_capped",
              "pcie_link_degraded")


def test_stale_samples_mean_cannot_tell():
    """A GPU whose fast sample is older than the staleness bound gives None, not a verdict, so an
    anomaly neither starts nor ends on data that is no longer true."""
    stale = snapshot(gpu(0, rtx_fast(speed=0.0, rpm=0.0, target=0.8), rtx_slow(), features=RTX_FEATURES, age=30))
    for rule_id in FAST_RULES:
        assert evaluate(rule_id, window(stale)) is None, rule_id


# ---------------------------------------------------------------------------------------- fans


def rtx(fast, **kwargs) -> Window:
    return window(snapshot(gpu(0, fast, rtx_slow(), features=RTX_FEATURES)), **kwargs)


def test_fan_stalled_when_the_driver_asks_for_speed_and_it_does_not_turn():
    """0 RPM while the target is 80 %: fires, with a one-line summary naming GPU, fan and numbers."""
    obs = evaluate("fan_stalled", rtx(rtx_fast(temperature=70, speed=0.0, target=0.8, rpm=0.0)))
    assert obs == Observation(True, 0.0, 200.0, "GPU 0 fan 0 at 0% (0 RPM) while the driver asks for 80%")


def test_fan_stalled_prefers_rpm_over_the_reported_intended_speed():
    """NVML's speed is the intended speed on many boards: RPM decides where it is reported."""
    blocked = rtx_fast(speed=0.8, target=0.8, rpm=0.0)  # speed still says 80 %, the fan is blocked
    assert evaluate("fan_stalled", rtx(blocked)).active
    spinning = rtx_fast(speed=0.0, target=0.8, rpm=3800.0)
    assert not evaluate("fan_stalled", rtx(spinning)).active
    no_rpm = rtx_fast(speed=0.02, target=0.8, rpm=None)
    assert evaluate("fan_stalled", rtx(no_rpm)).active


def test_fan_stalled_ignores_zero_rpm_idle_mode_but_not_a_warm_gpu():
    """Fans stopped on purpose at idle (target 0, cool GPU) are fine; a stopped fan on a GPU within
    30 °C of slowdown fires even when no target is reported or the target is 0 (manual policy)."""
    assert not evaluate("fan_stalled", rtx(rtx_fast(temperature=38, speed=0.0, target=0.0, rpm=0.0))).active
    warm = evaluate("fan_stalled", rtx(rtx_fast(temperature=70, speed=0.0, target=0.0, rpm=0.0)))
    assert warm.active and "25 °C below slowdown" in warm.summary
    no_target = rtx_fast(temperature=70, speed=0.0, target=None, rpm=0.0)
    assert evaluate("fan_stalled", rtx(no_target)).active


def test_fan_not_tracking_uses_the_median_gap_over_its_window():
    """A sustained gap fires; one odd sample neither fires nor ends it; a stopped fan is left to
    fan_stalled."""
    good, lagging = rtx_fast(speed=0.65, target=0.66), rtx_fast(speed=0.30, target=0.85, rpm=1440.0)
    assert not evaluate("fan_not_tracking", rtx(good, history={0: steady(good)})).active
    obs = evaluate("fan_not_tracking", rtx(lagging, history={0: steady(lagging)}))
    assert obs.active and obs.value == pytest.approx(0.55) and "fan 0 at 30% while its target is 85%" in obs.summary
    one_odd = {0: steady(good, 30)[:-1]}
    assert not evaluate("fan_not_tracking", rtx(lagging, history=one_odd)).active
    one_good = {0: steady(lagging, 30)[:-1]}
    assert evaluate("fan_not_tracking", rtx(good, history=one_good)).active
    stopped = rtx_fast(speed=0.0, target=0.8, rpm=0.0)
    assert not evaluate("fan_not_tracking", rtx(stopped, history={0: steady(stopped)})).active


def test_fan_at_max_only_when_the_gpu_is_still_near_slowdown():
    """100 % fan at 88 °C (7 °C under a 95 °C slowdown) fires; 100 % fan at 70 °C or 60 % fan at
    88 °C do not."""
    assert evaluate("fan_at_max", rtx(rtx_fast(temperature=88, speed=1.0, target=1.0, rpm=4800.0))).active
    assert not evaluate("fan_at_max", rtx(rtx_fast(temperature=70, speed=1.0, target=1.0, rpm=4800.0))).active
    assert not evaluate("fan_at_max", rtx(rtx_fast(temperature=88, speed=0.6, target=0.6))).active


# ---------------------------------------------------------------------------------------- thermal


def test_headroom_prefers_the_t_limit_margin():
    """H200: margin 35 and slowdown at T.Limit −2 give 37 °C headroom and an 89 °C slowdown; where
    both scales exist the margin wins; absolute thresholds are used otherwise."""
    assert slowdown_headroom(h200_fast(52.0), slow_sample()) == (37.0, 89.0)
    both = slow_sample(temperature_threshold_celsius={"slowdown": 80.0})
    assert slowdown_headroom(h200_fast(52.0), both) == (37.0, 89.0)
    assert slowdown_headroom(rtx_fast(65.0), rtx_slow()) == (30.0, 95.0)
    assert slowdown_headroom(rtx_fast(65.0), slow_sample(temperature_margin_threshold_celsius={})) == (None, None)


@pytest.mark.parametrize("fast,slow,active", [
    (h200_fast(84.0), slow_sample(), True),  # margin 3, T.Limit slowdown −2: 5 °C left
    (h200_fast(83.0), slow_sample(), False),  # 6 °C left
    (rtx_fast(91.0), rtx_slow(), True),  # 4 °C under 95
    (rtx_fast(88.0), rtx_slow(), False),  # 88 °C is fine on a 95 °C part: no fixed 85 °C limit
    (rtx_fast(86.0), rtx_slow(temperature_threshold_celsius={"slowdown": 97.0}), False),  # RTX 2080 SUPER
    (rtx_fast(80.0), rtx_slow(temperature_threshold_celsius={"slowdown": 84.0}), True),
])
def test_overheating_is_relative_to_the_gpus_own_slowdown_threshold(fast, slow, active):
    """Fires within 5 °C of the GPU's own slowdown threshold, whatever its absolute value."""
    win = window(snapshot(gpu(0, fast, slow)))
    assert evaluate("overheating", win).active is active


def test_overheating_of_the_memory_where_it_has_a_limit():
    """Memory within 5 °C of an absolute memory maximum fires with a memory summary; without an
    absolute memory limit (H200 gives only T.Limit 0) only the GPU is judged."""
    slow = slow_sample(temperature_threshold_celsius={"memory_max": 95.0})
    obs = evaluate("overheating", window(snapshot(gpu(0, h200_fast(60.0, memory_temperature_celsius=92.0), slow))))
    assert obs.active and obs.summary == "GPU 0 memory at 92 °C, 3 °C below its 95 °C maximum"
    hot_memory = h200_fast(60.0, memory_temperature_celsius=92.0)
    assert not evaluate("overheating", window(snapshot(gpu(0, hot_memory, slow_sample())))).active
    no_thresholds = slow_sample(temperature_margin_threshold_celsius={})
    assert evaluate("overheating", window(snapshot(gpu(0, h200_fast(60.0), no_thresholds)))) is None


def test_the_runaway_blocks_are_where_the_block_of_each_time_says():
    """_block_means finds the thirds of its span without a key function; each sample is in the block that
    min(2, int((t - start) // width)) names, also a sample at a block's start or a rounding step off it."""
    from gpuwatch.rules.thermal import _block_means

    rule = RULES["thermal_runaway"]
    for span in (60.0, 30.0, 10.0, 7.0):
        start, width = NOW - span, span / 3
        edges = [start + width, start + 2 * width]
        for times in ([NOW - span + 0.5 * k for k in range(int(span * 2) + 1)],
                      sorted({NOW - span + 1.0 * k for k in range(int(span) + 1)}
                             | {e for edge in edges for e in (edge, math.nextafter(edge, 0), math.nextafter(edge, NOW))})):
            history = [(t, h200_fast(float(i))) for i, t in enumerate(times)]
            expected = [[], [], []]
            for i, t in enumerate(times):
                if t >= start:
                    expected[min(2, int((t - start) // width))].append(float(i))
            win = Window(snapshot(gpu(0)), {uuid_of(0): history}, 6.0, now=NOW).for_rule(rule)
            assert _block_means(win, uuid_of(0), span) == [sum(b) / len(b) for b in expected]


def test_project_seconds_to_slowdown():
    """Linear when the rise does not slow down; Aitken's plateau when it does."""
    assert project_seconds_to(89.0, 80.0, [70.0, 73.0, 76.0], 20.0) == pytest.approx((89 - 80) / (3 / 20))
    # a first-order approach to 84 °C (below 89): never
    plateau = 84.0
    means = [plateau - 12 * math.exp(-k / 3) for k in range(3)]
    assert project_seconds_to(89.0, means[-1], means, 20.0) == math.inf
    # the same shape heading to 100 °C: reaches 89 on the exponential, later than linearly
    means = [100.0 - 30 * math.exp(-k / 3) for k in range(3)]
    exponential = project_seconds_to(89.0, means[-1], means, 20.0)
    assert exponential == pytest.approx(60 * math.log((100 - means[-1]) / 11), rel=1e-6)
    assert project_seconds_to(89.0, 70.0, [72.0, 71.0, 70.0], 20.0) == math.inf  # cooling
    assert project_seconds_to(89.0, 90.0, [86.0, 88.0, 90.0], 20.0) == 0.0  # already there


def _temperature_trace(fn, seconds=60, every=2.0):
    return {0: [(ago, h200_fast(float(round(fn(-ago))))) for ago in _agos(seconds, every)]}


def test_thermal_runaway_fires_on_a_sustained_rise_toward_slowdown():
    """An H200 at 78 °C climbing 6 °C/min is projected to reach 89 °C within 3 minutes: fires."""
    history = _temperature_trace(lambda t: 78 + 0.1 * t)
    obs = evaluate("thermal_runaway", window(snapshot(gpu(0, h200_fast(78.0))), history=history))
    assert obs.active and obs.value == pytest.approx(110, abs=10)
    assert re.fullmatch(r"GPU 0 at 78 °C rising 6\.\d °C/min: projected to reach its 89 °C slowdown threshold "
                        r"in 1\.\d min", obs.summary)


def test_thermal_runaway_ignores_warming_up_to_a_plateau_and_rises_far_from_slowdown():
    """A job start warming the GPU toward a steady 80 °C (levelling off) does not fire, nor a fast
    rise at 50 °C (outside the 15 °C watch margin), nor too little history."""
    levelling = _temperature_trace(lambda t: 80 - 12 * math.exp(-(t + 60) / 40))
    temp = levelling[0][-1][1].thermal.temperature_celsius
    assert not evaluate("thermal_runaway", window(snapshot(gpu(0, h200_fast(temp))), history=levelling)).active
    far = _temperature_trace(lambda t: 50 + 0.3 * t)
    assert not evaluate("thermal_runaway", window(snapshot(gpu(0, h200_fast(50.0))), history=far)).active
    short = {0: _temperature_trace(lambda t: 78 + 0.1 * t)[0][-5:]}
    assert evaluate("thermal_runaway", window(snapshot(gpu(0, h200_fast(78.0))), history=short)) is None


def test_thermal_throttling_from_bits_or_counters():
    """A thermal slowdown bit now fires; so does 20 % thermal throttle time over the window from the
    counters with no bit set at this instant; 5 % does not."""
    hot = h200_fast(86.0, clocks_event_active={**BUSY_EVENTS, "sw_thermal_slowdown": True})
    obs = evaluate("thermal_throttling", window(snapshot(gpu(0, hot))))
    assert obs.active and "sw_thermal_slowdown" in obs.summary

    def counting(seconds_per_poll):
        return {0: [(ago, h200_fast(60.0, clocks_event_seconds={"thermal": 100 + (60 - ago) / 2 * seconds_per_poll}))
                    for ago in _agos(60)]}

    latest = lambda hist: hist[0][-1][1]  # noqa: E731
    hist = counting(0.4)
    assert evaluate("thermal_throttling", window(snapshot(gpu(0, latest(hist))), history=hist)).active
    hist = counting(0.1)
    obs = evaluate("thermal_throttling", window(snapshot(gpu(0, latest(hist))), history=hist))
    assert not obs.active and obs.value == pytest.approx(0.05)


def test_thermal_outlier_needs_comparable_peers():
    """At the same power, 15 °C above the median of three peers fires; with only one comparable
    peer, or peers at idle power, or peers of another model, it cannot tell."""
    peers = [gpu(i, h200_fast(55.0 + i, power_watts=700.0)) for i in (1, 2, 3)]
    hot = gpu(0, h200_fast(72.0, power_watts=700.0))
    obs = evaluate("thermal_outlier", window(snapshot(hot, *peers)))
    assert obs.active and obs.value == 15.0 and "median of 3 peers" in obs.summary
    assert not evaluate("thermal_outlier", window(snapshot(gpu(0, h200_fast(62.0, power_watts=700.0)), *peers))).active
    assert evaluate("thermal_outlier", window(snapshot(hot, peers[0]))) is None
    idle = [gpu(i, h200_fast(30.0, power_watts=77.0)) for i in (1, 2, 3)]
    assert evaluate("thermal_outlier", window(snapshot(hot, *idle))) is None
    other_model = [gpu(i, h200_fast(55.0, power_watts=700.0), ident={"name": "NVIDIA H100"}) for i in (1, 2, 3)]
    assert evaluate("thermal_outlier", window(snapshot(hot, *other_model))) is None


# ---------------------------------------------------------------------------------------- throttle


def test_power_brake_from_the_bit_or_the_counter():
    braked = h200_fast(clocks_event_active={**BUSY_EVENTS, "hw_slowdown": True, "hw_power_brake_slowdown": True})
    assert evaluate("power_brake", window(snapshot(gpu(0, braked)))).active
    hist = {0: [(ago, h200_fast(clocks_event_seconds={"hw_power_brake_slowdown": 10.0 + (30 - ago) * 0.5}))
                for ago in _agos(30)]}
    assert evaluate("power_brake", window(snapshot(gpu(0, hist[0][-1][1])), history=hist)).active
    assert not evaluate("power_brake", window(snapshot(gpu(0)))).active


def _flags(**active):
    return h200_fast(clocks_event_active={**BUSY_EVENTS, **active})


def test_hw_slowdown_ignores_flashes_and_explained_slowdowns():
    """One poll in 15 with hw_slowdown (a clock change) does not fire; most polls do; HW slowdown
    with HW thermal slowdown or the power brake belongs to those rules."""
    calm, slowed = _flags(), _flags(hw_slowdown=True)
    flash = {0: [(ago, slowed if ago == 14 else calm) for ago in _agos(30)]}
    assert not evaluate("hw_slowdown", window(snapshot(gpu(0, calm)), history=flash)).active
    sustained = {0: steady(slowed, 30)}
    obs = evaluate("hw_slowdown", window(snapshot(gpu(0, slowed)), history=sustained))
    assert obs.active and obs.value == 1.0
    for explained in (_flags(hw_slowdown=True, hw_thermal_slowdown=True),
                      _flags(hw_slowdown=True, hw_power_brake_slowdown=True)):
        hist = {0: steady(explained, 30)}
        assert not evaluate("hw_slowdown", window(snapshot(gpu(0, explained)), history=hist)).active


def _engine_run(samples, rule_id, every=2.0):
    """Feed one GPU's samples, one poll each, through the engine; (time, firing) per poll."""
    rules = [RULES[rule_id]]
    engine = Engine(rules, build_configs(rules, None), 6.0)
    out = []
    for i, sample in enumerate(samples):
        t = 1000.0 + i * every
        state = GpuState(identity=identity(0), features=dict(H200_FEATURES), up=True, fast=sample,
                         fast_monotonic=t, slow=slow_sample(), slow_monotonic=t)
        snap = NodeSnapshot(i, "scripted", True, None, None, (state,), {}, 1, t, WALL + t)
        (anomaly,) = engine.evaluate(snap)
        out.append((t - 1000.0, anomaly.firing))
    return out


def test_hw_slowdown_flashes_never_fire_through_the_engine_but_a_sustained_one_does():
    """A flash every 20 s for 10 minutes never fires; a sustained slowdown fires within the time
    for half the window to fill plus the hold."""
    calm, slowed = _flags(), _flags(hw_slowdown=True)
    flashes = [slowed if i % 10 == 0 else calm for i in range(300)]
    assert not any(firing for _, firing in _engine_run(flashes, "hw_slowdown"))
    sustained = [calm] * 30 + [slowed] * 60
    first = next(t for t, firing in _engine_run(sustained, "hw_slowdown") if firing)
    hold = RULES["hw_slowdown"].hold_seconds
    assert 60 + hold <= first <= 60 + 16 + hold + 4


def test_power_capped_is_info_and_fires_at_the_cap():
    capped = _flags(sw_power_cap=True)
    obs = evaluate("power_capped", window(snapshot(gpu(0, capped)), history={0: steady(capped, 60)}))
    assert obs.active and "of its 700 W limit" in obs.summary
    assert RULES["power_capped"].severity == "info"


# ---------------------------------------------------------------------------------------- health


def test_gpu_lost_only_while_the_backend_is_up():
    """A GPU that stopped answering or vanished from discovery fires; with the backend down nobody
    can tell (backend_down says so)."""
    lost = gpu(1, up=False, age=12)
    obs = evaluate("gpu_lost", window(snapshot(gpu(0), lost)), index=1)
    assert obs.active and "not answering" in obs.summary and "last reading 12 s ago" in obs.summary
    gone = gpu(1, up=False, visible=False)
    assert "no longer listed" in evaluate("gpu_lost", window(snapshot(gpu(0), gone)), index=1).summary
    assert not evaluate("gpu_lost", window(snapshot(gpu(0))), index=0).active
    assert evaluate("gpu_lost", window(snapshot(lost, backend_up=False)), index=1) is None


def test_xid_critical_fires_for_allowlisted_codes_within_the_lookback():
    """XID 79 two minutes ago fires; the same an hour ago does not; evaluated on the timer the age
    counts from the evaluation time, not from the snapshot."""
    recent = gpu(0, xid_counts={79: 1}, xid_last_timestamp={79: WALL - 120})
    obs = evaluate("xid_critical", window(snapshot(recent)))
    assert obs.active and obs.value == 79.0
    assert obs.summary == ("GPU 0 XID 79 (GPU has fallen off the bus) 2 min ago, 1 since start: reboot the node; "
                           "contact support if it recurs")
    old = gpu(0, xid_counts={79: 1}, xid_last_timestamp={79: WALL - 3600})
    assert not evaluate("xid_critical", window(snapshot(old))).active
    assert not evaluate("xid_critical", window(snapshot(recent), now=NOW + 900)).active


@pytest.mark.parametrize("code", [13, 31, 43, 45, 63, 94, 154, 999])
def test_application_xids_never_fire(code):
    """Application faults (13, 31, 43, 45), the informational 63 / contained 94, the recovery action's 154
    (recovery_action_required says it) and a code nobody knows are not critical."""
    state = gpu(0, xid_counts={code: 50}, xid_last_timestamp={code: WALL - 1})
    assert not evaluate("xid_critical", window(snapshot(state))).active


def test_critical_xid_allowlist():
    """The critical rows of the one XID table (tests/test_xids.py pins it): the nine codes that were
    critical before it are still there, no application fault is."""
    assert {48, 62, 64, 74, 79, 95, 119, 120, 140} <= set(CRITICAL_XIDS)
    assert not {13, 31, 43} & set(CRITICAL_XIDS)


def test_xid_critical_names_the_newest_code_its_meaning_and_action():
    """A GPU timeout (158, critical in NVIDIA's catalog: reset the GPU) after an older 48: the summary is about
    the newest, with its meaning and action, and mentions the other."""
    state = gpu(0, xid_counts={48: 2, 158: 1}, xid_last_timestamp={48: WALL - 600, 158: WALL - 60})
    obs = evaluate("xid_critical", window(snapshot(state)))
    assert obs.active and obs.value == 158.0
    assert obs.summary == ("GPU 0 XID 158 (GPU fatal timeout) 1 min ago, 1 since start (also XID 48): "
                           "reset the GPU (nvidia-smi -r) once drained")


@pytest.mark.parametrize("action, words", [
    (1, "recovery action gpu_reset: drain the GPU and reset it (nvidia-smi -r)"),
    (2, "recovery action node_reboot: drain the node and reboot it"),
    (3, "recovery action drain_p2p: drain peer-to-peer (P2P) traffic: drain the jobs on the node"),
    (7, "recovery action system_reboot: drain the node and reboot the system"),
    (42, "recovery action unknown (42): see `nvidia-smi -q`"),
])
def test_recovery_action_required_fires_on_any_action_and_says_what_to_do(action, words):
    state = gpu(0, slow=slow_sample(recovery_action=action), features={**H200_FEATURES, "recovery_action": True})
    obs = evaluate("recovery_action_required", window(snapshot(state)))
    assert obs.active and obs.value == float(action)
    assert obs.summary.startswith(f"GPU 0 the driver asks for {words}"), obs.summary


def test_recovery_action_none_is_quiet_and_unsupported_cannot_tell():
    quiet = gpu(0, slow=slow_sample(recovery_action=0), features={**H200_FEATURES, "recovery_action": True})
    obs = evaluate("recovery_action_required", window(snapshot(quiet)))
    assert not obs.active and obs.summary == "GPU 0 the driver asks for no recovery action"
    assert evaluate("recovery_action_required", window(snapshot(gpu(0, slow=slow_sample())))) is None
    down = gpu(0, slow=slow_sample(recovery_action=2), up=False)
    assert evaluate("recovery_action_required", window(snapshot(down))) is None


def _fabric(**readings):
    return gpu(0, slow=slow_sample(fabric_state="completed", fabric_status="success", **readings))


@pytest.mark.parametrize("readings, active, summary", [
    ({"fabric_health_summary": "healthy"}, False, "GPU 0 fabric health healthy: no issue reported"),
    ({"fabric_health_summary": "limited_capacity", "fabric_health": {"degraded_bandwidth": True}}, True,
     "GPU 0 fabric health limited capacity: degraded bandwidth"),
    ({"fabric_health_summary": "unhealthy"}, True, "GPU 0 fabric health unhealthy: no issue reported"),
    ({"fabric_configuration": "insufficient_nvlinks", "fabric_health": {"route_unhealthy": False}}, True,
     "GPU 0 fabric health: incorrect configuration (insufficient nvlinks)"),
    ({"fabric_configuration": "none", "fabric_health": {"degraded_bandwidth": False}}, False,
     "GPU 0 fabric health: no issue reported"),
])
def test_fabric_degraded_reads_the_health_summary_and_the_configuration(readings, active, summary):
    obs = evaluate("fabric_degraded", window(snapshot(_fabric(**readings))))
    assert obs.active is active and obs.summary == summary


def _ecc(uncorrected_volatile, uncorrected_aggregate=None):
    counts = {("corrected", "volatile"): 5, ("corrected", "aggregate"): 9,
              ("uncorrected", "volatile"): uncorrected_volatile,
              ("uncorrected", "aggregate"): uncorrected_aggregate or uncorrected_volatile}
    return slow_sample(ecc_errors=counts)


def test_ecc_uncorrectable_on_the_volatile_count():
    """Uncorrectable errors since the last reset fire; only old (aggregate) ones or corrected ones
    do not; a GPU that is down keeps its state (None)."""
    obs = evaluate("ecc_uncorrectable", window(snapshot(gpu(0, slow=_ecc(2)))))
    assert obs.active and obs.value == 2.0 and "(2 over its lifetime)" in obs.summary
    assert not evaluate("ecc_uncorrectable", window(snapshot(gpu(0, slow=_ecc(0, 7))))).active
    assert evaluate("ecc_uncorrectable", window(snapshot(gpu(0, slow=_ecc(2), up=False)))) is None
    assert evaluate("ecc_uncorrectable", window(snapshot(gpu(0, slow=slow_sample(ecc_errors={}))))) is None


@pytest.mark.parametrize("rule_id,field", [
    ("row_remap_failed", "remapped_rows_failed"),
    ("row_remap_pending", "remapped_rows_pending"),
    ("retired_pages_pending", "retired_pages_pending"),
])
def test_memory_repair_flags(rule_id, field):
    assert evaluate(rule_id, window(snapshot(gpu(0, slow=slow_sample(**{field: True}))))).active
    assert not evaluate(rule_id, window(snapshot(gpu(0, slow=slow_sample(**{field: False}))))).active
    assert evaluate(rule_id, window(snapshot(gpu(0, slow=slow_sample(**{field: None}))))) is None


def _link(generation, width, maximum=(4, 16)):
    return rtx_slow(pcie_link_generation={"current": generation, "max": maximum[0]},
                    pcie_link_width={"current": width, "max": maximum[1]})


def _util(value):
    return rtx_fast(utilization_ratio={"gpu": value, "memory": 0.0, "encoder": 0.0, "decoder": 0.0})


def test_pcie_link_degraded_only_while_busy():
    """Gen 1 at idle (RTX 2080 SUPER capture: gen 1 idle, gen 3 under load) is a deliberate
    downshift; x8 of x16 under load fires; a link read while idle does not fire just because the
    GPU got busy since."""
    def win(fast, slow, then=None, slow_age=0.0):
        history = {0: [(slow_age, then)]} if then is not None else None
        return window(snapshot(gpu(0, fast, slow, features=RTX_FEATURES, slow_age=slow_age)), history=history)

    assert not evaluate("pcie_link_degraded", win(_util(0.0), _link(1, 16))).active
    obs = evaluate("pcie_link_degraded", win(_util(0.97), _link(4, 8)))
    assert obs.active and obs.summary == "GPU 0 PCIe link at gen 4 x8 while busy (max gen 4 x16)"
    assert evaluate("pcie_link_degraded", win(_util(0.97), _link(3, 16))).active
    assert not evaluate("pcie_link_degraded", win(_util(1.0), _link(1, 16), then=_util(0.0), slow_age=20)).active
    assert not evaluate("pcie_link_degraded", win(_util(1.0), _link(4, 16))).active


def test_pcie_replays_rising_rate_over_the_slow_history():
    """10 a minute over the last 5 minutes fire, a counter that stopped does not (however high), a
    reset counts from 0, and too short a history cannot tell."""

    def with_history(counts):
        snap = snapshot(gpu(0, slow=slow_sample(pcie_replays=counts[-1])))
        history = {uuid_of(0): [(NOW - 30 * (len(counts) - 1 - i), slow_sample(pcie_replays=c))
                                for i, c in enumerate(counts)]}
        return Window(snap, {}, 6.0, slow_history=history)

    rising = with_history([500 + 5 * i for i in range(11)])  # 5 per 30 s
    obs = evaluate("pcie_replays_rising", rising)
    assert obs.active and obs.value == pytest.approx(10.0)
    assert not evaluate("pcie_replays_rising", with_history([500] * 11)).active
    reset = with_history([900, 950, 0, 20, 40, 60, 80, 100, 120, 140, 160])  # a reset counts from 0
    assert evaluate("pcie_replays_rising", reset).value == pytest.approx((50 + 160) / 5)
    assert evaluate("pcie_replays_rising", with_history([40])) is None


# ---------------------------------------------------------------------------------------- node


def test_backend_down():
    obs = evaluate("backend_down", window(snapshot(gpu(0), backend_up=False, reason="driver not loaded")), None)
    assert obs.active and obs.summary == "backend scripted down: driver not loaded"
    assert not evaluate("backend_down", window(snapshot(gpu(0))), None).active


def test_collection_stalled_on_a_hung_poll():
    """With the last fast poll 20 s ago and one in flight for 18 s, collection has stalled; 4 s ago
    is normal; before the first poll there is nothing to say."""
    def snap(last, in_flight=None):
        fast_tier = TierState(True, 0.01, WALL, last, in_flight_since=in_flight)
        return snapshot(gpu(0), tiers={"fast": fast_tier, "slow": TierState()})

    obs = evaluate("collection_stalled", window(snap(NOW - 20, NOW - 18)), None)
    assert obs.active and obs.value == 20.0 and obs.threshold == 6.0 and "(NVML call hung?)" in obs.summary
    assert not evaluate("collection_stalled", window(snap(NOW - 4)), None).active
    assert evaluate("collection_stalled", window(snap(None)), None) is None
    assert evaluate("collection_stalled", window(snap(None, NOW - 30)), None).active


def test_collection_stalled_fires_on_the_timer_while_no_snapshot_arrives():
    """The engine run on a timer with a frozen snapshot (the poll hangs) fires after the staleness
    bound plus the hold, and resolves once polls complete again."""
    rules = [RULES["collection_stalled"]]
    engine = Engine(rules, build_configs(rules, None), 6.0)
    frozen = snapshot(gpu(0), tiers={"fast": TierState(True, 0.01, WALL, NOW, in_flight_since=NOW + 2),
                                     "slow": TierState()})
    firing = {t: engine.evaluate(frozen, NOW + t, WALL + t)[0].firing for t in range(0, 40, 2)}
    first = min(t for t, f in firing.items() if f)
    assert first == 8 + RULES["collection_stalled"].hold_seconds


def test_gpu_missing_against_the_expected_count():
    """7 of 8 expected GPUs fires and names the missing one; not while the backend is down."""
    gpus = [gpu(i) for i in range(7)] + [gpu(7, up=False, visible=False)]
    obs = evaluate("gpu_missing", window(snapshot(*gpus), expected=8), None)
    assert obs.active and obs.summary.startswith("7 GPUs visible, 8 expected; GPU 7 (")
    assert not evaluate("gpu_missing", window(snapshot(*gpus[:7]), expected=7), None).active
    assert evaluate("gpu_missing", window(snapshot(*gpus, backend_up=False), expected=8), None) is None
    assert evaluate("gpu_missing", window(snapshot(*gpus[:7]), expected=0), None) is None


# ---------------------------------------------------------------------------------------- configuration


def test_rules_are_configured_from_yaml_settings():
    """The documented YAML form overrides severity, hold, clear and thresholds."""
    configs = build_configs(all_rules(), {"fan_stalled": {"enabled": True, "severity": "warning", "hold": 30,
                                                          "clear": 60, "stalled_rpm": 300},
                                          "overheating": {"margin_celsius": 8}})
    assert configs["fan_stalled"].severity == "warning"
    assert configs["fan_stalled"].hold_seconds == 30 and configs["fan_stalled"]["stalled_rpm"] == 300
    win = window(snapshot(gpu(0, h200_fast(81.0))))
    assert RULES["overheating"].evaluate(win, uuid_of(0), configs["overheating"]).active


# -- input_bound: a job's GPU waits for its input -------------------------------------------------
def _fed(gpu_busy, cpu_busy, iowait=0.02, held=True, cpus=16.0):
    """GPU 0 at ``gpu_busy`` utilization for the last minute (no GPM), allocated to Slurm job 42 whose
    processes keep ``cpu_busy`` of its CPUs busy and spend ``iowait`` of their time waiting for I/O."""
    from gpuwatch.groups import GpuHost, HostSample
    from gpuwatch.groups.jobs import JobUsage
    from gpuwatch.groups.slurm import JobAllocation

    sample = h200_fast(utilization_ratio={"gpu": gpu_busy, "memory": 0.1}, sm_active_ratio=None)
    allocation = (JobAllocation(uuid_of(0), "42", "alice", "scontrol"),) if held else ()
    state = gpu(0, sample, host=GpuHost(allocation, None), host_monotonic=NOW)
    jobs = (JobUsage("slurm", "42", (100.0, 10.0, 3.0), None, None, cpus, 9, cpu_busy, iowait),)
    snap = dataclasses.replace(snapshot(state), host=HostSample(slurm=allocation, jobs=jobs), host_monotonic=NOW)
    return window(snap, {0: [(ago, sample) for ago in range(2, 60, 2)]})


def test_input_bound_fires_on_a_gpu_whose_job_saturates_its_cpus_or_waits_on_storage():
    cpu = evaluate("input_bound", _fed(0.35, 0.97))
    assert cpu.active and cpu.value == pytest.approx(0.35)
    assert "slurm job 42's 9 processes keep 97% of its 16 CPUs busy (CPU-bound input pipeline)" in cpu.summary
    io = evaluate("input_bound", _fed(0.3, 0.25, iowait=0.6))
    assert io.active and "spend 60% of their time waiting for I/O (storage-bound input)" in io.summary


@pytest.mark.parametrize("case, gpu_busy, cpu_busy, held", [
    ("compute-bound: the GPU is busy", 0.95, 0.97, True),
    ("idle: that is allocated_idle's", 0.01, 0.97, True),
    ("the job's CPUs idle: nothing to feed faster", 0.35, 0.2, True),
    ("nobody holds the GPU", 0.35, 0.97, False),
])
def test_input_bound_stays_silent_on_the_healthy_cases(case, gpu_busy, cpu_busy, held):
    assert not evaluate("input_bound", _fed(gpu_busy, cpu_busy, held=held)).active, case


def test_allocated_idle_holds_a_mig_instance_the_kubelet_gave_a_pod():
    """On a MIG-enabled GPU (no parent utilization), a pod allocated instance 9 by the kubelet holds it
    with no process and no memory in use: idle SM activity fires, naming the pod; instance 2 computes."""
    from gpuwatch.groups import GpuHost
    from gpuwatch.groups.kubernetes import PodAllocation
    from gpuwatch.groups.mig import MigReading

    sample = h200_fast(utilization_ratio={}, sm_active_ratio=None,
                       mig=(MigReading(2, 40 * 2**30, 20 * 2**30, 0.6), MigReading(9, 10 * 2**30, 0, 0.0)))
    pods = (PodAllocation(uuid_of(0), "ml", "notebook-3", "jupyter", 9),)
    state = gpu(0, sample, host=GpuHost(None, pods), host_monotonic=NOW)
    seen = evaluate("allocated_idle", window(snapshot(state), {0: [(ago, sample) for ago in range(2, 60, 2)]}))
    assert seen.active and "MIG instance 9 held by pod ml/notebook-3, at most 0% SM active" in seen.summary


# -- node power budget ------------------------------------------------------------------------------
def _powered(watts, budget, braked=()):
    from gpuwatch.model import NodeInfo

    states = []
    for i, w in enumerate(watts):
        events = dict(BUSY_EVENTS, hw_power_brake_slowdown=i in braked)
        states.append(gpu(i, h200_fast(power_watts=w, clocks_event_active=events)))
    return window(dataclasses.replace(snapshot(*states), node=NodeInfo(power_budget_watts=budget)))


def test_node_power_budget_warns_near_the_budget_and_the_critical_one_takes_over_above_it():
    near = _powered([650.0] * 8, 5600.0)  # 5,200 W: 93 %
    assert evaluate("node_power_budget", near, None).active
    assert not evaluate("node_power_over_budget", near, None).active
    over = _powered([700.0] * 7 + [300.0], 5600.0, braked=(7,))  # 5,200 W... under: braked GPU 7 pulls down
    assert evaluate("node_power_budget", over, None).active
    over = _powered([700.0] * 8 + [400.0], 5600.0, braked=(2, 8))
    seen = evaluate("node_power_over_budget", over, None)
    assert seen.active and seen.value == pytest.approx(6000.0 / 5600.0)
    assert seen.summary == ("the node's 9 GPUs draw 6,000 W of its 5,600 W power budget (107%); GPUs 2, 8 in "
                            "power brake: the supplies cannot deliver (a failed PSU?)")
    assert not evaluate("node_power_budget", over, None).active  # the critical one says it
    calm = _powered([300.0] * 8, 5600.0)
    assert not evaluate("node_power_budget", calm, None).active
    assert evaluate("node_power_budget", _powered([650.0] * 8, None), None) is None  # no budget: no rule


# ---------------------------------------------------------------------------------------- the rule contract


def _node_of(*temperatures, t=NOW):
    """A snapshot at ``t`` of H200s at these temperatures (each with a slow sample read at ``t``)."""
    states = [GpuState(identity=identity(i), features=dict(H200_FEATURES), up=True, fast=h200_fast(temp),
                       fast_monotonic=t, slow=slow_sample(), slow_monotonic=t) for i, temp in enumerate(temperatures)]
    return NodeSnapshot(1, "scripted", True, None, None, tuple(states), {}, len(states), t, WALL + t - NOW)


def _caches(engine):
    """("tally" | "column" | "derive", (rule id, name)) of every series the engine's histories keep."""
    return [(uuid, kind, key) for histories in (engine._history, engine._slow_history)
            for uuid, history in histories.items() for kind, key in history.cached()]


def test_repeated_evaluations_keep_one_cache_per_declared_series_and_gpu():
    """200 evaluations of every shipped rule (each at every poll), history trimmed and compacted on
    the way: the caches after the last are those after the first, each one a series its rule declares."""
    rules = all_rules()
    engine = Engine(rules, build_configs(rules, {rule.id: {"every": 0} for rule in rules}), 6.0)
    declared = {(rule.id, name) for rule in rules for name in (*rule.predicates, *rule.columns, *rule.derived)}
    counts = []
    for poll in range(200):
        engine.evaluate(_node_of(55.0 + poll % 3, 60.0, 61.0, 62.0, t=NOW + 2 * poll))
        counts.append(len(_caches(engine)))
    assert {key for _, _, key in _caches(engine)} <= declared
    assert counts[0] > 0 and set(counts) == {counts[0]}  # none made after the first evaluation
    assert len(_caches(engine)) == len(set(_caches(engine))) <= 4 * len(declared)


def _tallying(rule_id, predicates, asks="hot"):
    """A GpuRule that observes (hits, samples) of its predicate ``asks`` over the last 60 s."""
    def evaluate(window, uuid, config):
        hits, samples = window.tally(uuid, 60.0, asks)
        return Observation(hits > 0, float(hits), float(samples))

    return GpuRule(id=rule_id, severity="warning", hold_seconds=0, clear_seconds=0, condition="A test rule.",
                   evaluate=evaluate, predicates=predicates)


def test_a_series_asked_for_again_and_again_is_one_cache():
    """The leak this contract closes: a rule asking 200 times (it used to pass a fresh lambda each time,
    one cache per call) keeps one cache per GPU."""
    rules = (_tallying("hot_gpu", {"hot": lambda sample: sample.thermal.temperature_celsius >= 80.0}),)
    engine = Engine(rules, build_configs(rules, None), 6.0)
    for poll in range(200):
        (anomaly,) = engine.evaluate(_node_of(85.0, t=NOW + 2 * poll))
    assert anomaly.firing and anomaly.value == anomaly.threshold > 1  # every sample kept is hot
    assert _caches(engine) == [(uuid_of(0), "tally", ("hot_gpu", "hot"))]


def test_an_undeclared_series_is_an_error_naming_the_rule_and_the_name_never_a_cache():
    rule = _tallying("hot_gpu", {"hot": lambda sample: True}, asks="warm")
    win = window(snapshot(gpu(0)))
    with pytest.raises(UndeclaredSeries, match="rule 'hot_gpu' reads predicates 'warm', which it does not "
                                               "declare \\(its predicates: hot\\)"):
        rule.evaluate(win.for_rule(rule), uuid_of(0), rule.default_config())
    with pytest.raises(UndeclaredSeries, match="for no rule"):  # the engine's own Window declares nothing
        win.tally(uuid_of(0), 60.0, "hot")
    with pytest.raises(UndeclaredSeries, match="rule 'thermal_runaway' reads columns 'activity'"):
        win.for_rule(RULES["thermal_runaway"]).column(uuid_of(0), "activity")  # another rule's series
    assert win.history(uuid_of(0)).cached() == []
    engine = Engine((rule,), build_configs((rule,), None), 6.0)  # in the engine: a failing rule, counted
    engine.evaluate(_node_of(85.0))
    assert engine.counters()[1] == {"hot_gpu": 1} and _caches(engine) == []


def test_two_rules_declaring_the_same_name_keep_their_own_series():
    rules = (_tallying("above_80", {"hot": lambda sample: sample.thermal.temperature_celsius >= 80.0}),
             _tallying("above_60", {"hot": lambda sample: sample.thermal.temperature_celsius >= 60.0}))
    engine = Engine(rules, build_configs(rules, None), 6.0)
    for poll in range(10):
        result = {a.rule: a for a in engine.evaluate(_node_of(70.0 + 20.0 * (poll % 2), t=NOW + 2 * poll))}
    above_80, above_60 = result["above_80"], result["above_60"]
    assert above_60.value == above_60.threshold == 4  # the samples kept (6 s at 2 s polls), every one over 60
    assert above_80.value == 2  # 90, 70, 90, 70: half over 80
    assert sorted(key for _, _, key in _caches(engine)) == [("above_60", "hot"), ("above_80", "hot")]


def test_rule_kinds_check_their_evaluators():
    """A GpuRule evaluates (window, uuid, config), a NodeRule (window, config): mypy checks the shipped
    rules; a rule it does not see (an untyped lambda) fails when made, not at its first evaluation."""
    common = dict(severity="warning", hold_seconds=0, clear_seconds=0, condition="A test rule.")
    assert GpuRule(id="g", evaluate=lambda w, u, c: None, **common).scope == "gpu"
    assert NodeRule(id="n", evaluate=lambda w, c: None, **common).scope == "node"
    with pytest.raises(TypeError, match="rule 'g': a gpu rule's evaluate takes \\(window, uuid, config\\)"):
        GpuRule(id="g", evaluate=lambda w, c: None, **common)
    with pytest.raises(TypeError, match="rule 'n': a node rule's evaluate takes \\(window, config\\)"):
        NodeRule(id="n", evaluate=lambda w, u, c: None, **common)
    with pytest.raises(TypeError, match="make a GpuRule or a NodeRule"):
        Rule(id="r", **common)
    assert all(isinstance(rule, GpuRule if rule.scope == "gpu" else NodeRule) for rule in all_rules())
    twice = (GpuRule(id="g", evaluate=lambda w, u, c: None, applies=needs("fan"), **common),) * 2
    with pytest.raises(ValueError, match="duplicate rule ids: \\['g'\\]"):
        Engine(twice, build_configs(twice[:1], None), 6.0)


def test_rules_see_the_last_slow_sample_of_an_answering_gpu_and_a_host_read_up_to_the_bound():
    """Window.slow is the one definition of which slow sample a rule sees: the latest one while the GPU
    answers and the backend is up, whatever its age (a slow tier that stalls must not silence the critical
    rules that read thresholds and counters); a GPU or backend that does not answer: cannot tell. A read
    of the host groups exactly as old as the slow bound is seen, one a millisecond older is not."""
    ecc = slow_sample(ecc_errors={("uncorrected", "volatile"): 2, ("uncorrected", "aggregate"): 2})

    def win(age, bound=30.0, **state):
        snap = snapshot(gpu(0, slow=ecc, slow_age=age, **state))
        snap = dataclasses.replace(snap, host=HostSample(), host_monotonic=NOW - age)
        return Window(snap, {}, 6.0, slow_staleness=bound)

    old = win(3600.0)
    assert old.slow(uuid_of(0)) is ecc and evaluate("ecc_uncorrectable", old).active
    assert win(0.0, up=False).slow(uuid_of(0)) is None  # a GPU that does not answer: cannot tell
    down = Window(snapshot(gpu(0, slow=ecc), backend_up=False), {}, 6.0)
    assert down.slow(uuid_of(0)) is None and evaluate("ecc_uncorrectable", down) is None
    host = GpuHost(None, None)
    assert win(30.0, host=host, host_monotonic=NOW - 30.0).host(uuid_of(0)) is host
    assert win(30.0, host=host, host_monotonic=NOW - 30.001).host(uuid_of(0)) is None
    assert win(30.0, bound=None, host=host, host_monotonic=NOW - 3600.0).host(uuid_of(0)) is host
    at = win(0.0)
    assert at.host_fresh(NOW - 30.0) and not at.host_fresh(NOW - 30.001) and not at.host_fresh(None)
    rules = [RULES["ecc_uncorrectable"]]  # and in the engine, with the agent's bound: a stalled slow tier
    engine = Engine(rules, build_configs(rules, None), 6.0, slow_staleness=30.0)
    assert engine.evaluate(snapshot(gpu(0, slow=ecc, slow_age=0.0)), now=NOW + 600.0, wall=WALL + 600.0)[0].firing


def test_a_stalled_slow_tier_leaves_overheating_and_a_stopped_fan_firing():
    """The thresholds the fan and overheating rules read come from the slow tier: when it stalls (a wedged
    process-list call) the last ones still hold, so overheating and fan_stalled keep their verdict."""
    hot = fast_sample(temperature_celsius=95.0, temperature_margin_celsius=2.0, fans=(fan(0, speed=0.0, target=0.0, rpm=0.0),))
    window = Window(snapshot(gpu(0, fast=hot, slow=slow_sample(), slow_age=3600.0)), {}, 6.0, slow_staleness=90.0)
    assert window.slow(uuid_of(0)) is not None
    assert evaluate("overheating", window).active
    assert evaluate("fan_stalled", window).active


def test_the_rules_median_is_statistics_median():
    import statistics

    from gpuwatch.rules.common import median
    for values in ([1.0], [3.0, 1.0], [0.5, -0.2, 0.1], [4.0, 1.0, 3.0, 2.0], [-1.0, -1.0, 2.0, 7.5, 0.0]):
        assert median(list(values)) == statistics.median(values)
