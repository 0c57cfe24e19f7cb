"""The simulated backend: deterministic physics, profiles true to the captures, fault signatures."""

from __future__ import annotations

import re
import threading

import pytest

from gpuwatch.backends.simulated import (
    DEMO_TOUR_SECONDS,
    FAULT_KINDS,
    PROFILES,
    Fault,
    SimulatedBackend,
    demo_tour,
)
from gpuwatch.clock import FakeClock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.groups import HARDWARE_FEATURES
from gpuwatch.model import (
    CLOCKS,
    CLOCKS_EVENT_REASON_BITS,
    CLOCKS_EVENT_TIME_REASONS,
    FEATURES,
    THRESHOLDS,
    FastSample,
    SlowSample,
    temperature_thresholds,
)

WALL0 = 1_700_000_000.0


def make(profile="rtx6000", gpu_count=1, faults=(), seed=0):
    clock = FakeClock(wall=WALL0, monotonic=1000.0)
    backend = SimulatedBackend(clock, gpu_count=gpu_count, profile=profile, faults=faults, seed=seed)
    backend.open()
    uuids = [gpu.identity.uuid for gpu in backend.discover()]
    return clock, backend, uuids


def trace(clock, backend, uuid, seconds, every=1.0):
    """Fast samples of one GPU taken every ``every`` seconds for ``seconds``, as (t, sample)."""
    samples = [(0.0, backend.read_fast(uuid))]
    t = 0.0
    while t < seconds - 1e-9:
        clock.advance(every)
        t += every
        samples.append((t, backend.read_fast(uuid)))
    return samples


def burn(gpu=0, start=0.0, end=None, utilization=1.0):
    return Fault("load", gpu, start, end, params={"utilization": utilization})


def fan_curve(celsius):
    """The documented fan curve: 30 % up to 40 °C, linear to 100 % at 85 °C."""
    return min(1.0, max(0.3, 0.3 + 0.7 * (celsius - 40) / 45))


# ------------------------------------------------------------------------------ determinism


def test_readings_depend_on_elapsed_time_not_on_poll_frequency():
    """Same seed and elapsed time give identical samples however often the GPUs were read."""
    faults = demo_tour(600)
    clock_a, a, uuids = make(gpu_count=8, faults=faults, seed=7)
    clock_b, b, _ = make(gpu_count=8, faults=faults, seed=7)
    for _ in range(430):  # a: every second, every GPU
        clock_a.advance(1.0)
        for uuid in uuids:
            try:
                a.read_fast(uuid)
                a.read_slow(uuid)
            except DeviceLost:
                pass
    for _ in range(58):  # b: every 7.3 s, only GPU 0
        clock_b.advance(7.3)
        b.read_fast(uuids[0])
    clock_b.advance(430 - 58 * 7.3)

    for uuid in reversed(uuids):
        assert a.read_fast(uuid) == b.read_fast(uuid)
        assert a.read_slow(uuid) == b.read_slow(uuid)


def test_different_seeds_give_different_nodes():
    """The seed changes identities and the job sequence."""
    clock_a, a, uuids_a = make(gpu_count=2, seed=1)
    clock_b, b, uuids_b = make(gpu_count=2, seed=2)
    assert set(uuids_a).isdisjoint(uuids_b)
    clock_a.advance(300)
    clock_b.advance(300)
    assert a.read_fast(uuids_a[0]) != b.read_fast(uuids_b[0])


def test_gpus_run_different_job_sequences():
    """Each GPU has its own load: the utilization traces of two GPUs differ."""
    clock, backend, uuids = make(gpu_count=2)
    traces = {uuid: [] for uuid in uuids}
    for _ in range(120):
        clock.advance(10)
        for uuid in uuids:
            traces[uuid].append(backend.read_fast(uuid).utilization.utilization_ratio["gpu"])
    first, second = traces.values()
    assert first != second
    for values in traces.values():
        busy = [u for u in values if u > 0]
        assert busy, "a GPU never ran a job in 20 minutes"
        assert all(0.55 <= u <= 1.0 for u in busy)


# ---------------------------------------------------------------------------------- physics


def test_gpu_heats_under_load_and_cools_at_idle():
    """A burn job heats the GPU toward a plateau; idling brings it back near ambient."""
    faults = [burn(0, 0, 400), burn(0, 400, 1200, utilization=0.0)]
    clock, backend, (uuid,) = make(faults=faults)
    samples = dict(trace(clock, backend, uuid, 1200, every=10))
    start, hot, cool = samples[0.0], samples[390.0], samples[1190.0]
    assert hot.thermal.temperature_celsius > start.thermal.temperature_celsius + 20
    assert 55 <= hot.thermal.temperature_celsius <= 80  # plausible next to the captures
    assert hot.thermal.temperature_celsius - samples[300.0].thermal.temperature_celsius <= 2  # plateau
    assert cool.thermal.temperature_celsius < hot.thermal.temperature_celsius - 20
    assert cool.thermal.temperature_celsius <= 35
    assert cool.clocks.clocks_event_active["gpu_idle"] and not hot.clocks.clocks_event_active["gpu_idle"]


