"""Cost rules: a GPU that a workload holds but does not use, and one that waits for its input.

A cluster pays for every allocated GPU-hour. ``allocated_idle`` fires when a GPU is held — a
scheduler allocated it to a job or pod (the slurm and kubernetes groups: the 8-asked, 1-used job),
a workload's process is on it (``GpuState.workloads``, slow tier), or its frame buffer is in use —
while its activity stays near zero. Activity is the SM activity where the GPU has GPM (Hopper and
newer: a GPU "100 % utilized" by a resident kernel at 2 % SM activity is not busy), else NVML's
utilization (the share of time any kernel ran). "Stays" is the rule's hold time (default 30 minutes): the
condition looks at the last minute only, and any busy minute resets the hold, so a job that
computes in bursts never fires.

``input_bound`` fires when a job's GPU is busy but well below what it could do while the job's host
side is saturated: its processes (the jobs group: every process of its cgroup, data loaders
included) keep nearly all the CPUs they may use busy, or spend a large share of their time waiting
for block I/O. The GPU is waiting for its input; more loader workers, faster storage or
pre-processed data help, a bigger GPU does not.
"""

from __future__ import annotations

from gpuwatch.model import FastSample, GpuHost, Observation, ProcessInfo
from gpuwatch.rules.base import GpuRule, RuleConfig, Window, needs_any
from gpuwatch.rules.common import gpu_label


def _known(values: list[float | None]) -> list[float]:
    """``values`` without the samples that had no reading (a copy only when there are some: a window of
    the activity column is 120 values per GPU at 0.5 s polls)."""
    return [v for v in values if v is not None] if None in values else values  # type: ignore[return-value]


