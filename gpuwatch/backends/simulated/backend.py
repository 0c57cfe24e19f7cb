"""SimulatedBackend: the Backend protocol over the simulated GPUs."""

from __future__ import annotations

import hashlib
import math
import threading
import uuid as uuidlib
from collections.abc import Sequence
from typing import Any

from gpuwatch.backends.simulated.faults import FAULT_KINDS, Fault
from gpuwatch.backends.simulated.physics import SimGpu, fast_reading, new_gpu, slow_reading, step
from gpuwatch.backends.simulated.profiles import (
    DRIVER_INFO,
    EVENT_POLL_SECONDS,
    HANG_POLL_SECONDS,
    MAX_GPUS,
    PROFILES,
    STEP_SECONDS,
    Profile,
    unknown_profile,
)
from gpuwatch.clock import Clock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.groups import HostSample, Selection
from gpuwatch.groups.grace import GraceSensor
from gpuwatch.groups.jobs import JobUsage
from gpuwatch.groups.slurm import JobAllocation
from gpuwatch.model import (
    DiscoveredGpu,
    DriverInfo,
    FastSample,
    GpuIdentity,
    SlowSample,
    XidEvent,
)


def _identity(seed: int, index: int, profile: Profile) -> GpuIdentity:
    digest = hashlib.sha256(f"gpuwatch-simulated:{seed}:{index}".encode()).digest()
    serial = int.from_bytes(digest[16:24], "big") % 10**9
    return GpuIdentity(
        index=index,
        uuid="GPU-" + str(uuidlib.UUID(bytes=digest[:16], version=4)),
        name=profile.name,
        pci_bus_id=f"{index // 16:08X}:{0x18 + 0x0E * (index % 16):02X}:00.0",
        serial=f"{profile.serial_prefix}{serial:09d}",
        minor_number=index,
        vbios_version=profile.vbios_version,
        architecture=profile.architecture,
    )


