"""A live one-line-per-GPU view for a terminal (``gpuwatch demo``)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TextIO

from gpuwatch.clock import Clock
from gpuwatch.model import GpuState, NodeSnapshot, absolute_thresholds

HEADER = f"{'GPU':>3}  {'TEMP':>6}  {'LIMIT':>6}  {'FAN':>5}  {'POWER':>7}  {'UTIL':>5}  {'SM CLOCK':>9}  STATE"


def _fmt(value: float | None, pattern: str, missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


def gpu_line(gpu: GpuState, now: float, bound: float) -> str:
    index = gpu.identity.index
    fast = gpu.fast if gpu.up and gpu.fast_monotonic is not None and now - gpu.fast_monotonic <= bound else None
    if fast is None:
        return f"{index:>3}  {'':>6}  {'':>6}  {'':>5}  {'':>7}  {'':>5}  {'':>9}  " + ("LOST" if not gpu.up else "stale")
    limits = absolute_thresholds(fast, gpu.slow)
    fan = fast.fans[0].speed_ratio if fast.fans else None
    active = [r for r, on in fast.clocks_event_active.items() if on and r != "gpu_idle"]
    state = ",".join(active) if active else ("idle" if fast.clocks_event_active.get("gpu_idle") else "ok")
    sm = fast.clock_hertz.get("sm")
    return (
        f"{index:>3}  {_fmt(fast.temperature_celsius, '{:.0f}°C'):>6}  {_fmt(limits.get('slowdown'), '{:.0f}°C'):>6}  "
        f"{_fmt(fan, '{:.0%}', 'n/a'):>5}  {_fmt(fast.power_watts, '{:.0f} W'):>7}  "
        f"{_fmt(fast.utilization_ratio.get('gpu'), '{:.0%}'):>5}  "
        f"{_fmt(None if sm is None else sm / 1e6, '{:.0f} MHz'):>9}  {state}"
    )


def render(snap: NodeSnapshot, now: float, bound: float) -> list[str]:
    status = "backend up" if snap.backend_up else f"backend DOWN: {snap.backend_reason}"
    lines = [f"gpuwatch · {snap.visible_gpus} GPUs · {status}", HEADER]
    lines += [gpu_line(gpu, now, bound) for gpu in snap.gpus]
    return lines


class LiveView:
    def __init__(self, snapshot: Callable[[], NodeSnapshot], clock: Clock, bound: float, out: TextIO) -> None:
        self._snapshot = snapshot
        self._clock = clock
        self._bound = bound
        self._out = out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = 0

    def draw(self) -> None:
        lines = render(self._snapshot(), self._clock.monotonic(), self._bound)
        if self._drawn:
            self._out.write(f"\x1b[{self._drawn}F")  # back to the top of the previous frame
        self._out.write("".join(f"\x1b[2K{line}\n" for line in lines))
        self._out.flush()
        self._drawn = len(lines)

    def start(self, interval: float) -> None:
        def loop() -> None:
            while not self._stop.wait(interval):
                self.draw()

        self._thread = threading.Thread(target=loop, name="gpuwatch-live", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
