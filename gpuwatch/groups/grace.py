"""grace: the Grace CPU's power sensors on Grace Hopper / Grace Blackwell nodes (host side, slow tier).

No NVML: Grace CPU, SysIO and module power are not in NVML at all. As DCGM does
(modules/sysmon/DcgmSystemMonitor.cpp), every slow interval gpuwatch/hostside/grace.py looks at each
``hwmon*/device/power1_oem_info`` under ``--collector.grace.hwmon-root`` (default
``/sys/class/hwmon``; the reader also accepts the file in the hwmon directory itself). Its text names
the sensor: "CPU Power Socket N", "SysIO Power Socket N" and "Module Power Socket N" (their
``power1_average``, µW), "Grace Power Socket N" (its ``power1_cap``: the socket's power cap). A
node without them (every x86 node) reports nothing, logs nothing and costs one directory listing a
read. A file whose text is not a sane number is skipped with one warning naming it (repeated at most
hourly); the node's other sensors stay.

Node-level families (no gpu/uuid): one series per sensor and socket (a GH200 node: 3 per superchip;
a GB200 compute tray: 3 per Grace, 2 Graces).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwatch.groups.base import Emit, Group, Spec

SENSORS = ("cpu", "sysio", "module")  # sensor label values of gpuwatch_grace_power_watts


@dataclass(frozen=True, slots=True)
class GraceSensor:
    """One Grace hwmon reading: ``sensor`` cpu | sysio | module with its power, or "cap" with the cap."""

    sensor: str
    socket: str  # "0", "1", ...
    watts: float


def render_node(emit: Emit, sensors: tuple[GraceSensor, ...] | None) -> None:
    for s in sensors or ():
        if s.sensor == "cap":
            emit("gpuwatch_grace_power_cap_watts", (s.socket,), s.watts)
        else:
            emit("gpuwatch_grace_power_watts", (s.sensor, s.socket), s.watts)


GROUP: Group[None, None] = Group(
    name="grace",
    help="Grace CPU, SysIO and module power and the Grace power cap per socket, from hwmon (GH200/GB200 nodes)",
    host="grace",
    render_node=render_node,
    options={"hwmon-root": ("/sys/class/hwmon", "where the hwmon devices are (a host's /sys/class/hwmon mounted "
                                                "elsewhere in a container)")},
    specs=(
        Spec("gpuwatch_grace_power_watts", "gauge", ("sensor", "socket"),
             "Grace power per socket in watts, from hwmon power1_average: cpu (the Grace CPU and its memory), "
             "sysio (the SoC's I/O), module (the whole Grace Hopper / Grace Blackwell module: Grace and its GPUs) "
             "(power1_oem_info 'CPU|SysIO|Module Power Socket N'; DCGM DCGM_FI_DEV_CPU_POWER_WATTS, "
             "_SYSIO_POWER_UTIL_CURRENT, _MODULE_POWER_UTIL_CURRENT). Only on Grace nodes."),
        Spec("gpuwatch_grace_power_cap_watts", "gauge", ("socket",),
             "The Grace socket's power cap in watts (hwmon power1_cap of 'Grace Power Socket N'). Only on Grace "
             "nodes."),
    ),
)
