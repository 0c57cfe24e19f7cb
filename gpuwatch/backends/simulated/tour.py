"""The faults a demo node plays: the demo tour (every rule's anomaly in turn) and ``--sim.fault`` specs."""

from __future__ import annotations

from gpuwatch.backends.simulated.faults import Fault, is_number
from gpuwatch.backends.simulated.profiles import PROFILES, unknown_profile

#: How long the demo tour takes before everything is back to normal.
DEMO_TOUR_SECONDS = 330.0


def demo_tour(
    period_seconds: float = 600.0, gpu_count: int = 8, profile: str = "rtx6000"
) -> list[Fault]:
    """The scripted tour of the demo, repeating every ``period_seconds``.

    ====================  =========================================================================
    0–20 s                all GPUs run their normal jobs
    20–210 s   (GPU 2)    a burn job; its fan stalls at 30 s (speed → 0 while the target climbs
                          and the GPU heats) and spins again at 200 s. Fanless profiles get a
                          power brake at 30–120 s instead.
    100–330 s  (GPU 5)    a burn job; its cooling fails from 110 s (4× thermal resistance, ramped
                          over 60 s): it reaches its slowdown threshold and throttles, clocks
                          halved, until the cooling comes back at 320 s
    240–330 s  (GPU 7)    falls off the bus: XID 79 at 240 s, DeviceLost until it returns at 330 s
    0–330 s    (GPU 1)    Slurm job 4300 whose data loaders keep its 16 CPUs 97 % busy while the GPU
                          runs at 35 % (input_bound); GPU 0 on 4- to 7-GPU nodes, none on 3
    330 s–period          everything normal again
    ====================  =========================================================================

    On NVLink profiles (the HGX H200) the first GPU also loses NVLink link 5 from 60 to 300 s and
    the second one's links throw CRC errors and replays from 40 to 300 s; on fabric profiles the fabric
    manager is not running for GPU 3 for the first 200 s after start (once, as at a boot); on MIG profiles (h100-mig)
    GPU instance 9 of the first GPU is held idle from 20 to 330 s; on Grace-coupled profiles (gh200,
    gb200) the first GPU's C2C link 3 to its Grace CPU is down from 90 to 270 s. With fewer than 8 GPUs
    the last three GPUs play the main parts.
    """
    if not is_number(period_seconds) or period_seconds < DEMO_TOUR_SECONDS:
        raise ValueError(f"demo tour period must be at least {DEMO_TOUR_SECONDS:.0f} s")
    if not isinstance(gpu_count, int) or gpu_count < 3:
        raise ValueError("the demo tour needs at least 3 GPUs")
    if profile not in PROFILES:
        raise ValueError(unknown_profile(profile))
    if gpu_count >= 8:
        fan_gpu, hot_gpu, lost_gpu = 2, 5, 7
    else:
        fan_gpu, hot_gpu, lost_gpu = gpu_count - 3, gpu_count - 2, gpu_count - 1
    p = period_seconds

    def f(kind: str, gpu: int, start: float, end: float, **params: float) -> Fault:
        return Fault(kind, gpu, start, end, params=params, repeat_seconds=p)

    if PROFILES[profile].fan_count:
        first = [f("load", fan_gpu, 20, 210), f("fan_stall", fan_gpu, 30, 200)]
    else:
        first = [f("load", fan_gpu, 20, 210), f("power_brake", fan_gpu, 30, 120)]
    interconnect: list[Fault] = []
    if PROFILES[profile].nvlink_links:
        interconnect = [f("load", 0, 50, 310), f("nvlink_down", 0, 60, 300, link=5),
                        f("nvlink_crc_storm", 1, 40, 300)]
    if PROFILES[profile].fabric:
        interconnect.append(Fault("fabric_manager_down", 3 if gpu_count >= 8 else fan_gpu, 0, 200))
    if PROFILES[profile].mig_instances:
        interconnect = [f("mig_idle_allocation", 0, 20, 330, gpu_instance=9)]
    if PROFILES[profile].c2c_links:
        interconnect.append(f("c2c_link_down", 0 if gpu_count >= 4 else fan_gpu, 90, 270, link=3))
    job_gpu = 1 if gpu_count >= 8 else 0 if gpu_count >= 4 else None
    jobs = [] if job_gpu is None or PROFILES[profile].mig_instances else [f("input_starved", job_gpu, 0, 330)]
    return [
        *jobs,
        *first,
        f("load", hot_gpu, 100, 330),
        f("cooling_failure", hot_gpu, 110, 320),
        f("fell_off_bus", lost_gpu, 240, 330),
        *interconnect,
    ]


def parse_fault_spec(spec: str, gpu_count: int) -> list[Fault]:
    """``KIND[@GPU][:param=value,...]`` (--sim.fault): the fault from the start, forever, on GPU
    ``GPU`` or, without it, on every GPU. ValueError says what is wrong."""
    head, _, params_text = spec.strip().partition(":")
    kind, _, gpu_text = head.partition("@")
    params: dict[str, float] = {}
    for item in filter(None, (p.strip() for p in params_text.split(","))):
        name, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"parameter {item!r} is not name=value")
        try:
            params[name.strip()] = float(value)
        except ValueError:
            raise ValueError(f"parameter {name.strip()}: {value!r} is not a number") from None
    if gpu_text:
        if not gpu_text.isdigit():
            raise ValueError(f"GPU {gpu_text!r} is not an index")
        gpus = [int(gpu_text)]
    else:
        gpus = list(range(gpu_count))
    return [Fault(kind, gpu, 0.0, None, params=params) for gpu in gpus]