def test_fan_target_follows_temperature_and_speed_follows_target():
    """Target = fan curve of the temperature; the measured speed tracks the target closely."""
    clock, backend, (uuid,) = make(faults=[burn(0, 0, 600)])
    samples = trace(clock, backend, uuid, 600, every=5)
    targets = [s.fans[0].target_speed_ratio for _, s in samples]
    for _, sample in samples:
        (fan,) = sample.fans
        assert fan.target_speed_ratio == pytest.approx(
            fan_curve(sample.thermal.temperature_celsius), abs=0.02
        )
        assert fan.speed_ratio == pytest.approx(fan.target_speed_ratio, abs=0.03)
        assert fan.speed_rpm == pytest.approx(fan.speed_ratio * 4800, abs=30)
    assert targets[0] == 0.3
    assert targets[-1] > 0.55
    assert targets == sorted(targets)  # rising with the temperature


def test_fan_speed_lags_its_target_by_a_few_seconds():
    """After a stall ends, the fan needs a few seconds to reach its target again."""
    faults = [burn(0, 0, 400), Fault("fan_stall", 0, 60, 300)]
    clock, backend, (uuid,) = make(faults=faults)
    clock.advance(299)
    at_end = backend.read_fast(uuid).fans[0]
    clock.advance(2)
    one_later = backend.read_fast(uuid).fans[0]
    clock.advance(19)
    settled = backend.read_fast(uuid).fans[0]
    assert at_end.speed_ratio < 0.05
    assert 0.05 < one_later.speed_ratio < one_later.target_speed_ratio - 0.3
    assert settled.speed_ratio == pytest.approx(settled.target_speed_ratio, abs=0.02)


def test_power_is_capped_at_the_enforced_limit():
    """A load that would draw more than the limit draws exactly the limit, with sw_power_cap."""
    faults = [burn(0, 0, 200), burn(0, 200, 400, utilization=0.6)]
    clock, backend, (uuid,) = make(faults=faults)
    limit = backend.read_slow(uuid).power.power_limit_watts["enforced"]
    samples = dict(trace(clock, backend, uuid, 400, every=10))
    capped, uncapped = samples[150.0], samples[350.0]
    assert limit == 300.0
    assert capped.power.power_watts == limit
    assert capped.clocks.clocks_event_active["sw_power_cap"]
    assert capped.clocks.clock_hertz["graphics"] < 2505e6
    assert capped.power.performance_state == 0
    assert uncapped.power.power_watts < limit - 50
    assert not uncapped.clocks.clocks_event_active["sw_power_cap"]
    assert uncapped.clocks.clock_hertz["graphics"] == 2505e6
    assert all(s.power.power_watts <= limit for s in samples.values())
    cap_seconds = [samples[t].clocks.clocks_event_seconds["sw_power_cap"] for t in (100.0, 190.0, 390.0)]
    assert cap_seconds[1] - cap_seconds[0] == pytest.approx(90, abs=1)
    assert cap_seconds[2] - cap_seconds[1] == pytest.approx(10, abs=1)  # only until 200 s


def test_energy_counter_integrates_power():
    """The energy counter grows by the integral of the power draw."""
    clock, backend, (uuid,) = make(gpu_count=1, seed=3)
    samples = trace(clock, backend, uuid, 900, every=1)
    integral = sum(s.power.power_watts for _, s in samples[1:])  # 1 s steps
    gained = samples[-1][1].power.energy_joules - samples[0][1].power.energy_joules
    assert gained == pytest.approx(integral, rel=1e-4)
    # coarser polling, trapezoid estimate
    coarse = samples[::5]
    estimate = sum(
        (a.power.power_watts + b.power.power_watts) / 2 * (tb - ta)
        for (ta, a), (tb, b) in zip(coarse, coarse[1:])
    )
    assert gained == pytest.approx(estimate, rel=0.03)