class SimulatedBackend:
    """A node of simulated GPUs (see the module docstring for the model).

    Time zero is the first ``open()``; ``close()`` then ``open()`` reconnects to the same running
    node (like re-initialising NVML, not like a driver reload), so counters keep going.

    ``wait_events`` returns the XID events that came due (by the injected clock) since the last
    call at once; when none are due it waits in *real* time on a ``threading.Event``, re-checking
    every 0.25 s, up to ``timeout_seconds`` or until ``close()``. With a FakeClock, call it with a
    timeout of 0 (or a small one) after advancing the clock.
    """

    name = "simulated"

    def __init__(
        self,
        clock: Clock,
        gpu_count: int = 8,
        profile: str = "rtx6000",
        faults: Sequence[Fault] | None = None,
        seed: int = 0,
        selection: Selection | None = None,
    ) -> None:
        # the groups' options it can honour (the poller leaves the readings of groups not selected out)
        self._video = bool((selection or Selection.of()).option("utilization", "video"))
        if profile not in PROFILES:
            raise ValueError(unknown_profile(profile))
        if not isinstance(gpu_count, int) or isinstance(gpu_count, bool) or not (
            1 <= gpu_count <= MAX_GPUS
        ):
            raise ValueError(
                f"gpu_count must be an integer from 1 to {MAX_GPUS}, got {gpu_count!r}"
            )
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"seed must be an integer, got {seed!r}")
        self._profile = PROFILES[profile]
        faults = tuple(faults or ())
        # what faults may require: the features, and the C2C links (the c2c group has no feature series)
        features = {**self._profile.features, "c2c": self._profile.c2c_links > 0}
        for fault in faults:
            if not isinstance(fault, Fault):
                raise ValueError(f"faults must be Fault objects, got {fault!r}")
            if fault.gpu >= gpu_count:
                raise ValueError(
                    f"fault {fault.kind} is on GPU {fault.gpu}, but the node has {gpu_count} GPUs"
                )
            missing = [f for f in FAULT_KINDS[fault.kind].requires if not features[f]]
            if missing:
                raise ValueError(
                    f"fault {fault.kind} needs {', '.join(missing)}, which profile "
                    f"{profile!r} does not have"
                )
        self._clock = clock
        self._seed = seed
        self._faults = faults
        self._backend_faults = tuple(f for f in faults if FAULT_KINDS[f.kind].backend)
        self._identities = [_identity(seed, i, self._profile) for i in range(gpu_count)]
        self._index_by_uuid = {ident.uuid: ident.index for ident in self._identities}
        self._lock = threading.Lock()
        self._open = False
        self._closed = threading.Event()
        self._t0: float | None = None
        self._gpus: list[SimGpu] = []
        self._events_until = -1.0  # XID onsets up to this elapsed time have been delivered
        self._blocked = 0  # reads waiting in a hang

    @property
    def profile(self) -> Profile:
        return self._profile

    @property
    def gpu_count(self) -> int:
        return len(self._identities)

    @property
    def hung_reads(self) -> int:
        """Reads blocked right now by a hang fault that is still active by the clock.

        For harnesses that run polls on threads under a FakeClock: a poll is either finished,
        running, or hung, and this tells the last apart without waiting in real time.
        """
        with self._lock:
            return self._blocked if self._effect("hang") else 0

    def open(self) -> DriverInfo:
        with self._lock:
            if self._t0 is None:
                self._t0 = self._clock.monotonic()
                self._gpus = [
                    new_gpu(
                        ident.index,
                        ident.uuid,
                        self._profile,
                        tuple(f for f in self._faults if f.gpu == ident.index),
                        self._seed,
                    )
                    for ident in self._identities
                ]
            self._check_available()
            self._open = True
            self._closed = threading.Event()
            return self._profile.driver or DRIVER_INFO

    def close(self) -> None:
        with self._lock:
            self._open = False
            self._closed.set()

    def discover(self) -> list[DiscoveredGpu]:
        with self._lock:
            self._check_open()
            features = self._profile.features
            return [
                DiscoveredGpu(identity=i, features=dict(features))
                for i in self._identities
                if not self._effect("unlisted", i.index)
            ]

    def read_fast(self, uuid: str) -> FastSample:
        self._wait_out_hang()
        with self._lock:
            return fast_reading(self._current(uuid))

    def read_slow(self, uuid: str) -> SlowSample:
        self._wait_out_hang()
        with self._lock:
            return slow_reading(self._current(uuid), video=self._video)

    def read_host(self, gpus: Sequence[Any] = ()) -> HostSample:
        """The host groups of the simulated node: the Slurm jobs of the active ``job`` faults (their
        allocations and their processes' CPU use since the fault began); no kubelet; on Grace-coupled
        profiles the Grace sockets' hwmon power sensors."""
        with self._lock:
            elapsed = self._elapsed() if self._t0 is not None else 0.0
            grace = self._grace_sensors()
        allocations: list[JobAllocation] = []
        jobs: dict[str, JobUsage] = {}
        for fault in self._faults:
            since = fault.since_onset(elapsed) if FAULT_KINDS[fault.kind].job else None
            if since is None:
                continue
            p = fault.params
            job_id = str(int(p["job_id"]))
            allocations.append(JobAllocation(self._identities[fault.gpu].uuid, job_id, "sim", "scontrol"))
            if job_id not in jobs:
                busy = p["cpu_busy"] * p["cpus"] * since  # CPU seconds
                wait = busy * p["iowait"] / (1.0 - p["iowait"]) if p["iowait"] < 1.0 else 0.0
                jobs[job_id] = JobUsage("slurm", job_id, (0.9 * busy, 0.1 * busy, wait), int(2e8 * since),
                                        int(1e6 * since), p["cpus"], 6, p["cpu_busy"] if since > 0 else None,
                                        p["iowait"] if since > 0 else None)
        collected = (("slurm", 0.0, True), ("jobs", 0.0, True)) + ((("grace", 0.0, True),) if grace else ())
        return HostSample(slurm=tuple(allocations), jobs=tuple(jobs.values()), collected=collected,
                          gpus=tuple(g.identity.uuid for g in gpus) if gpus else None, grace=grace)

    def _grace_sensors(self) -> tuple[GraceSensor, ...] | None:
        """Per Grace socket (``gpus_per_grace`` GPUs each): the CPU's power (its GPUs' Grace share, less a
        fixed SysIO part), SysIO, the module (its GPUs and the Grace together) and the cap, as hwmon has
        them; None on profiles without Grace. At the GPUs' last step (called with the lock held)."""
        p = self._profile
        if not p.c2c_links or not self._gpus:
            return None
        sensors = []
        per = max(1, p.gpus_per_grace)
        for socket in range((len(self._gpus) + per - 1) // per):
            mine = self._gpus[socket * per:(socket + 1) * per]
            grace = sum(g.grace_power for g in mine)
            sysio = 20.0 * len(mine)
            module = grace + sum(g.power for g in mine if not g.lost)
            s = str(socket)
            sensors += [GraceSensor("cap", s, p.grace_cap_watts), GraceSensor("cpu", s, round(grace - sysio, 3)),
                        GraceSensor("module", s, round(module, 3)), GraceSensor("sysio", s, sysio)]
        return tuple(sorted(sensors, key=lambda x: (x.sensor, int(x.socket))))

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        remaining = max(0.0, float(timeout_seconds))
        while True:
            with self._lock:
                self._check_open()
                events = self._due_events()
                closed = self._closed
            if events or remaining <= 0.0:
                return events
            wait = min(remaining, EVENT_POLL_SECONDS)
            if closed.wait(wait):
                return []
            remaining -= wait

    # -- internals (called with the lock held)

    def _check_open(self) -> None:
        if not self._open:
            raise BackendUnavailable(
                "not_open",
                "the simulated backend is not open",
                "call open() first (the poller does this on start and after errors)",
            )
        self._check_available()

    def _check_available(self) -> None:
        if self._effect("unavailable"):
            raise BackendUnavailable(
                "driver_not_loaded",
                "the simulated driver is not loaded (backend_down fault)",
                "wait for the fault window to end; the poller retries by itself",
            )

    def _effect(self, effect: str, index: int | None = None) -> bool:
        """Whether a backend-level fault of that effect (on GPU ``index``) is active now."""
        if self._t0 is None or not self._backend_faults:
            return False
        t = math.floor(self._elapsed() / STEP_SECONDS + 1e-6) * STEP_SECONDS
        return any(
            FAULT_KINDS[f.kind].backend == effect
            and (index is None or f.gpu == index)
            and f.since_onset(t) is not None
            for f in self._backend_faults
        )

    def _wait_out_hang(self) -> None:
        """Block, like a wedged NVML call, while a hang fault is active (until close())."""
        with self._lock:
            if not self._open or not self._effect("hang"):
                return
            self._blocked += 1
            closed = self._closed
        try:
            while not closed.wait(HANG_POLL_SECONDS):
                with self._lock:
                    if not self._open or not self._effect("hang"):
                        return
        finally:
            with self._lock:
                self._blocked -= 1

    def _elapsed(self) -> float:
        assert self._t0 is not None
        return max(0.0, self._clock.monotonic() - self._t0)

    def _current(self, uuid: str) -> SimGpu:
        self._check_open()
        index = self._index_by_uuid.get(uuid)
        if index is None:
            raise DeviceLost(uuid, f"no simulated GPU has UUID {uuid}")
        g = self._gpus[index]
        target = math.floor(self._elapsed() / STEP_SECONDS + 1e-6)
        while g.step < target:
            g.step += 1
            step(g, g.step * STEP_SECONDS, STEP_SECONDS)
        if g.lost:
            raise DeviceLost(uuid, f"simulated GPU {index} has fallen off the bus")
        if self._effect("unlisted", index):
            raise DeviceLost(uuid, f"simulated GPU {index} is no longer on the PCI bus")
        return g

    def _due_events(self) -> list[XidEvent]:
        now = self._elapsed()
        wall = self._clock.wall()
        due: list[tuple[float, int, XidEvent]] = []
        for order, fault in enumerate(self._faults):
            code_of = FAULT_KINDS[fault.kind].xid
            code = code_of(fault) if code_of else None
            if not code:
                continue
            uuid = self._identities[fault.gpu].uuid
            for onset in fault.onsets_between(self._events_until, now):
                due.append((onset, order, XidEvent(uuid, code, wall - (now - onset))))
        self._events_until = now
        return [event for _, _, event in sorted(due, key=lambda d: (d[0], d[1]))]

