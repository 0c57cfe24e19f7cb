"""Traces: exact codecs, recording a node through the real poller, replaying it, rejecting bad files."""

from __future__ import annotations

import dataclasses
import json
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gpuwatch import groups
from gpuwatch.backends.recorder import Recorder
from gpuwatch.backends.replay import ReplayBackend
from gpuwatch.backends.simulated import Fault, SimulatedBackend
from gpuwatch.clock import FakeClock
from gpuwatch.errors import BackendUnavailable, DeviceLost, ReplayFormatError
from gpuwatch.groups.mig import MigInstance, MigReading
from gpuwatch.model import (
    DiscoveredGpu,
    DriverInfo,
    FanReading,
    FastSample,
    GpuIdentity,
    GpuProcess,
    SlowSample,
)
from gpuwatch.poller import Poller
from gpuwatch.store import Store
from gpuwatch.testing import H200_FEATURES, ScriptedBackend, fan, fast_sample, identity, slow_sample
from gpuwatch.trace import (
    FAST_FIELDS,
    SLOW_FIELDS,
    FastRecord,
    LostRecord,
    SlowRecord,
    TraceWriter,
    XidRecord,
    decode_driver,
    decode_fast,
    decode_gpu,
    decode_slow,
    encode_driver,
    encode_fast,
    encode_gpu,
    encode_slow,
    read_trace,
)

WALL0 = 1_700_000_000.0
MONO0 = 1000.0
DRIVER = DriverInfo("590.48.01", "13.590.48.01", "13.1")

# A 3-GPU fanned node: GPU 0 burns and its fan stalls, GPU 1 falls off the bus (XID 79) and comes
# back, GPU 2 gets an XID 13 and uncorrectable ECC errors (XID 94).
FAULTS = (
    Fault("load", 0, 0, 60),
    Fault("fan_stall", 0, 10, 40),
    Fault("fell_off_bus", 1, 21, 41),
    Fault("xid", 2, 11, params={"xid": 13}),
    Fault("ecc_uncorrectable", 2, 25, 50),
)
SECONDS = 60


def json_round_trip(data):
    return json.loads(json.dumps(data, allow_nan=False))


def every_field_set(sample):
    """Every reading of every group (and the errors) holds something."""
    return all(v not in (None, {}, ()) for name, v in groups.flat(sample).items() if name != "collected")


# ------------------------------------------------------------------------------------------ codecs


def full_fast_sample():
    return fast_sample(
        fans=(fan(0), fan(1, speed=0.0, target=0.93, rpm=0.0), FanReading(fan=2, speed_ratio=1.07)),
        power_watts=0.1 + 0.2,  # not exactly representable in decimal: repr must round-trip it
        energy_joules=123456789.000001,
        module_power_watts=201.35,
        memory_used_bytes=2**40 + 1,
        clocks_event_active={"gpu_idle": False, "hw_slowdown": True},
        mig=(MigReading(2, 40448 * 2**20, 26 * 2**20, 0.5, 0.2, 0.3), MigReading(9)),
        errors=("timeout", "unknown"),
    )


def full_slow_sample():
    return slow_sample(
        temperature_threshold_celsius={"shutdown": 95.0, "slowdown": 89.0, "gpu_max": 87.0},
        ecc_errors={("corrected", "volatile"): 3, ("uncorrected", "volatile"): 1,
                    ("corrected", "aggregate"): 12, ("uncorrected", "aggregate"): 2},
        remapped_rows={"correctable": 1, "uncorrectable": 2},
        remapped_rows_pending=True,
        remapped_rows_failed=False,
        retired_pages_pending=False,
        processes=(GpuProcess(pid=4242, used_memory_bytes=2 * 2**30), GpuProcess(pid=4243)),
        pcie_replays=7,
        utilization_ratio={"encoder": 0.0, "decoder": 0.25},
        nvlink_link_errors={("3", "replay"): 4, ("17", "crc_flit"): 0},
        nvlink_per_link=True,
        nvlink_bit_error_rate={"effective": 3e-13},
        nvlink_generation=5,
        power_smoothing_lifetime_ratio=0.87,
        energy_joules=91234.567,
        fabric_health={"degraded_bandwidth": True, "route_unhealthy": False},
        fabric_health_summary="limited_capacity",
        fabric_configuration="insufficient_nvlinks",
        recovery_action=2,
        mig=(MigInstance(2, 0, "MIG-6f7d2b7c-0a4d-5c1e-9a55-3f1b2c4d5e6f", "3g.40gb"), MigInstance(9)),
        c2c_up={"0": True, "1": False}, c2c_low_power={"0": False, "1": True},
        c2c_bandwidth_bytes={"0": 44712e6}, c2c_errors={"crc": 3, "replay": 0},
        c2c_up_at_discovery={"0": True, "1": True},
        errors=("gpu_is_lost",),
    )