def test_idle_and_busy_states_look_like_the_captures():
    """Idle: P8, idle clocks, gpu_idle, PCIe gen 1. Busy: P0, max clocks, PCIe gen 4, memory used."""
    faults = [burn(0, 0, 100, utilization=0.0), Fault("load", 0, 100, 300, params={"utilization": 0.7})]
    clock, backend, (uuid,) = make(faults=faults)
    clock.advance(50)
    idle, idle_slow = backend.read_fast(uuid), backend.read_slow(uuid)
    clock.advance(150)
    busy, busy_slow = backend.read_fast(uuid), backend.read_slow(uuid)

    assert idle.power.performance_state == 8
    assert idle.clocks.clock_hertz == {"graphics": 210e6, "sm": 210e6, "memory": 405e6}
    assert idle_slow.clocks.clock_hertz == {"video": 1185e6}  # the video clock is read in the slow tier
    assert {k for k, v in idle.clocks.clocks_event_active.items() if v} == {"gpu_idle"}
    assert idle.memory.memory_used_bytes == 0
    assert idle.power.power_watts == pytest.approx(24, abs=2)
    assert idle_slow.pcie.pcie_link_generation == {"current": 1, "max": 4}

    assert busy.power.performance_state == 0
    assert busy.clocks.clock_hertz["graphics"] == 2505e6 and busy.clocks.clock_hertz["memory"] == 10001e6
    assert not any(busy.clocks.clocks_event_active.values())
    assert busy_slow.pcie.pcie_link_generation == {"current": 4, "max": 4}
    assert busy_slow.pcie.pcie_link_width == {"current": 16, "max": 16}
    assert busy.memory.memory_used_bytes > 10 * 1024**3
    assert 0 < busy.utilization.utilization_ratio["memory"] < busy.utilization.utilization_ratio["gpu"]
    assert busy_slow.utilization.utilization_ratio == {}  # encoder/decoder: --collector.utilization.video
    for sample in (idle, busy):
        assert sample.memory.memory_total_bytes == 46068 * 1024**2
        assert (
            sample.memory.memory_free_bytes
            == sample.memory.memory_total_bytes - sample.memory.memory_reserved_bytes - sample.memory.memory_used_bytes
        )


# --------------------------------------------------------------------------------- profiles


def test_h200_has_no_fans_and_reports_the_t_limit_scale():
    """H200: no fan readings at all, margin = 87 − temperature, thresholds on the T.Limit scale."""
    clock, backend, (uuid,) = make(profile="h200", faults=[burn(0, 0, 600)])
    (gpu,) = backend.discover()
    assert gpu.identity.name == "NVIDIA H200"
    assert gpu.identity.architecture == "hopper"
    assert not gpu.features["fan"] and not gpu.features["fan_rpm"] and not gpu.features["fan_target"]
    assert gpu.features["temperature_margin"] and gpu.features["memory_temperature"]
    assert gpu.features["ecc"] and gpu.features["remapped_rows"]
    assert not gpu.features["retired_pages"]

    for _, fast in trace(clock, backend, uuid, 600, every=30):
        assert fast.fans == ()
        assert fast.thermal.temperature_margin_celsius == 87 - fast.thermal.temperature_celsius
        assert fast.thermal.memory_temperature_celsius is not None
    slow = backend.read_slow(uuid)
    assert slow.thermal.temperature_threshold_celsius == {}
    assert slow.thermal.temperature_margin_threshold_celsius == {
        "shutdown": -8.0,
        "slowdown": -2.0,
        "gpu_max": 0.0,
        "memory_max": 0.0,
    }
    assert slow.power.power_limit_watts == {"enforced": 700.0, "default": 700.0, "min": 200.0, "max": 700.0}
    assert slow.pcie.pcie_link_generation == {"current": 5, "max": 5}
    assert fast.memory.memory_total_bytes == 143771 * 1024**2
    assert 45 <= fast.thermal.temperature_celsius <= 60  # 52 °C at 628 W in the capture
    assert temperature_thresholds(fast, slow) == {"shutdown": 95.0, "slowdown": 89.0, "gpu_max": 87.0}


def test_h200_idles_like_the_capture():
    """Idle H200: about 77 W and 28 °C, 345 MHz graphics, memory clock stays at 3201 MHz."""
    clock, backend, (uuid,) = make(profile="h200", faults=[burn(0, 0, 900, utilization=0.0)])
    clock.advance(600)
    fast = backend.read_fast(uuid)
    assert fast.power.power_watts == pytest.approx(77, abs=3)
    assert 24 <= fast.thermal.temperature_celsius <= 33
    assert fast.clocks.clock_hertz == {"graphics": 345e6, "sm": 345e6, "memory": 3201e6}
    assert backend.read_slow(uuid).clocks.clock_hertz == {"video": 765e6}
    assert fast.clocks.clocks_event_active["gpu_idle"]
    # the throttle-time counters nvidia-smi prints, not the perf-policy ones (low_utilization...)
    assert set(fast.clocks.clocks_event_seconds) == {"sw_power_cap", "sync_boost", "sw_thermal_slowdown",
                                                     "hw_thermal_slowdown", "hw_power_brake_slowdown"}


