"""The Backend protocol every data source implements.

A backend is used from the poller's threads: ``read_fast``/``read_slow`` may be called from two
threads at once (one per tier), ``wait_events`` (with a timeout of 0) from the fast tier's after its poll.
Implementations must be safe for that. No backend method is ever called from an HTTP request.
"""

from __future__ import annotations

from typing import Protocol

from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, SlowSample, XidEvent

# How long ``close`` waits for a drain of the events in progress (the poller's drains do not wait: wait_events
# with a timeout of 0, after each fast poll) before NVML is shut down: never under a thread inside
# nvmlEventSetWait; one stuck in a wedged driver is left behind.
EVENTS_CLOSE_SECONDS = 2.0


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
        """The XID events queued, waiting up to ``timeout_seconds`` for one (the poller waits 0); [] when none came.

        Raises BackendUnavailable when the backend went away. Backends without events sleep
        for the timeout and return [].
        """
        ...
