"""The rule engine's state machine: hold before firing, clear before resolving, one event per transition."""

import dataclasses
import json

import pytest

from gpuwatch.errors import ConfigError
from gpuwatch.model import DiscoveredGpu, GpuState, NodeSnapshot, Observation, SlowSample
from gpuwatch.rules import all_rules
from gpuwatch.rules.base import GpuRule, needs
from gpuwatch.rules.engine import Engine
from gpuwatch.rules.settings import build_configs, check_lookback
from gpuwatch.store import Store
from gpuwatch.testing import H200_FEATURES, FakeClock, fast_sample, identity, slow_sample

HOT = 80.0


def too_hot(window, uuid, config):
    sample = window.fast(uuid)
    if sample is None:
        return None
    t = sample.thermal.temperature_celsius
    return Observation(t >= config["limit"], t, config["limit"], f"GPU at {t:.0f} C")


RULES = (
    GpuRule(id="too_hot", severity="critical", hold_seconds=6, clear_seconds=4, condition="temperature >= limit",
            evaluate=too_hot, params={"limit": HOT}),
    GpuRule(id="fan_thing", severity="warning", hold_seconds=0, clear_seconds=0, condition="needs a fan",
            evaluate=lambda w, u, c: Observation(True), applies=needs("fan")),
)


class Node:
    def __init__(self, rules=RULES, raw=None):
        self.clock = FakeClock()
        self.store = Store(self.clock, "scripted")
        self.gpu = DiscoveredGpu(identity(0), H200_FEATURES)
        self.store.set_gpus([self.gpu])
        self.store.set_backend(True)
        self.engine = Engine(rules, build_configs(rules, raw), fast_staleness=6)

    def poll(self, temperature):
        self.clock.advance(2)
        self.store.put_fast(self.gpu.identity.uuid, fast_sample(temperature_celsius=temperature))
        return {a.rule: a for a in self.engine.evaluate(self.store.snapshot())}


def events(capsys):
    return [json.loads(l) for l in capsys.readouterr().err.splitlines() if l.startswith("{")]


def test_fires_after_hold_and_resolves_after_clear(capsys):
    node = Node()
    states = [node.poll(t)["too_hot"].firing for t in (50, 85, 85, 85, 85, 50, 50, 50)]
    # condition true from poll 2 (t=4); hold 6 s -> firing at t=10 (poll 5); false from t=12; clear 4 s -> t=16
    assert states == [False, False, False, False, True, True, True, False]
    log = [e for e in events(capsys) if e["event"].startswith("anomaly_")]
    assert [e["event"] for e in log] == ["anomaly_started", "anomaly_resolved"]
    started = log[0]
    assert started["rule"] == "too_hot" and started["gpu"] == "0" and started["uuid"] == node.gpu.identity.uuid
    assert (started["severity"], started["value"], started["threshold"]) == ("critical", 85.0, HOT)
    assert started["summary"] == "GPU at 85 C"


def test_a_single_noisy_sample_neither_fires_nor_clears():
    node = Node()
    assert not any(node.poll(t)["too_hot"].firing for t in (50, 90, 50, 90, 50, 90, 50))
    for t in (90, 90, 90, 90):
        last = node.poll(t)["too_hot"]
    assert last.firing and last.onsets == 1
    assert node.poll(50)["too_hot"].firing  # one cool sample: clearing, still firing
    assert node.poll(90)["too_hot"].firing
    assert node.poll(90)["too_hot"].onsets == 1  # no new onset after a flap


def test_since_and_onsets_and_rules_not_applicable_are_absent():
    node = Node()
    for t in (85, 85, 85, 85):
        result = node.poll(t)
    assert "fan_thing" not in result  # H200: no fan, rule not evaluated, no series
    assert result["too_hot"].since_wall == node.clock.wall()
    for t in (50, 50, 50, 85, 85, 85, 85):
        result = node.poll(t)
    assert result["too_hot"].onsets == 2


def test_stale_data_does_not_move_the_state():
    node = Node()
    for t in (85, 85, 85, 85):
        node.poll(t)
    node.clock.advance(30)  # no poll: data stale, the rule answers None
    result = {a.rule: a for a in node.engine.evaluate(node.store.snapshot(), node.clock.monotonic(), node.clock.wall())}
    assert result["too_hot"].firing


def test_yaml_settings_override_defaults():
    node = Node(raw={"too_hot": {"limit": 90, "hold": 0, "severity": "warning"}})
    result = node.poll(85)["too_hot"]
    assert not result.firing
    result = node.poll(95)["too_hot"]
    assert result.firing and result.severity == "warning"
    node = Node(raw={"too_hot": False})
    assert "too_hot" not in node.poll(95)