def _present(feature: str, fast: FastSample, slow: SlowSample) -> bool:
    fans = fast.fans
    return {
        "clocks_event_reasons": bool(fast.clocks.clocks_event_active),
        "clocks_event_time": bool(fast.clocks.clocks_event_seconds),
        "ecc": bool(slow.ecc.ecc_errors),
        "energy": fast.power.energy_joules is not None,
        "fan": bool(fans) and all(f.speed_ratio is not None for f in fans),
        "fan_rpm": bool(fans) and all(f.speed_rpm is not None for f in fans),
        "fan_target": bool(fans) and all(f.target_speed_ratio is not None for f in fans),
        "memory_temperature": fast.thermal.memory_temperature_celsius is not None,
        "pcie": bool(slow.pcie.pcie_link_generation)
        and bool(slow.pcie.pcie_link_width)
        and slow.pcie.pcie_replays is not None,
        "power": fast.power.power_watts is not None,
        "power_limit": bool(slow.power.power_limit_watts),
        "remapped_rows": bool(slow.ecc.remapped_rows)
        and slow.ecc.remapped_rows_pending is not None
        and slow.ecc.remapped_rows_failed is not None,
        "retired_pages": slow.ecc.retired_pages_pending is not None,
        "temperature_margin": fast.thermal.temperature_margin_celsius is not None
        and bool(slow.thermal.temperature_margin_threshold_celsius),
        "utilization": set(fast.utilization.utilization_ratio) == {"gpu", "memory"}
        and not slow.utilization.utilization_ratio,  # encoder/decoder only with --collector.utilization.video
        "gpm": fast.gpm.sm_active_ratio is not None and set(fast.gpm.pipe_active_ratio) == {"tensor"}
        and fast.gpm.dram_bandwidth_ratio is not None and set(fast.gpm.pcie_traffic_bytes) == {"tx", "rx"},
        "nvlink": bool(slow.nvlink.nvlink_up) and bool(slow.nvlink.nvlink_errors),
        "fabric": slow.fabric.fabric_state is not None,
        "mig": bool(fast.mig) and bool(slow.mig) and all(r.sm_active_ratio is not None for r in fast.mig),
        "power_smoothing": slow.power.power_smoothing_lifetime_ratio is not None,
        "recovery_action": slow.recovery.recovery_action is not None,
        "c2c": bool(slow.c2c.c2c_up),
    }[feature]


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_features_match_what_the_samples_contain(profile):
    """A feature is supported exactly when its readings are present, idle or busy, in every sample."""
    clock, backend, uuids = make(profile=profile, gpu_count=3, seed=5)
    discovered = backend.discover()
    for gpu in discovered:  # a class of hardware the model lacks is no feature of it
        assert set(FEATURES) - HARDWARE_FEATURES <= set(gpu.features) <= set(FEATURES)
        assert all(gpu.features[f] for f in set(gpu.features) & HARDWARE_FEATURES)
    for _ in range(40):
        clock.advance(15)
        for gpu in discovered:
            fast = backend.read_fast(gpu.identity.uuid)
            slow = backend.read_slow(gpu.identity.uuid)
            for feature, supported in gpu.features.items():
                if feature == "xid_events":
                    continue
                assert _present(feature, fast, slow) == supported, feature
            assert fast.thermal.temperature_celsius is not None
            assert set(fast.clocks.clock_hertz) | set(slow.clocks.clock_hertz) == set(CLOCKS)
            assert set(fast.clocks.clocks_event_active) == set(CLOCKS_EVENT_REASON_BITS)
            assert set(fast.clocks.clocks_event_seconds) <= set(CLOCKS_EVENT_TIME_REASONS)
            assert set(slow.thermal.temperature_threshold_celsius) <= set(THRESHOLDS)
            assert set(slow.thermal.temperature_margin_threshold_celsius) <= set(THRESHOLDS)
            assert fast.errors == () and slow.errors == ()


def test_rtx6000_profile_facts():
    """RTX 6000 Ada: one blower fan, absolute thresholds, ECC but no row remapping, 300 W."""
    clock, backend, (uuid,) = make()
    (gpu,) = backend.discover()
    assert gpu.identity.name == "NVIDIA RTX 6000 Ada Generation"
    assert gpu.identity.architecture == "ada"
    assert gpu.features["fan"] and gpu.features["fan_rpm"] and gpu.features["fan_target"]
    assert gpu.features["ecc"]
    assert not gpu.features["memory_temperature"] and not gpu.features["temperature_margin"]
    assert not gpu.features["remapped_rows"] and not gpu.features["retired_pages"]
    fast, slow = backend.read_fast(uuid), backend.read_slow(uuid)
    assert len(fast.fans) == 1
    assert slow.thermal.temperature_threshold_celsius == {"shutdown": 100.0, "slowdown": 95.0, "gpu_max": 90.0}
    assert slow.thermal.temperature_margin_threshold_celsius == {}
    assert slow.power.power_limit_watts["enforced"] == 300.0
    assert slow.ecc.ecc_errors == {
        ("corrected", "volatile"): 0,
        ("corrected", "aggregate"): 0,
        ("uncorrected", "volatile"): 0,
        ("uncorrected", "aggregate"): 0,
    }


