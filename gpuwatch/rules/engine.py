"""The rule engine: runs after a fast poll about every 4 s and tracks each (rule, GPU) with hysteresis.

    quiet --condition--> pending --held for `hold`--> firing --false--> clearing --false for `clear`--> quiet
                ^            |  false                     ^                |  true again
                +------------+                            +----------------+

A single noisy sample neither fires nor clears an anomaly. Each firing and each resolution is
one structlog event (``anomaly_started``, ``anomaly_resolved``) with rule, gpu, uuid, severity,
value, threshold and summary. A rule returning None ("cannot tell": stale or missing data)
leaves the state where it is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gpuwatch.groups import FAST_HISTORY
from gpuwatch.logs import get_logger
from gpuwatch.model import SEVERITIES, Anomaly, FastSample, GpuState, NodeSnapshot, Observation, SlowSample
from gpuwatch.rules.base import GpuRule, History, Needs, NodeRule, Rule, RuleConfig, Window, everywhere
from gpuwatch.rules.settings import check_lookback, fast_lookback

DEFAULT_WINDOW_SECONDS = 300.0  # config.Config.rules_window's default


@dataclass(slots=True)
class _Track:
    state: str = "quiet"  # quiet | pending | firing | clearing
    since: float = 0.0  # monotonic start of the current pending or clearing phase
    since_wall: float | None = None  # wall time the current episode started firing
    onsets: int = 0
    last: Observation | None = None
    # What ``anomaly`` was made of: (severity, gpu, state, since_wall, onsets, last observation).
    shown: tuple[Any, ...] | None = None
    anomaly: Anomaly | None = None


_NOTHING = Observation(False)


def _copier(kind: Any, table: Sequence[tuple[str, Callable[[Any], Any] | None]],
            whole: bool = False) -> Callable[[Any, Any], Any]:
    """``copy(sample, previous)``: ``sample`` as the history keeps it. The readings ``table`` names, each through
    its ``keep`` (None: as it is), and each shared with the previous kept sample's when equal (an idle GPU's
    utilization, throttle counters and health counters stay put from poll to poll); readings not named stay at
    their defaults. Where every reading equals the previous kept sample's, that sample itself (a steady GPU's
    history holds one object many times: the samples are immutable). ``whole``: ``table`` names every field
    of ``kind`` in order, and the copy is built positionally (the fast samples': every GPU at every poll).

    The function is written out for the table, a statement per reading (as gpuwatch.frozen writes an
    ``__init__``): every GPU's fast sample is copied at every poll, and a loop over the table by name (getattr
    by name, a list, the call's unpacking) made a copy 6.3 µs a GPU where this takes 4.9 (hot, readings
    changing, 8 x L40S; the rest is the groups' ``history`` copies and the comparisons)."""
    space: dict[str, Any] = {"kind": kind}
    body = ["    if previous is None:\n"]
    names = [name for name, _ in table]
    firsts = []
    for i, (name, keep) in enumerate(table):
        if keep is not None:
            space[f"keep{i}"] = keep
        firsts.append(f"keep{i}(sample.{name})" if keep is not None else f"sample.{name}")
    args = ", ".join(firsts) if whole else ", ".join(f"{n}={v}" for n, v in zip(names, firsts))
    body.append(f"        return kind({args})\n")
    body.append("    same = True\n")
    for i, (name, keep) in enumerate(table):
        value = f"keep{i}(sample.{name})" if keep is not None else f"sample.{name}"
        body.append(f"    v{i} = {value}\n    b{i} = previous.{name}\n"
                    f"    if b{i} is v{i} or b{i} == v{i}:\n        v{i} = b{i}\n    else:\n        same = False\n")
    body.append("    if same:\n        return previous\n")
    args = ", ".join(f"v{i}" for i in range(len(table))) if whole else ", ".join(
        f"{n}=v{i}" for i, n in enumerate(names))
    body.append(f"    return kind({args})\n")
    exec("def copy(sample, previous):\n" + "".join(body), space)
    return space["copy"]


#: The fast sample as the history keeps it: each group's reading as its declaration says the look-back keeps it
#: (Group.history: without what no rule looks back at), equal readings shared. Rules read clocks, memory, energy
#: and P-state from the latest sample only (``Window.fast``, always complete); dropping them from the copies kept
#: for the look-back saves about a third of the history's memory (docs/performance.md).
_for_history: Callable[[FastSample, FastSample | None], FastSample] = _copier(FastSample, FAST_HISTORY, whole=True)


# The slow readings the rules look back at (Window.slow_derive: PCIe replays, NVLink error counters); the
# history keeps those of each past sample and leaves the others at their empty defaults (a GPU's process
# list, MIG layout, limits: at a 1 s slow interval and 300 s of look-back, 300 copies a GPU otherwise).
# Rules read the latest slow sample whole (Window.slow). A rule that looks back at another adds it here.
SLOW_HISTORY = ("pcie", "nvlink")

#: The slow sample as the history keeps it: the readings rules look back at (SLOW_HISTORY), equal readings shared.
_for_slow_history: Callable[[SlowSample, SlowSample | None], SlowSample] = _copier(
    SlowSample, tuple((name, None) for name in SLOW_HISTORY))


class Engine:
    """Evaluates the rules on every snapshot it is fed and keeps their history and state.

    Raises ConfigError (at construction and in ``reconfigure``) when an enabled rule would look
    back further than the fast history it may keep (``window_seconds``, the ``rules.window``
    setting). It keeps what the rules look back at: the longest enabled fast look-back, and at
    least ``min_history_seconds`` (the slow interval and a fast staleness bound: pcie_link_degraded
    finds the fast sample of the time the last slow sample was read), plus one fast staleness
    bound; never more than the window. By default 66 s: at 0.5 s polls 123 samples per GPU, not 600.

    ``slow_staleness`` is the slow tier's staleness bound: the oldest read of the host groups a rule
    sees (Window.host_fresh; None: any age); slow samples are seen whatever their age (Window.slow).
    Rule ids must be unique: the engine keeps each rule's state, and the histories each rule's series,
    under its id (ValueError otherwise).
    """

    def __init__(self, rules: Sequence[Rule], configs: Mapping[str, RuleConfig], fast_staleness: float,
                 window_seconds: float = DEFAULT_WINDOW_SECONDS, expected_gpus: int = 0,
                 min_history_seconds: float = 0.0, slow_staleness: float | None = None) -> None:
        self._rules = list(rules)
        ids = [rule.id for rule in self._rules]
        if len(ids) != len(set(ids)):
            raise ValueError(f"duplicate rule ids: {sorted({i for i in ids if ids.count(i) > 1})}")
        self._window_seconds = window_seconds
        self._min_history = min_history_seconds
        self._configs = dict(configs)
        self._slow_seconds = check_lookback(self._rules, self._configs, window_seconds)
        self._fast_staleness = fast_staleness
        self._slow_staleness = slow_staleness
        self._fast_seconds = self._history_seconds(self._configs)
        self._expected_gpus = expected_gpus
        self._most_gpus = 0
        self._tracks: dict[str, dict[str | None, _Track]] = {}  # rule id -> GPU uuid (None: the node) -> state
        self._history: dict[str, History[FastSample]] = {}
        self._slow_history: dict[str, History[SlowSample]] = {}
        # the GPUs (uuid, features) of _targets: a new plan (new lists) when they change
        self._signature: tuple[tuple[str, Mapping[str, bool]], ...] | None = None
        self._targets: dict[str, list[int] | None] = {}
        self._onsets: dict[str, int] = {}  # rule id -> onsets on any GPU or the node
        self._errors: dict[str, int] = {}  # rule id -> evaluations that raised
        self._counted: tuple[dict[str, int], dict[str, int]] | None = None  # counters(), until one changes
        self._failed_logged: set[tuple[str, str | None]] = set()
        # rule id -> (when, the plan's targets, the anomalies) of its last evaluation, for the rules
        # with ``every``: until ``every`` has passed, the same targets get the same anomalies
        self._kept: dict[str, tuple[float, list[int] | None, list[Anomaly]]] = {}
        self._log = get_logger(component="rules")
        self._lock = threading.Lock()

    @property
    def rules(self) -> list[Rule]:
        return list(self._rules)

    @property
    def window_seconds(self) -> float:
        """Seconds of fast-sample history the rules may look back (``rules.window``)."""
        return self._window_seconds

    @property
    def history_seconds(self) -> float:
        """Seconds of fast-sample history kept: what the enabled rules look back at."""
        return self._fast_seconds

    def _history_seconds(self, configs: Mapping[str, RuleConfig]) -> float:
        wanted = max(fast_lookback(self._rules, configs), self._min_history) + self._fast_staleness
        return min(self._window_seconds, wanted)

    def reconfigure(self, configs: Mapping[str, RuleConfig]) -> None:
        """New thresholds/holds take effect at the next poll; episodes in progress carry on.

        ConfigError (nothing changes) if an enabled rule would look back further than the window.
        """
        configs = dict(configs)
        slow_seconds = check_lookback(self._rules, configs, self._window_seconds)
        with self._lock:
            self._configs, self._slow_seconds = configs, slow_seconds
            self._counted = None
            self._fast_seconds = self._history_seconds(configs)
            self._kept.clear()

    def counters(self) -> tuple[dict[str, int], dict[str, int]]:
        """(onsets, evaluation errors) per enabled rule, over every GPU and the node; 0 until the first.
        The same two dicts until an onset, an error or a new configuration changes them (each run asks)."""
        with self._lock:
            counted = self._counted
            if counted is None:
                enabled = [rule.id for rule in self._rules if self._configs[rule.id].enabled]
                counted = self._counted = ({r: self._onsets.get(r, 0) for r in enabled},
                                           {r: self._errors.get(r, 0) for r in enabled})
            return counted

    def _remember(self, gpus: Sequence[GpuState], taken: float, visible: int) -> None:
        fast_horizon = taken - self._fast_seconds
        slow_horizon = taken - self._slow_seconds
        for state in gpus:
            uuid = state.identity.uuid
            history = self._history.get(uuid)
            if history is None:
                history = self._history[uuid] = History()
            slow = self._slow_history.get(uuid)
            if slow is None:
                slow = self._slow_history[uuid] = History()
            if state.up:
                # Only newer samples: a snapshot taken before the last one evaluated adds nothing.
                if state.fast is not None and state.fast_monotonic is not None:
                    last = history.last_time
                    if last is None or state.fast_monotonic > last:
                        previous = history.samples[-1] if history.samples else None
                        history.append(state.fast_monotonic, _for_history(state.fast, previous))
                if state.slow is not None and state.slow_monotonic is not None:
                    last = slow.last_time
                    if last is None or state.slow_monotonic > last:
                        previous_slow = slow.samples[-1] if slow.samples else None
                        slow.append(state.slow_monotonic, _for_slow_history(state.slow, previous_slow))
            history.trim(fast_horizon)
            slow.trim(slow_horizon)
        self._most_gpus = max(self._most_gpus, visible)

    def remember(self, snap: NodeSnapshot) -> None:
        """Keep the snapshot's new samples in the history without evaluating: after each fast poll that does
        not run the rules, so the windows the rules look back at have every poll's sample (shares, medians,
        the fast sample nearest a slow read), as if the rules ran after every poll."""
        self.remember_states(snap.gpus, snap.taken_monotonic, snap.visible_gpus)

    def remember_states(self, gpus: Sequence[GpuState], taken: float, visible: int) -> None:
        """``remember`` from the GPUs' states (Store.gpu_states) taken at monotonic time ``taken``, with
        ``visible`` GPUs: the poller's way, without building a snapshot that the next write makes stale."""
        with self._lock:
            self._remember(gpus, taken, visible)

    def evaluate(self, snap: NodeSnapshot, now: float | None = None, wall: float | None = None) -> tuple[Anomaly, ...]:
        """Feed the latest snapshot; returns the state of every evaluated (rule, GPU).

        Runs after a fast poll about every 4 s, and at the fast ticks skipped while a poll hangs (``now``/``wall``:
        the time of evaluation), so that node rules such as collection_stalled fire then.
        """
        with self._lock:
            return self._evaluate(snap, snap.taken_monotonic if now is None else now,
                                  snap.taken_wall if wall is None else wall)

    def _evaluate(self, snap: NodeSnapshot, now: float, wall: float) -> tuple[Anomaly, ...]:
        self._remember(snap.gpus, snap.taken_monotonic, snap.visible_gpus)
        node = Window(snap, self._history, self._fast_staleness, self._expected_gpus or self._most_gpus, now,
                      self._slow_history, self._slow_staleness)
        gpus = snap.gpus
        plan = self._plan(gpus)
        labels = [str(state.identity.index) for state in gpus]
        uuids = [state.identity.uuid for state in gpus]
        step = self._step
        result: list[Anomaly] = []
        for rule in self._rules:
            config = self._configs[rule.id]
            if not config.enabled:
                continue
            every = config.every_seconds
            per_node = isinstance(rule, NodeRule)
            targets = None if per_node else plan[rule.id]
            if every:  # evaluated less than ``every`` ago, on the same GPUs: its last states again
                kept = self._kept.get(rule.id)
                if (kept is not None and kept[1] is targets and (targets is not None or per_node)
                        and 0.0 <= now - kept[0] < every):
                    result.extend(kept[2])
                    continue
            first = len(result)
            window = node.for_rule(rule)  # the series the rule declares, under (rule id, name)
            if isinstance(rule, NodeRule):
                try:
                    obs = rule.evaluate(window, config)
                except Exception as exc:
                    self._failed(rule, None, None, exc)
                    obs = None
                result.append(step(rule, config, None, None, obs, now, wall))
                if every:
                    self._kept[rule.id] = (now, None, result[first:])
                continue
            assert isinstance(rule, GpuRule)  # the two kinds of Rule
            evaluate = rule.evaluate
            kept_targets = targets
            if targets is None:  # an ``applies`` that may look at more than the features: ask every time
                targets = [i for i, state in enumerate(gpus) if self._applies(rule, state)]
            tracks = self._tracks.get(rule.id)
            if tracks is None:
                tracks = self._tracks[rule.id] = {}
            severity, append = config.severity, result.append
            for i in targets:
                uuid = uuids[i]
                try:
                    obs = evaluate(window, uuid, config)
                except Exception as exc:  # a bug in one rule on one GPU's odd reading stays there
                    self._failed(rule, uuid, labels[i], exc)
                    obs = None
                if obs is not None and not obs.active:
                    # Quiet and still quiet (almost every rule on almost every GPU at every run): nothing moves
                    # but the last observation; the Anomaly shown stays unless the severity or the label did
                    # (shown of a state that does not fire: since_wall None, onsets current). _step's way, inline.
                    track = tracks.get(uuid)
                    if track is not None and track.state == "quiet":
                        # a quiet track keeps no observation (_step's rule): this one is freed now, while its
                        # memory is warm, not a run later from cold memory
                        shown = track.shown
                        if shown is not None and not shown[2] and shown[0] == severity and shown[1] == labels[i]:
                            append(track.anomaly)  # type: ignore[arg-type]  # set with shown
                            continue
                append(step(rule, config, uuid, labels[i], obs, now, wall))
            if every:
                self._kept[rule.id] = (now, kept_targets, result[first:])
        return tuple(result)

    def _failed(self, rule: Rule, uuid: str | None, gpu: str | None, exc: Exception,
                hint: str = "a bug in this rule: its state on this GPU is frozen") -> None:
        """Count the failure; log it once per (rule, GPU). The caller then observes nothing (None): the
        rule's state on that GPU stays as it was (or, for a summary, the anomaly goes on with a placeholder)."""
        self._errors[rule.id] = self._errors.get(rule.id, 0) + 1
        self._counted = None
        if (rule.id, uuid) not in self._failed_logged:
            self._failed_logged.add((rule.id, uuid))
            self._log.error("rule_failed", rule=rule.id, gpu=gpu, uuid=uuid, error=f"{type(exc).__name__}: {exc}",
                            exc_info=exc,
                            hint=f"{hint}, the other rules and GPUs are evaluated as usual "
                                 "(gpuwatch_rule_evaluation_errors_total); please report it")

    def _applies(self, rule: GpuRule, state: GpuState) -> bool:
        try:
            return rule.applies(state)
        except Exception as exc:
            self._failed(rule, state.identity.uuid, str(state.identity.index), exc)
            return False

    def _plan(self, gpus: Sequence[GpuState]) -> dict[str, list[int] | None]:
        """Rule id -> indices in ``gpus`` of the GPUs it applies to (None: ask ``applies`` each time).

        ``everywhere`` and ``needs(...)`` depend on the probed features only, so the answer holds
        until a discovery changes the GPUs or their features.
        """
        signature = tuple((state.identity.uuid, state.features) for state in gpus)
        if signature != self._signature:  # the same mappings, or equal ones in the same order: the same plan
            plan: dict[str, list[int] | None] = {}
            for rule in self._rules:
                if not isinstance(rule, GpuRule):
                    continue
                applies = rule.applies
                if applies is everywhere:
                    plan[rule.id] = list(range(len(gpus)))
                elif isinstance(applies, Needs):
                    plan[rule.id] = [i for i, state in enumerate(gpus) if applies(state)]
                else:
                    plan[rule.id] = None
            self._signature, self._targets = signature, plan
        return self._targets

    def _step(self, rule: Rule, config: RuleConfig, uuid: str | None, gpu: str | None,
              obs: Observation | None, now: float, wall: float) -> Anomaly:
        tracks = self._tracks.get(rule.id)
        if tracks is None:
            tracks = self._tracks[rule.id] = {}
        track = tracks.get(uuid)
        if track is None:
            track = tracks[uuid] = _Track()
        if obs is not None:
            state, active = track.state, obs.active
            if active or state == "quiet" or state == "pending" or track.last is None:
                track.last = obs
            if state == "quiet":
                if active:
                    state, track.since = "pending", now
            elif state == "pending":
                if not active:
                    state = "quiet"
            elif state == "firing":
                if not active:
                    state, track.since = "clearing", now
            elif active:  # clearing
                state = "firing"
            track.state = state
            if state == "pending" and now - track.since >= config.hold_seconds:
                track.state, track.since_wall = "firing", wall
                track.onsets += 1
                self._onsets[rule.id] = self._onsets.get(rule.id, 0) + 1
                self._counted = None
                self._transition("anomaly_started", rule, config, uuid, gpu, track.last)
            elif state == "clearing" and now - track.since >= config.clear_seconds:
                track.state, track.since_wall = "quiet", None
                self._transition("anomaly_resolved", rule, config, uuid, gpu, obs)
            if track.state == "quiet":
                track.last = None  # a quiet track shows no observation: keep none (as the engine's loop does)
        # A firing anomaly shows its latest reading (value, threshold, summary); a quiet or pending
        # one shows none (like Prometheus' ALERTS, nothing reads it), so it is the same object from
        # one evaluation to the next and its summary is never formatted.
        firing = track.state == "firing" or track.state == "clearing"
        last = (track.last or _NOTHING) if firing else None
        shown = (config.severity, gpu, firing, track.since_wall, track.onsets, last)
        if shown != track.shown:  # else the Anomaly returned last time says the same: return it again
            track.shown = shown
            track.anomaly = Anomaly(
                rule=rule.id, severity=config.severity, uuid=uuid, gpu=gpu, firing=firing,
                since_wall=track.since_wall, onsets=track.onsets,
                value=None if last is None else last.value, threshold=None if last is None else last.threshold,
                summary="" if last is None else self._summary(rule, uuid, gpu, last),
            )
        return track.anomaly  # type: ignore[return-value]

    def _transition(self, event: str, rule: Rule, config: RuleConfig, uuid: str | None, gpu: str | None,
                    obs: Observation | None) -> None:
        method = self._log.warning if config.severity != "info" else self._log.info
        if event == "anomaly_resolved":
            method = self._log.info
        method(event, rule=rule.id, gpu=gpu, uuid=uuid, severity=config.severity,
               value=None if obs is None else obs.value, threshold=None if obs is None else obs.threshold,
               summary=None if obs is None else self._summary(rule, uuid, gpu, obs))

    def _summary(self, rule: Rule, uuid: str | None, gpu: str | None, obs: Observation) -> str:
        """The observation's summary; one whose text cannot be made (a bug in the rule's summary function) is
        counted and logged as the rule's failure and named so, never an exception out of the evaluation (it
        took every rule's verdicts of that evaluation with it, and a resolving anomaly's state)."""
        try:
            return obs.summary
        except Exception as exc:
            self._failed(rule, uuid, gpu, exc, hint="a bug in this rule's summary: the anomaly is reported, "
                                                    "with a placeholder for its summary")
            return f"{rule.id}: its summary could not be written ({type(exc).__name__}; a gpuwatch bug)"


def summarize(anomalies: Iterable[Anomaly]) -> list[Anomaly]:
    """The firing ones, critical first."""
    order = {s: i for i, s in enumerate(SEVERITIES)}
    firing = [a for a in anomalies if a.firing]
    return sorted(firing, key=lambda a: (order.get(a.severity, 9), a.rule, a.gpu or ""))