def test_a_rule_with_every_is_evaluated_at_most_that_often_and_keeps_its_state_between():
    """every: 6 s with polls 2 s apart: evaluated at every third poll, firing (hold 6 s) at most
    6 s later than at every poll, its last state returned between evaluations."""
    seen = []

    def counting(window, uuid, config):
        seen.append(window.now)
        return too_hot(window, uuid, config)

    rules = (GpuRule(id="too_hot", severity="critical", hold_seconds=6, clear_seconds=4,
                     condition="temperature >= limit", evaluate=counting, params={"limit": HOT}, every_seconds=6),)
    node = Node(rules)
    firing = [node.poll(t)["too_hot"].firing for t in (50, 85, 85, 85, 85, 85, 85, 85, 85)]
    assert [b - a for a, b in zip(seen, seen[1:])] == [6.0, 6.0]  # t=2, 8, 14
    assert firing == [False] * 6 + [True] * 3  # pending from t=8 (seen 85), firing at t=14
    node = Node(rules, raw={"too_hot": {"every": 0}})  # YAML: back to every poll
    seen.clear()
    for t in (50, 85, 85):
        node.poll(t)
    assert len(seen) == 3


def test_a_rule_with_every_evaluates_a_new_gpu_at_once():
    rules = (GpuRule(id="too_hot", severity="critical", hold_seconds=0, clear_seconds=0,
                     condition="temperature >= limit", evaluate=too_hot, params={"limit": HOT}, every_seconds=60),)
    node = Node(rules)
    assert not node.poll(75)["too_hot"].firing
    second = DiscoveredGpu(identity(1), H200_FEATURES)
    node.store.set_gpus([node.gpu, second])
    node.store.put_fast(second.identity.uuid, fast_sample(temperature_celsius=95.0))
    node.poll(75)
    states = {a.uuid: a for a in node.engine.evaluate(node.store.snapshot())}
    assert states[second.identity.uuid].firing and not states[node.gpu.identity.uuid].firing


@pytest.mark.parametrize(("raw", "message"), [
    ({"nope": {}}, "unknown rule 'nope'"),
    ({"too_hot": {"limt": 3}}, "rules.too_hot.limt: unknown setting; too_hot takes enabled, severity, hold, clear, every, limit"),
    ({"too_hot": {"hold": -1}}, "must be 0 or more"),
    ({"too_hot": {"every": -5}}, "must be 0 or more"),
    ({"too_hot": {"severity": "page"}}, "must be one of critical, warning, info"),
    ({"too_hot": {"limit": "hot"}}, "expected a number"),
    ({"too_hot": {"enabled": "yes"}}, "expected true or false"),
])
def test_bad_rule_settings_are_config_errors(raw, message):
    with pytest.raises(ConfigError, match=message):
        build_configs(RULES, raw)


# ---------------------------------------------------------------------------------------- history window


def test_a_rule_that_looks_back_further_than_the_window_is_a_config_error():
    """Every shipped default fits in the default 300 s window; a longer fast look-back of an
    enabled rule is refused with the fix in the message; slow look-backs and XID look-backs are not
    bounded by the window (the engine keeps the slow history as long as they need)."""
    rules = all_rules()
    Engine(rules, build_configs(rules, None), 6.0)  # DEFAULT_WINDOW_SECONDS
    Engine(rules, build_configs(rules, None), 6.0, window_seconds=60)  # the longest default fast look-back
    too_long = {"power_capped": {"window_seconds": 400}}
    with pytest.raises(ConfigError, match=r"^rules\.power_capped\.window_seconds: 400 s is longer than the 300 s "
                                          r"of fast-sample history .* raise rules\.window \(--rules\.window\) to at "
                                          r"least 400, or lower window_seconds$"):
        Engine(rules, build_configs(rules, too_long), 6.0, window_seconds=300)
    Engine(rules, build_configs(rules, too_long), 6.0, window_seconds=400)
    Engine(rules, build_configs(rules, {"power_capped": {"window_seconds": 400, "enabled": False}}), 6.0, 300)
    unbounded = {"xid_critical": {"lookback_seconds": 3600}, "pcie_replays_rising": {"lookback_seconds": 3600}}
    assert check_lookback(rules, build_configs(rules, unbounded), 300) == 3600
    assert check_lookback(rules, build_configs(rules, None), 600) == 600