def test_identities_are_stable_and_well_formed():
    """UUIDs are GPU-<uuid4> derived from seed and index; bus ids, serials and minors are unique."""
    _, backend, uuids = make(gpu_count=8, seed=42)
    _, again, uuids_again = make(gpu_count=8, seed=42)
    assert uuids == uuids_again
    assert len(set(uuids)) == 8
    pattern = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
    identities = [gpu.identity for gpu in backend.discover()]
    assert all(pattern.match(i.uuid) for i in identities)
    assert [i.index for i in identities] == list(range(8))
    assert [i.minor_number for i in identities] == list(range(8))
    bus_ids = [i.pci_bus_id for i in identities]
    assert len(set(bus_ids)) == 8
    assert all(re.match(r"^00000000:[0-9A-F]{2}:00\.0$", b) for b in bus_ids)
    assert all(i.serial and len(i.serial) == 13 and i.serial.isdigit() for i in identities)
    assert len({i.serial for i in identities}) == 8


# ----------------------------------------------------------------------------------- faults


def test_fan_stall_signature():
    """fan_stall: speed and RPM collapse to ~0 while the target climbs and the GPU heats."""
    faults = [burn(0, 0, 400), Fault("fan_stall", 0, 120, 360)]
    clock, backend, (uuid,) = make(faults=faults)
    samples = dict(trace(clock, backend, uuid, 400, every=5))
    before = samples[115.0]
    assert before.fans[0].speed_ratio > 0.5
    for t in range(130, 360, 5):
        fan = samples[float(t)].fans[0]
        assert fan.speed_ratio <= 0.01 and fan.speed_rpm <= 50
    late = samples[355.0]
    assert late.fans[0].target_speed_ratio >= 0.9
    assert late.fans[0].target_speed_ratio > before.fans[0].target_speed_ratio + 0.2
    assert late.thermal.temperature_celsius > before.thermal.temperature_celsius + 12
    assert samples[395.0].fans[0].speed_ratio > 0.8  # spinning again


def _absolute(backend, uuid, fast):
    return temperature_thresholds(fast, backend.read_slow(uuid))


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_cooling_failure_signature(profile):
    """cooling_failure: temperature reaches slowdown, then HW+SW thermal slowdown, clocks about
    halved, power down, thermal throttle seconds growing; it recovers after the fault."""
    faults = [burn(0, 0, 600), Fault("cooling_failure", 0, 120, 480)]
    clock, backend, (uuid,) = make(profile=profile, faults=faults)
    samples = dict(trace(clock, backend, uuid, 800, every=2))
    healthy = samples[118.0]
    slowdown = _absolute(backend, uuid, healthy)["slowdown"]
    max_graphics = backend.read_slow(uuid).clocks.clock_max_hertz["graphics"]
    assert not healthy.clocks.clocks_event_active["hw_thermal_slowdown"]
    assert healthy.clocks.clocks_event_seconds["hw_thermal_slowdown"] == 0

    onset = min(t for t, s in samples.items() if s.clocks.clocks_event_active["hw_thermal_slowdown"])
    assert 120 < onset < 300
    assert samples[onset].thermal.temperature_celsius >= slowdown
    shutdown = _absolute(backend, uuid, healthy)["shutdown"]
    for t in range(int(onset) + 20, 480, 2):
        s = samples[float(t)]
        active = s.clocks.clocks_event_active
        assert active["hw_thermal_slowdown"] and active["sw_thermal_slowdown"] and active["hw_slowdown"]
        assert s.clocks.clock_hertz["graphics"] <= 0.55 * max_graphics
        assert s.power.power_watts < 0.7 * healthy.power.power_watts
        assert slowdown - 5 <= s.thermal.temperature_celsius < shutdown
    seconds = [samples[t].clocks.clocks_event_seconds for t in (300.0, 400.0)]
    for reason in ("hw_thermal_slowdown", "sw_thermal_slowdown"):
        assert seconds[1][reason] - seconds[0][reason] == pytest.approx(100, abs=1)

    recovered = samples[800.0]
    assert not recovered.clocks.clocks_event_active["hw_thermal_slowdown"]
    assert not recovered.clocks.clocks_event_active["sw_thermal_slowdown"]
    assert recovered.thermal.temperature_celsius < slowdown - 30


def test_fell_off_bus_signature():
    """fell_off_bus: DeviceLost during the window (other GPUs fine), XID 79 once, back after."""
    clock, backend, (ok, lost) = make(gpu_count=2, faults=[Fault("fell_off_bus", 1, 100, 200)])
    events = []
    lost_at = []
    for t in range(0, 300):
        events += backend.wait_events(0)
        backend.read_fast(ok)
        try:
            backend.read_fast(lost)
            backend.read_slow(lost)
        except DeviceLost as exc:
            assert exc.uuid == lost
            lost_at.append(t)
            with pytest.raises(DeviceLost):
                backend.read_slow(lost)
        clock.advance(1)
    assert lost_at == list(range(100, 200))
    assert [(e.uuid, e.xid, e.timestamp) for e in events] == [(lost, 79, WALL0 + 100)]
    back = backend.read_fast(lost)
    assert back.utilization.utilization_ratio is not None and back.thermal.temperature_celsius is not None


