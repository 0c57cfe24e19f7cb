"""What the rule engine's speed rests on, checked by counting, never by timing.

- Per evaluation the work is O(GPUs x rules): the Window lookups and the node-wide aggregates per
  GPU do not grow with the number of GPUs (thermal_outlier used to build every GPU's peer list).
- History answers windowed questions from state kept per sample: a predicate is evaluated once
  per sample, however often it is asked, and trimming keeps the lists bounded.
- The faster helpers give exactly what the straightforward code they replaced gave (that code is
  kept below as the reference), on random histories that go through the engine's append/trim
  cycle, compaction included.
- decode_clocks_event_reasons shares one read-only mapping per (mask, supported) pair.
"""

from __future__ import annotations

import json
import random
import statistics

import pytest

from gpuwatch.model import (
    CLOCKS_EVENT_REASON_BITS,
    GpuState,
    NodeSnapshot,
    Observation,
    decode_clocks_event_reasons,
)
from gpuwatch.rules import all_rules, common, thermal
from gpuwatch.rules import history as rules_history
from gpuwatch.rules.base import History, Window
from gpuwatch.rules.common import counter_share, sample_share
from gpuwatch.rules.engine import Engine
from gpuwatch.rules.health import _sample_near
from gpuwatch.rules.settings import build_configs
from gpuwatch.rules.thermal import THERMAL_COUNTERS, THERMAL_REASONS
from gpuwatch.testing import H200_FEATURES, fast_sample, identity, slow_sample
from gpuwatch.trace import encode_fast

RULES = {rule.id: rule for rule in all_rules()}
WINDOW = 300.0

# ------------------------------------------------------------------------------------ references
# The code these helpers replaced (before the O(n) rework), kept as the definition of the result.


def ref_series(items, now, seconds):
    since = now - seconds
    result = []
    for item in reversed(items):
        if item[0] < since:
            break
        result.append(item)
    result.reverse()
    return result


def ref_counter_share(series, reasons):
    best = None
    for reason in reasons:
        points = [(t, s.clocks.clocks_event_seconds[reason]) for t, s in series if reason in s.clocks.clocks_event_seconds]
        if len(points) < 2:
            continue
        (t0, v0), (t1, v1) = points[0], points[-1]
        if t1 <= t0 or v1 < v0:
            continue
        share = min(1.0, (v1 - v0) / (t1 - t0))
        best = share if best is None else max(best, share)
    return best


def ref_sample_share(series, reasons, unless=()):
    if not series:
        return None
    hits = 0
    for _, sample in series:
        active = sample.clocks.clocks_event_active
        if any(active.get(r, False) for r in reasons) and not any(active.get(r, False) for r in unless):
            hits += 1
    return hits / len(series)


