"""Interconnect rules: NVLink links and errors, and the NVSwitch fabric registration.

All three read the slow tier (link states, error totals and the fabric state are read every slow
poll), so they run at most every 10 s. A GPU that is down or stale returns "cannot tell".
"""

from __future__ import annotations

from collections.abc import Mapping

from gpuwatch.groups.fabric import Fabric
from gpuwatch.model import Observation, SlowSample
from gpuwatch.rules.base import GpuRule, History, RuleConfig, Window, needs
from gpuwatch.rules.common import gpu_label

# ---------------------------------------------------------------------------------- links


def _links_by_model(window: Window) -> dict[str, list[tuple[str, Mapping[str, bool]]]]:
    """GPU model -> (uuid, link -> active) of the node's answering GPUs with fresh NVLink readings."""
    by_model: dict[str, list[tuple[str, Mapping[str, bool]]]] = {}
    for state in window.latest.gpus:
        slow = window.slow(state.identity.uuid)
        if slow is not None and slow.nvlink.nvlink_up:
            by_model.setdefault(state.identity.name, []).append((state.identity.uuid, slow.nvlink.nvlink_up))
    return by_model


def _nvlink_link_down(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    state = window.gpu(uuid)
    if state is None or slow is None or not slow.nvlink.nvlink_up:
        return None
    nv = slow.nvlink
    up = nv.nvlink_up
    # a link is expected up if it was active at discovery, or is active on every other GPU of the model
    expected = {link for link, active in nv.nvlink_up_at_discovery.items() if active}
    peers = [links for other, links in window.memo("nvlink_by_model", _links_by_model).get(state.identity.name, ())
             if other != uuid]
    if peers:
        expected.update(link for link in up if all(p.get(link) for p in peers))
    down = sorted((link for link in expected if up.get(link) is False), key=int)
    active = sum(1 for v in up.values() if v)

    def summary() -> str:
        if not down:
            return f"{gpu_label(window, uuid)} {active} of {len(up)} NVLink links active"
        ends = "; ".join(f"link {link} to {nv.nvlink_remote.get(link, 'an unknown end')}" for link in down)
        return (f"{gpu_label(window, uuid)} NVLink {'link' if len(down) == 1 else 'links'} "
                f"{', '.join(down)} inactive ({ends}); {active} of {len(up)} active")

    return Observation(bool(down), float(len(down)), 0.0, summary)


# --------------------------------------------------------------------------------- errors

# NVLink5 (Blackwell): any failed recovery or packet error is a failure (DCGM's health watch: an increase of
# 1); successful recoveries and effective errors count against their rate limits, as the DL counters do before
_ANY = ("recovery_failed", "malformed_packet", "buffer_overrun", "receive", "remote", "general",
        "local_link_integrity", "transmit_discards")


def _increases(history: History[SlowSample], lo: int) -> tuple[int, float, dict[str, int]]:
    """(readings, seconds from the first to the last, increase per error kind) of the NVLink error
    totals in the slow samples from ``lo`` on (a counter that went back: counted from 0)."""
    points = [(t, s.nvlink.nvlink_errors) for t, s in history.between(lo) if s.nvlink.nvlink_errors]
    if len(points) < 2:
        return len(points), 0.0, {}
    increase: dict[str, int] = {}
    for (_, before), (_, after) in zip(points, points[1:]):
        for kind, a in after.items():
            b = before.get(kind)
            if b is not None:
                increase[kind] = increase.get(kind, 0) + (a - b if a >= b else a)
    return len(points), points[-1][0] - points[0][0], increase


def _nvlink_errors_rising(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    if slow is None or not (slow.nvlink.nvlink_errors or slow.nvlink.nvlink_bit_error_rate):
        return None
    lookback = config.params["lookback_seconds"]
    readings, span, increase = window.slow_derive(uuid, lookback, "increases")
    ber = slow.nvlink.nvlink_bit_error_rate.get("effective")
    ber_limit = config.params["max_effective_ber"]
    ber_bad = ber is not None and ber > ber_limit  # DCGM: exactly 1e-12 is not exceeded
    if (readings < 2 or span < lookback / 5) and not ber_bad:
        return None
    per_minute = {kind: n / span * 60.0 for kind, n in increase.items()} if span > 0 else {}
    rate = per_minute.get
    limit = _positive
    # each rate against its own limit; recovery (a link retrained) weighs most: its limit is the lowest
    score = max(
        (rate("crc_flit", 0.0) + rate("crc_data", 0.0)) / limit(config.params["crc_per_minute"]),
        rate("replay", 0.0) / limit(config.params["replay_per_minute"]),
        rate("recovery", 0.0) / limit(config.params["recovery_per_minute"]),
        rate("recovery_successful", 0.0) / limit(config.params["recovery_per_minute"]),
        rate("effective", 0.0) / limit(config.params["effective_per_minute"]),
        float(any(increase.get(kind, 0) > 0 for kind in _ANY)),
        float(ber_bad),
    )

    def summary() -> str:
        rising = ", ".join(f"{kind} {r:.1f}/min" for kind, r in per_minute.items() if r > 0) or "none"
        ber_text = "" if ber is None else f"; effective BER {ber:.1e}"
        return f"{gpu_label(window, uuid)} NVLink errors over the last {span / 60:.0f} min: {rising}{ber_text}"

    return Observation(score >= 1.0, score, 1.0, summary)


def _positive(limit: float) -> float:
    """A rate limit of 0 (or less) in the configuration means "any error at all"."""
    return limit if limit > 0 else 1e-9


# --------------------------------------------------------------------------------- fabric


def _fabric(window: Window, uuid: str) -> Fabric | None:
    """The GPU's fabric reading, if it is answering and registers with a fabric."""
    slow = window.slow(uuid)
    return None if slow is None or slow.fabric.fabric_state is None else slow.fabric


def _fabric_not_ready(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fabric = _fabric(window, uuid)
    if fabric is None:
        return None
    failed = fabric.fabric_state == "completed" and fabric.fabric_status not in (None, "success")
    ready = fabric.fabric_state == "completed" and not failed

    def summary() -> str:
        if failed:
            return (f"{gpu_label(window, uuid)} fabric registration completed with error {fabric.fabric_status}: "
                    "CUDA cannot use the NVLink fabric; check nvidia-fabricmanager's log")
        if not ready:
            return (f"{gpu_label(window, uuid)} fabric registration {str(fabric.fabric_state).replace('_', ' ')}: "
                    "CUDA fails with 'system not yet initialized'; is nvidia-fabricmanager running?")
        return f"{gpu_label(window, uuid)} fabric registration completed"

    return Observation(not ready, 0.0 if ready else 1.0, 0.0, summary)


def _fabric_degraded(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    fabric = _fabric(window, uuid)
    if fabric is None:
        return None
    if fabric.fabric_state != "completed":  # not registered: fabric_not_ready's case, not this one's
        return Observation(False, 0.0, 0.0, lambda: f"{gpu_label(window, uuid)} fabric not registered")
    issues = sorted(issue.replace("_", " ") for issue, present in fabric.fabric_health.items() if present)
    if fabric.fabric_configuration not in (None, "none"):
        issues.append(f"incorrect configuration ({str(fabric.fabric_configuration).replace('_', ' ')})")
    verdict = fabric.fabric_health_summary
    degraded = bool(issues) or verdict in ("unhealthy", "limited_capacity")

    def summary() -> str:
        said = "" if verdict is None else f" {verdict.replace('_', ' ')}"
        return f"{gpu_label(window, uuid)} fabric health{said}: {', '.join(issues) or 'no issue reported'}"

    return Observation(degraded, float(len(issues) + (verdict in ("unhealthy", "limited_capacity"))), 0.0, summary)


RULES: tuple[GpuRule, ...] = (
    GpuRule(
        id="nvlink_link_down",
        severity="critical",
        hold_seconds=30.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="An NVLink link that was active when gpuwatch discovered the GPU, or that is active on every "
                  "other GPU of the same model, is inactive; the summary names the link and its other end.",
        evaluate=_nvlink_link_down,
        applies=needs("nvlink"),
    ),
    GpuRule(
        id="nvlink_errors_rising",
        severity="warning",
        hold_seconds=120.0,
        clear_seconds=300.0,
        every_seconds=10.0,
        condition="The NVLink error totals grow over the lookback faster than crc_per_minute (flit + data CRC), "
                  "replay_per_minute or recovery_per_minute (a link retrained: the lowest limit); a single "
                  "replay never fires; on NVLink5 (Blackwell): any failed link recovery or packet error, successful "
                  "recoveries faster than recovery_per_minute, effective errors faster than effective_per_minute, "
                  "or an effective bit error rate above max_effective_ber (DCGM's 1e-12).",
        evaluate=_nvlink_errors_rising,
        params={"lookback_seconds": 300.0, "crc_per_minute": 10.0, "replay_per_minute": 10.0,
                "recovery_per_minute": 1.0, "effective_per_minute": 10.0, "max_effective_ber": 1e-12},
        applies=needs("nvlink"),
        lookback={"lookback_seconds": "slow"},
        derived={"increases": _increases},
    ),
    GpuRule(
        id="fabric_not_ready",
        severity="critical",
        hold_seconds=120.0,
        clear_seconds=30.0,
        every_seconds=10.0,
        condition="On a GPU that registers with an NVSwitch fabric, the registration is not completed for the "
                  "hold time (the grace period after boot), or completed with an error status: the fabric "
                  "manager is down or failed, and CUDA reports 'system not yet initialized'.",
        evaluate=_fabric_not_ready,
        applies=needs("fabric"),
    ),
    GpuRule(
        id="fabric_degraded",
        severity="warning",
        hold_seconds=60.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="The fabric reports a health issue (degraded bandwidth, route recovery, unhealthy route, "
                  "access-timeout recovery, an incorrect configuration) or the driver's health summary is "
                  "unhealthy or limited capacity (R570+), while the registration itself is fine.",
        evaluate=_fabric_degraded,
        applies=needs("fabric"),
    ),
)


# ------------------------------------------------------------------------------------ C2C


def _c2c_link_down(window: Window, uuid: str, config: RuleConfig) -> Observation | None:
    slow = window.slow(uuid)
    if slow is None or not slow.c2c.c2c_up:
        return None
    c2c = slow.c2c
    up = c2c.c2c_up
    # every link of the GPU's link count is expected up: a Grace-coupled GPU has no unpopulated C2C link.
    # A link in the low-power state is idle, not down.
    down = sorted((link for link, active in up.items() if not active and not c2c.c2c_low_power.get(link)), key=int)
    active = sum(1 for v in up.values() if v)

    def summary() -> str:
        if not down:
            return f"{gpu_label(window, uuid)} {active} of {len(up)} C2C links to the Grace CPU active"
        since = [link for link in down if c2c.c2c_up_at_discovery.get(link) is False]
        when = f" (inactive since discovery: {', '.join(since)})" if since else ""
        return (f"{gpu_label(window, uuid)} C2C {'link' if len(down) == 1 else 'links'} {', '.join(down)} "
                f"to the Grace CPU inactive{when}; {active} of {len(up)} active")

    return Observation(bool(down), float(len(down)), 0.0, summary)


RULES = RULES + (
    GpuRule(
        id="c2c_link_down",
        severity="critical",
        hold_seconds=30.0,
        clear_seconds=60.0,
        every_seconds=10.0,
        condition="A C2C link between a Grace-coupled GPU (GH200, GB200) and its Grace CPU is inactive (it was "
                  "active at discovery, or the GPU's link count says it exists) and not in the low-power state; "
                  "the summary names the link.",
        evaluate=_c2c_link_down,
        applies=needs("c2c"),
    ),
)