def test_codec_tables_cover_every_reading():
    """A reading added to a group gets an encoding from its type, not a line in a table: every flat
    reading of FastSample and SlowSample is in the codec (the host's bookkeeping is not)."""
    assert set(FAST_FIELDS) == set(groups.FAST_FLAT) - {"collected"}
    assert set(SLOW_FIELDS) == set(groups.SLOW_FLAT) - {"collected"}
    assert "temperature_celsius" in FAST_FIELDS and "ecc_errors" in SLOW_FIELDS


def test_fast_sample_round_trip_is_exact():
    """Every field, fans with partial readings and every mapping come back equal, through JSON text."""
    sample = full_fast_sample()
    assert every_field_set(sample)
    assert sample == decode_fast(json_round_trip(encode_fast(sample)))


def test_slow_sample_round_trip_is_exact_and_tuple_keys_are_strings():
    """ecc_errors' (error, counter) keys are written as "error/counter" and read back as tuples."""
    sample = full_slow_sample()
    assert every_field_set(sample)
    encoded = encode_slow(sample)
    assert encoded["ecc_errors"]["uncorrected/volatile"] == 1
    assert sample == decode_slow(json_round_trip(encoded))


def test_absent_readings_are_left_out_and_read_back_as_absent():
    """None, empty mappings and no fans are simply not in the record; decoding restores them."""
    assert encode_fast(FastSample()) == {}
    assert encode_slow(SlowSample()) == {}
    sparse = groups.fast_sample(temperature_celsius=31.0, fans=(FanReading(fan=0),))
    assert encode_fast(sparse) == {"temperature_celsius": 31.0, "fans": [{"fan": 0}]}
    assert sparse == decode_fast(encode_fast(sparse))


def test_identity_features_and_driver_round_trip():
    gpu = DiscoveredGpu(identity(3), dict(H200_FEATURES))
    sparse = DiscoveredGpu(GpuIdentity(index=0, uuid="GPU-x", name="n", pci_bus_id="0:1:0.0"), {})
    assert gpu == decode_gpu(json_round_trip(encode_gpu(gpu)))
    assert sparse == decode_gpu(json_round_trip(encode_gpu(sparse)))
    assert DRIVER == decode_driver(json_round_trip(encode_driver(DRIVER)))


def test_non_finite_readings_are_refused():
    """JSON has no NaN: a NaN reading is an error when encoding, never a silent 0."""
    with pytest.raises(ValueError, match="power_watts"):
        encode_fast(groups.fast_sample(power_watts=float("nan")))


@pytest.mark.parametrize(("encode", "sample", "field"), [
    (encode_slow, groups.slow_sample(pcie_replays=-1), "pcie_replays"),
    (encode_slow, groups.slow_sample(ecc_errors={("uncorrected", "volatile"): 2**64}), "ecc_errors"),
    (encode_fast, groups.fast_sample(performance_state=16), "performance_state"),
    (encode_fast, groups.fast_sample(fans=(FanReading(fan=-1),)), "fans"),
])
def test_whole_numbers_out_of_range_are_refused_when_encoding(encode, sample, field):
    """The writer never records what the reader would refuse (the recorder skips such a sample)."""
    with pytest.raises(ValueError, match=field):
        encode(sample)


# ------------------------------------------------------------------------------- record and replay


