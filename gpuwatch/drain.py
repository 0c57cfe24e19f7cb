"""Drain and resume this node in Slurm from `gpuwatch check --drain --resume` (docs/slurm.md).

Run as Slurm's ``HealthCheckProgram`` (as root, killed after 60 s): the check reads the daemon's
status document; on a critical anomaly the node is drained with a ``gpuwatch:`` reason, and a node
that gpuwatch drained is resumed once it has been healthy for ``resume_after`` seconds. The
ownership rule is LBNL NHC's: gpuwatch only ever resumes a node whose reason starts with its own
prefix, and never drains over someone else's drain (or a DOWN node).

Two parts:

- pure functions over the check's verdict (``gpuwatch.status.verdict``, the one definition that
  `gpuwatch check`'s exit code also follows) — :func:`next_healthy_since`, :func:`intended` and :func:`decide` (the
  decision table), :func:`parse_show_node` and :func:`drain_reason`;
- :func:`enforce`, a thin runner: reads the node's state with ``scontrol show node NAME`` (the
  binary found on PATH, a total time budget for all scontrol calls), runs ``scontrol update`` with an
  argv (never a shell), logs every decision as a structlog event with the keys node, action, reason,
  dry_run, and keeps "healthy since" and the last action in a small JSON state file written atomically.

The exit code of `gpuwatch check` stays the check's verdict (0/1/2) whatever happens here; a failure
to talk to Slurm is an error line and an ``slurm_action_failed`` event.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gpuwatch import logs, scontrol
from gpuwatch.scontrol import ScontrolError
from gpuwatch.status import Verdict, verdict

PREFIX = "gpuwatch:"
REASON_MAX = 128
DEFAULT_STATE_FILE = "/var/lib/gpuwatch/check-state.json"
DEFAULT_RESUME_AFTER = 600.0
DEFAULT_MIN_INTERVAL = 300.0
DEFAULT_SCONTROL_TIMEOUT = 20.0  # for all scontrol calls of one run together: Slurm kills the check at 60 s
STATE_VERSION = 1

NONE, DRAIN, RESUME = "none", "drain", "resume"

# Node base states that gpuwatch leaves alone whatever it sees (NHC never touches DOWN nodes either).
_OFFLINE_BASES = frozenset({"DOWN", "FUTURE", "UNKNOWN", "FAIL", "FAILING"})
_DRAIN_WORDS = frozenset({"DRAIN", "DRAINED", "DRAINING"})


def default_node_name() -> str:
    """The short host name: what Slurm's NodeName usually is (otherwise pass --node)."""
    return socket.gethostname().split(".", 1)[0]


def parse_seconds(name: str, value: Any) -> float:
    """Seconds ≥ 0 from ``600``, ``10m``, ``1h30m``... (0 allowed: no wait / no rate limit)."""
    from gpuwatch.config import parse_duration

    try:
        if float(str(value).strip()) == 0:
            return 0.0
    except ValueError:
        pass
    return parse_duration(name, value)


# ---------------------------------------------------------------------------------------------------
# pure part


@dataclasses.dataclass(frozen=True)
class Settings:
    node: str
    drain: bool = False
    resume: bool = False
    dry_run: bool = False
    resume_after: float = DEFAULT_RESUME_AFTER
    min_interval: float = DEFAULT_MIN_INTERVAL
    state_file: str | None = DEFAULT_STATE_FILE  # None: remember nothing (no resume, no rate limit across runs)
    scontrol: str = "scontrol"  # looked up on PATH
    timeout: float = DEFAULT_SCONTROL_TIMEOUT


def sanitize(text: str) -> str:
    """Printable ASCII without quotes, brackets, backslashes or shell metacharacters; spaces collapsed."""
    for old, new in (("°", ""), ("−", "-"), ("×", "x"), ("…", "...")):
        text = text.replace(old, new)
    text = re.sub(r"[^A-Za-z0-9 .,:;_+\-/()%#@=<>!?*~]", " ", text)
    return re.sub(r"\s+", " ", text).strip()


