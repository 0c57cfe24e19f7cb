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
from gpuwatch.rules.base import Rule, RuleConfig, Window, needs_any
from gpuwatch.rules.thermal import gpu_label


def _allocated_idle(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    state = window.gpu(uuid)
    if fast is None or state is None:
        return None
    if fast.mig:
        return _idle_mig_instances(window, uuid, config)
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


def _idle_mig_instances(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    """On a MIG-enabled GPU: the instances a workload runs on whose SM activity stays at or below
    idle_ratio (the parent has no utilization; each instance is its own allocation)."""
    state = window.gpu(uuid)
    assert state is not None
    held: dict[int, list[str]] = {}
    for w in state.workloads:
        if w.gpu_instance is not None:  # as on a whole GPU, a process that cannot be attributed holds it too
            holder = f"{w.scheduler} {w.job_id}".strip() if w.scheduler != "unknown" else "a process"
            held.setdefault(w.gpu_instance, []).append(holder)
    fast = window.fast(uuid)
    for r in fast.mig if fast is not None else ():  # memory in use holds an instance too, as on a whole GPU
        if r.gpu_instance not in held and (r.memory_used_bytes or 0) >= config["min_memory_bytes"]:
            held[r.gpu_instance] = [f"{(r.memory_used_bytes or 0) / 2**30:.1f} GiB in use"]
    history = window.history(uuid)
    lo = history.index(window.since(config["window_seconds"]))
    busiest: dict[int, float] = {}
    for _, sample in history.items[lo:history.end]:
        for r in sample.mig:
            if r.sm_active_ratio is not None:
                busiest[r.gpu_instance] = max(busiest.get(r.gpu_instance, 0.0), r.sm_active_ratio)
    if not busiest:
        return None
    idle = sorted(gi for gi in held if gi in busiest and busiest[gi] <= config["idle_ratio"])
    top = max((busiest[gi] for gi in idle), default=max(busiest.values()))

    def summary() -> str:
        if not idle:
            return f"{gpu_label(window, uuid)} every held MIG instance works"
        parts = "; ".join(f"MIG instance {gi} held by {', '.join(sorted(held[gi]))}, at most {busiest[gi]:.0%} "
                          "SM active" for gi in idle)
        return f"{gpu_label(window, uuid)} {parts} over the last {config['window_seconds']:.0f} s"

    return Observation(bool(idle), top, config["idle_ratio"], summary)


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
        applies=needs_any("utilization", "mig"),  # a MIG-enabled GPU has no utilization, its instances GPM
        lookback={"window_seconds": "fast"},
    ),
)
