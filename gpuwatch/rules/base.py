"""What a rule is: a pure function of a window of snapshots plus its configuration.

A rule never does I/O and never reads a clock: time comes from the snapshots
(``NodeSnapshot.taken_monotonic``). It returns an Observation for *now*; the engine turns
observations into pending -> firing -> resolved with hold and clear times. What it sees is a
Window (gpuwatch/rules/window.py) over the engine's Histories (gpuwatch/rules/history.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from gpuwatch.model import FastSample, GpuState, Observation
from gpuwatch.rules.history import History, SeriesKey
from gpuwatch.rules.window import UndeclaredSeries, Window

__all__ = ["GpuEvaluate", "GpuRule", "History", "NodeEvaluate", "NodeRule", "Needs", "NeedsAny", "Rule",
           "RuleConfig", "SeriesKey", "UndeclaredSeries", "Window", "everywhere", "needs", "needs_any"]


@dataclass(frozen=True)
class RuleConfig:
    """A rule's effective settings: defaults overridden by the YAML ``rules:`` section."""

    enabled: bool
    severity: str
    hold_seconds: float
    clear_seconds: float
    params: Mapping[str, float]
    every_seconds: float = 0.0  # evaluated at most this often (0: at every evaluation), Rule.every_seconds

    def __getitem__(self, name: str) -> float:
        return self.params[name]


#: What a per-GPU rule evaluates: (window, GPU uuid, config) -> an observation, or None: cannot tell.
GpuEvaluate = Callable[[Window, str, RuleConfig], Observation | None]
#: What a node rule evaluates: (window, config) -> an observation, or None: cannot tell.
NodeEvaluate = Callable[[Window, RuleConfig], Observation | None]


def everywhere(state: GpuState) -> bool:
    """``applies`` of the rules that apply to every GPU (the default)."""
    return True


@dataclass(frozen=True, kw_only=True)
class Rule:
    """A rule's identity, documentation and defaults, with its pure evaluation function: a
    ``GpuRule`` or a ``NodeRule`` (this is what they share; it is not made by itself).

    ``GpuRule``: ``evaluate(window, uuid, config)`` per GPU where ``applies(state)`` is true.
    ``NodeRule``: ``evaluate(window, config)`` once per poll.
    Returning None means "cannot tell now" (no fresh data): the rule's state does not move.
    ``lookback``: the parameters that are seconds of the engine's history the rule looks back
    over, with the tier of that history ("fast" or "slow"). The engine keeps ``rules.window``
    seconds of fast samples and refuses (ConfigError) a fast look-back longer than that; it keeps
    slow samples for the longest slow look-back.
    ``every_seconds``: the rule is evaluated at most this often (0: at each run of the rules). For rules
    whose condition is held for tens of seconds or more, or that read the slow tier only: they
    fire at most that much later, and cost that much less (docs/rules.md, "Evaluation").
    ``predicates``, ``columns``, ``derived``: the series the rule derives from the history, by
    name (``Window.tally``/``first_last``, ``column``, ``derive``/``slow_derive``). The history
    keeps each under (rule id, name), extended once per sample: declared once here, never made
    per evaluation, and a name the rule does not declare is an error (UndeclaredSeries).
    """

    scope: ClassVar[Literal["gpu", "node"]]
    id: str
    severity: str
    hold_seconds: float
    clear_seconds: float
    condition: str  # one sentence, for docs/rules.md and the status API
    params: Mapping[str, float] = field(default_factory=dict)
    lookback: Mapping[str, str] = field(default_factory=dict)
    every_seconds: float = 0.0
    predicates: Mapping[str, Callable[[FastSample], bool]] = field(default_factory=dict)
    columns: Mapping[str, Callable[[FastSample], Any]] = field(default_factory=dict)
    derived: Mapping[str, Callable[[History[Any], int], Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        """The evaluator must take what the engine passes for the rule's kind (mypy checks the types;
        this catches what it does not see: an untyped lambda, a rule made in a test)."""
        if not isinstance(self, (GpuRule, NodeRule)):
            raise TypeError("make a GpuRule or a NodeRule, not a Rule")
        try:
            signature = inspect.signature(self.evaluate)
        except (TypeError, ValueError):  # a callable without a signature: nothing to check
            return
        try:
            signature.bind(*range(3 if self.scope == "gpu" else 2))
        except TypeError:
            wanted = "(window, uuid, config)" if self.scope == "gpu" else "(window, config)"
            raise TypeError(f"rule {self.id!r}: a {self.scope} rule's evaluate takes {wanted}, "
                            f"not {signature}") from None

    def default_config(self) -> RuleConfig:
        return RuleConfig(True, self.severity, self.hold_seconds, self.clear_seconds, dict(self.params),
                          self.every_seconds)


@dataclass(frozen=True, kw_only=True)
class GpuRule(Rule):
    """A rule evaluated per GPU, ``evaluate(window, uuid, config)``, on the GPUs where ``applies(state)``."""

    scope: ClassVar[Literal["gpu", "node"]] = "gpu"
    evaluate: GpuEvaluate
    applies: Callable[[GpuState], bool] = everywhere


@dataclass(frozen=True, kw_only=True)
class NodeRule(Rule):
    """A rule evaluated once per poll for the whole node, ``evaluate(window, config)``."""

    scope: ClassVar[Literal["gpu", "node"]] = "node"
    evaluate: NodeEvaluate


@dataclass(frozen=True)
class Needs:
    """``applies`` for rules that need readings the GPU may not support (no fan rules on an H200).

    A function of the GPU's probed features only, so the engine may keep its answer for as long
    as the GPU keeps the same ``features`` mapping (until it is discovered again).
    """

    features: tuple[str, ...]

    def __call__(self, state: GpuState) -> bool:
        return all(state.features.get(f, False) for f in self.features)


def needs(*features: str) -> Needs:
    """``applies`` for rules that need readings the GPU may not support (no fan rules on an H200)."""
    return Needs(features)


@dataclass(frozen=True)
class NeedsAny(Needs):
    """``applies`` for rules that can work from any one of several readings (a function of the
    features, kept by the engine like ``Needs``)."""

    def __call__(self, state: GpuState) -> bool:
        return any(state.features.get(f, False) for f in self.features)


def needs_any(*features: str) -> Needs:
    return NeedsAny(features)
