"""fans: speed, target speed and RPM per fan. Absent on passively cooled GPUs (H100/H200 SXM, L40S).

Fast tier: nvmlDeviceGetNumFans once, then per fan nvmlDeviceGetFanSpeed_v2, GetTargetFanSpeed and
GetFanSpeedRPM (the funnel's versioned struct for any fan; pynvml's wrapper asks for fan 0 only).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.groups.base import Call, Device, Emit, G, Group, Query, Spec, Unsupported


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
            count = int(dev.probe(dev.call("nvmlDeviceGetNumFans")) or 0)
        except Unsupported:
            count = 0
        if count and not dev.supported(dev.call("nvmlDeviceGetFanSpeed_v2", 0)):
            count = 0
        target = count > 0 and dev.supported(dev.call("nvmlDeviceGetTargetFanSpeed", 0))
        rpm = count > 0 and dev.supported(dev.call("nvmlDeviceGetFanSpeedRPM", 0))
        self.fans: tuple[tuple[int, Call, Call | None, Call | None], ...] = tuple(
            (i, dev.call("nvmlDeviceGetFanSpeed_v2", i),
             dev.call("nvmlDeviceGetTargetFanSpeed", i) if target else None,
             dev.call("nvmlDeviceGetFanSpeedRPM", i) if rpm else None)
            for i in range(count))
        dev.feature("fan", count > 0)
        dev.feature("fan_target", target)
        dev.feature("fan_rpm", rpm)

    def read_fast(self, q: Query) -> Fans:
        fans = []
        for i, speed_call, target_call, rpm_call in self.fans:
            speed = q(speed_call)
            target = q(target_call) if target_call is not None else None
            rpm = q(rpm_call) if rpm_call is not None else None
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
