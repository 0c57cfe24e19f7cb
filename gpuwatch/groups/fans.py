"""fans: speed, target speed and RPM per fan. Absent on passively cooled GPUs (H100/H200 SXM, L40S).

Fast tier: nvmlDeviceGetNumFans once, then per fan nvmlDeviceGetFanSpeed_v2, GetTargetFanSpeed and
GetFanSpeedRPM (the funnel's versioned struct for any fan; pynvml's wrapper asks for fan 0 only).
A speed or target beyond 0..200 % or an RPM beyond 0..100000 is left out and counted (Query.plausible);
a fan count beyond 32 is capped (logged once).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.frozen import quick
from gpuwatch.groups.base import Call, Device, Emit, G, Group, Query, Spec, Unsupported, whole

MAX_FANS = 32  # more than any board has: a larger count is garbage, capped (as NVLink's link count)
# What a fan can read (Query.plausible); beyond it (0xFFFFFFFF, 255 %) a reading is left out and counted
_MAX_PERCENT = 200  # speed and target: NVML documents that the speed may exceed 100 %
_MAX_RPM = 100_000


@quick  # built for every GPU at every poll (gpuwatch/frozen.py)
@dataclass(frozen=True, slots=True)
class FanReading:
    fan: int
    speed_ratio: float | None = None  # 1.0 = 100 %, can exceed 1
    target_speed_ratio: float | None = None
    speed_rpm: float | None = None


Fans = tuple[FanReading, ...]


class Nvml:
    def __init__(self, dev: Device) -> None:
        try:
            answered = dev.probe(dev.call("nvmlDeviceGetNumFans"))
        except Unsupported:
            answered = 0
        count = whole(answered) or 0
        if count > MAX_FANS:  # garbage (0xFFFFFFFF would build 4e9 readers): the fans that answer of the first 32
            dev.reject("fan_count", f"nvmlDeviceGetNumFans answered {answered!r}; at most {MAX_FANS} fans are probed")
            fans = tuple(i for i in range(MAX_FANS) if dev.supported(dev.call("nvmlDeviceGetFanSpeed_v2", i)))
        else:
            fans = tuple(range(count)) if count and dev.supported(dev.call("nvmlDeviceGetFanSpeed_v2", 0)) else ()
        first = fans[0] if fans else 0
        target = bool(fans) and dev.supported(dev.call("nvmlDeviceGetTargetFanSpeed", first))
        rpm = bool(fans) and dev.supported(dev.call("nvmlDeviceGetFanSpeedRPM", first))
        self.fans: tuple[tuple[int, Call, Call | None, Call | None, tuple[str, str, str]], ...] = tuple(
            (i, dev.call("nvmlDeviceGetFanSpeed_v2", i),
             dev.call("nvmlDeviceGetTargetFanSpeed", i) if target else None,
             dev.call("nvmlDeviceGetFanSpeedRPM", i) if rpm else None,
             (f"fan_speed{{fan={i}}}", f"fan_target_speed{{fan={i}}}", f"fan_speed_rpm{{fan={i}}}"))
            for i in fans)
        self.idle_fast = not fans  # NvmlReader: FastSample's default, (), every poll
        dev.feature("fan", bool(fans))
        dev.feature("fan_target", target)
        dev.feature("fan_rpm", rpm)

    def read_fast(self, q: Query) -> Fans:
        plausible = q.plausible
        fans = []
        for i, speed_call, target_call, rpm_call, (speed_what, target_what, rpm_what) in self.fans:
            speed = plausible(q(speed_call), 0, _MAX_PERCENT, speed_what)
            target = plausible(q(target_call), 0, _MAX_PERCENT, target_what) if target_call is not None else None
            rpm = plausible(q(rpm_call), 0, _MAX_RPM, rpm_what) if rpm_call is not None else None
            fans.append(FanReading(i, None if speed is None else speed / 100.0,
                                   None if target is None else target / 100.0, None if rpm is None else float(rpm)))
        return tuple(fans)

    def read_slow(self, q: Query) -> None:
        return None


def render(emit: Emit, fast: Fans | None, slow: None) -> None:
    for fan in fast or ():
        f = (str(fan.fan),)
        emit("gpuwatch_fan_speed_ratio", f, fan.speed_ratio)
        emit("gpuwatch_fan_target_speed_ratio", f, fan.target_speed_ratio)
        emit("gpuwatch_fan_speed_rpm", f, fan.speed_rpm)


GROUP = Group(
    name="fans",
    help="fan speed, target speed and RPM (absent on passively cooled GPUs)",
    features=("fan", "fan_rpm", "fan_target"),
    fast="fans",
    nvml=Nvml,
    render=render,
    specs=(
        Spec("gpuwatch_fan_speed_ratio", "gauge", G + ("fan",),
             "Reported fan speed, 1.0 = 100 % of the maximum noise-tolerance speed, can exceed 1 "
             "(nvmlDeviceGetFanSpeed_v2; 'Fan Speed')."),
        Spec("gpuwatch_fan_target_speed_ratio", "gauge", G + ("fan",),
             "Speed the driver drives the fan toward, 1.0 = 100 % (nvmlDeviceGetTargetFanSpeed)."),
        Spec("gpuwatch_fan_speed_rpm", "gauge", G + ("fan",),
             "Measured fan speed in revolutions per minute (nvmlDeviceGetFanSpeedRPM)."),
    ),
)