def poll(poller, backend, store, clock, seconds=SECONDS, step=2.0):
    """Drive a poller as its scheduler would, without threads: fast every ``step`` s, slow every 30 s,
    events after each poll. Returns what the store looked like after each step."""
    seen = []
    t = 0.0
    while t <= seconds:
        if t > 0 and t % 30 == 0:
            poller.poll_slow()
        poller.poll_fast()
        if poller.backend_up:
            for event in backend.wait_events(0):
                store.record_xid(event)
        seen.append((t, comparable(store.snapshot())))
        clock.advance(step)
        t += step
    return seen


def comparable(snapshot):
    """What a replay must reproduce: everything but the backend's name, poll durations and the
    wall-clock time of XIDs (replay stamps them with its own wall clock)."""
    return dict(
        backend_up=snapshot.backend_up,
        backend_reason=snapshot.backend_reason,
        driver=snapshot.driver,
        visible_gpus=snapshot.visible_gpus,
        gpus=tuple(dataclasses.replace(g, xid_last_timestamp={}) for g in snapshot.gpus),
        tiers={tier: (s.success, dict(s.errors_total)) for tier, s in snapshot.tiers.items()},
    )


def record(path, backend_factory):
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    inner = backend_factory(clock)
    with TraceWriter(path, clock, backend=inner.name, fast_interval=2.0, slow_interval=30.0) as writer:
        recorder = Recorder(inner, writer, clock)
        store = Store(clock, recorder.name)
        poller = Poller(backend=recorder, store=store, clock=clock, fast_interval=2, slow_interval=30)
        seen = poll(poller, recorder, store, clock)
    assert recorder.error is None and recorder.skipped == 0
    return seen


def replay(trace, **options):
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    backend = ReplayBackend(trace, clock, **options)
    store = Store(clock, backend.name)
    poller = Poller(backend=backend, store=store, clock=clock, fast_interval=2, slow_interval=30)
    return poll(poller, backend, store, clock)


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("trace") / "node.jsonl"
    seen = record(path, lambda clock: SimulatedBackend(clock, gpu_count=3, faults=FAULTS))
    return path, read_trace(path), seen


def samples_at(trace, kind):
    return {(r.uuid, r.t): r.sample for r in trace.records if isinstance(r, kind)}


def test_replay_through_the_poller_reproduces_the_recorded_store(recorded):
    """Replayed at the same times, the store holds what it held while recording: temperatures, fans,
    the lost GPU down, XID counts, tier errors."""
    _, trace, seen = recorded
    assert replay(trace) == seen

    by_t = dict(seen)
    gpu0, gpu1, gpu2 = by_t[30.0]["gpus"]
    assert gpu1.up is False and gpu1.xid_counts == {79: 1}
    assert gpu0.fast.fans[0].speed_ratio == 0.0 < gpu0.fast.fans[0].target_speed_ratio
    assert gpu2.xid_counts == {13: 1, 94: 1}
    assert gpu2.slow.ecc.ecc_errors[("uncorrected", "volatile")] == 2
    assert by_t[30.0]["tiers"]["fast"] == (False, {"gpu_is_lost": 5})
    assert all(g.up for g in by_t[42.0]["gpus"])


def test_trace_holds_every_record_type_of_the_recording(recorded):
    """What the poller saw went into the file: header, discovery, samples, the loss, XIDs."""
    path, trace, _ = recorded
    header = json.loads(path.read_text().splitlines()[0])
    assert {k: header[k] for k in ("type", "format", "version", "backend", "fast_interval")} == {
        "type": "header", "format": "gpuwatch-trace", "version": 1, "backend": "simulated", "fast_interval": 2.0}
    assert header["created"] == WALL0
    kinds = {json.loads(line)["type"] for line in path.read_text().splitlines()[1:]}
    assert kinds == {"backend_up", "gpus", "fast", "slow", "lost", "xid"}
    assert trace.duration == SECONDS and trace.notes == ()
    lost = [r for r in trace.records if isinstance(r, LostRecord)]
    assert {r.t for r in lost if r.tier == "fast"} == set(range(22, 41, 2))
    assert [(r.t, r.xid) for r in trace.records if isinstance(r, XidRecord)] == [(12.0, 13), (22.0, 79), (26.0, 94)]