def drain_reason(critical: list[Mapping[str, Any]], limit: int = REASON_MAX) -> str:
    """``gpuwatch: GPU 3 xid_critical: <summary> (+1 more)``, sanitised, at most ``limit`` characters."""
    first = critical[0]
    gpu = first.get("gpu")
    where = f"GPU {gpu} " if gpu is not None else ""
    summary = sanitize(str(first.get("summary") or ""))
    if where and summary.startswith(where):  # summaries begin with "GPU 3 " themselves
        summary = summary[len(where):]
    head = sanitize(f"{PREFIX} {where}{first.get('rule')}") + ": "
    tail = f" (+{len(critical) - 1} more)" if len(critical) > 1 else ""
    room = limit - len(head) - len(tail)
    if len(summary) > room:
        summary = summary[:max(0, room - 3)].rstrip() + "..."
    if not summary:
        return head.rstrip(": ") + tail
    return head + summary + tail


@dataclasses.dataclass(frozen=True)
class NodeState:
    """The node as ``scontrol show node`` reports it."""

    state: str  # e.g. IDLE, MIXED+DRAIN, DOWN*+DRAIN
    reason: str = ""  # without the trailing [user@time]; "" when there is none

    @property
    def words(self) -> list[str]:
        return [w.rstrip("*~#!%$@^-") for w in self.state.upper().split("+") if w]

    @property
    def drained(self) -> bool:
        return any(w in _DRAIN_WORDS for w in self.words)

    @property
    def offline(self) -> bool:
        """DOWN, FAIL, FUTURE or UNKNOWN: not gpuwatch's business (NHC does not touch DOWN nodes either)."""
        return any(w in _OFFLINE_BASES for w in self.words)

    @property
    def ours(self) -> bool:
        return self.reason.startswith(PREFIX)


_STATE = re.compile(r"(?:^|\s)State=(\S+)")
_REASON_STAMP = re.compile(r"\[[^\[\]]*@[^\[\]]*\]$")


def parse_show_node(text: str) -> NodeState:
    """State and Reason from ``scontrol show node NAME`` (multi-line format; Reason is on a line of its own)."""
    state = _STATE.search(text)
    if state is None:
        raise ValueError("no State= in the output of scontrol show node")
    # line by line, no regex over the whole text: a long run of spaces made "^\s*Reason=(.*?)\s*$" quadratic
    line = next((s.strip() for s in text.splitlines() if s.lstrip().startswith("Reason=")), "")
    value = line[len("Reason="):].rstrip()
    stamp = _REASON_STAMP.search(value)
    value = (value[:stamp.start()] if stamp else value).strip()
    if value in ("(null)", "none", "None"):
        value = ""
    return NodeState(state.group(1), value)


@dataclasses.dataclass(frozen=True)
class Action:
    action: str  # none, drain or resume
    decision: str  # stable code: drain, resume, cannot_tell, already_drained_by_gpuwatch, ...
    reason: str = ""  # drain: the reason to set; resume: the gpuwatch reason cleared; none: the node's reason
    detail: str = ""  # one human sentence


def next_healthy_since(v: Verdict, healthy_since: float | None, now: float) -> float | None:
    """Start of the current run of healthy checks: kept while healthy, forgotten on critical or unknown."""
    if not v.healthy:
        return None
    if healthy_since is None or healthy_since > now:  # first healthy check, or the clock went back
        return now
    return healthy_since


def intended(v: Verdict, healthy_since: float | None, now: float, settings: Settings) -> str:
    """The action the verdict asks for before looking at the node: decides whether Slurm is asked at all."""
    if v.status == "critical" and settings.drain:
        return DRAIN
    if v.healthy and settings.resume and healthy_since is not None and now - healthy_since >= settings.resume_after:
        return RESUME
    return NONE


