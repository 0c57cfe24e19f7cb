"""What a rule is: a pure function of a window of snapshots plus its configuration.

A rule never does I/O and never reads a clock: time comes from the snapshots
(``NodeSnapshot.taken_monotonic``). It returns an Observation for *now*; the engine turns
observations into pending -> firing -> resolved with hold and clear times.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuwatch.model import FastSample, GpuState, NodeSnapshot, Observation, SlowSample


@dataclass(frozen=True)
class RuleConfig:
    """A rule's effective settings: defaults overridden by the YAML ``rules:`` section."""

    enabled: bool
    severity: str
    hold_seconds: float
    clear_seconds: float
    params: Mapping[str, float]

    def __getitem__(self, name: str) -> float:
        return self.params[name]


class Window:
    """What rules see: the latest snapshot plus a bounded per-GPU history of fast samples.

    The engine keeps the history incrementally (one append per GPU per poll), so looking back
    costs only the samples a rule asks for.
    """

    def __init__(self, latest: NodeSnapshot, history: Mapping[str, Sequence[tuple[float, FastSample]]],
                 fast_staleness: float, expected_gpus: int = 0, now: float | None = None,
                 slow_history: Mapping[str, Sequence[tuple[float, SlowSample]]] | None = None) -> None:
        self.latest = latest
        self._slow_history = slow_history or {}
        self._now = latest.taken_monotonic if now is None else now
        self._history = history
        self.fast_staleness = fast_staleness
        self.expected_gpus = expected_gpus  # configured, else the most GPUs seen since start
        self._by_uuid = {state.identity.uuid: state for state in latest.gpus}

    @property
    def now(self) -> float:
        """Monotonic time of this evaluation (at or after the latest snapshot)."""
        return self._now

    def gpu(self, uuid: str) -> GpuState | None:
        return self._by_uuid.get(uuid)

    def fast(self, uuid: str) -> FastSample | None:
        """The GPU's latest fast sample, if it is up and fresh."""
        state = self._by_uuid.get(uuid)
        if state is None or not state.up or state.fast is None or state.fast_monotonic is None:
            return None
        if self.now - state.fast_monotonic > self.fast_staleness:
            return None
        return state.fast

    def slow(self, uuid: str) -> SlowSample | None:
        state = self._by_uuid.get(uuid)
        return None if state is None else state.slow

    def series(self, uuid: str, seconds: float | None = None) -> list[tuple[float, FastSample]]:
        """(monotonic time, fast sample) of the GPU over the last ``seconds`` (all kept if None), oldest first."""
        return self._recent(self._history.get(uuid, ()), seconds)

    def slow_series(self, uuid: str, seconds: float | None = None) -> list[tuple[float, SlowSample]]:
        """(monotonic time, slow sample) of the GPU over the last ``seconds``, oldest first."""
        return self._recent(self._slow_history.get(uuid, ()), seconds)

    def _recent(self, samples: Sequence[tuple[float, Any]], seconds: float | None) -> list[tuple[float, Any]]:
        if seconds is None:
            return list(samples)
        since = self.now - seconds
        result = []
        for item in reversed(samples):
            if item[0] < since:
                break
            result.append(item)
        result.reverse()
        return result

    def peers(self, uuid: str) -> list[tuple[str, FastSample]]:
        """(uuid, fresh fast sample) of the other GPUs of the node."""
        result = []
        for state in self.latest.gpus:
            other = state.identity.uuid
            if other != uuid:
                sample = self.fast(other)
                if sample is not None:
                    result.append((other, sample))
        return result


GpuEvaluate = Callable[[Window, str, RuleConfig], Observation | None]
NodeEvaluate = Callable[[Window, RuleConfig], Observation | None]


@dataclass(frozen=True)
class Rule:
    """A rule's identity, documentation and defaults, with its pure evaluation function.

    ``scope`` "gpu": ``evaluate(window, uuid, config)`` per GPU where ``applies(state)`` is true.
    ``scope`` "node": ``evaluate(window, config)`` once per poll.
    Returning None means "cannot tell now" (no fresh data): the rule's state does not move.
    """

    id: str
    scope: str
    severity: str
    hold_seconds: float
    clear_seconds: float
    condition: str  # one sentence, for docs/rules.md and the status API
    evaluate: Callable[..., Observation | None]
    params: Mapping[str, float] = field(default_factory=dict)
    applies: Callable[[GpuState], bool] = lambda state: True

    def default_config(self) -> RuleConfig:
        return RuleConfig(True, self.severity, self.hold_seconds, self.clear_seconds, dict(self.params))


def needs(*features: str) -> Callable[[GpuState], bool]:
    """``applies`` for rules that need readings the GPU may not support (no fan rules on an H200)."""

    def applies(state: GpuState) -> bool:
        return all(state.features.get(f, False) for f in features)

    return applies