def test_xid_fault_emits_one_event_with_its_code():
    """xid: one event of the configured code at the start, delivered once."""
    faults = [Fault("xid", 0, 50, params={"xid": 48}), Fault("xid", 1, 50)]
    clock, backend, uuids = make(gpu_count=2, faults=faults)
    assert backend.wait_events(0) == []
    clock.advance(49)
    assert backend.wait_events(0) == []
    clock.advance(11)
    events = backend.wait_events(0)
    assert [(e.uuid, e.xid, e.timestamp) for e in events] == [
        (uuids[0], 48, WALL0 + 50),
        (uuids[1], 13, WALL0 + 50),
    ]
    clock.advance(100)
    assert backend.wait_events(0) == []


def test_power_brake_signature():
    """power_brake: hw_power_brake_slowdown + hw_slowdown, clocks cut, power down, counter grows."""
    faults = [burn(0, 0, 400), Fault("power_brake", 0, 100, 300)]
    clock, backend, (uuid,) = make(profile="h200", faults=faults)
    samples = dict(trace(clock, backend, uuid, 400, every=10))
    before, during, after = samples[90.0], samples[200.0], samples[350.0]
    assert not before.clocks.clocks_event_active["hw_power_brake_slowdown"]
    assert during.clocks.clocks_event_active["hw_power_brake_slowdown"]
    assert during.clocks.clocks_event_active["hw_slowdown"]
    assert not during.clocks.clocks_event_active["hw_thermal_slowdown"]
    assert during.clocks.clock_hertz["graphics"] <= 0.35 * 1980e6
    assert during.power.power_watts < 0.5 * before.power.power_watts
    assert not after.clocks.clocks_event_active["hw_power_brake_slowdown"]
    assert after.clocks.clock_hertz["graphics"] > 1500e6
    brake = [samples[t].clocks.clocks_event_seconds["hw_power_brake_slowdown"] for t in (90.0, 350.0)]
    assert brake[1] - brake[0] == pytest.approx(200, abs=1)


def test_ecc_uncorrectable_signature_with_row_remapping():
    """ecc_uncorrectable on H200: uncorrected counters up, a remap pending until the reset."""
    clock, backend, (uuid,) = make(profile="h200", faults=[Fault("ecc_uncorrectable", 0, 60, 200)])
    before = backend.read_slow(uuid)
    assert before.ecc.ecc_errors[("uncorrected", "volatile")] == 0
    assert before.ecc.remapped_rows_pending is False
    clock.advance(61)
    during = backend.read_slow(uuid)
    assert during.ecc.ecc_errors[("uncorrected", "volatile")] == 2
    assert during.ecc.ecc_errors[("uncorrected", "aggregate")] == 2
    assert during.ecc.remapped_rows == {"correctable": 0, "uncorrectable": 1}
    assert during.ecc.remapped_rows_pending is True
    assert [e.xid for e in backend.wait_events(0)] == [94]
    clock.advance(200)
    after = backend.read_slow(uuid)
    assert after.ecc.remapped_rows_pending is False
    assert after.ecc.ecc_errors[("uncorrected", "volatile")] == 0
    assert after.ecc.ecc_errors[("uncorrected", "aggregate")] == 2
    assert after.ecc.remapped_rows["uncorrectable"] == 1


def test_ecc_uncorrectable_without_row_remapping():
    """On the RTX 6000 profile the counters rise but remapped rows stay absent."""
    faults = [Fault("ecc_uncorrectable", 0, 10, params={"count": 5, "xid": 0})]
    clock, backend, (uuid,) = make(faults=faults)
    clock.advance(20)
    slow = backend.read_slow(uuid)
    assert slow.ecc.ecc_errors[("uncorrected", "aggregate")] == 5
    assert slow.ecc.remapped_rows == {} and slow.ecc.remapped_rows_pending is None
    assert backend.wait_events(0) == []


def test_repeating_faults_recur_every_period():
    """A fault with repeat_seconds comes back each period, with its XID each time."""
    clock, backend, (uuid,) = make(faults=[Fault("fell_off_bus", 0, 10, 20, repeat_seconds=100)])
    events, lost = [], []
    for t in range(0, 250, 5):
        events += backend.wait_events(0)
        try:
            backend.read_fast(uuid)
        except DeviceLost:
            lost.append(t)
        clock.advance(5)
    assert lost == [10, 15, 110, 115, 210, 215]
    assert [e.timestamp - WALL0 for e in events] == [10, 110, 210]


def test_events_that_came_due_while_nobody_waited_are_all_delivered():
    """wait_events returns every onset since the last call, oldest first."""
    faults = [Fault("xid", 0, 30, params={"xid": 31}), Fault("fell_off_bus", 0, 10, 20)]
    clock, backend, (uuid,) = make(faults=faults)
    clock.advance(100)
    assert [(e.xid, e.timestamp - WALL0) for e in backend.wait_events(0)] == [(79, 10), (31, 30)]


