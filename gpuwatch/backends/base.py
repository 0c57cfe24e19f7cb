"""The Backend protocol every data source implements.

A backend is used from the poller's threads: ``read_fast``/``read_slow`` may be called from two
threads at once (one per tier) and ``wait_events`` from a third. Implementations must be safe for
that. No backend method is ever called from an HTTP request.
"""

from __future__ import annotations

from typing import Protocol

from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, SlowSample, XidEvent

# The events thread's wait (wait_events' timeout). An event ends the wait at once, whatever its length;
# the timeout is how often the thread wakes without one: each wake-up of a thread that slept costs about
# 0.1 ms of CPU on the bench's VM (a return from a 2 s wait cost the idle 8-GPU node a twentieth of its own CPU,
# docs/performance.md). Neither a stop nor a discovery waits for a wait in progress (NvmlBackend.close).
EVENT_WAIT_SECONDS = 10.0


class Backend(Protocol):
    #: value of the ``backend`` label of gpuwatch_backend_up
    name: str

    def open(self) -> DriverInfo:
        """Initialise. Raises BackendUnavailable with a reason and a hint when it cannot."""
        ...

    def close(self) -> None:
        """Release everything; never raises. ``open`` may be called again afterwards."""
        ...

    def discover(self) -> list[DiscoveredGpu]:
        """Enumerate GPUs, read identities and probe capabilities (once per GPU, cached)."""
        ...

    def read_fast(self, uuid: str) -> FastSample:
        """Fast-tier readings of one GPU. Raises DeviceLost or BackendUnavailable."""
        ...

    def read_slow(self, uuid: str) -> SlowSample:
        """Slow-tier readings of one GPU. Raises DeviceLost or BackendUnavailable."""
        ...

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        """Block up to ``timeout_seconds`` for XID events; [] when none came.

        Raises BackendUnavailable when the backend went away. Backends without events sleep
        for the timeout and return [].
        """
        ...
