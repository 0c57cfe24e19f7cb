"""Node rules: the backend is down, collection has stalled, GPUs are missing, the GPUs draw near or
over what the node's power supplies can deliver.

``node_power_budget`` / ``node_power_over_budget`` compare the GPUs' power (the fresh samples'
sum) with ``--node.power-budget-watts``: what the supplies deliver to the GPUs after redundancy. Near
the budget (warning) the node has no headroom left for a failed supply; over it (critical) a supply
is overloaded or already failed. A supply that cannot deliver shows on the GPUs as power brake
(HW_POWER_BRAKE_SLOWDOWN, asserted by the board): the summary names the GPUs in it.

The engine also runs at the fast ticks skipped while a poll hangs (``Engine.evaluate(snapshot, now, wall)``),
so collection_stalled fires while a poll hangs in NVML and no new snapshot arrives.
"""

from __future__ import annotations

from gpuwatch.model import Observation
from gpuwatch.rules.base import NodeRule, RuleConfig, Window


def _backend_down(window: Window, config: RuleConfig) -> Observation:
    latest = window.latest
    if latest.backend_up:
        return Observation(False, 1.0, 1.0, lambda: f"backend {latest.backend} up")
    return Observation(True, 0.0, 1.0, f"backend {latest.backend} down: {latest.backend_reason or 'unknown reason'}")


def _collection_stalled(window: Window, config: RuleConfig) -> Observation | None:
    tier = window.latest.tiers.get("fast")
    if tier is None:
        return None
    limit = config.params["staleness_factor"] * window.fast_staleness
    now, completed, since = window.now, tier.last_completed_monotonic, tier.in_flight_since
    if completed is not None:
        age = now - completed
    elif since is not None:
        age = now - since
    else:
        return None  # not started

    def summary() -> str:
        text = f"last fast poll completed {age:.0f} s ago" if completed is not None else "no fast poll completed yet"
        if since is not None:
            text += f"; one has been running for {now - since:.0f} s (NVML call hung?)"
        return text

    return Observation(age > limit, age, limit, summary)


def _gpu_missing(window: Window, config: RuleConfig) -> Observation | None:
    latest = window.latest
    expected = window.expected_gpus
    if not latest.backend_up or expected <= 0:
        return None  # backend_down covers a backend that sees nothing

    def summary() -> str:
        names = "".join(f"; GPU {s.identity.index} ({s.identity.uuid}) gone" for s in latest.gpus if not s.visible)
        return f"{latest.visible_gpus} GPUs visible, {expected} expected{names}"

    return Observation(latest.visible_gpus < expected, float(latest.visible_gpus), float(expected), summary)


def _node_power(window: Window) -> tuple[float, int, list[str]]:
    """(watts the GPUs draw, GPUs counted, the indices of those in power brake): once per Window."""
    total, counted, braked = 0.0, 0, []
    for uuid, sample in window.fresh():
        if sample.power.power_watts is not None:
            total += sample.power.power_watts
            counted += 1
        if sample.clocks.clocks_event_active.get("hw_power_brake_slowdown"):
            state = window.gpu(uuid)
            braked.append(str(state.identity.index) if state is not None else uuid)
    return total, counted, braked


def _budget(window: Window, over: bool, config: RuleConfig) -> Observation | None:
    budget = window.latest.node.power_budget_watts
    if budget is None or not window.latest.backend_up:
        return None
    total, counted, braked = window.memo(("node_power",), _node_power)
    if not counted:
        return None
    share = total / budget
    if over:
        active = share > config.params["over_ratio"]
        threshold = config.params["over_ratio"]
    else:  # near the budget, not over it: that is node_power_over_budget's
        active = config.params["warn_ratio"] <= share <= config.params["over_ratio"]
        threshold = config.params["warn_ratio"]

    def summary() -> str:
        text = f"the node's {counted} GPUs draw {total:,.0f} W of its {budget:,.0f} W power budget ({share:.0%})"
        if braked:
            text += (f"; GPU{'s' if len(braked) > 1 else ''} {', '.join(braked)} in power brake: the supplies "
                     "cannot deliver (a failed PSU?)")
        return text

    return Observation(active, share, threshold, summary)


def _node_power_budget(window: Window, config: RuleConfig) -> Observation | None:
    return _budget(window, False, config)


def _node_power_over_budget(window: Window, config: RuleConfig) -> Observation | None:
    return _budget(window, True, config)


RULES: tuple[NodeRule, ...] = (
    NodeRule(
        id="backend_down",
        severity="critical",
        hold_seconds=10.0,
        clear_seconds=30.0,
        condition="The backend (NVML) cannot be used: library or driver missing, driver/library "
                  "mismatch, or no GPU visible at all.",
        evaluate=_backend_down,
    ),
    NodeRule(
        id="collection_stalled",
        severity="critical",
        hold_seconds=20.0,
        clear_seconds=30.0,
        condition="No fast poll has completed for longer than staleness_factor × the fast staleness "
                  "bound (a poll hangs in NVML: wedged driver).",
        evaluate=_collection_stalled,
        params={"staleness_factor": 1.0},
    ),
    NodeRule(
        id="gpu_missing",
        severity="critical",
        hold_seconds=10.0,
        clear_seconds=30.0,
        condition="The last discovery found fewer GPUs than expected (rules.expected_gpus, else the "
                  "most seen since start).",
        evaluate=_gpu_missing,
    ),
    NodeRule(
        id="node_power_budget",
        severity="warning",
        hold_seconds=300.0,
        clear_seconds=120.0,
        condition="The GPUs' power (sum of the fresh samples) is at least warn_ratio of --node.power-budget-watts "
                  "(what the supplies deliver after redundancy) and not over over_ratio (that is "
                  "node_power_over_budget); held for 5 minutes; only where a budget is declared.",
        evaluate=_node_power_budget,
        params={"warn_ratio": 0.9, "over_ratio": 1.0},
    ),
    NodeRule(
        id="node_power_over_budget",
        severity="critical",
        hold_seconds=30.0,
        clear_seconds=120.0,
        condition="The GPUs' power is over over_ratio of --node.power-budget-watts, held for 30 s (the summary "
                  "names the GPUs in power brake: a supply that cannot deliver); only where a budget is declared.",
        evaluate=_node_power_over_budget,
        params={"over_ratio": 1.0},
    ),
)