def test_speed_two_plays_twice_as_fast(recorded):
    """At speed 2, 10 s after open the replay answers with the readings recorded at t = 20 s."""
    _, trace, _ = recorded
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    backend = ReplayBackend(trace, clock, speed=2.0)
    backend.open()
    uuid = backend.discover()[0].identity.uuid
    fast = samples_at(trace, FastRecord)
    clock.advance(10.0)
    assert backend.read_fast(uuid) == fast[(uuid, 20.0)]
    clock.advance(1.5)  # t = 23: between polls, the latest sample holds
    assert backend.read_fast(uuid) == fast[(uuid, 22.0)]
    assert backend.read_slow(uuid) == samples_at(trace, SlowRecord)[(uuid, 0.0)]


def test_lost_gpu_raises_device_lost_while_the_trace_says_so(recorded):
    _, trace, _ = recorded
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    backend = ReplayBackend(trace, clock)
    backend.open()
    uuid = backend.discover()[1].identity.uuid
    backend.read_fast(uuid)
    clock.advance(22.0)
    with pytest.raises(DeviceLost):
        backend.read_fast(uuid)
    with pytest.raises(DeviceLost):
        backend.read_slow(uuid)
    clock.advance(20.0)
    assert backend.read_fast(uuid) == samples_at(trace, FastRecord)[(uuid, 42.0)]


def test_loop_wraps_time_and_fires_xids_again(recorded):
    """With loop the trace repeats every duration + one fast interval; XIDs come again each time."""
    _, trace, _ = recorded
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    backend = ReplayBackend(trace, clock, loop=True)
    assert backend.period == SECONDS + 2.0
    backend.open()
    uuid = backend.discover()[0].identity.uuid
    fast = samples_at(trace, FastRecord)
    clock.advance(12.0)
    assert [(e.xid, e.timestamp) for e in backend.wait_events(0)] == [(13, WALL0 + 12.0)]
    clock.advance(backend.period)  # t = 74 wraps to 12
    assert backend.read_fast(uuid) == fast[(uuid, 12.0)]
    assert [e.xid for e in backend.wait_events(0)] == [79, 94, 13]
    clock.advance(3 * backend.period)  # three more loops in one go: every XID three times, in order
    assert [e.xid for e in backend.wait_events(0)] == [79, 94, 13] * 3


@pytest.mark.parametrize(("interval", "speed"), [(1e-300, 1.0), (2.0, 1e300)])
def test_a_loop_of_an_absurd_period_or_speed_delivers_a_bounded_number_of_xids(tmp_path, interval, speed):
    """A header's fast_interval of 1e-300 (positive, so valid) with one XID at t=0, or a huge speed: one
    wait_events walked 10**300 periods (the daemon spun a CPU and grew by 100 MB a second)."""
    path = tmp_path / "tiny.jsonl"
    header = HEADER.replace('"fast_interval": 2.0', f'"fast_interval": {interval!r}')
    path.write_text("\n".join([header, FAST.replace("1.0", "0.0", 1),
                                '{"t":0.0,"type":"xid","uuid":"GPU-a","xid":79}']) + "\n")
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    backend = ReplayBackend(read_trace(path), clock, speed=speed, loop=True)
    backend.open()
    for _ in range(3):
        clock.advance(10.0)
        events = backend.wait_events(0)
        assert 0 < len(events) <= 100 and {e.xid for e in events} == {79}


def test_without_loop_the_last_state_holds(recorded):
    _, trace, _ = recorded
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    backend = ReplayBackend(trace, clock)
    backend.open()
    uuid = backend.discover()[0].identity.uuid
    clock.advance(1000.0)
    assert backend.read_fast(uuid) == samples_at(trace, FastRecord)[(uuid, float(SECONDS))]
    assert [e.xid for e in backend.wait_events(0)] == [13, 79, 94]
    clock.advance(1000.0)
    assert backend.wait_events(0) == []


