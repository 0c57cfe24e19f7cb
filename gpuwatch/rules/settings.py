"""The rules' settings: the YAML ``rules:`` section merged into each rule's defaults, and the look-back the
enabled rules ask of the engine's history (checked against ``rules.window``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from gpuwatch.errors import ConfigError
from gpuwatch.model import SEVERITIES
from gpuwatch.rules.base import Rule, RuleConfig


def build_configs(rules: Sequence[Rule], raw: Mapping[str, Any] | None) -> dict[str, RuleConfig]:
    """Merge the YAML ``rules:`` section into the defaults; unknown rules or keys are a ConfigError."""
    by_id = {rule.id: rule for rule in rules}
    configs = {rule.id: rule.default_config() for rule in rules}
    if raw is None:
        return configs
    if not isinstance(raw, Mapping):
        raise ConfigError("rules: expected a mapping of rule id -> settings, e.g. 'rules: {fan_stalled: {hold: 60}}'")
    for rule_id, settings in raw.items():
        if rule_id not in by_id:
            raise ConfigError(f"rules: unknown rule {rule_id!r}; known rules: {', '.join(sorted(by_id))}")
        if settings is None:
            continue
        if isinstance(settings, bool):
            settings = {"enabled": settings}
        if not isinstance(settings, Mapping):
            raise ConfigError(f"rules.{rule_id}: expected a mapping (enabled, severity, hold, clear, thresholds)")
        rule = by_id[rule_id]
        base = configs[rule_id]
        enabled, severity = base.enabled, base.severity
        hold, clear, params = base.hold_seconds, base.clear_seconds, dict(base.params)
        every = base.every_seconds
        for key, value in settings.items():
            where = f"rules.{rule_id}.{key}"
            if key == "enabled":
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}: expected true or false, got {value!r}")
                enabled = value
            elif key == "severity":
                if value not in SEVERITIES:
                    raise ConfigError(f"{where}: must be one of {', '.join(SEVERITIES)}, got {value!r}")
                severity = value
            elif key in ("hold", "clear", "every"):
                seconds = _number(where, value)
                if seconds < 0:
                    raise ConfigError(f"{where}: must be 0 or more seconds, got {value!r}")
                if key == "hold":
                    hold = seconds
                elif key == "clear":
                    clear = seconds
                else:
                    every = seconds
            elif key in rule.params:
                params[key] = _number(where, value)
            else:
                known = ", ".join(["enabled", "severity", "hold", "clear", "every", *sorted(rule.params)])
                raise ConfigError(f"{where}: unknown setting; {rule_id} takes {known}")
        configs[rule_id] = RuleConfig(enabled, severity, hold, clear, params, every)
    return configs


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    return float(value)


def check_lookback(rules: Sequence[Rule], configs: Mapping[str, RuleConfig], window_seconds: float) -> float:
    """Check the enabled rules' look-back parameters (Rule.lookback) against the engine's window;
    returns the seconds of slow-sample history the engine must keep for them.

    Fast samples are kept for ``window_seconds`` (``rules.window``): a fast look-back longer than
    that is a ConfigError naming the rule, the parameter and the fix. Slow samples are kept for
    the longest enabled slow look-back (pcie_replays_rising's lookback_seconds), and at least
    ``window_seconds``, so those parameters are not bounded by the window.
    """
    slow = window_seconds
    for rule in rules:
        config = configs[rule.id]
        if not config.enabled:
            continue
        for param, tier in rule.lookback.items():
            seconds = config[param]
            if tier == "slow":
                slow = max(slow, seconds)
            elif seconds > window_seconds:
                raise ConfigError(
                    f"rules.{rule.id}.{param}: {seconds:g} s is longer than the {window_seconds:g} s of fast-sample "
                    f"history the rules keep (rules.window); raise rules.window (--rules.window) to at least "
                    f"{seconds:g}, or lower {param}"
                )
    return slow


def fast_lookback(rules: Sequence[Rule], configs: Mapping[str, RuleConfig]) -> float:
    """The longest fast-sample look-back of the enabled rules (0 when none looks back)."""
    return max((configs[rule.id][param] for rule in rules if configs[rule.id].enabled
                for param, tier in rule.lookback.items() if tier == "fast"), default=0.0)
