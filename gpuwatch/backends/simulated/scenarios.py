"""Named scenarios: one scripted situation per anomaly rule, plus a healthy node per profile."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from gpuwatch.backends.simulated.backend import SimulatedBackend
from gpuwatch.backends.simulated.faults import Fault
from gpuwatch.backends.simulated.profiles import PROFILES
from gpuwatch.clock import Clock
from gpuwatch.groups import Selection


@dataclass(frozen=True, slots=True)
class Scenario:
    """A named, scripted situation: one anomaly rule's textbook case, or a healthy node.

    The node runs ``faults`` (times in seconds after ``open()``) for ``duration_seconds``. With
    ``rule`` set, that rule is expected to start firing on GPU ``gpu`` (for a node rule: on the
    node, ``gpu`` being the GPU whose anomalies are its expected consequences, or None) once the
    fault has begun (``onset_seconds``), its condition has had time to appear (``latency_seconds``:
    the physics and the polling, e.g. minutes for a GPU to heat up, up to one 30 s slow poll for a
    health flag, half a window for a windowed share) and the rule's hold time has passed; and to
    resolve once the cause is gone (``end_seconds``, then ``recovery_seconds`` until the condition
    is false) and its clear time has passed. Other warning/critical anomalies may follow on that
    same GPU (a hot GPU is also throttled), never on another one. A healthy scenario (``rule``
    None) fires nothing of severity warning or critical.
    """

    name: str
    description: str
    profile: str
    gpu_count: int
    faults: tuple[Fault, ...]
    duration_seconds: float
    rule: str | None = None
    gpu: int | None = None
    onset_seconds: float = 0.0
    latency_seconds: float = 0.0
    end_seconds: float | None = None
    recovery_seconds: float = 0.0
    seed: int = 0
    node_power_budget_watts: float | None = None  # --node.power-budget-watts while it plays

    def backend(self, clock: Clock, selection: Selection | None = None) -> SimulatedBackend:
        """A fresh simulated node playing this scenario."""
        return SimulatedBackend(
            clock, gpu_count=self.gpu_count, profile=self.profile, faults=self.faults, seed=self.seed,
            selection=selection,
        )

    def fires_by(self, hold_seconds: float, poll_seconds: float = 2.0) -> float | None:
        """Latest time (s after open) the expected anomaly may start firing: onset + latency + hold
        + two polls (one to see the condition, one of rounding to the poll grid)."""
        if self.rule is None:
            return None
        return self.onset_seconds + self.latency_seconds + hold_seconds + 2 * poll_seconds

    def resolves_by(self, clear_seconds: float, poll_seconds: float = 2.0) -> float | None:
        """Latest time the expected anomaly may still be firing: end + recovery + clear + two polls."""
        if self.rule is None or self.end_seconds is None:
            return None
        return self.end_seconds + self.recovery_seconds + clear_seconds + 2 * poll_seconds


def _burn(gpu: int, start: float, end: float | None, utilization: float = 1.0) -> Fault:
    return Fault("load", gpu, start, end, params={"utilization": utilization})


def _healthy(profile: str, gpu_count: int) -> Scenario:
    slow_cap = {"rtx6000": 0.6, "h200": 0.7, "t4": 0.6, "h100-mig": 0.7, "gh200": 0.7, "gb200": 0.7}[profile]
    return Scenario(
        name=f"healthy-{profile}",
        description=(
            f"A healthy {PROFILES[profile].name} node for 30 minutes: GPU 0 idles for 5 minutes, "
            "then runs a burn job at its power cap for 10 minutes, then idles; GPU 1 runs a job "
            "below the cap for 20 minutes; GPU 2 idles for 15 minutes (PCIe downshifts where the "
            "board does that); GPU 3 runs its normal jobs with a 2 s hw_slowdown flash every "
            "minute (clock changes). Only info anomalies (power_capped) may fire."
        ),
        profile=profile,
        gpu_count=gpu_count,
        faults=(
            _burn(0, 0, 300, 0.0),
            _burn(0, 300, 900),
            _burn(0, 900, 1200, 0.0),
            _burn(1, 0, 1200, slow_cap),
            _burn(2, 0, 900, 0.0),
            Fault("hw_slowdown", 3, 45, 47, repeat_seconds=60),
        ),
        duration_seconds=1800.0,
    )


def scenarios() -> dict[str, Scenario]:
    """Every scenario by name: one per anomaly rule (named after it) and a healthy one per profile."""
    def one(rule: str, description: str, profile: str, faults: Sequence[Fault], *, gpu: int | None,
            latency: float, end: float | None, recovery: float = 0.0, onset: float = 120.0,
            gpu_count: int = 4, duration: float | None = None, budget: float | None = None) -> Scenario:
        if duration is None:
            duration = (end or onset) + recovery + 240.0
        name, rule = rule, rule.split("-")[0]  # "<rule>-<variant>": a second case of one rule
        return Scenario(name, description, profile, gpu_count, tuple(faults), duration, rule, gpu,
                        onset, latency, end, recovery, node_power_budget_watts=budget)

    cases = [
        _healthy("rtx6000", 4),
        _healthy("h200", 4),
        _healthy("h100-mig", 4),
        _healthy("t4", 4),
        _healthy("gb200", 4),
        one("fan_stalled",
            "GPU 2 runs a burn job; at 2 min its fan stops (0 RPM) while the driver keeps asking for "
            "more and the GPU heats; it spins again at 6 min.",
            "rtx6000", [_burn(2, 0, 600), Fault("fan_stall", 2, 120, 360)],
            gpu=2, latency=4, end=360, recovery=4),
        one("fan_not_tracking",
            "GPU 1 runs a burn job; from 2 min its worn fan reaches only 40 % of its target speed "
            "(it turns, but far too slowly) until 8 min.",
            "rtx6000", [_burn(1, 0, 720), Fault("fan_lag", 1, 120, 480, params={"ratio": 0.4})],
            gpu=1, latency=25, end=480, recovery=25),
        one("fan_at_max",
            "GPU 1 runs a burn job; from 2 min its heatsink clogs (2.1× thermal resistance): the fan "
            "runs at 100 % and the GPU still sits a few degrees under its slowdown threshold, until "
            "the heatsink is cleaned at 10 min.",
            "rtx6000", [_burn(1, 0, 900),
                        Fault("cooling_failure", 1, 120, 600, params={"factor": 2.1, "ramp_seconds": 60})],
            gpu=1, latency=150, end=600, recovery=90),
        one("overheating",
            "Passively cooled H200s: GPU 1 runs a burn job; from 2 min its airflow halves (2× "
            "thermal resistance): it settles within 5 °C of its slowdown threshold (T.Limit scale) "
            "until the airflow is back at 10 min.",
            "h200", [_burn(1, 0, 900),
                     Fault("cooling_failure", 1, 120, 600, params={"factor": 2.0, "ramp_seconds": 60})],
            gpu=1, latency=200, end=600, recovery=90),
        one("thermal_runaway",
            "H200 GPU 2 runs a burn job; from 2 min its cooling degrades steadily over 5 minutes "
            "(to 2.5× thermal resistance): the temperature climbs toward slowdown at several °C a "
            "minute, the GPU throttles, and the cooling is restored at 10 min.",
            "h200", [_burn(2, 0, 900),
                     Fault("cooling_failure", 2, 120, 600, params={"factor": 2.5, "ramp_seconds": 300})],
            gpu=2, latency=200, end=600, recovery=60),
        one("thermal_throttling",
            "RTX 6000 GPU 0 runs a burn job; at 2 min its cooling fails (4× thermal resistance): it "
            "reaches slowdown within a minute and the HW and SW thermal slowdowns hold the clocks "
            "down until the cooling is back at 8 min.",
            "rtx6000", [_burn(0, 0, 900), Fault("cooling_failure", 0, 120, 480)],
            gpu=0, latency=70, end=480, recovery=90),
        one("thermal_outlier",
            "Four passively cooled H200s all run burn jobs at their 700 W cap; from 2 min GPU 2's "
            "airflow is partly blocked (1.7× thermal resistance): it runs about 20 °C hotter than "
            "its peers, still well below slowdown, until 16 min.",
            "h200", [*(_burn(g, 0, 1300) for g in range(4)),
                     Fault("cooling_failure", 2, 120, 960, params={"factor": 1.7, "ramp_seconds": 60})],
            gpu=2, latency=150, end=960, recovery=90),
        one("power_brake",
            "H200 GPU 1 runs a burn job; from 2 to 6 min the PSU asserts the external power brake: "
            "clocks cut to 30 %.",
            "h200", [_burn(1, 0, 600), Fault("power_brake", 1, 120, 360)],
            gpu=1, latency=2, end=360, recovery=30),
        one("hw_slowdown",
            "H200 GPU 3 runs a burn job; from 2 to 6 min HW slowdown holds its clocks at half "
            "without a thermal or power-brake reason (fast-trigger over-power protection).",
            "h200", [_burn(3, 0, 600), Fault("hw_slowdown", 3, 120, 360)],
            gpu=3, latency=16, end=360, recovery=16),
        one("power_capped",
            "RTX 6000 GPU 0 idles, runs a burn job from 2 to 8 min at its 300 W cap, and idles again "
            "(info only: this is normal at full load).",
            "rtx6000", [_burn(0, 0, 120, 0.0), _burn(0, 120, 480), _burn(0, 480, None, 0.0),
                        _burn(1, 0, 600, 0.0)],
            gpu=0, latency=32, end=480, recovery=32, gpu_count=2),
        one("gpu_lost",
            "H200 GPU 1 falls off the bus at 2 min (XID 79, every query answers GPU_IS_LOST) and is "
            "back at 6 min.",
            "h200", [Fault("fell_off_bus", 1, 120, 360)],
            gpu=1, latency=2, end=360, recovery=2),
        one("xid_critical",
            "H200 GPU 2 reports XID 48 (double-bit ECC error) at 2 min; GPUs 0, 1 and 3 report the "
            "application faults XID 13, 31 and 43, which never fire. The anomaly ends 15 minutes "
            "after the event (the rule's lookback).",
            "h200", [Fault("xid", 2, 120, params={"xid": 48}), Fault("xid", 0, 100, params={"xid": 13}),
                     Fault("xid", 1, 110, params={"xid": 31}), Fault("xid", 3, 130, params={"xid": 43})],
            gpu=2, latency=2, end=1020, recovery=2, duration=1140),
        one("recovery_action_required",
            "H200 GPU 1 hits an uncorrectable error at 2 min and the driver asks for a node reboot (XID 154, "
            "recovery action 2) until the node is rebooted at 8 min.",
            "h200", [Fault("recovery_action", 1, 120, 480)],
            gpu=1, latency=30, end=480, recovery=30),
        one("ecc_uncorrectable",
            "H200 GPU 0 sees 2 uncorrectable ECC errors at 2 min (XID 94, contained; a row remap "
            "becomes pending); the GPU is reset at 8 min, which zeroes the volatile counters.",
            "h200", [Fault("ecc_uncorrectable", 0, 120, 480)],
            gpu=0, latency=30, end=480, recovery=30),
        one("row_remap_failed",
            "H200 GPU 1 fails to remap a memory row at 2 min (XID 64); the board is repaired at 8 min.",
            "h200", [Fault("row_remap_failure", 1, 120, 480)],
            gpu=1, latency=30, end=480, recovery=30),
        one("row_remap_pending",
            "H200 GPU 2 remaps a row after correctable errors at 2 min (XID 63, no uncorrectable "
            "error); the remap is pending until the GPU is reset at 8 min.",
            "h200", [Fault("row_remap_pending", 2, 120, 480)],
            gpu=2, latency=30, end=480, recovery=30),
        one("retired_pages_pending",
            "Tesla T4 GPU 1 marks a page for retirement after correctable errors at 2 min (XID 63); "
            "it is retired at the reboot at 8 min.",
            "t4", [Fault("retired_pages_pending", 1, 120, 480)],
            gpu=1, latency=30, end=480, recovery=30),
        one("pcie_link_degraded",
            "RTX 6000 GPU 3 runs a burn job with its PCIe link trained down to x8 from 2 to 8 min; "
            "GPU 1, idle, has the same x8 link and its usual idle downshift to gen 1, which never "
            "fires.",
            "rtx6000", [_burn(3, 0, 720), Fault("pcie_downtrain", 3, 120, 480),
                        _burn(1, 0, 720, 0.0), Fault("pcie_downtrain", 1, 120, 480)],
            gpu=3, latency=30, end=480, recovery=30),
        one("pcie_replays_rising",
            "H200 GPU 0's PCIe link replays 30 times a minute from 2 min; the card is reseated and "
            "reset at 8 min; the replay rate over the 5-minute lookback falls below 8/min some 4 minutes later.",
            "h200", [Fault("pcie_replays", 0, 120, 480)],
            gpu=0, latency=110, end=480, recovery=240),
        one("nvlink_link_down",
            "HGX H200 GPU 2's NVLink link 5 (to an NVSwitch) goes down from 2 to 8 min under a burn job; "
            "its 17 other links and the other GPUs' links stay up.",
            "h200", [_burn(2, 0, 600), Fault("nvlink_down", 2, 120, 480)],
            gpu=2, latency=30, end=480, recovery=30),
        one("nvlink_errors_rising",
            "HGX H200 GPU 1's NVLink throws 120 flit-CRC errors and 40 replays a minute from 2 to 8 min "
            "(a marginal link); the error rate over the 5-minute lookback falls below the limits some "
            "4 minutes later.",
            "h200", [Fault("nvlink_crc_storm", 1, 120, 480)],
            gpu=1, latency=90, end=480, recovery=300, duration=1200.0),
        one("nvlink_errors_rising-nvlink5",
            "HGX B200 GPU 1's NVLink5 links take 120 effective errors and 2 recoveries a minute, with an effective "
            "bit error rate above 1e-12, from 2 to 8 min; the rates fall below the limits some 4 minutes later.",
            "b200", [Fault("nvlink_crc_storm", 1, 120, 480, {"recovery_per_minute": 2.0})],
            gpu=1, latency=90, end=480, recovery=300, duration=1200.0),
        one("power_smoothing_worn",
            "HGX B200 GPU 2's power-smoothing circuitry reports 6 % of its lifetime left at 2 min (XID 164); the "
            "board is serviced at 8 min.",
            "b200", [Fault("power_smoothing_worn", 2, 120, 480)],
            gpu=2, latency=30, end=480, recovery=30),
        one("c2c_link_down",
            "GH200 GPU 1's NVLink-C2C link 3 to its Grace CPU goes down from 2 to 8 min under a burn job; its "
            "9 other C2C links and the other superchips' links stay up.",
            "gh200", [_burn(1, 0, 600), Fault("c2c_link_down", 1, 120, 480)],
            gpu=1, latency=30, end=480, recovery=30),
        one("fabric_not_ready",
            "nvidia-fabricmanager is not running at boot on an HGX H200 node: GPU 0's fabric registration "
            "stays not started for 6 minutes, then the fabric manager is started and it completes.",
            "h200", [Fault("fabric_manager_down", 0, 0, 360)],
            gpu=0, latency=30, end=360, recovery=30, onset=0.0),
        one("fabric_degraded",
            "The NVSwitch fabric of an HGX H200 node reports degraded bandwidth for GPU 3 from 2 to 8 min "
            "(a switch tray lost a port); the registration itself is fine.",
            "h200", [Fault("fabric_degraded", 3, 120, 480)],
            gpu=3, latency=30, end=480, recovery=30),
        Scenario("allocated_idle-mig",
                 "An H100 in MIG mode: a job holds GPU instance 9 (a 1g.10gb) from 2 to 36 min, 30 % of its "
                 "memory in use, and computes nothing; the GPU's other instances run the GPU's jobs. The rule "
                 "reads each instance's SM activity (the parent has no utilization with MIG on).",
                 "h100-mig", 2, (Fault("mig_idle_allocation", 0, 120, 2160, params={"gpu_instance": 9}),),
                 2160 + 10 + 240.0, "allocated_idle", 0, 120.0, 60, 2160, 10),
        one("allocated_idle",
            "RTX 6000 GPU 1 is held by a job that keeps 30 % of the frame buffer but computes nothing "
            "from 2 to 36 min (a notebook left open); the others run their normal jobs.",
            "rtx6000", [Fault("idle_allocation", 1, 120, 2160)],
            gpu=1, latency=60, end=2160, recovery=10),
        one("allocated_idle-no-process",
            "RTX 6000: Slurm job 4242 asked for GPUs 1 and 2 from 2 to 36 min but runs only on GPU 1; GPU 2 "
            "has no process and no memory in use, and is allocated all the same (scontrol's GRES).",
            "rtx6000", [_burn(1, 120, 2160, 0.9), Fault("job", 1, 120, 2160, params={"job_id": 4242}),
                        Fault("allocated_unused", 2, 120, 2160, params={"job_id": 4242})],
            gpu=2, latency=60, end=2160, recovery=30),
        one("input_bound",
            "RTX 6000 GPU 3 runs Slurm job 4300 from 2 to 12 min at 35 % busy while the job's data loaders keep "
            "97 % of its 16 CPUs busy. Beside it, GPU 1's job is compute-bound (GPU busy, CPUs busy) and GPU 2's "
            "job runs at 35 % with its CPUs 20 % busy: neither fires.",
            "rtx6000", [Fault("input_starved", 3, 120, 720),
                        _burn(1, 0, 900), Fault("job", 1, 0, 900, params={"job_id": 4201, "cpu_busy": 0.95}),
                        _burn(2, 0, 900, 0.35), Fault("job", 2, 0, 900, params={"job_id": 4202, "cpu_busy": 0.2})],
            gpu=3, latency=60, end=720, recovery=30, duration=900.0),
        one("input_bound-io",
            "HGX H200 GPU 0 runs Slurm job 4301 from 2 to 12 min at 30 % SM activity while the job's processes "
            "spend 60 % of their time waiting for block I/O (a dataset on a slow file system).",
            "h200", [Fault("input_starved", 0, 120, 720,
                           params={"job_id": 4301, "utilization": 0.3, "cpu_busy": 0.25, "iowait": 0.6})],
            gpu=0, latency=60, end=720, recovery=30, duration=900.0),
        one("node_power_budget",
            "An H200 node whose supplies deliver 3,000 W to its 4 GPUs after redundancy (their normal jobs draw "
            "1,350-2,500 W): from 2 to 12 min all four burn at their 700 W limit, 2,800 W, 93 % of the budget — "
            "no headroom left if a supply fails.",
            "h200", [_burn(i, 120, 720) for i in range(4)],
            gpu=None, latency=10, end=720, recovery=10, budget=3000.0),
        one("node_power_over_budget",
            "The same node with a 2,600 W budget: from 2 to 8 min all four GPUs burn at their 700 W limit, "
            "2,800 W, 108 % of what the supplies deliver (their normal jobs reach 96 % of it, briefly).",
            "h200", [_burn(i, 120, 480) for i in range(4)],
            gpu=None, latency=10, end=480, recovery=10, budget=2600.0),
        one("backend_down",
            "The driver of a 2-GPU H200 node is unloaded from 2 to 4 min: NVML cannot be used; the "
            "poller retries with capped exponential backoff and recovers by itself.",
            "h200", [Fault("backend_down", 0, 120, 240)],
            gpu=None, latency=2, end=240, recovery=60, gpu_count=2),
        one("collection_stalled",
            "NVML hangs on an H200 node from 2 to 3 min (a wedged driver): the fast poll in flight "
            "blocks, no poll completes, and the readings go stale.",
            "h200", [Fault("hang", 0, 120, 180)],
            gpu=None, latency=8, end=180, recovery=2),
        one("gpu_missing",
            "H200 GPU 3 drops off the PCI bus at 2 min and the driver is reloaded (4 s): the node now "
            "lists 3 GPUs of 4 (gpu_lost also fires on GPU 3, which stays listed as down). At 8 min "
            "it is back and a second reload lists it again.",
            "h200", [Fault("unlisted", 3, 120, 480), Fault("backend_down", 0, 120, 124),
                     Fault("backend_down", 0, 480, 484)],
            gpu=3, latency=8, end=480, recovery=8),
    ]
    return {case.name: case for case in cases}