def _allocated_idle(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    state = window.gpu(uuid)
    if fast is None or state is None:
        return None
    if fast.mig:
        return _idle_mig_instances(window, uuid, config)
    history = window.history(uuid)
    lo = history.index(window.since(config.params["window_seconds"]))
    values = _known(window.column(uuid, "activity")[lo:history.end])
    if not values:
        return None
    busiest = max(values)
    measure = "SM active" if fast.gpm.sm_active_ratio is not None else "busy"
    memory = fast.memory.memory_used_bytes or 0
    host = window.host(uuid)
    held = bool(state.workloads) or memory >= config.params["min_memory_bytes"] or bool(host and host.allocated)

    def summary() -> str:
        holders = _holders(state.workloads, host)
        if host is not None and host.allocated and not state.workloads:
            holder = f"{holders} (allocated, no process on it)"
        else:
            holder = holders or f"{memory / 2**30:.1f} GiB in use"
        return (f"{gpu_label(window, uuid)} held by {holder} but at most {busiest:.0%} {measure} over the last "
                f"{config['window_seconds']:.0f} s")

    return Observation(held and busiest <= config.params["idle_ratio"], busiest, config.params["idle_ratio"], summary)


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
    host = window.host(uuid)
    for p in (host.kubernetes or ()) if host is not None else ():  # a pod the kubelet gave the instance to
        if p.gpu_instance is not None:
            held.setdefault(p.gpu_instance, []).append(f"pod {p.namespace}/{p.pod}")
    fast = window.fast(uuid)
    for r in fast.mig if fast is not None else ():  # memory in use holds an instance too, as on a whole GPU
        if r.gpu_instance not in held and (r.memory_used_bytes or 0) >= config.params["min_memory_bytes"]:
            held[r.gpu_instance] = [f"{(r.memory_used_bytes or 0) / 2**30:.1f} GiB in use"]
    history = window.history(uuid)
    lo = history.index(window.since(config.params["window_seconds"]))
    busiest: dict[int, float] = {}
    for sample in history.samples[lo:history.end]:
        for r in sample.mig:
            if r.sm_active_ratio is not None:
                busiest[r.gpu_instance] = max(busiest.get(r.gpu_instance, 0.0), r.sm_active_ratio)
    if not busiest:
        return None
    idle = sorted(gi for gi in held if gi in busiest and busiest[gi] <= config.params["idle_ratio"])
    top = max((busiest[gi] for gi in idle), default=max(busiest.values()))

    def summary() -> str:
        if not idle:
            return f"{gpu_label(window, uuid)} every held MIG instance works"
        parts = "; ".join(f"MIG instance {gi} held by {', '.join(sorted(held[gi]))}, at most {busiest[gi]:.0%} "
                          "SM active" for gi in idle)
        return f"{gpu_label(window, uuid)} {parts} over the last {config['window_seconds']:.0f} s"

    return Observation(bool(idle), top, config.params["idle_ratio"], summary)


def _holders(workloads: tuple[ProcessInfo, ...], host: GpuHost | None) -> str:
    """"slurm job 42 of alice, pod ml/train-0": the jobs and pods that hold a GPU, named once each."""
    jobs: dict[tuple[str, str], str] = {}
    for w in workloads:
        if w.scheduler not in ("unknown", "none") and w.job_id:
            jobs.setdefault((w.scheduler, w.job_id), w.user)
        elif w.scheduler == "none":
            jobs.setdefault(("process", str(w.pid)), w.user)
    for a in (host.slurm or ()) if host is not None else ():
        if not jobs.get(("slurm", a.job_id)):
            jobs[("slurm", a.job_id)] = a.user
    names = [f"{_KIND.get(scheduler, scheduler)} {job_id}" + (f" of {user}" if user else "")
             for (scheduler, job_id), user in sorted(jobs.items())]
    pods = sorted({f"pod {p.namespace}/{p.pod}" for p in (host.kubernetes or ())} if host is not None else ())
    return ", ".join(names + pods)


_KIND = {"slurm": "slurm job", "kubernetes": "pod", "systemd": "unit"}


def _held_jobs(window: Window, uuid: str) -> list[tuple[str, str]]:
    """(scheduler, job id) of the Slurm jobs and pods holding the GPU: its processes' and its allocations'."""
    state = window.gpu(uuid)
    found = dict.fromkeys((w.scheduler, w.job_id) for w in (state.workloads if state is not None else ())
                          if w.scheduler in ("slurm", "kubernetes") and w.job_id)
    host = window.host(uuid)
    for a in (host.slurm or ()) if host is not None else ():
        found.setdefault(("slurm", a.job_id), None)
    return list(found)


def _input_bound(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fast = window.fast(uuid)
    if fast is None or fast.mig:
        return None
    held = _held_jobs(window, uuid)
    if not held:
        return Observation(False, None, config.params["busy_ratio"])
    usage = window.jobs()
    known = [(key, usage[key]) for key in held if key in usage and usage[key].cpu_busy_ratio is not None]
    if not known:
        return None  # the jobs group has not read the job twice yet (or is off): cannot tell
    history = window.history(uuid)
    lo = history.index(window.since(config.params["window_seconds"]))
    values = _known(window.column(uuid, "activity")[lo:history.end])
    if not values:
        return None
    mean = sum(values) / len(values)
    working = config.params["idle_ratio"] < mean < config.params["busy_ratio"]  # idle is allocated_idle's; busy is fine
    starved = [(key, job) for key, job in known if (job.cpu_busy_ratio or 0.0) >= config.params["cpu_ratio"]
               or (job.iowait_ratio or 0.0) >= config.params["iowait_ratio"]]
    measure = "SM active" if fast.gpm.sm_active_ratio is not None else "busy"

    def summary() -> str:
        if not (working and starved):
            return f"{gpu_label(window, uuid)} is not waiting for its input"
        causes = []
        for (scheduler, job_id), job in starved:
            name = f"{_KIND.get(scheduler, scheduler)} {job_id}"
            if (job.cpu_busy_ratio or 0.0) >= config.params["cpu_ratio"]:
                cpus = f" of its {job.cpus:g} CPUs" if job.cpus else ""
                causes.append(f"{name}'s {job.processes} processes keep {job.cpu_busy_ratio:.0%}{cpus} busy (CPU-bound "
                              "input pipeline)")
            else:
                causes.append(f"{name}'s processes spend {job.iowait_ratio:.0%} of their time waiting for I/O "
                              "(storage-bound input)")
        return (f"{gpu_label(window, uuid)} only {mean:.0%} {measure} on average over the last "
                f"{config['window_seconds']:.0f} s while {'; '.join(causes)}")

    return Observation(working and bool(starved), mean, config.params["busy_ratio"], summary)


def _activity(sample: FastSample) -> float | None:
    """SM activity (GPM) where the GPU has it, else the GPU utilization."""
    sm = sample.gpm.sm_active_ratio
    return sm if sm is not None else sample.utilization.utilization_ratio.get("gpu")


RULES: tuple[GpuRule, ...] = (
    GpuRule(
        id="allocated_idle",
        severity="warning",
        hold_seconds=1800.0,
        clear_seconds=60.0,
        every_seconds=30.0,
        condition="A workload holds the GPU (a scheduler allocated it to a job or pod, a process is on it, or at "
                  "least min_memory_bytes of its memory is in use) while its activity (SM activity where the GPU has "
                  "GPM, else utilization) stays at or below idle_ratio; held for 30 minutes.",
        evaluate=_allocated_idle,
        params={"idle_ratio": 0.05, "window_seconds": 60.0, "min_memory_bytes": 1024.0 * 2**20},
        applies=needs_any("utilization", "mig"),  # a MIG-enabled GPU has no utilization, its instances GPM
        lookback={"window_seconds": "fast"},
        columns={"activity": _activity},
    ),
    GpuRule(
        id="input_bound",
        severity="warning",
        hold_seconds=300.0,
        clear_seconds=120.0,
        every_seconds=10.0,
        condition="A Slurm job or pod holds the GPU, whose mean activity (SM activity where the GPU has GPM, else "
                  "utilization) over window_seconds stays above idle_ratio but below busy_ratio, while the job's "
                  "processes (jobs group) keep at least cpu_ratio of the CPUs they may use busy, or spend at least "
                  "iowait_ratio of their time waiting for I/O; held for 5 minutes.",
        evaluate=_input_bound,
        params={"busy_ratio": 0.6, "idle_ratio": 0.05, "cpu_ratio": 0.9, "iowait_ratio": 0.3,
                "window_seconds": 60.0},
        applies=needs_any("utilization"),
        lookback={"window_seconds": "fast"},
        columns={"activity": _activity},
    ),
)