def ref_block_means(points, start, width):
    blocks = [[], [], []]
    for t, value in points:
        k = min(2, int((t - start) // width))
        if k >= 0:
            blocks[k].append(value)
    if any(len(b) < 2 for b in blocks):
        return None
    return [sum(b) / len(b) for b in blocks]


def ref_sample_near(items, now, when, staleness):
    best = None
    for t, sample in ref_series(items, now, now - when + staleness):
        gap = abs(t - when)
        if gap <= staleness and (best is None or gap < best[0]):
            best = (gap, sample)
    return None if best is None else best[1]


def ref_thermal_outlier(window, uuid, config):
    fast = window.fast(uuid)
    state = window.gpu(uuid)
    if fast is None or state is None or fast.power.power_watts is None or fast.thermal.temperature_celsius is None:
        return None
    power, temp = fast.power.power_watts, fast.thermal.temperature_celsius
    tolerance = max(config["power_tolerance_ratio"] * power, config["power_tolerance_watts"])
    temps = []
    for other, sample in window.peers(uuid):
        peer = window.gpu(other)
        if peer is None or peer.identity.name != state.identity.name:
            continue
        if sample.power.power_watts is None or sample.thermal.temperature_celsius is None:
            continue
        if abs(sample.power.power_watts - power) <= tolerance:
            temps.append(sample.thermal.temperature_celsius)
    if len(temps) < config["min_peers"] or not temps:
        return None
    median = statistics.median(temps)
    delta = temp - median
    return Observation(
        delta >= config["delta_celsius"], delta, config["delta_celsius"],
        f"{common.gpu_label(window, uuid)} at {temp:.0f} °C, {delta:+.0f} °C from the median of {len(temps)} "
        f"peers drawing about the same power ({power:.0f} W)",
    )


# ------------------------------------------------------------------------------------ builders

ALL_REASONS = sum(CLOCKS_EVENT_REASON_BITS.values())
MASKS = [0x001, 0x004, 0x008, 0x008 | 0x040, 0x008 | 0x080, 0x020, 0x040, 0x004 | 0x020, 0x000]


def random_samples(rng, count):
    """(time, FastSample) with irregular gaps, flapping reasons, counters that sometimes are
    missing or reset, and temperatures that are sometimes missing."""
    t, counters, temp = 1000.0, {r: 100.0 for r in THERMAL_COUNTERS + ("hw_power_brake_slowdown",)}, 60.0
    out = []
    for _ in range(count):
        t += rng.choice([0.5, 1.0, 2.0, 2.0, 2.0, 2.0, 3.0, 7.0]) + (40.0 if rng.random() < 0.01 else 0.0)
        for reason in counters:
            counters[reason] += rng.choice([0.0, 0.0, 0.3, 1.0, 2.0])
            if rng.random() < 0.005:
                counters[reason] = 0.0  # driver reload
        seconds = {r: v for r, v in counters.items() if rng.random() > 0.05}
        temp += rng.choice([-1.0, 0.0, 0.0, 1.0, 1.0, 2.0])
        out.append((t, fast_sample(
            temperature_celsius=None if rng.random() < 0.05 else temp + rng.random(),
            clocks_event_active=decode_clocks_event_reasons(rng.choice(MASKS), ALL_REASONS),
            clocks_event_seconds=seconds)))
    return out


def state_of(index, sample, t, **overrides):
    return GpuState(identity=identity(index, **overrides.pop("ident", {})), features=dict(H200_FEATURES), up=True,
                    fast=sample, fast_monotonic=t, slow=slow_sample(), slow_monotonic=t, **overrides)


def snapshot_of(states, t):
    return NodeSnapshot(1, "scripted", True, None, None, tuple(states), {}, len(states), t, 1.7e9 + t)


# ------------------------------------------------------------------------------------ equivalence


@pytest.mark.parametrize("seed", range(6))
def test_windowed_helpers_match_the_reference_through_append_trim_and_compaction(seed):
    """Every step of a random GPU's history, kept as the engine keeps it (append, trim at the
    window, compaction), gives the reference's shares, block means and nearest sample."""
    rng = random.Random(seed)
    history, plain = History(), []
    uuid = identity(0).uuid
    for step, (t, sample) in enumerate(random_samples(rng, 700)):
        history.append(t, sample)
        history.trim(t - WINDOW)
        plain.append((t, sample))
        plain = [item for item in plain if item[0] >= t - WINDOW]
        assert history.between(history.start) == plain
        now = t + rng.choice([0.0, 0.0, 0.7, 3.0])  # evaluated after the poll, or on the timer
        win = Window(snapshot_of([state_of(0, sample, t)], t), {uuid: history}, 6.0, now=now)
        # each helper as the rule that declares its series sees the window
        heat, brake = win.for_rule(RULES["thermal_throttling"]), win.for_rule(RULES["power_brake"])
        slowdown, runaway = win.for_rule(RULES["hw_slowdown"]), win.for_rule(RULES["thermal_runaway"])
        for seconds in (30.0, 60.0, 61.3, WINDOW):
            series = ref_series(plain, now, seconds)
            assert win.series(uuid, seconds) == series
            assert counter_share(heat, uuid, THERMAL_COUNTERS, seconds) == ref_counter_share(series, THERMAL_COUNTERS)
            assert counter_share(brake, uuid, ("hw_power_brake_slowdown",), seconds) == \
                ref_counter_share(series, ("hw_power_brake_slowdown",))
            assert sample_share(heat, uuid, "thermal_slowdown", seconds) == ref_sample_share(series, THERMAL_REASONS)
            unless = ("hw_thermal_slowdown", "hw_power_brake_slowdown")
            assert sample_share(slowdown, uuid, "hw_slowdown", seconds) == \
                ref_sample_share(series, ("hw_slowdown",), unless)
            points = [(pt, s.thermal.temperature_celsius) for pt, s in series if s.thermal.temperature_celsius is not None]
            expected = ref_block_means(points, now - seconds, seconds / 3) if points else None
            assert thermal._block_means(runaway, uuid, seconds) == expected, (step, seconds)
        when = t - rng.choice([0.0, 1.0, 4.0, 6.0, 20.0, 31.0])
        assert _sample_near(win, uuid, when) is ref_sample_near(plain, now, when, 6.0)
    assert len(history.samples) <= WINDOW / 0.5 + rules_history._CHUNK + 1  # the window + one chunk, not growing


@pytest.mark.parametrize("seed", range(25))
def test_thermal_outlier_matches_the_reference(seed):
    """Random nodes (two models, clustered powers, missing readings, stale GPUs, random
    tolerances): the sorted-by-power ranges give the reference's median and peer count."""
    rng = random.Random(seed)
    t = 5000.0
    states = []
    for i in range(rng.randint(1, 40)):
        power = None if rng.random() < 0.1 else rng.choice([77.0, 300.0, 650.0, 700.0]) + rng.randint(-40, 40)
        temp = None if rng.random() < 0.05 else float(rng.randint(30, 90))
        sample = fast_sample(power_watts=power, temperature_celsius=temp)
        age = 30.0 if rng.random() < 0.1 else 0.0
        model = {"ident": {"name": "NVIDIA H100"}} if rng.random() < 0.3 else {}
        states.append(state_of(i, sample, t - age, **model))
    win = Window(snapshot_of(states, t), {}, 6.0)
    params = {"power_tolerance_ratio": rng.choice([0.0, 0.05, 0.15]), "power_tolerance_watts": rng.choice([0, 10, 25]),
              "min_peers": rng.choice([0, 1, 2, 3])}
    config = build_configs(all_rules(), {"thermal_outlier": params})["thermal_outlier"]
    for state in states:
        uuid = state.identity.uuid
        assert RULES["thermal_outlier"].evaluate(win, uuid, config) == ref_thermal_outlier(win, uuid, config)


# ------------------------------------------------------------------------------------ counting


def _count_lookups(gpus, counts):
    """Runs 40 polls of ``gpus`` GPUs; ``counts`` gets the calls of the last evaluation."""
    rng = random.Random(gpus)
    every_poll = {rule.id: {"every": 0} for rule in all_rules()}  # each rule at each of these evaluations
    engine = Engine(all_rules(), build_configs(all_rules(), every_poll), 6.0, WINDOW)
    for poll in range(40):
        t = 1000.0 + 2 * poll
        states = [state_of(i, fast_sample(power_watts=700.0 + rng.randint(-5, 5),
                                          temperature_celsius=float(rng.randint(50, 60))), t) for i in range(gpus)]
        counts.clear()
        engine.evaluate(snapshot_of(states, t))
    return dict(counts)


def test_an_evaluation_makes_the_same_window_lookups_per_gpu_at_8_and_64_gpus(monkeypatch):
    """O(GPUs x rules): the lookups per GPU do not grow with the node, peers() is not used by any
    shipped rule, and the outlier's per-model index is built once per evaluation."""
    counts: dict[str, int] = {}

    def counting(name, method):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return method(*args, **kwargs)
        return wrapper

    for name in ("gpu", "fast", "slow", "peers", "fresh", "history", "slow_history", "series", "slow_series"):
        monkeypatch.setattr(Window, name, counting(name, getattr(Window, name)))
    monkeypatch.setattr(thermal, "_peers_by_model", counting("peers_by_model", thermal._peers_by_model))
    small, large = _count_lookups(8, counts), _count_lookups(64, counts)
    assert small.get("peers", 0) == large.get("peers", 0) == 0
    per_node = ("peers_by_model", "fresh")  # node-wide, once per evaluation
    for name in per_node:
        assert small[name] == large[name] == 1, name
    for name in set(small) | set(large):
        if name not in per_node:
            assert large.get(name, 0) / 64 == small.get(name, 0) / 8, name
    assert sum(large.values()) <= 64 * 60  # a few dozen lookups per GPU for all rules together


def test_history_evaluates_a_predicate_once_per_sample_however_often_asked():
    calls = []

    def odd(sample):
        calls.append(sample)
        return sample % 2 == 1

    history = History()
    key = ("a_rule", "odd")  # the (rule id, name) of a declared series
    for i in range(1000):
        history.append(float(i), i)
        history.trim(i - 100.0)
        for _ in range(3):  # three GPUs' evaluations asking the same question
            hits, samples = history.tally(key, odd, i - 30.0)
            assert (hits, samples) == (sum(1 for k in range(i - 30, i + 1) if k >= 0 and k % 2), min(i + 1, 31))
            first, last = history.first_last(key, odd, i - 30.0) or (None, None)
            if i >= 1:
                assert first[1] == next(k for k in range(max(0, i - 30), i + 1) if k % 2)
                assert last[1] == (i if i % 2 else i - 1)
    assert len(calls) <= 1000 + rules_history._CHUNK  # once each (a column restarted after compaction at most)
    assert len(history.samples) == len(history.times) <= 101 + rules_history._CHUNK + 1
    assert history.cached() == [("tally", key)]


def test_history_derive_recomputes_only_when_its_samples_change():
    computed = []

    def total(history, lo):
        computed.append(lo)
        return sum(history.samples[lo:])

    history = History((float(t), t) for t in range(10))
    key = ("a_rule", "total")
    assert history.derive(key, total, 5.0) == 5 + 6 + 7 + 8 + 9
    assert history.derive(key, total, 4.5) == 35 and len(computed) == 1  # the same samples
    history.append(10.0, 10)
    assert history.derive(key, total, 5.0) == 45 and len(computed) == 2


def test_the_latest_snapshot_wins_over_one_taken_earlier_and_evaluated_later():
    """Two threads (the poll and the timer) may evaluate snapshots out of order: an older sample
    is not appended after a newer one, so the history stays in time order."""
    engine = Engine(all_rules(), build_configs(all_rules(), None), 6.0, WINDOW)
    old, new = fast_sample(temperature_celsius=50.0), fast_sample(temperature_celsius=51.0)
    engine.evaluate(snapshot_of([state_of(0, new, 1002.0)], 1002.0))
    engine.evaluate(snapshot_of([state_of(0, old, 1000.0)], 1000.0), now=1002.5)
    history = engine._history[identity(0).uuid]
    assert [(t, s.thermal.temperature_celsius) for t, s in history.pairs()] == [(1002.0, 51.0)]


def test_history_keeps_only_what_rules_look_back_at():
    """The copies kept for the look-back drop clocks, memory, energy and P-state (the latest sample
    in the snapshot keeps them): a third less memory per kept sample."""
    engine = Engine(all_rules(), build_configs(all_rules(), None), 6.0, WINDOW)
    sample = fast_sample(temperature_celsius=51.0)
    engine.evaluate(snapshot_of([state_of(0, sample, 1002.0)], 1002.0))
    [kept] = engine._history[identity(0).uuid].samples
    assert (kept.clocks.clock_hertz, kept.memory.memory_used_bytes, kept.power.energy_joules, kept.power.performance_state) == ({}, None, None, None)
    assert (kept.thermal.temperature_celsius, kept.power.power_watts, kept.utilization.utilization_ratio, kept.clocks.clocks_event_seconds) == (
        sample.thermal.temperature_celsius, sample.power.power_watts, sample.utilization.utilization_ratio, sample.clocks.clocks_event_seconds)


# ------------------------------------------------------------------------------------ memory


def test_decoded_clock_event_reasons_are_one_shared_read_only_mapping_per_pair():
    first = decode_clocks_event_reasons(0x044, ALL_REASONS)
    assert first is decode_clocks_event_reasons(0x044, ALL_REASONS)
    assert first is decode_clocks_event_reasons(0x044 | 1 << 40, ALL_REASONS | 1 << 41)  # unknown bits
    assert first == {name: bit in (0x004, 0x040) for name, bit in CLOCKS_EVENT_REASON_BITS.items()}
    assert decode_clocks_event_reasons(0x044, 0x004) == {"sw_power_cap": True}
    with pytest.raises(TypeError):
        first["gpu_idle"] = True  # type: ignore[index]
    # a trace records it like any mapping
    encoded = encode_fast(fast_sample(clocks_event_active=first))
    assert json.loads(json.dumps(encoded))["clocks_event_active"]["hw_thermal_slowdown"] is True


def test_history_holds_a_sample_in_two_slots_not_a_pair_and_a_float():
    """A kept sample costs its list slot and an 8-byte time (the sample itself is shared): a (time, sample)
    tuple and a float object per sample were 88 bytes more, 0.8 MB at 64 GPUs."""
    import tracemalloc

    history, sample = History(), fast_sample()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20_000):
            history.append(1000.0 + i * 0.5, sample)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown / 20_000 < 24  # 16 and the lists' spare room
    assert history.pair(19_999) == (10_999.5, sample) and len(history) == 20_000
