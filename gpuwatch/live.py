"""A live one-line-per-GPU view for a terminal (``gpuwatch demo``), with the latest log lines below."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import TextIO

from gpuwatch.clock import Clock
from gpuwatch.model import GpuState, NodeSnapshot, temperature_thresholds

HEADER = f"{'GPU':>3}  {'TEMP':>6}  {'LIMIT':>6}  {'FAN':>5}  {'POWER':>7}  {'UTIL':>5}  {'SM CLOCK':>9}  STATE"


def _fmt(value: float | None, pattern: str, missing: str = "-") -> str:
    return missing if value is None else pattern.format(value)


def gpu_line(gpu: GpuState, now: float, bound: float, anomalies: list[str] | None = None) -> str:
    index = gpu.identity.index
    fast = gpu.fresh_fast(now, bound)
    if fast is None:
        state = "LOST" if not gpu.up else "stale"
        if anomalies:
            state = "ANOMALY " + ",".join(anomalies) + " | " + state
        return f"{index:>3}  {'':>6}  {'':>6}  {'':>5}  {'':>7}  {'':>5}  {'':>9}  " + state
    limits = temperature_thresholds(fast, gpu.slow)
    fan = fast.fans[0].speed_ratio if fast.fans else None
    active = [r for r, on in fast.clocks.clocks_event_active.items() if on and r != "gpu_idle"]
    state = ",".join(active) if active else ("idle" if fast.clocks.clocks_event_active.get("gpu_idle") else "ok")
    if anomalies:
        state = "ANOMALY " + ",".join(anomalies) + " | " + state
    sm = fast.clocks.clock_hertz.get("sm")
    return (
        f"{index:>3}  {_fmt(fast.thermal.temperature_celsius, '{:.0f}°C'):>6}  "
        f"{_fmt(limits.get('slowdown'), '{:.0f}°C'):>6}  "
        f"{_fmt(fan, '{:.0%}', 'n/a'):>5}  {_fmt(fast.power.power_watts, '{:.0f} W'):>7}  "
        f"{_fmt(fast.utilization.utilization_ratio.get('gpu'), '{:.0%}'):>5}  "
        f"{_fmt(None if sm is None else sm / 1e6, '{:.0f} MHz'):>9}  {state}"
    )


def render(snap: NodeSnapshot, now: float, bound: float) -> list[str]:
    status = "backend up" if snap.backend_up else f"backend DOWN: {snap.backend_reason}"
    firing: dict[str | None, list[str]] = {}
    for a in snap.anomalies:
        if a.firing and a.severity != "info":
            firing.setdefault(a.uuid, []).append(a.rule)
    node = f" · NODE ANOMALY {','.join(firing[None])}" if None in firing else ""
    lines = [f"gpuwatch · {snap.visible_gpus} GPUs · {status}{node}", HEADER]
    lines += [gpu_line(gpu, now, bound, firing.get(gpu.identity.uuid)) for gpu in snap.gpus]
    return lines


class LogTail:
    """A stream for structlog that keeps the last lines, shown under the live view."""

    def __init__(self, size: int = 6) -> None:
        self.lines: deque[str] = deque(maxlen=size)
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self.lines.extend(line for line in text.splitlines() if line.strip())
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)


class LiveView:
    def __init__(self, snapshot: Callable[[], NodeSnapshot], clock: Clock, bound: float, out: TextIO,
                 log_tail: LogTail | None = None) -> None:
        self._snapshot = snapshot
        self._tail = log_tail
        self._clock = clock
        self._bound = bound
        self._out = out
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drawn = 0

    def draw(self) -> None:
        lines = render(self._snapshot(), self._clock.monotonic(), self._bound)
        if self._tail is not None:
            width = 160
            lines += ["", "latest events:"] + [line[:width] for line in self._tail.snapshot()]
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