def test_backend_down_and_recovery_replay_with_reason_and_hint(tmp_path):
    """A backend that could not be opened at first is replayed as down, with the recorded reason."""
    path = tmp_path / "down.jsonl"
    down = BackendUnavailable("driver_not_loaded", "NVML: Driver Not Loaded", "modprobe nvidia")

    def scripted(clock):
        backend = ScriptedBackend(2)
        backend.open_error = down
        # the driver comes back at t = 5 (the poller's backoff retries at 0, 2, 6)
        original = backend.open

        def open_():
            if clock.monotonic() - MONO0 >= 5:
                backend.open_error = None
            return original()

        backend.open = open_
        return backend

    seen = record(path, scripted)
    trace = read_trace(path)
    assert [s["backend_up"] for _, s in seen[:4]] == [False, False, False, True]
    assert replay(trace) == seen

    backend = ReplayBackend(trace, FakeClock(wall=WALL0, monotonic=MONO0))
    with pytest.raises(BackendUnavailable) as raised:
        backend.open()
    assert (raised.value.reason, raised.value.message, raised.value.hint) == (
        "driver_not_loaded", "NVML: Driver Not Loaded", "modprobe nvidia")


def test_writer_flushes_each_record_and_accepts_explicit_times(tmp_path):
    """A trace can be read while it is being written (a killed recorder leaves a valid prefix), and
    tests can write synthetic traces with chosen times; before the first sample, the first answers."""
    path = tmp_path / "synthetic.jsonl"
    clock = FakeClock(wall=WALL0, monotonic=MONO0)
    gpu = DiscoveredGpu(identity(0), dict(H200_FEATURES))
    writer = TraceWriter(path, clock, backend="scripted", fast_interval=1.0, slow_interval=10.0, driver=DRIVER)
    writer.write_gpus([gpu], t=0.5)
    writer.write_fast(gpu.identity.uuid, fast_sample(temperature_celsius=40.0), t=1.0)
    writer.write_fast(gpu.identity.uuid, fast_sample(temperature_celsius=85.0), t=5.0)
    assert len(read_trace(path).records) == 3
    with pytest.raises(ValueError, match="time order"):
        writer.write_fast(gpu.identity.uuid, fast_sample(), t=4.0)
    writer.close()

    replay_clock = FakeClock(wall=WALL0, monotonic=MONO0)
    backend = ReplayBackend(read_trace(path), replay_clock)
    assert backend.open() == DRIVER  # no backend_up record: the header's driver
    assert backend.discover() == [gpu]
    assert backend.read_fast(gpu.identity.uuid).thermal.temperature_celsius == 40.0
    replay_clock.advance(5.0)
    assert backend.read_fast(gpu.identity.uuid).thermal.temperature_celsius == 85.0
    with pytest.raises(DeviceLost):
        backend.read_slow(gpu.identity.uuid)  # never recorded


def test_recorder_skips_unrecordable_samples_but_returns_them():
    """Recording never changes what the poller sees: a NaN reading is passed on and not written."""
    clock = FakeClock()
    inner = ScriptedBackend(1)
    uuid = inner.gpus[0].identity.uuid
    inner.fast[uuid] = fast_sample(power_watts=float("nan"))
    writer = TraceWriter(open("/dev/null", "w"), clock, backend="scripted", fast_interval=2, slow_interval=30)
    recorder = Recorder(inner, writer, clock)
    recorder.open()
    assert recorder.read_fast(uuid) is inner.fast[uuid]
    assert (recorder.skipped, writer.records) == (1, 1)  # backend_up only


def test_close_interrupts_wait_events(recorded):
    """wait_events waits in real time for the next XID; close() ends the wait at once."""
    _, trace, _ = recorded
    backend = ReplayBackend(trace, FakeClock(wall=WALL0, monotonic=MONO0))
    backend.open()
    backend.wait_events(0)
    result = []
    waiter = threading.Thread(target=lambda: result.append(backend.wait_events(60.0)))
    waiter.start()
    backend.close()
    waiter.join(timeout=5.0)
    assert not waiter.is_alive() and result == [[]]


