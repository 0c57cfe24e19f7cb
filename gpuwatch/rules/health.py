"""Health rules: lost GPUs, critical XIDs, ECC and memory repair states, the PCIe link.

Counters and flags of the slow tier (ECC, remapping, retirement, PCIe) are facts reported by the
driver, not noisy measurements, so those rules fire on the first slow poll that shows them
(hold 0). While a GPU is down its last slow sample is stale: the rules then return "cannot tell"
and keep their state.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Mapping

from gpuwatch.groups.recovery import ACTIONS as RECOVERY_ACTIONS
from gpuwatch.groups.xid import CRITICAL_XIDS as CRITICAL_XID_CODES
from gpuwatch.groups.xid import XIDS
from gpuwatch.model import FastSample, Observation, SlowSample
from gpuwatch.rules.base import GpuRule, History, RuleConfig, Window, needs
from gpuwatch.rules.common import gpu_label

#: XID codes that mean the GPU (not the application) is in trouble, with their meanings: the critical
#: rows of gpuwatch's one XID table (gpuwatch/groups/xid.py, from NVIDIA's Xid catalog). Application
#: faults such as 13 (graphics engine exception), 31 (GPU memory page fault), 43 (GPU stopped processing)
#: and 45 (preemptive cleanup) are not here, nor are 63 (a row remap / page retirement was recorded:
#: row_remap_pending and retired_pages_pending cover it) and 94 (contained ECC error: ecc_uncorrectable
#: covers it), nor 154 (the recovery action changed: recovery_action_required covers it).
CRITICAL_XIDS: Mapping[int, str] = {code: XIDS[code][0] for code in sorted(CRITICAL_XID_CODES)}


# ------------------------------------------------------------------------------------ lost


def _gpu_lost(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    state = window.gpu(uuid)
    if state is None or not window.latest.backend_up:
        return None  # with the backend down nothing is known about any GPU (backend_down says so)
    if state.up:
        return Observation(False, 0.0, 0.0, lambda: f"{gpu_label(window, uuid)} ({uuid}) answering")
    label = f"{gpu_label(window, uuid)} ({uuid})"
    if not state.visible:
        return Observation(True, 1.0, 0.0, f"{label} no longer listed by the driver")
    age = "" if state.fast_monotonic is None else f"; last reading {window.now - state.fast_monotonic:.0f} s ago"
    return Observation(True, 1.0, 0.0, f"{label} not answering (GPU is lost: fell off the bus or hangs){age}")


# ------------------------------------------------------------------------------------ XID


def _wall_now(window: Window) -> float:
    latest = window.latest
    return latest.taken_wall + (window.now - latest.taken_monotonic)


def _xid_critical(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    state = window.gpu(uuid)
    if state is None:
        return None
    now = _wall_now(window)
    lookback = config.params["lookback_seconds"]
    recent = sorted(
        ((now - when, code) for code, when in state.xid_last_timestamp.items()
         if code in CRITICAL_XIDS and now - when <= lookback),
    )
    if not recent:
        return Observation(False, None, lookback,
                           lambda: f"{gpu_label(window, uuid)} no critical XID in the last {lookback / 60:.0f} min")
    label = gpu_label(window, uuid)
    age, code = recent[0]
    others = "" if len(recent) == 1 else f" (also XID {', '.join(str(c) for _, c in recent[1:])})"
    count = state.xid_counts.get(code, 0)
    meaning, _, action = XIDS[code]
    return Observation(True, float(code), lookback,
                       f"{label} XID {code} ({meaning}) {max(0.0, age) / 60:.0f} min ago, "
                       f"{count} since start{others}: {action}")


# ------------------------------------------------------------------------------------ recovery


def _recovery_action_required(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    action = None if slow is None else slow.recovery.recovery_action
    if action is None:
        return None
    name, what = RECOVERY_ACTIONS.get(action, (f"unknown ({action})", "see `nvidia-smi -q` (GPU Recovery Action) "
                                                                      "and NVIDIA's docs; drain the node meanwhile"))

    def summary() -> str:
        if action == 0:
            return f"{gpu_label(window, uuid)} the driver asks for no recovery action"
        return f"{gpu_label(window, uuid)} the driver asks for recovery action {name}: {what}"

    return Observation(action != 0, float(action), 0.0, summary)


# ------------------------------------------------------------------------------------ memory


def _ecc_uncorrectable(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    if slow is None:
        return None
    count = slow.ecc.ecc_errors.get(("uncorrected", "volatile"))
    if count is None:
        return None
    total = slow.ecc.ecc_errors.get(("uncorrected", "aggregate"))

    def summary() -> str:
        lifetime = "" if total is None else f" ({total} over its lifetime)"
        return (f"{gpu_label(window, uuid)} {count} uncorrectable ECC errors since the last driver load "
                f"or GPU reset{lifetime}")

    return Observation(count >= config.params["min_count"], float(count), config.params["min_count"], summary)


def _flag_rule(field: str, text_on: str, text_off: str) -> Callable[[Window, str, RuleConfig], Observation | None]:
    def evaluate(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
        slow = window.slow(uuid)
        flag = None if slow is None else getattr(slow.ecc, field)
        if flag is None:
            return None
        return Observation(bool(flag), float(flag), 1.0,
                           lambda: f"{gpu_label(window, uuid)} {text_on if flag else text_off}")

    return evaluate


# ------------------------------------------------------------------------------------ PCIe


def _busy(sample: FastSample | None, config: RuleConfig) -> bool | None:
    if sample is None:
        return None
    util = sample.utilization.utilization_ratio.get("gpu")
    return None if util is None else util >= config.params["busy_utilization_ratio"]


def _sample_near(window: Window, uuid: str, when: float | None) -> FastSample | None:
    """The fast sample closest to monotonic time ``when`` (within the fast staleness bound); of
    two equally close, the older. The closest is one of the two around ``when``: found by bisection,
    not by walking the samples of twice the staleness bound (40 of them per GPU at 0.5 s polls)."""
    if when is None:
        return None
    history = window.history(uuid)
    times, samples, start, end = history.times, history.samples, history.start, history.end
    i = bisect.bisect_left(times, when, start, end)  # times[i - 1] < when <= times[i]
    best: tuple[float, FastSample] | None = None
    for j in (i - 1, i):  # the older first: it stays on a tie
        if start <= j < end:
            gap = abs(times[j] - when)
            if gap <= window.fast_staleness and (best is None or gap < best[0]):
                best = (gap, samples[j])
    return None if best is None else best[1]


def _pcie_link_degraded(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    state = window.gpu(uuid)
    fast = window.fast(uuid)
    if state is None or slow is None or fast is None:
        return None
    gen, width = slow.pcie.pcie_link_generation, slow.pcie.pcie_link_width
    parts = []
    if "current" in gen and "max" in gen and gen["current"] < gen["max"]:
        parts.append(("generation", gen["current"], gen["max"]))
    if "current" in width and "max" in width and width["current"] < width["max"]:
        parts.append(("width", width["current"], width["max"]))
    if not gen and not width:
        return None
    # Idle GPUs downshift on purpose: only a link that was slow while the GPU was busy, both when
    # the link was read (slow tier) and now, counts.
    busy_now = _busy(fast, config)
    busy_then = _busy(_sample_near(window, uuid, state.slow_monotonic), config)
    if busy_now is None:
        return None
    active = bool(parts and busy_now and busy_then)

    def summary() -> str:
        link = f"gen {gen.get('current', '?')} x{width.get('current', '?')}"
        best = f"gen {gen.get('max', '?')} x{width.get('max', '?')}"
        if not parts:
            return f"{gpu_label(window, uuid)} PCIe link at {link} (max {best})"
        if active:
            state_text = "while busy"
        elif busy_now:
            state_text = "read while the GPU was not busy yet"
        else:
            state_text = "while idle (a downshift on purpose)"
        return f"{gpu_label(window, uuid)} PCIe link at {link} {state_text} (max {best})"

    if not parts:
        return Observation(False, float(width.get("current", 0)), float(width.get("max", 0)), summary)
    _, current, maximum = parts[-1]  # width first: lanes lost are the worse sign
    return Observation(active, float(current), float(maximum), summary)


def _replays_increase(points: list[tuple[float, int]]) -> int:
    increase = 0
    for (_, before), (_, after) in zip(points, points[1:]):
        increase += after - before if after >= before else after  # a reset: count from 0
    return increase


def _replays(history: History[SlowSample], lo: int) -> tuple[int, float, int]:
    """(readings, seconds from the first to the last, increase) of the replay counter in the slow
    samples from ``lo`` on; kept by the history until a slow sample enters or leaves them."""
    points = [(t, s.pcie.pcie_replays) for t, s in history.between(lo) if s.pcie.pcie_replays is not None]
    if len(points) < 2:
        return len(points), 0.0, 0
    return len(points), points[-1][0] - points[0][0], _replays_increase(points)


def _pcie_replays_rising(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    if slow is None or slow.pcie.pcie_replays is None:
        return None
    lookback, per_minute = config.params["lookback_seconds"], config.params["min_per_minute"]
    readings, span, increase = window.slow_derive(uuid, lookback, "replays")
    if readings < 2 or span < lookback / 5:
        return None
    rate = increase / span * 60.0
    return Observation(rate >= per_minute, rate, per_minute,
                       lambda: f"{gpu_label(window, uuid)} {rate:.1f} PCIe replays a minute over the last "
                               f"{span / 60:.0f} min ({slow.pcie.pcie_replays} since the last reset)")


RULES: tuple[GpuRule, ...] = (
    GpuRule(
        id="gpu_lost",
        severity="critical",
        hold_seconds=10.0,
        clear_seconds=30.0,
        condition="The GPU does not answer (NVML GPU_IS_LOST) or is no longer listed, while the "
                  "backend itself is up.",
        evaluate=_gpu_lost,
    ),
    GpuRule(
        id="xid_critical",
        severity="critical",
        hold_seconds=0.0,
        clear_seconds=0.0,
        condition="The last XID event of a code on the critical list ("
                  + ", ".join(map(str, CRITICAL_XIDS)) + "; docs/runbooks.md has the table) happened within the "
                  "lookback; the summary names the code's meaning and the action NVIDIA's Xid catalog gives.",
        evaluate=_xid_critical,
        params={"lookback_seconds": 900.0},
        applies=needs("xid_events"),
    ),
    GpuRule(
        id="recovery_action_required",
        severity="critical",
        hold_seconds=0.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="The driver asks for a recovery action (NVML field 230, R570 and newer): anything but none, "
                  "such as a GPU reset, a node reboot or draining peer-to-peer traffic; the summary says which "
                  "and what to do, and `gpuwatch check --drain` drains the node for it.",
        evaluate=_recovery_action_required,
        applies=needs("recovery_action"),
    ),
    GpuRule(
        id="ecc_uncorrectable",
        severity="critical",
        hold_seconds=0.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="The volatile uncorrectable ECC count (since the last driver load or GPU reset) is "
                  "at least min_count.",
        evaluate=_ecc_uncorrectable,
        params={"min_count": 1.0},
        applies=needs("ecc"),
    ),
    GpuRule(
        id="row_remap_failed",
        severity="critical",
        hold_seconds=0.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="The driver reports that a memory row remapping failed.",
        evaluate=_flag_rule("remapped_rows_failed", "row remapping failed: the memory cannot be repaired",
                            "no row remapping failure"),
        applies=needs("remapped_rows"),
    ),
    GpuRule(
        id="row_remap_pending",
        severity="warning",
        hold_seconds=0.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="A memory row remap is pending and needs a GPU reset to take effect.",
        evaluate=_flag_rule("remapped_rows_pending", "row remap pending: reset the GPU when it is drained",
                            "no row remap pending"),
        applies=needs("remapped_rows"),
    ),
    GpuRule(
        id="retired_pages_pending",
        severity="warning",
        hold_seconds=0.0,
        clear_seconds=60.0,
        every_seconds=5.0,
        condition="A memory page is marked for retirement, which takes effect at the next reboot or "
                  "driver reload.",
        evaluate=_flag_rule("retired_pages_pending", "page retirement pending: reboot when drained",
                            "no page retirement pending"),
        applies=needs("retired_pages"),
    ),
    GpuRule(
        id="pcie_link_degraded",
        severity="warning",
        hold_seconds=60.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="The PCIe link runs below its maximum generation or width while the GPU is busy "
                  "(when the link was read and now); idle downshifts are ignored.",
        evaluate=_pcie_link_degraded,
        params={"busy_utilization_ratio": 0.5},
        applies=needs("pcie", "utilization"),
    ),
    GpuRule(
        id="pcie_replays_rising",
        severity="warning",
        hold_seconds=0.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="The PCIe replay counter grows by at least min_per_minute over the lookback "
                  "(approximation until the engine keeps slow samples: the count since the last reset "
                  "reaches min_per_minute × lookback).",
        evaluate=_pcie_replays_rising,
        params={"lookback_seconds": 300.0, "min_per_minute": 8.0},
        applies=needs("pcie"),
        lookback={"lookback_seconds": "slow"},
        derived={"replays": _replays},
    ),
)