def test_the_history_keeps_what_the_enabled_rules_look_back_at_not_the_whole_window():
    """Default rules look back 60 s at most: with a 90 s floor (min_history_seconds) and a 6 s fast
    staleness, 96 s of samples are kept of the 300 s window; a longer look-back configured by
    reload extends it, never past the window."""
    rules = all_rules()
    engine = Engine(rules, build_configs(rules, None), 6.0, window_seconds=300, min_history_seconds=90.0)
    assert engine.history_seconds == 96.0
    clock = FakeClock()
    store = Store(clock, "scripted")
    gpu = DiscoveredGpu(identity(0), H200_FEATURES)
    store.set_gpus([gpu])
    store.set_backend(True)
    for _ in range(200):  # 400 s of polls every 2 s
        clock.advance(2.0)
        store.put_fast(gpu.identity.uuid, fast_sample())
        engine.evaluate(store.snapshot())
    history = engine._history[gpu.identity.uuid]
    kept = history.times[history.start:]
    assert clock.monotonic() - kept[0] <= 96.0 and len(history.samples) <= 96 / 2 + 1 + 16  # a trim chunk
    engine.reconfigure(build_configs(rules, {"power_capped": {"window_seconds": 200}}))
    assert engine.history_seconds == 206.0
    engine.reconfigure(build_configs(rules, {"power_capped": {"window_seconds": 300}}))
    assert engine.history_seconds == 300.0  # capped by the window


def test_reconfigure_refuses_a_longer_look_back_and_keeps_the_settings_in_effect():
    node = Node()
    node.engine = Engine(all_rules(), build_configs(all_rules(), None), 6.0, window_seconds=60)
    with pytest.raises(ConfigError, match="rules.thermal_runaway.window_seconds: 90 s"):
        node.engine.reconfigure(build_configs(all_rules(), {"thermal_runaway": {"window_seconds": 90}}))
    assert node.engine._configs["thermal_runaway"]["window_seconds"] == 60
    node.engine.reconfigure(build_configs(all_rules(), {"thermal_runaway": {"window_seconds": 45}}))
    assert node.engine._configs["thermal_runaway"]["window_seconds"] == 45


def test_every_look_back_parameter_of_the_shipped_rules_is_declared():
    """window_seconds reads the fast history (checked against rules.window); pcie_replays_rising's
    lookback reads the slow history; xid_critical's lookback reads the store's XID timestamps."""
    for rule in all_rules():
        if "window_seconds" in rule.params:
            assert rule.lookback.get("window_seconds") == "fast", rule.id
        assert set(rule.lookback) <= set(rule.params), rule.id
    by_id = {rule.id: rule for rule in all_rules()}
    assert by_id["pcie_replays_rising"].lookback == {"lookback_seconds": "slow"}
    assert by_id["xid_critical"].lookback == {}


def test_slow_history_is_kept_for_the_pcie_look_back_beyond_the_window():
    """With rules.window 120 s the replay rate is still taken over pcie_replays_rising's 300 s."""
    rules = [rule for rule in all_rules() if rule.id == "pcie_replays_rising"]
    engine = Engine(rules, build_configs(rules, None), 6.0, window_seconds=120)
    gpu = identity(0)
    for i in range(15):  # a slow poll every 30 s, 5 replays each: 10 a minute
        t = 1000.0 + 30 * i
        state = GpuState(identity=gpu, features=dict(H200_FEATURES), up=True, fast=fast_sample(), fast_monotonic=t,
                         slow=slow_sample(pcie_replays=500 + 5 * i), slow_monotonic=t)
        (anomaly,) = engine.evaluate(NodeSnapshot(i, "scripted", True, None, None, (state,), {}, 1, t, 1.7e9 + t))
    assert anomaly.value == pytest.approx(10.0) and "over the last 5 min" in anomaly.summary