def test_replay_refuses_a_bad_speed(recorded):
    with pytest.raises(ValueError, match="speed"):
        ReplayBackend(recorded[1], FakeClock(), speed=0)


# ----------------------------------------------------------------------------------------- bad files

HEADER = json.dumps({"type": "header", "format": "gpuwatch-trace", "version": 1, "created": WALL0,
                     "backend": "nvml", "driver": None, "fast_interval": 2.0, "slow_interval": 30.0})
FAST = '{"t":1.0,"type":"fast","uuid":"GPU-a","temperature_celsius":40.0}'
HUGE = "9" * 400


@pytest.mark.parametrize(
    ("lines", "where", "message"),
    [
        ([HEADER, FAST, "{not json", FAST], ":3:", "not valid JSON"),
        ([HEADER.replace('"version": 1', '"version": 2'), FAST], ":1:", "newer than this gpuwatch"),
        ([HEADER.replace('"version": 1', '"version": 2'), FAST], ":1:", "reads version 1"),
        ([HEADER, FAST.replace('"fast"', '"fast_v2"')], ":2:", "unknown record type 'fast_v2'"),
        ([FAST, HEADER], ":1:", "missing header"),
        ([HEADER.replace("gpuwatch-trace", "other"), FAST], ":1:", "not a gpuwatch trace"),
        ([HEADER, FAST.replace("40.0", '"hot"')], ":2:", "'temperature_celsius': expected a number"),
        ([HEADER, FAST.replace("40.0", "NaN")], ":2:", "NaN"),
        ([HEADER, FAST, FAST.replace('"t":1.0', '"t":0.5')], ":3:", "time order"),
        ([HEADER, FAST.replace('"t":1.0,', "")], ":2:", "missing field 't'"),
        ([HEADER, FAST.replace('"uuid":"GPU-a",', "")], ":2:", "missing field 'uuid'"),
        ([HEADER, '{"t":1,"type":"slow","uuid":"GPU-a","ecc_errors":{"uncorrected":1}}'], ":2:", "uncorrected/volatile"),
        ([HEADER, "[1, 2]"], ":2:", "expected a JSON object"),
        ([HEADER, HEADER], ":2:", "a second header"),
        ([HEADER, FAST[:20], FAST], ":2:", "not valid JSON"),  # cut short, but not the last line
        # json.loads reads integers of up to 4300 digits; none of these is a float (OverflowError before)
        ([HEADER, FAST.replace('"t":1.0', f'"t":{HUGE}')], ":2:", "field 't': expected a number, got 999"),
        ([HEADER.replace(f'"created": {WALL0}', f'"created": {HUGE}'), FAST], ":1:", "'created': expected a number"),
        ([HEADER.replace('"fast_interval": 2.0', f'"fast_interval": {HUGE}'), FAST], ":1:",
         "'fast_interval': expected a number"),
        ([HEADER, FAST.replace("40.0", f"-{HUGE}")], ":2:", "'temperature_celsius': expected a number"),
        # a lone surrogate (bytes that were not UTF-8) as a uuid label: every render of /metrics raised
        ([HEADER, FAST.replace('"GPU-a"', '"GPU-\\udcff"')], ":2:", "not UTF-8 text"),
    ],
)
def test_malformed_traces_name_the_file_line_and_problem(tmp_path, lines, where, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ReplayFormatError) as raised:
        read_trace(path)
    assert f"{path}{where}" in str(raised.value)
    assert message in str(raised.value)


def test_a_trace_that_begins_with_a_byte_order_mark_is_read(tmp_path):
    """A trace saved by an editor that writes a UTF-8 BOM: json.loads(bytes) took it, and the strict decoding
    that refuses lone surrogates keeps taking it."""
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join([HEADER, FAST]).encode() + b"\n")
    assert [r.uuid for r in read_trace(path).records] == ["GPU-a"]


