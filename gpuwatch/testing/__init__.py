"""Public test helpers: sample builders, a scripted in-memory backend, exposition rendering, and the
whole agent in-process on simulated time (``Harness``, gpuwatch/testing/harness.py) over any backend,
one in a child process included (``ChildBackend``, gpuwatch/testing/child.py).

Used by gpuwatch's own tests; usable by anyone writing rules or dashboards against gpuwatch.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

from gpuwatch import groups
from gpuwatch.clock import Clock, FakeClock
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.exporter import build_exposition
from gpuwatch.model import (
    FEATURES,
    DiscoveredGpu,
    DriverInfo,
    FanReading,
    FastSample,
    GpuIdentity,
    SlowSample,
    XidEvent,
)
from gpuwatch.store import Store

__all__ = ["FakeClock", "ScriptedBackend", "identity", "fast_sample", "slow_sample", "exposition", "Harness",
           "ChildBackend", "ForkServer", "load_config"]


def identity(index: int = 0, **overrides: Any) -> GpuIdentity:
    values: dict[str, Any] = dict(
        index=index,
        uuid=f"GPU-00000000-0000-4000-8000-{index:012d}",
        name="NVIDIA H200",
        pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
        serial=f"165000000{index:04d}",
        minor_number=index,
        vbios_version="96.00.AF.00.01",
        architecture="hopper",
    )
    values.update(overrides)
    return GpuIdentity(**values)


def fast_sample(**overrides: Any) -> FastSample:
    """An idle H200-like fast sample (values from the H200 capture); readings by their flat names
    (``temperature_celsius=85.0``), as in gpuwatch.groups.fast_sample."""
    values: dict[str, Any] = dict(
        temperature_celsius=28.0,
        memory_temperature_celsius=32.0,
        temperature_margin_celsius=59.0,
        fans=(),
        power_watts=77.67,
        energy_joules=123456.789,
        performance_state=0,
        utilization_ratio={"gpu": 0.0, "memory": 0.0},
        memory_total_bytes=143771 * 2**20,
        memory_used_bytes=0,
        memory_free_bytes=143203 * 2**20,
        memory_reserved_bytes=568 * 2**20,
        clock_hertz={"graphics": 345e6, "sm": 345e6, "memory": 3201e6},
        clocks_event_active={"gpu_idle": True, "sw_power_cap": False, "hw_slowdown": False,
                             "sw_thermal_slowdown": False, "hw_thermal_slowdown": False},
        clocks_event_seconds={"sw_power_cap": 12.5, "hw_thermal_slowdown": 0.0},
        sm_active_ratio=0.0,
        sm_occupancy_ratio=0.0,
        graphics_engine_active_ratio=0.0,
        pipe_active_ratio={"tensor": 0.0, "fp64": 0.0, "fp32": 0.0, "fp16": 0.0, "integer": 0.0},
        dram_bandwidth_ratio=0.0,
        pcie_traffic_bytes={"tx": 1.5e9, "rx": 2.5e9},
    )
    values.update(overrides)
    return groups.fast_sample(**values)


def slow_sample(**overrides: Any) -> SlowSample:
    """An H200-like slow sample; readings by their flat names, as in gpuwatch.groups.slow_sample."""
    values: dict[str, Any] = dict(
        temperature_margin_threshold_celsius={"shutdown": -8.0, "slowdown": -2.0, "gpu_max": 0.0, "memory_max": 0.0},
        power_limit_watts={"enforced": 700.0, "default": 700.0, "min": 200.0, "max": 700.0},
        clock_hertz={"video": 765e6},
        clock_max_hertz={"graphics": 1980e6, "sm": 1980e6, "memory": 3201e6, "video": 1545e6},
        ecc_errors={("corrected", "volatile"): 0, ("uncorrected", "volatile"): 0,
                    ("corrected", "aggregate"): 0, ("uncorrected", "aggregate"): 0},
        remapped_rows={"correctable": 0, "uncorrectable": 0},
        remapped_rows_pending=False,
        remapped_rows_failed=False,
        pcie_link_generation={"current": 1, "max": 5},
        pcie_link_width={"current": 16, "max": 16},
        pcie_replays=0,
        # HGX H200: 18 NVLinks to the NVSwitches, all up; fabric registration completed (the capture)
        nvlink_up=dict.fromkeys(map(str, range(18)), True),
        nvlink_up_at_discovery=dict.fromkeys(map(str, range(18)), True),
        nvlink_remote={str(link): "NVSwitch" for link in range(18)},
        nvlink_errors=dict.fromkeys(groups.nvlink.ERRORS, 0),
        nvlink_traffic_bytes={"tx": 1.2e12, "rx": 1.1e12},
        fabric_state="completed",
        fabric_status="success",
        fabric_cluster_uuid="00000000-0000-0000-0000-000000000000",
        fabric_clique_id=0,
    )
    values.update(overrides)
    return groups.slow_sample(**values)


def fan(index: int = 0, speed: float = 0.38, target: float = 0.38, rpm: float = 1500.0) -> FanReading:
    return FanReading(fan=index, speed_ratio=speed, target_speed_ratio=target, speed_rpm=rpm)


H200_FEATURES = {f: f not in ("fan", "fan_rpm", "fan_target", "retired_pages") for f in FEATURES}


class ScriptedBackend:
    """An in-memory backend whose answers the test sets, including failures.

    ``open_error`` (a BackendUnavailable) makes open() fail; ``lost`` holds UUIDs whose reads
    raise DeviceLost; ``fast``/``slow`` map UUID -> sample; ``block`` (a threading.Event) makes
    read_fast wait on it, like a wedged NVML call; ``calls`` counts method calls.
    """

    name = "scripted"

    def __init__(self, gpus: int = 2, features: dict[str, bool] | None = None) -> None:
        self.gpus = [DiscoveredGpu(identity(i), dict(features or H200_FEATURES)) for i in range(gpus)]
        self.fast = {g.identity.uuid: fast_sample() for g in self.gpus}
        self.slow = {g.identity.uuid: slow_sample() for g in self.gpus}
        self.open_error: BackendUnavailable | None = None
        self.read_error: BackendUnavailable | None = None
        self.lost: set[str] = set()
        self.block: threading.Event | None = None
        self.events: list[XidEvent] = []
        self.calls: dict[str, int] = {}
        self._lock = threading.Lock()

    def _count(self, name: str) -> None:
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1

    def open(self) -> DriverInfo:
        self._count("open")
        if self.open_error is not None:
            raise self.open_error
        return DriverInfo("590.48.01", "13.590.48.01", "13.1")

    def close(self) -> None:
        self._count("close")

    def discover(self) -> list[DiscoveredGpu]:
        self._count("discover")
        return list(self.gpus)

    def read_fast(self, uuid: str) -> FastSample:
        self._count("read_fast")
        if self.block is not None:
            self.block.wait()
        if self.read_error is not None:
            raise self.read_error
        if uuid in self.lost:
            raise DeviceLost(uuid)
        return self.fast[uuid]

    def read_slow(self, uuid: str) -> SlowSample:
        self._count("read_slow")
        if self.read_error is not None:
            raise self.read_error
        if uuid in self.lost:
            raise DeviceLost(uuid)
        return self.slow[uuid]

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        self._count("wait_events")
        with self._lock:
            events, self.events = self.events, []
        if not events:
            threading.Event().wait(min(timeout_seconds, 0.05))
        return events


def registry_for(store: Store, clock: Clock, staleness: Callable[[str], float] | None = None) -> Any:
    """The /metrics renderer over ``store`` without process metrics (deterministic output)."""
    return build_exposition(store.snapshot, clock, staleness or (lambda tier: 6.0 if tier == "fast" else 90.0),
                            process_metrics=False)


def exposition(store: Store, clock: Clock, staleness: Callable[[str], float] | None = None) -> str:
    """The text exposition of a store, as /metrics would serve it (without process metrics)."""
    return registry_for(store, clock, staleness).render()[0].decode()


def replace(obj: Any, **changes: Any) -> Any:
    """``dataclasses.replace``; on a FastSample or SlowSample the changes may name readings by their
    flat names (``replace(sample, temperature_celsius=90.0)``)."""
    if isinstance(obj, (FastSample, SlowSample)) and changes:
        values = groups.flat(obj)
        values.update(changes)
        return (groups.fast_sample if isinstance(obj, FastSample) else groups.slow_sample)(**values)
    return dataclasses.replace(obj, **changes)


from gpuwatch.testing.child import ChildBackend, ForkServer  # noqa: E402  (after the helpers the harness builds on)
from gpuwatch.testing.harness import Harness, load_config  # noqa: E402