# -------------------------------------------------------------------------------- demo tour


def test_demo_tour_shows_each_anomaly_within_six_minutes_and_repeats():
    """GPU 2's fan stalls, GPU 5 throttles, GPU 7 falls off the bus; all well again, then again."""
    clock, backend, uuids = make(gpu_count=8, faults=demo_tour(600))
    seen = {"fan": None, "throttle": None, "lost": None}
    events = []
    for t in range(0, 961, 2):
        events += backend.wait_events(0)
        fan = backend.read_fast(uuids[2]).fans[0]
        if seen["fan"] is None and fan.speed_ratio <= 0.01 and fan.target_speed_ratio >= 0.5:
            seen["fan"] = t
        if seen["throttle"] is None and backend.read_fast(uuids[5]).clocks.clocks_event_active[
            "hw_thermal_slowdown"
        ]:
            seen["throttle"] = t
        try:
            backend.read_fast(uuids[7])
        except DeviceLost:
            if seen["lost"] is None:
                seen["lost"] = t
        if t == DEMO_TOUR_SECONDS + 30:  # everything is back
            for uuid in uuids:
                sample = backend.read_fast(uuid)
                assert not sample.clocks.clocks_event_active["hw_thermal_slowdown"]
                assert all(f.speed_ratio > 0.2 for f in sample.fans)
        clock.advance(2)
    assert all(t is not None and t < 360 for t in seen.values()), seen
    assert [(e.uuid, e.xid, e.timestamp - WALL0) for e in events] == [
        (uuids[7], 79, 240.0),
        (uuids[7], 79, 840.0),
    ]


def test_demo_tour_fits_fanless_and_small_nodes():
    """The H200 tour swaps the fan stall for a power brake and adds an NVLink link going down and a CRC
    storm; small nodes use their last GPUs."""
    faults = demo_tour(600, profile="h200")
    assert "fan_stall" not in {f.kind for f in faults}
    assert {"nvlink_down", "nvlink_crc_storm", "fabric_manager_down"} <= {f.kind for f in faults}
    clock, backend, uuids = make(gpu_count=8, profile="h200", faults=faults)
    clock.advance(120)
    assert backend.read_slow(uuids[0]).nvlink.nvlink_up["5"] is False
    assert backend.read_slow(uuids[1]).nvlink.nvlink_errors["crc_flit"] > 100
    assert "mig_idle_allocation" in {f.kind for f in demo_tour(600, profile="h100-mig")}
    small = demo_tour(600, gpu_count=4)
    assert {f.gpu for f in small} == {0, 1, 2, 3}  # GPU 0: the input-bound job
    assert {f.gpu for f in demo_tour(600, gpu_count=3)} == {0, 1, 2}
    SimulatedBackend(FakeClock(), gpu_count=4, faults=small)
    assert all(f.repeat_seconds == 900 for f in demo_tour(900))


# -------------------------------------------------------------------------------- lifecycle


def test_backend_must_be_open():
    """Reads and discovery before open, and event waits after close, raise BackendUnavailable."""
    clock = FakeClock()
    backend = SimulatedBackend(clock)
    assert backend.name == "simulated"
    with pytest.raises(BackendUnavailable):
        backend.discover()
    info = backend.open()
    assert (info.driver_version, info.nvml_version, info.cuda_driver_version) == (
        "590.48.01",
        "13.590.48.01",
        "13.1",
    )
    uuid = backend.discover()[0].identity.uuid
    backend.close()
    backend.close()  # idempotent
    with pytest.raises(BackendUnavailable):
        backend.read_fast(uuid)
    with pytest.raises(BackendUnavailable) as excinfo:
        backend.wait_events(0)
    assert excinfo.value.reason == "not_open" and excinfo.value.hint


def test_reopening_continues_the_same_node():
    """close() then open() reconnects: counters keep growing, identities stay."""
    clock, backend, (uuid,) = make()
    clock.advance(100)
    energy = backend.read_fast(uuid).power.energy_joules
    backend.close()
    clock.advance(100)
    backend.open()
    assert backend.discover()[0].identity.uuid == uuid
    assert backend.read_fast(uuid).power.energy_joules > energy


def test_unknown_uuid_is_reported_as_lost():
    _, backend, _ = make()
    with pytest.raises(DeviceLost):
        backend.read_fast("GPU-00000000-0000-0000-0000-000000000000")


def test_close_interrupts_a_waiting_wait_events():
    """A thread blocked in wait_events returns [] promptly when the backend is closed."""
    _, backend, _ = make()
    result = []
    started = threading.Event()

    def waiter():
        started.set()
        result.append(backend.wait_events(60))

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    started.wait(5)
    backend.close()
    thread.join(5)
    assert not thread.is_alive()
    assert result == [[]]