SLOW = '{"t":1.0,"type":"slow","uuid":"GPU-a","pcie_replays":7}'
XID = '{"t":1.0,"type":"xid","uuid":"GPU-a","xid":79}'
GPUS = '{"t":1.0,"type":"gpus","gpus":[{"index":0,"uuid":"GPU-a","name":"n","pci_bus_id":"0:1:0.0"}]}'


@pytest.mark.parametrize(
    ("kind", "field", "value", "where"),
    [
        ("fast", "memory_used_bytes", 10**400, "memory_used_bytes"),  # the render failed with OverflowError
        ("slow", "pcie_replays", 10**400, "pcie_replays"),
        ("slow", "pcie_replays", 2**64, "pcie_replays"),  # one more than NVML's widest counter
        ("slow", "pcie_replays", -5, "pcie_replays"),  # was exported as a negative counter
        ("slow", "ecc_errors", {"uncorrected/volatile": -1}, "ecc_errors.uncorrected/volatile"),
        ("slow", "processes", [{"pid": -1}], "processes[0].pid"),
        ("fast", "fans", [{"fan": 10**30}], "fans[0].fan"),
        ("fast", "performance_state", -7, "performance_state"),
        ("fast", "performance_state", 16, "performance_state"),  # P0-P15
        ("xid", "xid", -79, "xid"),
        ("gpus", "gpus", [{"index": -1, "uuid": "GPU-a", "name": "n", "pci_bus_id": "0:1:0.0"}], "index"),
    ],
    ids=lambda v: v if isinstance(v, str) else str(v)[:12],
)
def test_whole_numbers_out_of_range_name_the_file_line_and_field(tmp_path, kind, field, value, where):
    """A count, size, id or P-state is what NVML could answer: 0..2**64-1 (P-state 0..15); anything
    else is refused like a wrong type, never replayed into a failing render or a negative counter."""
    path = tmp_path / "bad.jsonl"
    line = {"fast": FAST, "slow": SLOW, "xid": XID, "gpus": GPUS}[kind]
    path.write_text(f"{HEADER}\n{json.dumps(json.loads(line) | {field: value})}\n")
    with pytest.raises(ReplayFormatError) as raised:
        read_trace(path)
    assert str(raised.value).startswith(f"{path}:2: ")
    assert f"field {where!r}: expected a whole number 0.." in str(raised.value)


def test_whole_numbers_at_the_ends_of_their_range_are_read(tmp_path):
    path = tmp_path / "edges.jsonl"
    fast = json.loads(FAST) | {"performance_state": 15, "memory_used_bytes": 0}
    slow = json.loads(SLOW) | {"pcie_replays": 2**64 - 1, "temperature_threshold_celsius": {"shutdown": 10**300}}
    path.write_text("\n".join([HEADER, json.dumps(fast), json.dumps(slow)]) + "\n")
    fast_record, slow_record = read_trace(path).records
    assert (fast_record.sample.power.performance_state, fast_record.sample.memory.memory_used_bytes) == (15, 0)
    assert slow_record.sample.pcie.pcie_replays == 2**64 - 1
    assert slow_record.sample.thermal.temperature_threshold_celsius == {"shutdown": 1e300}


def test_a_value_nested_too_deep_to_spell_out_is_still_a_format_error():
    """The message quotes the bad value; one nested past the recursion limit is summarized, not re-encoded
    (json.dumps raised RecursionError where json.loads had just managed)."""
    deep: list = []
    for _ in range(sys.getrecursionlimit() + 10):
        deep = [deep]
    with pytest.raises(ReplayFormatError, match=r"'performance_state': expected a whole number 0..15, got \[\.\.\.\]"):
        decode_fast({"performance_state": deep})