def test_a_rule_that_raises_fails_alone_and_the_watchdog_stays_fed(capsys):
    """overheating raises on every GPU (a bug on an odd reading): it is logged once per GPU as
    rule_failed, counted per evaluation, its state stays as it was; every other rule is evaluated
    on every GPU, an anomaly of another rule still fires, and Agent.alive() (the watchdog) is fine."""
    import dataclasses

    from gpuwatch.agent import Agent
    from gpuwatch.config import Config
    from gpuwatch.testing import ScriptedBackend

    clock = FakeClock()
    backend = ScriptedBackend(gpus=2)
    hot = backend.gpus[1].identity.uuid
    backend.slow[hot] = slow_sample(ecc_errors={("uncorrected", "volatile"): 3, ("uncorrected", "aggregate"): 3,
                                                 ("corrected", "volatile"): 0, ("corrected", "aggregate"): 0})
    agent = Agent(Config(), clock=clock, backend=backend)

    def broken(window, uuid, config):
        raise ZeroDivisionError("division by zero")

    engine = agent.engine
    engine._rules = [dataclasses.replace(r, evaluate=broken) if r.id == "overheating" else r for r in engine.rules]
    for _ in range(5):
        clock.advance(4)  # RULES_EVERY_SECONDS: each poll runs the rules
        agent.poller.poll_fast()
    snap = agent.store.snapshot()
    evaluated = {(a.rule, a.uuid) for a in snap.anomalies}
    assert ("overheating", hot) in evaluated  # still listed, never firing
    assert {r for r, _ in evaluated} == {r.id for r in engine.rules if r.scope == "node"
                                         or any(r.applies(g) for g in snap.gpus)}
    assert [a.rule for a in snap.anomalies if a.firing] == ["ecc_uncorrectable"]
    assert snap.rule_errors["overheating"] == 10 and snap.rule_errors["thermal_runaway"] == 0
    failed = [e for e in events(capsys) if e["event"] == "rule_failed"]
    assert sorted(e["gpu"] for e in failed) == ["0", "1"] and "ZeroDivisionError" in failed[0]["error"]
    assert agent.alive() is None
    text = agent.exposition.render()[0].decode()
    assert 'gpuwatch_rule_evaluation_errors_total{rule="overheating"} 10.0' in text


def test_history_copies_drop_what_no_rule_looks_back_at_and_share_equal_readings():
    import dataclasses

    from gpuwatch.rules.engine import _for_history

    first = fast_sample(temperature_celsius=60.0, power_watts=300.0)
    again = fast_sample(temperature_celsius=60.0, power_watts=310.0)
    kept1 = _for_history(first, None)
    kept2 = _for_history(again, kept1)
    assert kept1.memory.memory_used_bytes is None and kept1.errors == () and kept1.collected == ()
    assert not kept1.clocks.clock_hertz and kept1.clocks.clocks_event_active == first.clocks.clocks_event_active
    assert kept1.power.power_watts == 300.0 and kept1.power.energy_joules is None
    assert kept2.thermal is kept1.thermal and kept2.utilization is kept1.utilization  # equal: shared
    assert kept2.power is not kept1.power and kept2.power.power_watts == 310.0
    assert kept1.thermal == first.thermal and kept2.fans == again.fans
    # only what the history leaves out changed (memory, errors): the previous kept sample itself
    steady = dataclasses.replace(again, memory=fast_sample(memory_used_bytes=1 << 30).memory, errors=("timeout",))
    assert _for_history(steady, kept2) is kept2
    assert _for_history(fast_sample(temperature_celsius=61.0, power_watts=310.0), kept2) is not kept2


def test_slow_history_copies_keep_what_rules_look_back_at_and_share_equal_readings():
    import dataclasses

    from gpuwatch.rules.engine import SLOW_HISTORY, _for_slow_history

    first = dataclasses.replace(slow_sample(pcie_replays=3, ecc_errors={"volatile_corrected": 1}),
                                errors=("timeout",), collected=(("ecc", 0.001, True),))
    again = slow_sample(pcie_replays=3, ecc_errors={"volatile_corrected": 1})
    third = slow_sample(pcie_replays=5)
    kept1 = _for_slow_history(first, None)
    kept2 = _for_slow_history(again, kept1)
    kept3 = _for_slow_history(third, kept2)
    assert set(SLOW_HISTORY) == {"pcie", "nvlink"}  # what Window.slow_derive's rules read (health, interconnect)
    assert kept1.pcie == first.pcie and kept1.nvlink == first.nvlink
    assert kept1.ecc == SlowSample().ecc and kept1.errors == () and kept1.collected == ()  # not looked back at
    assert kept2.pcie is kept1.pcie and kept2.pcie is not again.pcie  # equal readings: shared
    assert kept3.pcie is third.pcie and kept3.pcie.pcie_replays == 5  # a changed reading: its own


def test_the_history_keeps_every_polls_sample_while_the_rules_run_every_4_s():
    """At 0.5 s polls the rules run after every eighth poll, but every poll's fast sample goes into the
    history they look back at: windowed shares, medians and the fast sample nearest a slow read (the
    PCIe rule) see the same samples as if the rules ran after every poll."""
    import dataclasses

    from gpuwatch.agent import Agent
    from gpuwatch.config import Config
    from gpuwatch.testing import ScriptedBackend

    clock = FakeClock()
    backend = ScriptedBackend(gpus=2)
    agent = Agent(dataclasses.replace(Config(), poll_interval=0.5), clock=clock, backend=backend)
    runs = []
    evaluate = agent.engine.evaluate
    agent.engine.evaluate = lambda *a, **k: runs.append(clock.monotonic()) or evaluate(*a, **k)  # type: ignore[method-assign]
    for _ in range(33):
        agent.poller.poll_fast()
        clock.advance(0.5)
    assert len(runs) == 5  # 0, 4, 8, 12, 16 s
    uuid = backend.gpus[0].identity.uuid
    times = list(agent.engine._history[uuid].times)
    assert len(times) == 33 and all(abs(b - a - 0.5) < 1e-9 for a, b in zip(times, times[1:]))


