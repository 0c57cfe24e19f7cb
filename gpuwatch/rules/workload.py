"""Cost rules: a GPU that a workload holds but does not use.

A cluster pays for every allocated GPU-hour. ``allocated_idle`` fires when a GPU is held — a
workload's process is on it (``GpuState.workloads``, slow tier), or its frame buffer is in use —
while its activity stays near zero. Activity is the SM activity where the GPU has GPM (Hopper and
newer: a GPU "100 % utilized" by a resident kernel at 2 % SM activity is not busy), else NVML's
utilization (the share of time any kernel ran). "Stays" is the rule's hold time (default 30 minutes): the
condition looks at the last minute only, and any busy minute resets the hold, so a job that
computes in bursts never fires.
"""

from __future__ import annotations

from gpuwatch.model import FastSample, Observation
from gpuwatch.rules.base import Rule, RuleConfig, Window, needs
from gpuwatch.rules.thermal import gpu_label


def _allocated_idle(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    state = window.gpu(uuid)
    if fast is None or state is None:
        return None
    history = window.history(uuid)
    lo = history.index(window.since(config["window_seconds"]))
    busiest = max((u for u in history.column(_activity)[lo:history.end] if u is not None), default=None)
    if busiest is None:
        return None
    measure = "SM active" if fast.gpm.sm_active_ratio is not None else "busy"
    memory = fast.memory.memory_used_bytes or 0
    held = bool(state.workloads) or memory >= config["min_memory_bytes"]

    def summary() -> str:
        jobs = sorted({f"{w.scheduler} {w.job_id}".strip() for w in state.workloads if w.scheduler != "unknown"})
        holder = ", ".join(jobs) if jobs else f"{memory / 2**30:.1f} GiB in use"
        return (f"{gpu_label(window, uuid)} held by {holder} but at most {busiest:.0%} {measure} over the last "
                f"{config['window_seconds']:.0f} s")

    return Observation(held and busiest <= config["idle_ratio"], busiest, config["idle_ratio"], summary)


def _activity(sample: FastSample) -> float | None:
    """SM activity (GPM) where the GPU has it, else the GPU utilization."""
    sm = sample.gpm.sm_active_ratio
    return sm if sm is not None else sample.utilization.utilization_ratio.get("gpu")


RULES: tuple[Rule, ...] = (
    Rule(
        id="allocated_idle",
        scope="gpu",
        severity="warning",
        hold_seconds=1800.0,
        clear_seconds=60.0,
        every_seconds=30.0,
        condition="A workload holds the GPU (a process on it, or at least min_memory_bytes of its memory in "
                  "use) while its activity (SM activity where the GPU has GPM, else utilization) stays at or "
                  "below idle_ratio; held for 30 minutes.",
        evaluate=_allocated_idle,
        params={"idle_ratio": 0.05, "window_seconds": 60.0, "min_memory_bytes": 1024.0 * 2**20},
        applies=needs("utilization"),
        lookback={"window_seconds": "fast"},
    ),
)
