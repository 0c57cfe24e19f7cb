"""Anomaly rules: one module per family, each a tuple RULES of pure Rule definitions."""

from __future__ import annotations

from gpuwatch.rules.base import Rule


def all_rules() -> tuple[Rule, ...]:
    """Every shipped rule, in documentation order (rule ids are unique)."""
    from gpuwatch.rules import fan, health, interconnect, node, thermal, throttle, workload

    rules = (fan.RULES + thermal.RULES + throttle.RULES + health.RULES + interconnect.RULES + workload.RULES
             + node.RULES)
    ids = [rule.id for rule in rules]
    assert len(ids) == len(set(ids)), "duplicate rule id"
    return rules
