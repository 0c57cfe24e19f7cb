"""The rule engine: runs after every fast poll and tracks each (rule, GPU) with hysteresis.

    quiet --condition--> pending --held for `hold`--> firing --false--> clearing --false for `clear`--> quiet
                ^            |  false                     ^                |  true again
                +------------+                            +----------------+

A single noisy sample neither fires nor clears an anomaly. Each firing and each resolution is
one structlog event (``anomaly_started``, ``anomaly_resolved``) with rule, gpu, uuid, severity,
value, threshold and summary. A rule returning None ("cannot tell": stale or missing data)
leaves the state where it is.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatch.errors import ConfigError
from gpuwatch.logs import get_logger
from gpuwatch.model import SEVERITIES, Anomaly, FastSample, NodeSnapshot, Observation, SlowSample
from gpuwatch.rules.base import Rule, RuleConfig, Window

DEFAULT_WINDOW_SECONDS = 900.0


@dataclass
class _Track:
    state: str = "quiet"  # quiet | pending | firing | clearing
    since: float = 0.0  # monotonic start of the current pending or clearing phase
    since_wall: float | None = None  # wall time the current episode started firing
    onsets: int = 0
    last: Observation | None = None


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
            elif key in ("hold", "clear"):
                seconds = _number(where, value)
                if seconds < 0:
                    raise ConfigError(f"{where}: must be 0 or more seconds, got {value!r}")
                if key == "hold":
                    hold = seconds
                else:
                    clear = seconds
            elif key in rule.params:
                params[key] = _number(where, value)
            else:
                known = ", ".join(["enabled", "severity", "hold", "clear", *sorted(rule.params)])
                raise ConfigError(f"{where}: unknown setting; {rule_id} takes {known}")
        configs[rule_id] = RuleConfig(enabled, severity, hold, clear, params)
    return configs


def _number(where: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    return float(value)


class Engine:
    def __init__(self, rules: Sequence[Rule], configs: Mapping[str, RuleConfig], fast_staleness: float,
                 window_seconds: float = DEFAULT_WINDOW_SECONDS, expected_gpus: int = 0) -> None:
        self._rules = list(rules)
        self._configs = dict(configs)
        self._fast_staleness = fast_staleness
        self._window_seconds = window_seconds
        self._expected_gpus = expected_gpus
        self._most_gpus = 0
        self._tracks: dict[tuple[str, str | None], _Track] = {}
        self._history: dict[str, deque[tuple[float, FastSample]]] = {}
        self._slow_history: dict[str, deque[tuple[float, SlowSample]]] = {}
        self._log = get_logger(component="rules")
        self._lock = threading.Lock()

    @property
    def rules(self) -> list[Rule]:
        return list(self._rules)

    def reconfigure(self, configs: Mapping[str, RuleConfig]) -> None:
        """New thresholds/holds take effect at the next poll; episodes in progress carry on."""
        self._configs = dict(configs)

    def _remember(self, snap: NodeSnapshot) -> None:
        horizon = snap.taken_monotonic - self._window_seconds
        for state in snap.gpus:
            uuid = state.identity.uuid
            history = self._history.setdefault(uuid, deque())
            if state.up and state.fast is not None and state.fast_monotonic is not None:
                if not history or history[-1][0] != state.fast_monotonic:
                    history.append((state.fast_monotonic, state.fast))
            while history and history[0][0] < horizon:
                history.popleft()
            slow = self._slow_history.setdefault(uuid, deque())
            if state.up and state.slow is not None and state.slow_monotonic is not None:
                if not slow or slow[-1][0] != state.slow_monotonic:
                    slow.append((state.slow_monotonic, state.slow))
            while slow and slow[0][0] < horizon:
                slow.popleft()
        self._most_gpus = max(self._most_gpus, snap.visible_gpus)

    def evaluate(self, snap: NodeSnapshot, now: float | None = None, wall: float | None = None) -> tuple[Anomaly, ...]:
        """Feed the latest snapshot; returns the state of every evaluated (rule, GPU).

        Runs after every fast poll, and on a timer too (``now``/``wall``: the time of evaluation),
        so that node rules such as collection_stalled fire while a poll hangs.
        """
        with self._lock:
            return self._evaluate(snap, snap.taken_monotonic if now is None else now,
                                  snap.taken_wall if wall is None else wall)

    def _evaluate(self, snap: NodeSnapshot, now: float, wall: float) -> tuple[Anomaly, ...]:
        self._remember(snap)
        window = Window(snap, self._history, self._fast_staleness, self._expected_gpus or self._most_gpus, now,
                        self._slow_history)
        result: list[Anomaly] = []
        for rule in self._rules:
            config = self._configs[rule.id]
            if not config.enabled:
                continue
            if rule.scope == "node":
                result.append(self._step(rule, config, None, None, rule.evaluate(window, config), now, wall))
                continue
            for state in snap.gpus:
                if not rule.applies(state):
                    continue
                uuid = state.identity.uuid
                observation = rule.evaluate(window, uuid, config)
                result.append(self._step(rule, config, uuid, str(state.identity.index), observation, now, wall))
        return tuple(result)

    def _step(self, rule: Rule, config: RuleConfig, uuid: str | None, gpu: str | None,
              obs: Observation | None, now: float, wall: float) -> Anomaly:
        track = self._tracks.setdefault((rule.id, uuid), _Track())
        if obs is not None:
            if obs.active:
                track.last = obs
            elif track.state in ("quiet", "pending") or track.last is None:
                track.last = obs
            if track.state == "quiet" and obs.active:
                track.state, track.since = "pending", now
            elif track.state == "pending" and not obs.active:
                track.state = "quiet"
            elif track.state == "firing" and not obs.active:
                track.state, track.since = "clearing", now
            elif track.state == "clearing" and obs.active:
                track.state = "firing"
            if track.state == "pending" and now - track.since >= config.hold_seconds:
                track.state, track.since_wall = "firing", wall
                track.onsets += 1
                self._transition("anomaly_started", rule, config, uuid, gpu, track.last)
            elif track.state == "clearing" and now - track.since >= config.clear_seconds:
                track.state, track.since_wall = "quiet", None
                self._transition("anomaly_resolved", rule, config, uuid, gpu, obs)
        last = track.last or Observation(False)
        return Anomaly(
            rule=rule.id, severity=config.severity, uuid=uuid, gpu=gpu,
            firing=track.state in ("firing", "clearing"), since_wall=track.since_wall, onsets=track.onsets,
            value=last.value, threshold=last.threshold, summary=last.summary,
        )

    def _transition(self, event: str, rule: Rule, config: RuleConfig, uuid: str | None, gpu: str | None,
                    obs: Observation | None) -> None:
        method = self._log.warning if config.severity != "info" else self._log.info
        if event == "anomaly_resolved":
            method = self._log.info
        method(event, rule=rule.id, gpu=gpu, uuid=uuid, severity=config.severity,
               value=None if obs is None else obs.value, threshold=None if obs is None else obs.threshold,
               summary=None if obs is None else obs.summary)


def summarize(anomalies: Iterable[Anomaly]) -> list[Anomaly]:
    """The firing ones, critical first."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    firing = [a for a in anomalies if a.firing]
    return sorted(firing, key=lambda a: (order.get(a.severity, 9), a.rule, a.gpu or ""))
