"""Every rule's scenario through the real pipeline: simulated node -> poller -> store -> engine.

No scheduler and no sleeps: the agent as `gpuwatch run --sim.scenario NAME` wires it, on a FakeClock
(gpuwatch.testing.Harness: fast polls every 2 s with the rules after each, slow polls and the host job
every 30 s, XID events drained after each job), read every 2 s, all with the shipped defaults. The
scenario whose reads hang (collection_stalled) plays on worker threads instead, as APScheduler runs
the polls, so that the hung call really blocks its poll while time goes on;
``SimulatedBackend.hung_reads`` tells a hung poll from a running one, so every tick waits for its poll
unless that poll is hung, and the run stays deterministic; there the engine is evaluated every tick
with the tick's time (like its timer).

Timing expectations come from the scenario: the expected anomaly starts firing no later than
onset + condition latency + hold + every + a run of the rules + 2 polls (``Scenario.fires_by``) and is
quiet again no later than end + recovery + clear + every + a run + 2 polls (``Scenario.resolves_by``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from daemon import wait_for

from gpuwatch.backends.simulated import Fault, Scenario, SimulatedBackend, scenarios
from gpuwatch.clock import FakeClock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.model import NodeInfo
from gpuwatch.poller import RULES_EVERY_SECONDS, Poller
from gpuwatch.rules import all_rules
from gpuwatch.rules.engine import Engine
from gpuwatch.rules.settings import build_configs
from gpuwatch.store import Store
from gpuwatch.testing import Harness

FAST, SLOW, STALENESS = 2.0, 30.0, 6.0
RULES = {rule.id: rule for rule in all_rules()}
CONFIGS = build_configs(all_rules(), None)
SCENARIOS = scenarios()


class _Tier:
    """One tier's polls on a worker thread, at most one in flight (APScheduler's max_instances=1)."""

    def __init__(self, poll: Callable[[], None], backend: SimulatedBackend) -> None:
        self._poll, self._backend = poll, backend
        self._thread: threading.Thread | None = None

    def settle(self) -> None:
        """Wait until the poll in flight has finished, unless it is hung in the backend."""
        deadline = time.monotonic() + 30.0
        while self._thread is not None and self._thread.is_alive() and not self._backend.hung_reads:
            assert time.monotonic() < deadline, "a poll neither finished nor hung"
            self._thread.join(0.002)

    def run(self) -> None:
        self.settle()
        if self._thread is not None and self._thread.is_alive():
            return  # still hung: this run is skipped
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        self.settle()


@dataclass
class Run:
    """What the engine said at every tick: time (s after open) -> {(rule, gpu): firing anomaly}."""

    ticks: list[tuple[float, dict[tuple[str, str | None], str]]] = field(default_factory=list)

    def firing(self, rule: str, gpu: str | None) -> list[float]:
        return [t for t, firing in self.ticks if (rule, gpu) in firing]

    def others(self, allowed_gpu: str | None, expected: tuple[str, str | None] | None) -> set:
        """Warning/critical anomalies other than the expected one, on GPUs other than ``allowed_gpu``."""
        found = set()
        for t, firing in self.ticks:
            for (rule, gpu), severity in firing.items():
                if severity == "info" or (rule, gpu) == expected:
                    continue
                if gpu is not None and gpu == allowed_gpu:
                    continue
                found.add((rule, gpu, t))
        return found


def play(scenario: Scenario) -> Run:
    """The scenario through the agent as `gpuwatch run --backend simulated --sim.scenario NAME` wires it,
    on simulated time (gpuwatch.testing.Harness); a scenario whose reads hang plays on threads (play_hung)."""
    if any(fault.kind == "hang" for fault in scenario.faults):
        return play_hung(scenario)
    harness = Harness(args=["--backend", "simulated", "--sim.scenario", scenario.name, "--poll.interval", str(FAST),
                            "--poll.slow-interval", str(SLOW)])
    start = harness.clock.monotonic()
    run = Run()
    try:
        for tick in range(int(scenario.duration_seconds / FAST) + 1):
            harness.advance(FAST if tick else 0)
            run.ticks.append((harness.clock.monotonic() - start,
                              {(a.rule, a.gpu): a.severity for a in harness.anomalies()}))
    finally:
        harness.close()
    return run


def play_hung(scenario: Scenario) -> Run:
    """Polls on worker threads, as APScheduler runs them, so that a hung read blocks its poll while
    time goes on (see the module docstring)."""
    clock = FakeClock()
    backend = scenario.backend(clock)
    store = Store(clock, backend.name, NodeInfo(power_budget_watts=scenario.node_power_budget_watts))
    poller = Poller(backend, store, clock, fast_interval=FAST, slow_interval=SLOW, host=backend.read_host)
    engine = Engine(all_rules(), CONFIGS, fast_staleness=STALENESS, slow_staleness=3 * SLOW)
    fast, slow = _Tier(poller.poll_fast, backend), _Tier(poller.poll_slow, backend)
    start = clock.monotonic()
    run = Run()
    ticks = int(scenario.duration_seconds / FAST)
    try:
        for tick in range(ticks + 1):
            if tick:
                clock.advance(FAST)
            if tick and tick % int(SLOW / FAST) == 0:
                slow.run()
            fast.run()
            if tick % int(SLOW / FAST) == 0:
                poller.poll_host()  # the host job, every slow interval from the start
            try:
                for event in backend.wait_events(0):
                    store.record_xid(event)
            except BackendUnavailable:
                pass
            anomalies = engine.evaluate(store.snapshot(), clock.monotonic(), clock.wall())
            run.ticks.append((clock.monotonic() - start,
                              {(a.rule, a.gpu): a.severity for a in anomalies if a.firing}))
    finally:
        backend.close()  # releases a read still hung
        fast.settle()
        slow.settle()
    return run


FAULT_SCENARIOS = sorted(name for name, s in SCENARIOS.items() if s.rule is not None)
HEALTHY_SCENARIOS = sorted(name for name, s in SCENARIOS.items() if s.rule is None)


def test_every_rule_has_a_scenario_named_after_it():
    """One scenario per rule, expecting that rule; healthy scenarios cover both main profiles."""
    assert {s.rule for s in SCENARIOS.values() if s.rule} == set(RULES)
    for name in FAULT_SCENARIOS:  # a variant of a rule's scenario is "<rule>-<variant>"
        assert SCENARIOS[name].rule == name.split("-")[0]
    assert {SCENARIOS[name].profile for name in HEALTHY_SCENARIOS} >= {"rtx6000", "h200"}
    for name in HEALTHY_SCENARIOS:
        assert SCENARIOS[name].duration_seconds >= 1800


@pytest.mark.parametrize("name", FAULT_SCENARIOS)
def test_scenario_fires_its_rule_in_time_and_resolves(name):
    """The expected anomaly fires after the fault's onset and by onset + latency + hold + every + a run of the
    rules (4 s) + 2 polls, is quiet again by end + recovery + clear + every + a run + 2 polls, and nothing else of warning or critical
    severity fires anywhere but on the faulty GPU."""
    scenario = SCENARIOS[name]
    rule = RULES[scenario.rule]
    config = CONFIGS[rule.id]
    gpu = str(scenario.gpu) if scenario.gpu is not None else None
    key = (rule.id, None if rule.scope == "node" else gpu)
    run = play(scenario)

    firing = run.firing(*key)
    assert firing, f"{rule.id} never fired on {key[1]}"
    first = firing[0]
    # a rule's ``every`` counts from the runs of the rules (about every RULES_EVERY_SECONDS): one run more
    fires_by = scenario.fires_by(config.hold_seconds + config.every_seconds + RULES_EVERY_SECONDS, FAST)
    assert scenario.onset_seconds + config.hold_seconds <= first <= fires_by, (
        f"{rule.id} first fired at {first:.0f} s; expected from "
        f"{scenario.onset_seconds + config.hold_seconds:.0f} to {fires_by:.0f} s")
    resolved_by = scenario.resolves_by(config.clear_seconds + config.every_seconds + RULES_EVERY_SECONDS, FAST)
    assert resolved_by is not None and resolved_by <= scenario.duration_seconds
    late = [t for t in firing if t > resolved_by]
    assert not late, f"{rule.id} still firing at {late[0]:.0f} s, after {resolved_by:.0f} s"
    assert run.ticks[-1][0] >= resolved_by

    assert run.others(gpu, key) == set()


@pytest.mark.parametrize("name", HEALTHY_SCENARIOS)
def test_healthy_scenario_fires_nothing_of_warning_or_critical(name):
    """Idle GPUs, burn jobs at the power cap, jobs below it, P-state changes, idle PCIe downshifts
    and brief hw_slowdown flashes are all normal: at most info anomalies (power_capped) fire."""
    run = play(SCENARIOS[name])
    assert run.others(None, None) == set()
    assert run.firing("power_capped", "0"), "the burn job at the cap should show as power_capped (info)"


# ------------------------------------------------------------------ backend-level faults the scenarios use


def _node(faults, gpu_count=2):
    clock = FakeClock()
    backend = SimulatedBackend(clock, gpu_count=gpu_count, profile="h200", faults=faults)
    backend.open()
    return clock, backend, [g.identity.uuid for g in backend.discover()]


def test_hang_blocks_reads_until_the_window_ends_by_the_clock():
    """A read during a hang blocks (hung_reads says so) and returns once the clock passes the end;
    close() releases it too."""
    clock, backend, (uuid, _) = _node([Fault("hang", 0, 10, 20)])
    clock.advance(12)
    done = threading.Event()
    reader = threading.Thread(target=lambda: (backend.read_fast(uuid), done.set()), daemon=True)
    reader.start()
    wait_for(lambda: backend.hung_reads, what="the read to hang")
    assert not done.is_set()
    clock.advance(8)
    reader.join(10)
    assert done.is_set() and backend.hung_reads == 0

    clock2, backend2, (uuid2, _) = _node([Fault("hang", 0, 0, 100)])
    failed = []

    def read():
        try:
            backend2.read_fast(uuid2)
        except BackendUnavailable:
            failed.append(True)

    blocked = threading.Thread(target=read, daemon=True)
    blocked.start()
    wait_for(lambda: backend2.hung_reads, what="the read to hang")
    backend2.close()
    blocked.join(10)
    assert failed == [True]


def test_backend_down_and_unlisted_faults():
    """backend_down: every call raises BackendUnavailable(driver_not_loaded), then the node answers
    again; unlisted: the GPU is left out of discovery and its reads raise DeviceLost."""
    clock, backend, (first, second) = _node([Fault("backend_down", 0, 10, 20), Fault("unlisted", 1, 30, 40)])
    clock.advance(10)
    for call in (lambda: backend.read_fast(first), backend.discover, lambda: backend.wait_events(0), backend.open):
        with pytest.raises(BackendUnavailable) as raised:
            call()
        assert raised.value.reason == "driver_not_loaded"
    clock.advance(10)
    backend.open()
    assert len(backend.discover()) == 2
    clock.advance(10)
    assert [g.identity.uuid for g in backend.discover()] == [first]
    with pytest.raises(DeviceLost):
        backend.read_fast(second)
    clock.advance(10)
    assert len(backend.discover()) == 2 and backend.read_fast(second).thermal.temperature_celsius is not None


def test_slow_tier_faults_change_the_readings_they_should():
    """pcie_downtrain and pcie_replays on the link; the row_remap_* flags with their XIDs."""
    clock, backend, (a, b) = _node([Fault("pcie_downtrain", 0, 10, 20), Fault("pcie_replays", 1, 10, 130),
                                    Fault("row_remap_failure", 0, 30, 40), Fault("row_remap_pending", 1, 30, 40)])
    clock.advance(15)
    assert backend.read_slow(a).pcie.pcie_link_width == {"current": 8, "max": 16}
    clock.advance(75)  # 80 s of 30 replays a minute
    assert backend.read_slow(b).pcie.pcie_replays == 40
    assert backend.read_slow(a).ecc.remapped_rows_failed is False
    clock.advance(45)  # after the replays' end: the reset zeroed the counter
    assert backend.read_slow(b).pcie.pcie_replays == 0
    clock2, backend2, (c, _) = _node([Fault("row_remap_failure", 0, 30, 40), Fault("row_remap_pending", 1, 30, 40)])
    clock2.advance(31)
    slow_c = backend2.read_slow(c)
    assert slow_c.ecc.remapped_rows_failed is True and slow_c.ecc.remapped_rows_pending is False
    assert [e.xid for e in backend2.wait_events(0)] == [64, 63]
