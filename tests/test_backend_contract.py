"""The Backend protocol (gpuwatch/backends/base.py), asserted the same way over every backend: the
scripted one, the simulator, the replay of a recorded trace, and NVML through the real pynvml binding
over the fake libnvidia-ml.so.1 (in a child process: gpuwatch.testing.ChildBackend).

open() says which driver; discover() lists each GPU once, in index order, with its features; read_fast
and read_slow answer every discovered GPU with samples of their tier; wait_events(0) answers a list of
XID events at once; close() never raises and open() works again after it, finding the same GPUs; a
GPU that falls off the bus after discovery raises DeviceLost naming it while the others still answer; a backend that is down raises
BackendUnavailable with a reason, a message and a hint.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import fakenvml
import pytest
from daemon import isolated_env

from gpuwatch.backends.recorder import Recorder
from gpuwatch.backends.replay import ReplayBackend
from gpuwatch.backends.simulated import Fault, SimulatedBackend
from gpuwatch.backends.simulated.tour import parse_fault_spec
from gpuwatch.clock import FakeClock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.model import FEATURES, DiscoveredGpu, DriverInfo, FastSample, SlowSample, XidEvent
from gpuwatch.testing import ChildBackend, ForkServer, Harness, ScriptedBackend, load_config
from gpuwatch.trace import TraceWriter, read_trace

GPUS = 2
LOST = 1  # the index of the GPU that falls off the bus where a case asks for it
LOST_AT = 10.0  # when it does, on simulated time (simulator, replay)
DOWN = BackendUnavailable("driver_not_loaded", "NVML: Driver Not Loaded", "load the nvidia kernel module")


@dataclasses.dataclass
class Case:
    """A backend of the kind under test; ``advance`` moves its time (a no-op where time is real)."""

    backend: object
    advance: Callable[[float], None]
    lose: Callable[[], None]  # GPU LOST falls off the bus (a backend made with lost=True)
    close: Callable[[], None] = lambda: None


def scripted(tmp_path, lost=False, down=False) -> Case:
    backend = ScriptedBackend(GPUS)
    if down:
        backend.open_error = DOWN
    return Case(backend, lambda seconds: None, lambda: backend.lost.add(backend.gpus[LOST].identity.uuid))


def simulated(tmp_path, lost=False, down=False) -> Case:
    clock = FakeClock()
    faults = []
    if lost:
        faults.append(Fault("fell_off_bus", LOST, LOST_AT, None))
    if down:
        faults += parse_fault_spec("backend_down", GPUS)
    return Case(SimulatedBackend(clock, gpu_count=GPUS, faults=faults), clock.advance, lambda: clock.advance(LOST_AT))


def replay(tmp_path, lost=False, down=False) -> Case:
    """A trace recorded from the scripted backend through the agent (the harness) for 40 s (GPU LOST
    falling off the bus at LOST_AT with lost=True), replayed."""
    path = tmp_path / "node.jsonl"
    clock = FakeClock()
    recorded = scripted(tmp_path, lost, down)
    inner = recorded.backend
    with TraceWriter(path, clock, backend=inner.name, fast_interval=2.0, slow_interval=30.0) as writer:
        harness = Harness(backend=Recorder(inner, writer, clock), clock=clock,
                          args=["--poll.interval", "2", "--poll.slow-interval", "30", "--no-collector.slurm",
                                "--no-collector.kubernetes", "--no-collector.jobs"])
        harness.advance(LOST_AT - 1)
        if lost:
            recorded.lose()
        harness.advance(40 - LOST_AT + 1)
        harness.close()
    replay_clock = FakeClock()
    return Case(ReplayBackend(read_trace(path), replay_clock), replay_clock.advance,
                lambda: replay_clock.advance(LOST_AT + 1))


def nvml(tmp_path, lost=False, down=False) -> Case:
    node = fakenvml.FakeNode.h200(GPUS)
    if down:
        node.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    fx = fakenvml.prepare(tmp_path, node)
    env = isolated_env({**fx.env, "FAKE_NVML_RECHECK_MS": "0"})
    log = open(tmp_path / "backend.log", "w")
    backend = ChildBackend(load_config(["--backend", "nvml"], env), env, stderr=log, server=ForkServer.shared(env))

    def lose():
        node.gpus[LOST].lost = True
        fx.write(node)  # seen by the next call (FAKE_NVML_RECHECK_MS=0)

    def close():
        backend.stop()
        log.close()

    return Case(backend, lambda seconds: None, lose, close)


KINDS = {"scripted": scripted, "simulated": simulated, "replay": replay, "nvml": nvml}


@pytest.fixture(params=sorted(KINDS))
def make(request, tmp_path):
    cases = []

    def make(lost=False, down=False) -> Case:
        workdir = tmp_path / f"case{len(cases)}"
        workdir.mkdir()
        case = KINDS[request.param](workdir, lost, down)
        cases.append(case)
        return case

    yield make
    for case in cases:
        case.close()


def opened(case: Case) -> list[DiscoveredGpu]:
    driver = case.backend.open()
    assert isinstance(driver, DriverInfo) and driver.driver_version
    return case.backend.discover()


def test_open_discover_and_read_every_gpu(make):
    case = make()
    b = case.backend
    assert isinstance(b.name, str) and b.name
    gpus = opened(case)
    assert [g.identity.index for g in gpus] == list(range(GPUS))
    assert len({g.identity.uuid for g in gpus}) == GPUS
    for gpu in gpus:
        assert set(gpu.features) <= set(FEATURES) and all(isinstance(v, bool) for v in gpu.features.values())
    for _ in range(3):
        case.advance(2.0)
        for gpu in gpus:
            assert isinstance(b.read_fast(gpu.identity.uuid), FastSample)
            assert isinstance(b.read_slow(gpu.identity.uuid), SlowSample)
    events = b.wait_events(0)
    assert isinstance(events, list) and all(isinstance(e, XidEvent) for e in events)


def test_close_never_raises_and_open_again_finds_the_same_gpus(make):
    case = make()
    first = [g.identity for g in opened(case)]
    case.backend.close()
    case.backend.close()  # twice: still no error
    case.advance(2.0)
    assert [g.identity for g in opened(case)] == first
    assert isinstance(case.backend.read_fast(first[0].uuid), FastSample)
    case.backend.close()


def test_a_lost_gpu_raises_device_lost_naming_it_and_the_others_answer(make):
    case = make(lost=True)
    uuids = [g.identity.uuid for g in opened(case)]
    for uuid in uuids:
        case.backend.read_fast(uuid)
    case.lose()
    lost = uuids[LOST]
    for read in (case.backend.read_fast, case.backend.read_slow):
        with pytest.raises(DeviceLost) as raised:
            read(lost)
        assert raised.value.uuid == lost
    others = [u for u in uuids if u != lost]
    assert all(isinstance(case.backend.read_fast(u), FastSample) for u in others)
    assert all(isinstance(case.backend.read_slow(u), SlowSample) for u in others)


def test_a_backend_that_is_down_raises_backend_unavailable_with_reason_and_hint(make):
    case = make(down=True)
    with pytest.raises(BackendUnavailable) as raised:
        opened(case)
    assert raised.value.reason == "driver_not_loaded"
    assert raised.value.message and raised.value.hint
    case.backend.close()  # closing a backend that never opened: no error
