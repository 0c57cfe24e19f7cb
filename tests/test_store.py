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
