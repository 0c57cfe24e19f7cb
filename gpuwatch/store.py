"""The snapshot store: latest readings per GPU, tier outcomes and XID counters, thread-safe.

Writers are the poller's threads; readers (exporter, rules, status API) take an immutable
``NodeSnapshot``. A snapshot is rebuilt only after a write, so scrapes between polls are cheap.
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter
from collections.abc import Iterable, Mapping

from gpuwatch.clock import Clock
from gpuwatch.model import (
    Anomaly,
    DiscoveredGpu,
    DriverInfo,
    FastSample,
    GpuIdentity,
    GpuState,
    HostSample,
    NodeInfo,
    NodeSnapshot,
    ProcessInfo,
    SlowSample,
    TierState,
    XidEvent,
)

TIERS = ("fast", "slow")


class Store:
    def __init__(self, clock: Clock, backend: str, node: NodeInfo | None = None) -> None:
        self._clock = clock
        self._node = node or NodeInfo()
        self._lock = threading.Lock()
        self._backend = backend
        self._backend_up = False
        self._backend_reason: str | None = "not started"
        self._driver: DriverInfo | None = None
        self._gpus: dict[str, GpuState] = {}
        # the GPUs' uuids in index order, and the identities of the visible ones: they change only with a
        # discovery (set_gpus), while a poll replaces each GPU's state (no sort per snapshot or poll)
        self._order: tuple[str, ...] = ()
        self._visible_identities: tuple[GpuIdentity, ...] = ()
        self._visible = 0
        self._tiers: dict[str, TierState] = {t: TierState() for t in TIERS}
        self._errors: dict[str, Counter[str]] = {t: Counter() for t in TIERS}
        self._generation = 0
        self._snapshot: NodeSnapshot | None = None
        self._anomalies: tuple[Anomaly, ...] = ()
        self._onsets: dict[str, int] = {}
        self._events_ok: bool | None = None
        self._rule_errors: dict[str, int] = {}
        self._host: HostSample | None = None
        self._host_monotonic: float | None = None
        self._host_errors: Counter[tuple[str, str]] = Counter()

    # -- writers -----------------------------------------------------------------------------
    def _changed(self) -> None:
        self._generation += 1
        self._snapshot = None

    def set_backend(self, up: bool, reason: str | None = None, driver: DriverInfo | None = None) -> None:
        with self._lock:
            self._backend_up = up
            self._backend_reason = None if up else reason
            self._driver = driver
            if not up:
                # Nothing can be said about the GPUs while the backend is down: they stay listed, down.
                self._visible = 0
                for uuid, state in self._gpus.items():
                    if state.up:
                        self._gpus[uuid] = dataclasses.replace(state, up=False)
            self._changed()

    def set_gpus(self, discovered: Iterable[DiscoveredGpu]) -> None:
        """Apply a discovery. GPUs seen before but not now stay, down and not visible."""
        with self._lock:
            seen = set()
            for gpu in discovered:
                uuid = gpu.identity.uuid
                seen.add(uuid)
                old = self._gpus.get(uuid)
                if old is None:
                    self._gpus[uuid] = GpuState(identity=gpu.identity, features=dict(gpu.features), up=True)
                else:
                    self._gpus[uuid] = dataclasses.replace(
                        old, identity=gpu.identity, features=dict(gpu.features), up=True, visible=True
                    )
            for uuid, state in self._gpus.items():
                if uuid not in seen and state.visible:
                    self._gpus[uuid] = dataclasses.replace(state, up=False, visible=False)
            self._visible = len(seen)
            ordered = sorted(self._gpus.values(), key=lambda s: (s.identity.index, s.identity.uuid))
            self._order = tuple(state.identity.uuid for state in ordered)
            self._visible_identities = tuple(state.identity for state in ordered if state.visible)
            self._changed()

    def put_fast(self, uuid: str, sample: FastSample) -> None:
        with self._lock:
            s = self._gpus[uuid]
            # GpuState(...) spelled out: dataclasses.replace costs as much as reading the GPU's power
            self._gpus[uuid] = GpuState(s.identity, s.features, True, sample, self._clock.monotonic(), s.slow,
                                        s.slow_monotonic, s.xid_counts, s.xid_last_timestamp, s.workloads, s.visible,
                                        s.host, s.host_monotonic)
            self._changed()

    def put_slow(self, uuid: str, sample: SlowSample, workloads: tuple[ProcessInfo, ...] = ()) -> None:
        with self._lock:
            state = self._gpus[uuid]
            self._gpus[uuid] = dataclasses.replace(
                state, slow=sample, slow_monotonic=self._clock.monotonic(), workloads=workloads
            )
            self._changed()

    def put_host(self, sample: HostSample) -> None:
        """A read of the host groups: the node's part, and each GPU's allocations (``HostSample.on``)."""
        with self._lock:
            now = self._clock.monotonic()
            self._host, self._host_monotonic = sample, now
            self._host_errors.update(sample.errors)
            for uuid, state in self._gpus.items():
                if sample.gpus is not None and uuid not in sample.gpus:
                    continue  # found after the read began: its allocations come with the next read
                part = sample.on(uuid)
                self._gpus[uuid] = dataclasses.replace(
                    state, host=state.host if part == state.host else part, host_monotonic=now)
            self._changed()

    def set_gpu_up(self, uuid: str, up: bool) -> bool:
        """Mark one GPU up or down; returns True when that changed its state."""
        with self._lock:
            state = self._gpus.get(uuid)
            if state is None or state.up == up:
                return False
            self._gpus[uuid] = dataclasses.replace(state, up=up)
            self._changed()
            return True

    def record_xid(self, event: XidEvent) -> None:
        with self._lock:
            state = self._gpus.get(event.uuid)
            if state is None:
                return
            counts = dict(state.xid_counts)
            counts[event.xid] = counts.get(event.xid, 0) + 1
            last = dict(state.xid_last_timestamp)
            last[event.xid] = event.timestamp
            self._gpus[event.uuid] = dataclasses.replace(state, xid_counts=counts, xid_last_timestamp=last)
            self._changed()

    def set_anomalies(self, anomalies: tuple[Anomaly, ...], onsets: Mapping[str, int] | None = None,
                      errors: Mapping[str, int] | None = None) -> None:
        """The rule engine's latest verdicts (every evaluated rule and GPU, firing or not), and its
        counters per enabled rule: onsets and evaluations that raised."""
        onsets = dict(onsets or {})
        errors = dict(errors or {})
        with self._lock:
            if (anomalies, onsets, errors) != (self._anomalies, self._onsets, self._rule_errors):
                self._anomalies, self._onsets, self._rule_errors = anomalies, onsets, errors
                self._changed()

    def poll_started(self, tier: str) -> None:
        with self._lock:
            t = self._tiers[tier]  # TierState(...) spelled out: dataclasses.replace costs twice as much, every poll
            self._tiers[tier] = TierState(t.success, t.duration_seconds, t.last_completed_wall,
                                          t.last_completed_monotonic, t.errors_total, self._clock.monotonic(),
                                          t.groups)
            self._changed()

    def poll_overrun(self, tier: str) -> None:
        """A scheduled poll was skipped because the previous one is still running."""
        with self._lock:
            if self._tiers[tier].success:
                self._tiers[tier] = dataclasses.replace(self._tiers[tier], success=False)
                self._changed()

    def poll_finished(self, tier: str, success: bool, duration: float, errors: Iterable[str] = (),
                      groups: Mapping[str, tuple[float, bool]] | None = None) -> None:
        """A poll of ``tier`` ended; ``groups``: reading group -> (seconds, succeeded on every GPU)."""
        with self._lock:
            counter = self._errors[tier]
            counter.update(errors)
            self._tiers[tier] = TierState(
                success=success,
                duration_seconds=duration,
                last_completed_wall=self._clock.wall(),
                last_completed_monotonic=self._clock.monotonic(),
                errors_total=dict(counter),
                in_flight_since=None,
                groups=dict(groups) if groups is not None else self._tiers[tier].groups,
            )
            self._changed()

    def set_events_ok(self, ok: bool) -> None:
        """Whether the XID events thread's last wait worked (gpuwatch_collector_success{group="xid"})."""
        with self._lock:
            self._events_ok = ok
            self._changed()

    # -- readers -----------------------------------------------------------------------------
    def _sorted(self) -> tuple[GpuState, ...]:
        gpus = self._gpus
        return tuple(gpus[uuid] for uuid in self._order)

    def visible_identities(self) -> tuple[GpuIdentity, ...]:
        """The identities of the GPUs of the last discovery, in index order: what a poll reads (without
        building a snapshot, which each poll's writes make stale)."""
        with self._lock:
            return self._visible_identities

    def gpu_states(self) -> tuple[tuple[GpuState, ...], float, int]:
        """(every GPU's state in index order, the monotonic time now, visible GPUs): what the rules' history
        takes after each poll, without building a snapshot."""
        with self._lock:
            return self._sorted(), self._clock.monotonic(), self._visible

    def snapshot(self) -> NodeSnapshot:
        with self._lock:
            if self._snapshot is None:
                self._snapshot = NodeSnapshot(
                    generation=self._generation,
                    backend=self._backend,
                    backend_up=self._backend_up,
                    backend_reason=self._backend_reason,
                    driver=self._driver,
                    gpus=self._sorted(),
                    tiers=dict(self._tiers),
                    visible_gpus=self._visible,
                    taken_monotonic=self._clock.monotonic(),
                    taken_wall=self._clock.wall(),
                    anomalies=self._anomalies,
                    rule_onsets=self._onsets,
                    rule_errors=self._rule_errors,
                    events_ok=self._events_ok,
                    host=self._host,
                    host_monotonic=self._host_monotonic,
                    host_errors=dict(self._host_errors),
                    node=self._node,
                )
            return self._snapshot