def decide(document_or_verdict: Mapping[str, Any] | Verdict | None, node: NodeState | None,
           healthy_since: float | None, last_action: float | None, now: float, settings: Settings) -> Action:
    """The decision table (docs/slurm.md). ``healthy_since`` is already updated for this run
    (:func:`next_healthy_since`); ``node`` may be None only when :func:`intended` says none."""
    v = document_or_verdict if isinstance(document_or_verdict, Verdict) else verdict(document_or_verdict)
    current = "" if node is None else node.reason
    if v.status == "unknown":
        return Action(NONE, "cannot_tell", current, f"gpuwatch cannot tell ({v.detail}): nothing is drained")
    if v.status == "critical" and not settings.drain:
        return Action(NONE, "drain_disabled", current, "critical, but --drain is not given")
    if v.healthy:
        if not settings.resume:
            return Action(NONE, "resume_disabled", current, "healthy; --resume is not given")
        healthy_for = 0.0 if healthy_since is None else now - healthy_since
        if healthy_for < settings.resume_after:
            return Action(NONE, "healthy_too_short", current,
                          f"healthy for {healthy_for:.0f} s of the {settings.resume_after:g} s --resume-after")
    if node is None:
        raise ValueError("decide() needs the node's state for this verdict")
    if node.offline:
        return Action(NONE, "node_offline", current, f"node is {node.state}: left alone")
    if v.status == "critical":
        if node.drained:
            who = "already_drained_by_gpuwatch" if node.ours else "already_drained_by_other"
            return Action(NONE, who, current, f"node is already {node.state} (Reason={current or 'none'})")
        action = Action(DRAIN, DRAIN, drain_reason(list(v.critical)), v.detail)
    else:
        if not node.drained:
            return Action(NONE, "not_drained", current, f"healthy and node is {node.state}")
        if not node.ours:
            return Action(NONE, "drained_by_other", current,
                          "drained with a reason that is not gpuwatch's: never resumed by gpuwatch")
        action = Action(RESUME, RESUME, current, f"healthy for {now - healthy_since:.0f} s")  # type: ignore[operator]
    if last_action is not None and 0 <= now - last_action < settings.min_interval:
        return Action(NONE, "rate_limited", action.reason,
                      f"would {action.action}, but the last action was {now - last_action:.0f} s ago "
                      f"(--min-interval {settings.min_interval:g} s)")
    return action


# ---------------------------------------------------------------------------------------------------
# runner


@dataclasses.dataclass(frozen=True)
class Memory:
    """What the state file keeps between runs."""

    healthy_since: float | None = None
    last_action: float | None = None
    last_action_kind: str | None = None
    last_reason: str | None = None

    def to_json(self, node: str) -> dict[str, Any]:
        return {"version": STATE_VERSION, "node": node, **dataclasses.asdict(self)}


def load_memory(path: str | None) -> tuple[Memory, str | None]:
    """The state file's content; a missing file is a fresh start, an unreadable one too (with why)."""
    if path is None:
        return Memory(), None
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        return Memory(), None
    except (OSError, ValueError) as exc:
        return Memory(), f"cannot read the state file {path}: {getattr(exc, 'strerror', None) or exc}"
    if not isinstance(data, dict):
        return Memory(), f"the state file {path} is not a JSON object: starting afresh"

    def number(key: str) -> float | None:  # a time: 0 or later, finite (json reads NaN and 400-digit numbers)
        value = data.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 2**53:
            return None
        return float(value)

    kind = data.get("last_action_kind")
    reason = data.get("last_reason")
    return Memory(number("healthy_since"), number("last_action"), kind if isinstance(kind, str) else None,
                  reason if isinstance(reason, str) else None), None


