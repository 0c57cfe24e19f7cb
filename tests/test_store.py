"""The store: a new fast sample changes only the GPU's fast sample, its time and up."""

import dataclasses

from gpuwatch.clock import FakeClock
from gpuwatch.model import DiscoveredGpu, ProcessInfo, XidEvent
from gpuwatch.store import Store
from gpuwatch.testing import H200_FEATURES, fast_sample, identity, slow_sample


def test_put_fast_keeps_every_other_field_of_the_gpu():
    """put_fast builds the new GpuState field by field (for speed): every field it does not set
    must survive, including any field added to GpuState later."""
    clock = FakeClock()
    store = Store(clock, "scripted")
    gpu = DiscoveredGpu(identity(0), H200_FEATURES)
    uuid = gpu.identity.uuid
    store.set_gpus([gpu])
    store.put_slow(uuid, slow_sample(), (ProcessInfo(42, 1 << 30, "alice", "slurm", "1234"),))
    store.record_xid(XidEvent(uuid=uuid, xid=79, timestamp=clock.wall()))
    store.set_gpu_up(uuid, False)
    before = store.snapshot().gpus[0]
    assert before.xid_counts and before.workloads and not before.up  # non-defaults to lose
    clock.advance(2.0)
    sample = fast_sample(temperature_celsius=61.0)
    store.put_fast(uuid, sample)
    after = store.snapshot().gpus[0]
    assert after == dataclasses.replace(before, up=True, fast=sample, fast_monotonic=clock.monotonic())


def test_put_fast_carries_every_field_it_does_not_set_whatever_fields_gpustate_has():
    """Every field of GpuState, present and future, set to a marker of its own: put_fast keeps them all."""
    from gpuwatch.model import GpuState

    clock = FakeClock()
    store = Store(clock, "scripted")
    gpu = DiscoveredGpu(identity(0), H200_FEATURES)
    store.set_gpus([gpu])
    uuid = gpu.identity.uuid
    markers = {f.name: object() for f in dataclasses.fields(GpuState)}
    store._gpus[uuid] = GpuState(**markers)
    sample = fast_sample()
    store.put_fast(uuid, sample)
    new = store._gpus[uuid]
    set_here = {"up": True, "fast": sample, "fast_monotonic": clock.monotonic()}
    for name, marker in markers.items():
        assert getattr(new, name) is set_here.get(name, marker), name


def test_poll_started_carries_every_field_it_does_not_set_whatever_fields_tierstate_has():
    """poll_started builds the tier's new TierState field by field (every poll): every field but the start of
    the poll in flight, present and future, keeps its value."""
    from gpuwatch.model import TierState

    clock = FakeClock()
    store = Store(clock, "scripted")
    markers = {f.name: object() for f in dataclasses.fields(TierState)}
    store._tiers["fast"] = TierState(**markers)
    clock.advance(5.0)
    store.poll_started("fast")
    new = store._tiers["fast"]
    assert new.in_flight_since == clock.monotonic()
    for name, marker in markers.items():
        if name != "in_flight_since":
            assert getattr(new, name) is marker, name


def test_visible_identities_and_states_follow_the_discoveries_in_index_order():
    """What a poll reads and what the rules' history takes come without a snapshot: the GPUs of the last
    discovery in index order (a discovery lists them in any order), a GPU gone from a discovery left out
    of the polls but kept, down, among the states; a new index moves a GPU."""
    clock = FakeClock()
    store = Store(clock, "scripted")
    gpus = [DiscoveredGpu(identity(i), H200_FEATURES) for i in (2, 0, 1)]
    store.set_gpus(gpus)
    assert [i.index for i in store.visible_identities()] == [0, 1, 2]
    states, taken, visible = store.gpu_states()
    assert states == store.snapshot().gpus and taken == clock.monotonic() and visible == 3
    store.set_gpus(gpus[1:])  # GPU 2 is gone
    assert [i.index for i in store.visible_identities()] == [0, 1]
    states, _, visible = store.gpu_states()
    assert [(s.identity.index, s.visible, s.up) for s in states] == [(0, True, True), (1, True, True),
                                                                     (2, False, False)]
    assert visible == 2 and states == store.snapshot().gpus
    moved = DiscoveredGpu(dataclasses.replace(gpus[1].identity, index=5), H200_FEATURES)  # GPU 0 is now 5
    store.set_gpus([moved, gpus[2]])
    assert [(i.index, i.uuid) for i in store.visible_identities()] == [(1, gpus[2].identity.uuid),
                                                                      (5, gpus[1].identity.uuid)]
    assert [s.identity.index for s in store.snapshot().gpus] == [1, 2, 5]
    clock.advance(3.0)
    store.put_fast(gpus[2].identity.uuid, fast_sample(temperature_celsius=50.0))
    states, taken, _ = store.gpu_states()
    assert states[0].fast.thermal.temperature_celsius == 50.0 and taken == clock.monotonic()