# Any JSON value where a record or the header has a field: unbounded integers (json.loads reads up to
# 4300 digits), floats, strings, lists and objects whose keys are the nested readings' fields.
HUGE_INTS = st.sampled_from([10**400, -10**400, 2**64, 2**64 - 1, 2**63, 10**308 * 2, -1, 16])
NESTED_KEYS = sorted(
    {f.name for cls in (FanReading, GpuProcess, MigReading, MigInstance, GpuIdentity) for f in dataclasses.fields(cls)}
    | {"uncorrected/volatile", "current", "shutdown", "driver_version", "features"}
)
JSON_VALUES = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), HUGE_INTS, st.floats(allow_nan=False, allow_infinity=False),
              st.text(max_size=6)),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.one_of(st.sampled_from(NESTED_KEYS), st.text(max_size=4)), inner, max_size=3),
    max_leaves=10,
)
RECORD_FIELDS = {
    "fast": sorted(FAST_FIELDS), "slow": sorted(SLOW_FIELDS), "xid": ["xid", "timestamp"], "gpus": ["gpus"],
    "lost": ["tier", "message"], "backend_up": ["driver"], "backend_down": ["reason", "message", "hint"],
}
HEADER_FIELDS = ["created", "fast_interval", "slow_interval", "version", "backend", "driver"]


@st.composite
def hostile_records(draw):
    kind = draw(st.sampled_from(sorted(RECORD_FIELDS)))
    record = {"t": draw(st.one_of(st.just(1.0), JSON_VALUES)), "type": kind, "uuid": "GPU-a"}
    return record | draw(st.dictionaries(st.sampled_from(RECORD_FIELDS[kind]), JSON_VALUES, max_size=4))


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(HEADER_FIELDS), JSON_VALUES, max_size=2),
       st.lists(hostile_records(), max_size=3))
def test_a_trace_of_hostile_values_is_a_trace_or_a_format_error(header_edits, records):
    """Never another exception from read_trace; and what it accepts, the writer could have written."""
    header = json.loads(HEADER) | header_edits
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "t.jsonl"
        path.write_text("\n".join(json.dumps(line) for line in [header, *records]) + "\n")
        try:
            trace = read_trace(path)
        except ReplayFormatError as exc:
            assert str(exc).startswith(str(path))
            return
    for record_ in trace.records:
        assert record_.t >= 0 and record_.t != float("inf")
        if isinstance(record_, FastRecord):
            encode_fast(record_.sample)
        elif isinstance(record_, SlowRecord):
            encode_slow(record_.sample)


@pytest.mark.parametrize(("content", "message"), [("", "empty"), ("\n\n", "empty"), (HEADER[:30], "incomplete")])
def test_files_without_a_header_are_refused(tmp_path, content, message):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ReplayFormatError, match=message):
        read_trace(path)


def test_missing_file_is_a_format_error(tmp_path):
    with pytest.raises(ReplayFormatError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_truncated_last_line_is_ignored_with_a_note(tmp_path):
    """A recorder killed mid-write leaves half a line: the rest of the trace is still replayable."""
    path = tmp_path / "killed.jsonl"
    path.write_text(f"{HEADER}\n{FAST}\n{FAST[:25]}")
    trace = read_trace(path)
    assert [r.t for r in trace.records] == [1.0]
    assert len(trace.notes) == 1 and f"{path}:3:" in trace.notes[0] and "incomplete" in trace.notes[0]


def test_unknown_fields_are_ignored(tmp_path):
    """Compatibility: a later version 1 writer may add optional fields; this reader skips them."""
    path = tmp_path / "newer.jsonl"
    header = json.loads(HEADER) | {"hostname": "node7"}
    path.write_text(f"{json.dumps(header)}\n{FAST[:-1]},\"fan_noise_decibels\":41.5}}\n")
    (record_,) = read_trace(path).records
    assert record_ == FastRecord(1.0, "GPU-a", groups.fast_sample(temperature_celsius=40.0))


def test_the_documented_example_lines_are_a_valid_trace(tmp_path):
    """docs/trace-format.md's header and records read back: the documentation cannot drift from the code."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "trace-format.md").read_text()
    lines = [line for line in doc.splitlines() if line.startswith('{"')]
    path = tmp_path / "doc.jsonl"
    path.write_text("\n".join(lines) + "\n")
    trace = read_trace(path)
    kinds = {type(r).__name__ for r in trace.records}
    assert kinds == {"BackendUpRecord", "BackendDownRecord", "GpusRecord", "FastRecord", "SlowRecord",
                     "LostRecord", "XidRecord"}