def save_memory(path: str, memory: Memory, node: str) -> None:
    """Atomically (temporary file in the same directory, fsync, rename). OSError when not writable."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
    import tempfile  # the drain command only: the daemon never loads it

    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(memory.to_json(node), f, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _scontrol(settings: Settings, args: list[str], deadline: float) -> str:
    left = deadline - time.monotonic()
    if left <= 0:
        raise ScontrolError(scontrol.TIMEOUT, f"no time left for scontrol (budget {settings.timeout:g} s)")
    try:
        return scontrol.run(settings.scontrol, args, left)
    except ScontrolError as exc:
        if exc.kind == scontrol.MISSING:
            raise ScontrolError(exc.kind, f"{exc}: set PATH in the HealthCheckProgram wrapper") from None
        if exc.kind == scontrol.TIMEOUT:
            raise ScontrolError(exc.kind, f"`{' '.join([settings.scontrol, *args][:3])}` did not finish within the "
                                f"{settings.timeout:g} s allowed for scontrol (slurmctld not answering?)") from None
        raise


def read_node(settings: Settings, deadline: float) -> NodeState:
    text = _scontrol(settings, ["show", "node", settings.node], deadline)
    try:
        return parse_show_node(text)
    except ValueError as exc:
        raise ScontrolError(scontrol.EXITED, f"cannot parse `scontrol show node {settings.node}`: {exc}") from None


def update_args(action: Action, node: str) -> list[str]:
    """The argv after ``scontrol`` for an action (each element one argument: no shell quoting involved)."""
    if action.action == DRAIN:
        return ["update", f"NodeName={node}", "State=DRAIN", f"Reason={action.reason}"]
    if action.action == RESUME:
        return ["update", f"NodeName={node}", "State=RESUME"]
    raise ValueError(f"no scontrol command for action {action.action!r}")


@dataclasses.dataclass(frozen=True)
class Outcome:
    verdict: Verdict
    action: Action | None  # None when Slurm could not be asked
    performed: bool  # scontrol update ran and succeeded
    lines: tuple[str, ...]  # for stdout, after the check's own line(s)


def enforce(document: Mapping[str, Any] | None, settings: Settings, now: float | None = None,
            log: Any = None) -> Outcome:
    """One run: verdict, decision, scontrol, state file. Never raises for Slurm or file trouble."""
    now = time.time() if now is None else now
    deadline = time.monotonic() + settings.timeout
    log = log or logs.get_logger(component="slurm")
    v = verdict(document)
    lines: list[str] = []
    ctx = {"node": settings.node, "dry_run": settings.dry_run}

    memory, problem = load_memory(settings.state_file)
    if problem:
        lines.append(f"gpuwatch: WARNING: {problem}")
        log.warning("slurm_state_file_unusable", path=settings.state_file, error=problem)
    healthy_since = next_healthy_since(v, memory.healthy_since, now)
    new_memory = dataclasses.replace(memory, healthy_since=healthy_since)

    action: Action | None
    performed = False
    node: NodeState | None = None
    want = intended(v, healthy_since, now, settings)
    try:
        if want != NONE:
            node = read_node(settings, deadline)
        action = decide(v, node, healthy_since, memory.last_action, now, settings)
    except ScontrolError as exc:
        action = None
        lines.append(f"gpuwatch: ERROR: cannot read the Slurm state of node {settings.node}: {exc}")
        log.error("slurm_action_failed", **ctx, action=want,
                  reason=drain_reason(list(v.critical)) if want == DRAIN else "",
                  error=str(exc), hint="the node was not changed; the next run tries again")
    if action is not None:
        node_state = None if node is None else node.state
        if action.action == NONE:
            level = log.warning if action.decision == "rate_limited" else log.debug
            level("slurm_no_action", **ctx, action=NONE, reason=action.reason, decision=action.decision,
                  detail=action.detail, verdict=v.status, node_state=node_state)
            if action.decision == "rate_limited":
                lines.append(f"gpuwatch: WARNING: node {settings.node}: {action.detail}")
        else:
            event = "slurm_drain" if action.action == DRAIN else "slurm_resume"
            if settings.dry_run:
                log.info(event, **ctx, action=action.action, reason=action.reason, detail=action.detail,
                         node_state=node_state)
                lines.append(f"gpuwatch: DRY RUN: would {action.action} node {settings.node} "
                             f"(Reason={action.reason})")
            else:
                new_memory = dataclasses.replace(new_memory, last_action=now, last_action_kind=action.action,
                                                 last_reason=action.reason)  # attempts count for the rate limit
                try:
                    _scontrol(settings, update_args(action, settings.node), deadline)
                    performed = True
                except ScontrolError as exc:
                    lines.append(f"gpuwatch: ERROR: cannot {action.action} node {settings.node}: {exc}")
                    log.error("slurm_action_failed", **ctx, action=action.action, reason=action.reason,
                              error=str(exc), hint="the next run tries again after --min-interval")
                else:
                    done = "drained" if action.action == DRAIN else "resumed"
                    lines.append(f"gpuwatch: {done} node {settings.node} (Reason={action.reason})")
                    (log.warning if action.action == DRAIN else log.info)(
                        event, **ctx, action=action.action, reason=action.reason, detail=action.detail,
                        node_state=node_state)

    if settings.state_file is not None and new_memory != memory:
        try:
            save_memory(settings.state_file, new_memory, settings.node)
        except OSError as exc:
            why = exc.strerror or str(exc)
            lines.append(f"gpuwatch: WARNING: cannot write the state file {settings.state_file}: {why}; "
                         "--resume and --min-interval need it (run as root, or pass --state-file in a "
                         "writable directory)")
            log.warning("slurm_state_file_unusable", path=settings.state_file, error=why)
    return Outcome(v, action, performed, tuple(lines))