def test_concurrent_reads_are_safe_and_consistent():
    """Fast and slow reads from several threads at once see the same deterministic node."""
    clock, backend, uuids = make(gpu_count=4)
    clock.advance(300)
    errors = []

    def reader(read):
        try:
            for _ in range(50):
                for uuid in uuids:
                    read(uuid)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [
        threading.Thread(target=reader, args=(fn,))
        for fn in (backend.read_fast, backend.read_slow, backend.read_fast)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert errors == []
    reference_clock, reference, _ = make(gpu_count=4)
    reference_clock.advance(300)  # same elapsed time on a fresh, sequentially read node
    assert [backend.read_fast(u) for u in uuids] == [reference.read_fast(u) for u in uuids]


# ------------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"profile": "v100"}, "unknown simulated GPU profile 'v100'"),
        ({"gpu_count": 0}, "gpu_count"),
        ({"gpu_count": 1000}, "gpu_count"),
        ({"gpu_count": "8"}, "gpu_count"),
        ({"seed": 1.5}, "seed"),
        ({"faults": [Fault("xid", 3, 0)], "gpu_count": 2}, "node has 2 GPUs"),
        ({"faults": [Fault("fan_stall", 0, 0)], "profile": "h200"}, "needs fan"),
        ({"faults": ["fan_stall"]}, "Fault objects"),
    ],
)
def test_bad_backend_arguments_raise_value_error(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SimulatedBackend(FakeClock(), **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("meteor", 0, 0), {}, "unknown fault kind 'meteor'"),
        (("xid", -1, 0), {}, "gpu must be"),
        (("xid", 0, -5), {}, "start_seconds"),
        (("xid", 0, 10, 10), {}, "end_seconds"),
        (("xid", 0, 10), {"params": {"code": 3}}, "unknown params ['code']"),
        (("xid", 0, 10), {"params": {"xid": "79"}}, "must be a number"),
        (("xid", 0, 10), {"repeat_seconds": 60}, "needs end_seconds"),
        (("xid", 0, 10, 100), {"repeat_seconds": 60}, "longer than repeat_seconds"),
    ],
)
def test_bad_faults_raise_value_error(args, kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        Fault(*args, **kwargs)


def test_bad_demo_tour_arguments_raise_value_error():
    with pytest.raises(ValueError, match="period"):
        demo_tour(60)
    with pytest.raises(ValueError, match="at least 3 GPUs"):
        demo_tour(600, gpu_count=2)
    with pytest.raises(ValueError, match="profile"):
        demo_tour(600, profile="v100")


def test_every_fault_kind_is_documented_and_instantiable():
    """Each registered kind has a description and can be built with its defaults."""
    for kind, spec in FAULT_KINDS.items():
        assert spec.description
        fault = Fault(kind, 0, 1, 2)
        assert dict(fault.params) == dict(spec.params)
        hash(fault)  # usable in sets


def test_the_configs_profile_choices_are_the_simulators_profiles():
    from gpuwatch import config

    assert set(config.SIM_PROFILES) == set(PROFILES)


def test_the_simulator_honours_the_groups_options():
    """The Selection reaches the simulator: --collector.utilization.video adds encoder and decoder utilization
    (idle: compute jobs), except on a MIG-enabled GPU, where NVML has none."""
    from gpuwatch.groups import Selection

    video = Selection.of(options={"utilization.video": True})
    for profile, expected in (("h200", {"encoder": 0.0, "decoder": 0.0}), ("h100-mig", {})):
        plain = SimulatedBackend(FakeClock(), gpu_count=1, profile=profile)
        shown = SimulatedBackend(FakeClock(), gpu_count=1, profile=profile, selection=video)
        assert plain.read_slow(_first(plain)).utilization.utilization_ratio == {}
        assert shown.read_slow(_first(shown)).utilization.utilization_ratio == expected


def _first(backend):
    backend.open()
    return backend.discover()[0].identity.uuid


def test_narrow_empties_the_unselected_groups_and_returns_a_sample_of_selected_ones_as_it_is():
    """Selection.narrow runs on every GPU's sample of every poll: readings of groups that are off go back
    to their empty defaults (a backend that reads everything), a sample that has none is not copied."""
    from gpuwatch.groups import DEFAULT_ENABLED, fast_sample, slow_sample
    from gpuwatch.groups.selection import Selection

    selection = Selection.of(DEFAULT_ENABLED - {"thermal", "pcie"})
    full = fast_sample(temperature_celsius=71.0, power_watts=300.0)
    narrowed = selection.narrow(full)
    assert narrowed.thermal == fast_sample().thermal and narrowed.power is full.power
    assert selection.narrow(narrowed) is narrowed  # nothing unselected left: the same object
    slow = slow_sample(pcie_replays=4, ecc_errors={"volatile_corrected": 1})
    narrowed_slow = selection.narrow(slow)
    assert narrowed_slow.pcie == slow_sample().pcie and narrowed_slow.ecc is slow.ecc
    assert Selection.of(DEFAULT_ENABLED).narrow(full).thermal is full.thermal