def test_a_fast_poll_that_does_not_run_the_rules_builds_no_snapshot(monkeypatch):
    """Each write of a poll makes the store's snapshot stale: the poll reads the GPUs to poll and the rules'
    history takes its samples from the store's states, not from a snapshot built for them (two a poll
    before). The history still gets every poll's sample."""
    import dataclasses

    from gpuwatch import store as store_module
    from gpuwatch.agent import Agent
    from gpuwatch.config import Config
    from gpuwatch.testing import ScriptedBackend

    clock = FakeClock()
    backend = ScriptedBackend(gpus=2)
    agent = Agent(dataclasses.replace(Config(), poll_interval=1.0), clock=clock, backend=backend)
    clock.advance(4)
    agent.poller.poll_fast()  # the first: the slow tier too, and the rules (then 3.5 s on: RULES_EVERY_SECONDS)
    built = []
    real = store_module.NodeSnapshot
    monkeypatch.setattr(store_module, "NodeSnapshot", lambda **kw: built.append(1) or real(**kw))
    uuid = backend.gpus[0].identity.uuid
    before = len(agent.engine._history[uuid])
    for _ in range(3):
        clock.advance(1)
        agent.poller.poll_fast()
    assert built == []
    assert len(agent.engine._history[uuid]) == before + 3
    clock.advance(4)
    agent.poller.poll_fast()  # the rules run: they see a snapshot
    assert built and len(agent.engine._history[uuid]) == before + 4


def scripted_rule(script, severity="warning"):
    """A rule that observes what ``script`` says, in order: (active, whether its summary raises)."""

    def evaluate(window, uuid, config):
        active, broken = script.pop(0)

        def summary():
            if broken:
                raise ValueError("summary bug")
            return "scripted"

        return Observation(active, 1.0, 0.0, summary)

    return GpuRule(id="scripted", severity=severity, hold_seconds=0, clear_seconds=0, condition="as scripted",
                   evaluate=evaluate)


def test_a_summary_that_raises_costs_its_text_not_the_evaluation_nor_the_resolution(capsys):
    """A rule fires, then its summary raises on the observation that resolves it: the evaluation still
    returns every verdict (the other rule's too), the anomaly resolves (logged with a placeholder summary,
    counted as the rule's error) and stays resolved; a firing anomaly whose summary raises shows a placeholder."""
    script = [(True, False), (False, True), (False, False), (False, False), (True, True)]
    node = Node(rules=(scripted_rule(script), RULES[0]))
    seen = []
    for _ in range(5):
        result = node.poll(50)
        assert set(result) == {"scripted", "too_hot"}
        seen.append(result["scripted"].firing)
    assert seen == [True, False, False, False, True]
    assert "could not be written (ValueError" in result["scripted"].summary
    log = events(capsys)
    resolved = [e for e in log if e["event"] == "anomaly_resolved"]
    assert len(resolved) == 1 and "could not be written" in resolved[0]["summary"]
    assert [e["event"] for e in log].count("rule_failed") == 1  # once per rule and GPU
    assert node.engine.counters()[1]["scripted"] == 3  # the resolution's log, the firing Anomaly and its log


def test_a_quiet_rule_shows_a_new_severity_and_a_new_gpu_label():
    """A rule that stays quiet keeps its Anomaly from one evaluation to the next, until what it shows changes:
    a severity reconfigured, the GPU's index under the same uuid."""
    script = [(False, False)] * 4
    rule = scripted_rule(script)
    node = Node(rules=(rule,))
    first = node.poll(50)["scripted"]
    assert node.poll(50)["scripted"] is first and first.severity == "warning"
    node.engine.reconfigure(build_configs((rule,), {"scripted": {"severity": "critical"}}))
    assert node.poll(50)["scripted"].severity == "critical"
    moved = DiscoveredGpu(dataclasses.replace(node.gpu.identity, index=3), H200_FEATURES)
    node.store.set_gpus([moved])
    assert node.poll(50)["scripted"].gpu == "3"
