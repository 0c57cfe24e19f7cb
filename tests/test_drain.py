"""Slurm draining (`gpuwatch check --drain --resume`, gpuwatch/drain.py, docs/slurm.md).

The decision table is tested as a pure function; the runner against tests/fakes/scontrol (put first on
PATH; it records its argv and keeps node states in a JSON file), and end to end against the real
daemon over the fake NVML library. No test ever runs a real scontrol.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

import fakenvml
import pytest
from daemon import Daemon, fake_env, wait_for
from structlog.testing import capture_logs

from gpuwatch import drain
from gpuwatch.drain import Action, NodeState, Settings, decide
from gpuwatch.status import verdict

FAKES = Path(__file__).resolve().parent / "fakes"
NODE = "gpu01"
T0 = 1_796_000_000.0
SETTINGS = Settings(node=NODE, drain=True, resume=True, resume_after=600, min_interval=300, state_file=None)


def document(*anomalies, up=True, fresh=True):
    severities = {a["severity"] for a in anomalies}
    status = ("unknown" if not (up and fresh) else "critical" if "critical" in severities
              else "warning" if "warning" in severities else "ok")  # as the daemon computes it
    return {
        "api_version": 1, "status": status, "generated_at": T0, "fresh": fresh,
        "backend": {"name": "nvml", "up": up, "reason": None if up else "NVML: Driver Not Loaded"},
        "gpus": [{"gpu": "0"}, {"gpu": "1"}], "anomalies": list(anomalies),
        "polls": {"fast": {"age_seconds": 0.5 if fresh else 45.0}},
    }


def anomaly(rule="ecc_uncorrectable", gpu="1", severity="critical", summary=None):
    summary = summary or f"GPU {gpu} 2 uncorrectable ECC errors since the last driver load or GPU reset"
    return {"rule": rule, "severity": severity, "gpu": gpu, "uuid": None if gpu is None else f"GPU-{gpu}",
            "since": T0, "value": 2.0, "threshold": 1.0, "summary": summary}


CRITICAL = document(anomaly())
HEALTHY = document()
IDLE = NodeState("IDLE")
OURS = NodeState("IDLE+DRAIN", "gpuwatch: GPU 1 ecc_uncorrectable: 2 uncorrectable ECC errors")
OPERATOR = NodeState("IDLE+DRAIN", "bad DIMM, ticket 4711")


# ------------------------------------------------------------------------------------------------
# the decision table


def test_critical_on_an_idle_node_drains_with_a_gpuwatch_reason():
    action = decide(CRITICAL, IDLE, None, None, T0, SETTINGS)
    assert action.action == "drain"
    assert action.reason == ("gpuwatch: GPU 1 ecc_uncorrectable: 2 uncorrectable ECC errors since the last "
                             "driver load or GPU reset")


@pytest.mark.parametrize("state", ["IDLE", "MIXED", "ALLOCATED", "IDLE+MAINT", "MIXED+RESERVED"])
def test_critical_drains_a_node_that_takes_jobs(state):
    assert decide(CRITICAL, NodeState(state), None, None, T0, SETTINGS).action == "drain"


def test_critical_never_overwrites_an_operators_drain():
    for state in ("IDLE+DRAIN", "MIXED+DRAIN", "ALLOCATED+DRAIN"):
        action = decide(CRITICAL, NodeState(state, OPERATOR.reason), None, None, T0, SETTINGS)
        assert (action.action, action.decision) == ("none", "already_drained_by_other")
        assert action.reason == OPERATOR.reason


def test_critical_on_a_node_gpuwatch_already_drained_does_nothing():
    action = decide(CRITICAL, OURS, None, None, T0, SETTINGS)
    assert (action.action, action.decision) == ("none", "already_drained_by_gpuwatch")


@pytest.mark.parametrize("state", ["DOWN", "DOWN*", "DOWN+DRAIN", "IDLE+FAIL", "FUTURE", "UNKNOWN"])
def test_down_or_failed_nodes_are_left_alone(state):
    assert decide(CRITICAL, NodeState(state, "Not responding"), None, None, T0, SETTINGS).decision == "node_offline"
    ours = NodeState(state, "gpuwatch: GPU 1 gpu_lost")
    assert decide(HEALTHY, ours, T0 - 3600, None, T0, SETTINGS).decision == "node_offline"


def test_healthy_for_less_than_resume_after_does_nothing():
    action = decide(HEALTHY, OURS, T0 - 599, None, T0, SETTINGS)
    assert (action.action, action.decision) == ("none", "healthy_too_short")
    # the node's state is not even needed for that answer
    assert decide(HEALTHY, None, T0 - 599, None, T0, SETTINGS).decision == "healthy_too_short"
    assert drain.intended(verdict(HEALTHY), T0 - 599, T0, SETTINGS) == "none"


def test_healthy_for_resume_after_resumes_a_node_gpuwatch_drained():
    action = decide(HEALTHY, OURS, T0 - 600, None, T0, SETTINGS)
    assert (action.action, action.reason) == ("resume", OURS.reason)
    assert drain.intended(verdict(HEALTHY), T0 - 600, T0, SETTINGS) == "resume"


def test_warnings_count_as_healthy():
    doc = document(anomaly("pcie_link_degraded", severity="warning"), anomaly("power_capped", severity="info"))
    v = verdict(doc)
    assert (v.status, v.exit_code, v.healthy, v.critical) == ("warning", 0, True, ())
    assert decide(doc, OURS, T0 - 600, None, T0, SETTINGS).action == "resume"


@pytest.mark.parametrize("reason", ["bad DIMM, ticket 4711", "NHC: check_fs_mount: /scratch not mounted",
                                    "Kill task failed", "GPUWATCH: uppercase is not ours", " gpuwatch: leading space",
                                    "gpuwatch GPU 1 (no colon)", ""])
def test_a_drain_gpuwatch_did_not_make_is_never_resumed(reason):
    node = NodeState("IDLE+DRAIN", reason)
    for healthy_since in (T0 - 600, T0 - 86400 * 30):
        action = decide(HEALTHY, node, healthy_since, None, T0, SETTINGS)
        assert (action.action, action.decision) == ("none", "drained_by_other")


def test_healthy_node_not_drained_needs_nothing():
    assert decide(HEALTHY, IDLE, T0 - 3600, None, T0, SETTINGS).decision == "not_drained"


@pytest.mark.parametrize("doc", [None, document(anomaly(), up=False), document(anomaly(), fresh=False)],
                         ids=["daemon-down", "backend-down", "stale"])
def test_cannot_tell_never_drains_nor_resumes(doc):
    v = verdict(doc)
    assert (v.status, v.exit_code) == ("unknown", 2)
    for node in (IDLE, OURS, OPERATOR):
        action = decide(doc, node, T0 - 86400, None, T0, SETTINGS)
        assert (action.action, action.decision) == ("none", "cannot_tell")
    assert drain.intended(v, T0 - 86400, T0, SETTINGS) == "none"
    assert drain.next_healthy_since(v, T0 - 86400, T0) is None  # a gap in knowledge restarts the healthy clock


def test_rate_limit_holds_back_a_second_action_within_min_interval():
    for doc, node, healthy_since in ((CRITICAL, IDLE, None), (HEALTHY, OURS, T0 - 3600)):
        limited = decide(doc, node, healthy_since, T0 - 299, T0, SETTINGS)
        assert (limited.action, limited.decision) == ("none", "rate_limited")
        assert decide(doc, node, healthy_since, T0 - 300, T0, SETTINGS).action in ("drain", "resume")
        assert decide(doc, node, healthy_since, T0 - 299, T0, Settings(NODE, True, True, min_interval=0)).action \
            in ("drain", "resume")
    # nothing to do is not reported as rate limited
    assert decide(CRITICAL, OURS, None, T0 - 10, T0, SETTINGS).decision == "already_drained_by_gpuwatch"


def test_drain_and_resume_each_need_their_flag():
    only_resume = Settings(NODE, drain=False, resume=True)
    only_drain = Settings(NODE, drain=True, resume=False)
    assert decide(CRITICAL, IDLE, None, None, T0, only_resume).decision == "drain_disabled"
    assert decide(HEALTHY, OURS, T0 - 3600, None, T0, only_drain).decision == "resume_disabled"
    assert decide(CRITICAL, IDLE, None, None, T0, only_drain).action == "drain"
    assert decide(HEALTHY, OURS, T0 - 3600, None, T0, only_resume).action == "resume"


def test_decide_needs_the_node_state_when_an_action_is_possible():
    with pytest.raises(ValueError):
        decide(CRITICAL, None, None, None, T0, SETTINGS)


def test_healthy_since_starts_at_the_first_healthy_check_and_is_forgotten_otherwise():
    ok, critical, unknown = verdict(HEALTHY), verdict(CRITICAL), verdict(None)
    assert drain.next_healthy_since(ok, None, T0) == T0
    assert drain.next_healthy_since(ok, T0 - 50, T0) == T0 - 50
    assert drain.next_healthy_since(ok, T0 + 50, T0) == T0  # the clock went back
    assert drain.next_healthy_since(critical, T0 - 50, T0) is None
    assert drain.next_healthy_since(unknown, T0 - 50, T0) is None


def test_verdict_agrees_with_the_documented_exit_codes():
    assert verdict(HEALTHY).exit_code == 0
    assert verdict(CRITICAL).exit_code == 1
    assert verdict(document(anomaly(severity="warning"), anomaly(rule="gpu_lost", gpu="0"))).exit_code == 1
    assert verdict(None).exit_code == 2


# ------------------------------------------------------------------------------------------------
# reasons and scontrol output


def test_the_reason_names_the_first_critical_anomaly_and_counts_the_others():
    doc = document(anomaly("xid_critical", "3", summary="GPU 3 XID 79 (fell off the bus) 0 min ago, 1 since start"),
                   anomaly("gpu_lost", "3", summary="GPU 3 (GPU-3) not answering"),
                   anomaly("pcie_link_degraded", "2", severity="warning"))
    assert drain.drain_reason(list(verdict(doc).critical)) == "gpuwatch: GPU 3 xid_critical: XID 79 (fell off the bus) 0 min ago, " \
                                        "1 since start (+1 more)"
    node_level = document(anomaly("gpu_missing", None, summary="3 GPUs visible, 4 expected"))
    assert drain.drain_reason(list(verdict(node_level).critical)) == "gpuwatch: gpu_missing: 3 GPUs visible, 4 expected"


def test_the_reason_is_truncated_and_has_nothing_that_breaks_scontrol():
    hostile = 'GPU 1 at 91 °C "quoted" \'single\' [bracket] $(rm -rf /) `x` \\ ; a|b & c\nsecond line\ttab ' * 5
    doc = document(anomaly("overheating", "1", summary=hostile), anomaly("fan_stalled", "1"))
    reason = drain.drain_reason(list(verdict(doc).critical))
    assert reason.startswith("gpuwatch: GPU 1 overheating: at 91 C quoted single bracket")
    assert reason.endswith("... (+1 more)")
    assert len(reason) <= drain.REASON_MAX
    assert not set(reason) & set("\"'`[]\\|&$\n\t°{}")
    assert "  " not in reason
    assert drain.drain_reason([anomaly(summary="x" * 1000)], limit=60).__len__() == 60


def test_show_node_output_is_parsed_with_and_without_a_reason():
    text = ("NodeName=gpu01 Arch=x86_64 CoresPerSocket=32\n"
            "   State=MIXED+DRAIN ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A\n"
            "   Partitions=gpu\n"
            "   Reason=gpuwatch: GPU 3 xid_critical: XID 79 [slot 3] [root@2026-11-30T15:00:00]\n")
    node = drain.parse_show_node(text)
    assert node == NodeState("MIXED+DRAIN", "gpuwatch: GPU 3 xid_critical: XID 79 [slot 3]")
    assert node.drained and node.ours and not node.offline
    bare = drain.parse_show_node("NodeName=gpu01\n   State=IDLE ThreadsPerCore=1\n   Partitions=gpu\n")
    assert bare == NodeState("IDLE", "") and not bare.drained
    with pytest.raises(ValueError):
        drain.parse_show_node("Node gpu01 not found\n")


def test_update_commands_are_argv_lists():
    action = Action("drain", "drain", "gpuwatch: GPU 1 ecc_uncorrectable: 2 errors")
    assert drain.update_args(action, NODE) == ["update", "NodeName=gpu01", "State=DRAIN",
                                              "Reason=gpuwatch: GPU 1 ecc_uncorrectable: 2 errors"]
    assert drain.update_args(Action("resume", "resume", OURS.reason), NODE) == [
        "update", "NodeName=gpu01", "State=RESUME"]


def test_parse_seconds_accepts_durations_and_zero():
    assert drain.parse_seconds("--resume-after", "10m") == 600
    assert drain.parse_seconds("--min-interval", "0") == 0
    assert drain.parse_seconds("--min-interval", "90") == 90


def test_default_node_name_is_the_short_host_name(monkeypatch):
    monkeypatch.setattr(drain.socket, "gethostname", lambda: "gpu07.cluster.example.org")
    assert drain.default_node_name() == "gpu07"


# ------------------------------------------------------------------------------------------------
# the runner, with the fake scontrol on PATH


class FakeSlurm:
    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.log = tmp_path / "scontrol.calls"
        self.state = tmp_path / "scontrol.state.json"
        monkeypatch.setenv("FAKE_SCONTROL_LOG", str(self.log))
        monkeypatch.setenv("FAKE_SCONTROL_STATE", str(self.state))
        monkeypatch.setenv("PATH", f"{FAKES}{os.pathsep}{os.environ.get('PATH', os.defpath)}")
        assert shutil.which("scontrol") == str(FAKES / "scontrol")  # never a real one
        self.world: dict = {"nodes": {NODE: {"state": "IDLE", "reason": ""}}}
        self.save()

    def save(self) -> None:
        self.state.write_text(json.dumps(self.world))

    def set_node(self, state: str, reason: str = "", user: str = "root") -> None:
        self.world = json.loads(self.state.read_text())
        self.world["nodes"][NODE] = {"state": state, "reason": reason, "reason_user": user}
        self.save()

    def node(self) -> dict:
        return json.loads(self.state.read_text())["nodes"][NODE]

    def set(self, key: str, value: dict) -> None:
        self.world = json.loads(self.state.read_text())
        self.world[key] = value
        self.save()

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [json.loads(line)["argv"] for line in self.log.read_text().splitlines()]

    def updates(self) -> list[list[str]]:
        return [c for c in self.calls() if c[0] == "update"]


@pytest.fixture
def fake(tmp_path, monkeypatch):
    return FakeSlurm(tmp_path, monkeypatch)


def settings(tmp_path, **kw) -> Settings:
    return Settings(**{"node": NODE, "drain": True, "resume": True, "resume_after": 600, "min_interval": 300,
                       "state_file": str(tmp_path / "state" / "check-state.json"), **kw})


def memory(tmp_path) -> dict:
    return json.loads((tmp_path / "state" / "check-state.json").read_text())


def test_critical_drains_through_scontrol_and_logs_it(tmp_path, fake):
    with capture_logs() as events:
        outcome = drain.enforce(CRITICAL, settings(tmp_path), now=T0)
    reason = "gpuwatch: GPU 1 ecc_uncorrectable: 2 uncorrectable ECC errors since the last driver load or GPU reset"
    assert fake.calls() == [["show", "node", NODE],
                            ["update", f"NodeName={NODE}", "State=DRAIN", f"Reason={reason}"]]
    assert fake.node()["state"] == "IDLE+DRAIN" and fake.node()["reason"] == reason
    assert outcome.performed and outcome.verdict.exit_code == 1
    assert outcome.lines == (f"gpuwatch: drained node {NODE} (Reason={reason})",)
    drained = [e for e in events if e["event"] == "slurm_drain"]
    assert len(drained) == 1
    assert {k: drained[0][k] for k in ("node", "action", "reason", "dry_run", "log_level")} == {
        "node": NODE, "action": "drain", "reason": reason, "dry_run": False, "log_level": "warning"}
    assert memory(tmp_path)["last_action"] == T0 and memory(tmp_path)["last_action_kind"] == "drain"
    assert memory(tmp_path)["healthy_since"] is None

    # the next run sees its own drain and leaves it (a debug event says so)
    with capture_logs() as events:
        again = drain.enforce(CRITICAL, settings(tmp_path), now=T0 + 300)
    assert len(fake.updates()) == 1 and not again.performed and again.lines == ()
    [quiet] = [e for e in events if e["event"] == "slurm_no_action"]
    assert (quiet["log_level"], quiet["decision"], quiet["action"], quiet["reason"]) == (
        "debug", "already_drained_by_gpuwatch", "none", reason)


def test_dry_run_reads_the_node_but_never_updates_it(tmp_path, fake):
    with capture_logs() as events:
        outcome = drain.enforce(CRITICAL, settings(tmp_path, dry_run=True), now=T0)
    assert fake.calls() == [["show", "node", NODE]]
    assert fake.node() == {"state": "IDLE", "reason": ""}
    assert not outcome.performed and outcome.action.action == "drain"
    assert outcome.lines[0].startswith(f"gpuwatch: DRY RUN: would drain node {NODE} (Reason=gpuwatch: GPU 1 ")
    [event] = [e for e in events if e["event"] == "slurm_drain"]
    assert event["dry_run"] is True and event["node"] == NODE
    assert not (tmp_path / "state" / "check-state.json").exists()  # nothing was done, nothing to remember

    fake.set_node("IDLE+DRAIN", OURS.reason)
    drain.enforce(HEALTHY, settings(tmp_path, dry_run=True), now=T0)
    assert memory(tmp_path)["healthy_since"] == T0  # observations are kept, so a dry run shows a resume too
    out = drain.enforce(HEALTHY, settings(tmp_path, dry_run=True), now=T0 + 600)
    assert out.lines == (f"gpuwatch: DRY RUN: would resume node {NODE} (Reason={OURS.reason})",)
    assert fake.updates() == [] and memory(tmp_path)["last_action"] is None


def test_a_full_cycle_drain_then_resume_after_the_healthy_time(tmp_path, fake):
    s = settings(tmp_path)
    drain.enforce(CRITICAL, s, now=T0)
    assert fake.node()["state"] == "IDLE+DRAIN"
    for t in (T0 + 300, T0 + 600, T0 + 899):  # healthy from T0 + 300 on; not yet 600 s
        out = drain.enforce(HEALTHY, s, now=t)
        assert out.action.decision == "healthy_too_short" and out.lines == ()
    assert memory(tmp_path)["healthy_since"] == T0 + 300
    assert fake.calls()[2:] == []  # while too short, Slurm is not even asked
    with capture_logs() as events:
        out = drain.enforce(HEALTHY, s, now=T0 + 900)
    assert out.performed and fake.updates()[-1] == ["update", f"NodeName={NODE}", "State=RESUME"]
    assert fake.node() == {"state": "IDLE", "reason": "", "reason_user": "root"}
    assert out.lines[0].startswith(f"gpuwatch: resumed node {NODE} (Reason=gpuwatch: GPU 1 ecc_uncorrectable")
    [event] = [e for e in events if e["event"] == "slurm_resume"]
    assert (event["action"], event["dry_run"], event["log_level"]) == ("resume", False, "info")
    assert event["reason"].startswith("gpuwatch: ")
    assert memory(tmp_path)["last_action_kind"] == "resume"


def test_a_critical_check_in_between_restarts_the_healthy_time(tmp_path, fake):
    s = settings(tmp_path)
    fake.set_node("IDLE+DRAIN", OURS.reason)
    drain.enforce(HEALTHY, s, now=T0)
    drain.enforce(CRITICAL, s, now=T0 + 300)
    drain.enforce(HEALTHY, s, now=T0 + 600)
    assert drain.enforce(HEALTHY, s, now=T0 + 900).action.decision == "healthy_too_short"
    assert drain.enforce(HEALTHY, s, now=T0 + 1200).performed


def test_an_operators_drain_is_never_touched(tmp_path, fake):
    fake.set_node("MIXED+DRAIN", OPERATOR.reason, user="alice")
    s = settings(tmp_path)
    assert drain.enforce(CRITICAL, s, now=T0).action.decision == "already_drained_by_other"
    for t in range(0, 7200, 300):
        assert drain.enforce(HEALTHY, s, now=T0 + 300 + t).action.action == "none"
    assert fake.updates() == []
    assert fake.node()["reason"] == OPERATOR.reason


def test_the_rate_limit_survives_between_runs(tmp_path, fake):
    s = settings(tmp_path)
    drain.enforce(CRITICAL, s, now=T0)
    fake.set_node("IDLE")  # an operator resumed it by hand, the GPU is still bad
    with capture_logs() as events:
        out = drain.enforce(CRITICAL, s, now=T0 + 60)
    assert out.action.decision == "rate_limited" and len(fake.updates()) == 1
    assert out.lines == (f"gpuwatch: WARNING: node {NODE}: would drain, but the last action was 60 s ago "
                         "(--min-interval 300 s)",)
    [event] = [e for e in events if e["event"] == "slurm_no_action"]
    assert event["log_level"] == "warning" and event["decision"] == "rate_limited"
    assert drain.enforce(CRITICAL, s, now=T0 + 300).performed and len(fake.updates()) == 2


def test_cannot_tell_asks_slurm_nothing(tmp_path, fake):
    fake.set_node("IDLE+DRAIN", OURS.reason)
    for doc in (None, document(anomaly(), up=False), document(anomaly(), fresh=False)):
        out = drain.enforce(doc, settings(tmp_path), now=T0 + 86400)
        assert out.verdict.exit_code == 2 and out.action.decision == "cannot_tell" and out.lines == ()
    assert fake.calls() == []


def test_scontrol_failures_are_an_error_line_and_leave_the_verdict(tmp_path, fake):
    fake.set("fail", {"update": [1, "slurm_update error: Invalid user id"]})
    with capture_logs() as events:
        out = drain.enforce(CRITICAL, settings(tmp_path), now=T0)
    assert not out.performed and out.verdict.exit_code == 1
    assert out.lines == (f"gpuwatch: ERROR: cannot drain node {NODE}: `scontrol update NodeName={NODE}` exited "
                         "with 1: slurm_update error: Invalid user id",)
    [event] = [e for e in events if e["event"] == "slurm_action_failed"]
    assert (event["node"], event["action"], event["dry_run"], event["log_level"]) == (NODE, "drain", False, "error")
    assert memory(tmp_path)["last_action"] == T0  # an attempt counts for the rate limit

    fake.set("fail", {"show": [1, f"Node {NODE} not found"]})
    out = drain.enforce(CRITICAL, settings(tmp_path), now=T0 + 600)
    assert out.lines == (f"gpuwatch: ERROR: cannot read the Slurm state of node {NODE}: `scontrol show node` "
                         f"exited with 1: Node {NODE} not found",)


def test_a_hanging_scontrol_is_cut_off_within_the_budget(tmp_path, fake):
    fake.set("sleep", {"show": 30})
    out = drain.enforce(CRITICAL, settings(tmp_path, timeout=0.5), now=T0)
    assert out.lines == (f"gpuwatch: ERROR: cannot read the Slurm state of node {NODE}: `scontrol show node` "
                         "did not finish within the 0.5 s allowed for scontrol (slurmctld not answering?)",)
    assert out.verdict.exit_code == 1 and not out.performed


def test_scontrol_missing_from_path(tmp_path, fake, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    out = drain.enforce(CRITICAL, settings(tmp_path), now=T0)
    assert "scontrol not found on PATH" in out.lines[0] and "wrapper" in out.lines[0]


def test_an_unwritable_state_file_is_a_clear_warning_and_drain_still_works(tmp_path, fake):
    (tmp_path / "file").write_text("not a directory")
    s = settings(tmp_path, state_file=str(tmp_path / "file" / "check-state.json"))
    out = drain.enforce(CRITICAL, s, now=T0)
    assert out.performed
    assert out.lines[-1].startswith(f"gpuwatch: WARNING: cannot write the state file {s.state_file}: ")
    assert "--state-file" in out.lines[-1]


def test_a_corrupt_state_file_is_a_fresh_start(tmp_path, fake):
    path = tmp_path / "state" / "check-state.json"
    path.parent.mkdir()
    path.write_text("{not json")
    out = drain.enforce(HEALTHY, settings(tmp_path), now=T0)
    assert out.lines[0].startswith(f"gpuwatch: WARNING: cannot read the state file {path}")
    assert memory(tmp_path)["healthy_since"] == T0 and memory(tmp_path)["version"] == 1
    assert [p.name for p in path.parent.iterdir()] == ["check-state.json"]  # no temporary file left


def test_hostile_summaries_reach_scontrol_as_one_clean_argument(tmp_path, fake):
    doc = document(anomaly("xid_critical", "0", summary='GPU 0 "; scontrol delete" Reason=x\nState=DOWN [a@b]'))
    drain.enforce(doc, settings(tmp_path), now=T0)
    [update] = fake.updates()
    assert update[:3] == ["update", f"NodeName={NODE}", "State=DRAIN"] and len(update) == 4
    assert update[3] == "Reason=gpuwatch: GPU 0 xid_critical: ; scontrol delete Reason=x State=DOWN a@b"
    assert fake.node()["state"] == "IDLE+DRAIN"


# ------------------------------------------------------------------------------------------------
# against the real daemon


def fetch_status(d: Daemon) -> dict:
    with urllib.request.urlopen(d.base + "/api/v1/status", timeout=5) as response:
        return json.load(response)


def check_exit_code(address: str, env: dict) -> int:
    return subprocess.run([sys.executable, "-m", "gpuwatch", "check", "--web.listen-address", address],
                          capture_output=True, text=True, timeout=30, env=env).returncode


@pytest.mark.daemon
def test_a_real_daemon_with_an_ecc_fault_drains_the_node(tmp_path, fake):
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    env = fake_env(fx)
    d = Daemon(tmp_path, env)
    address = d.base.removeprefix("http://")
    s = settings(tmp_path)
    try:
        d.wait_value("gpuwatch_poll_success", 1, tier="slow")
        healthy = drain.enforce(fetch_status(d), s)
        assert healthy.verdict.exit_code == 0 == check_exit_code(address, env)
        assert fake.calls() == []  # healthy, nothing drained: Slurm is not asked
        node.gpus[1].ecc_errors = {(0, 0): 0, (1, 0): 2, (0, 1): 0, (1, 1): 2}
        fx.write(node)
        status = wait_for(lambda: (doc := fetch_status(d))["status"] == "critical" and doc, what="critical status")
        out = drain.enforce(status, s)
        assert out.verdict.exit_code == 1 == check_exit_code(address, env)
    finally:
        d.stop()
    assert out.performed
    [update] = fake.updates()
    assert update[:3] == ["update", f"NodeName={NODE}", "State=DRAIN"]
    assert update[3].startswith("Reason=gpuwatch: GPU 1 ecc_uncorrectable: 2 uncorrectable ECC errors")
    assert fake.node()["state"] == "IDLE+DRAIN" and fake.node()["reason"] == update[3].removeprefix("Reason=")


@pytest.mark.daemon
def test_a_daemon_with_its_backend_down_or_gone_drains_nothing(tmp_path, fake):
    node = fakenvml.FakeNode.h200(1)
    node.init_error = 9  # NVML_ERROR_DRIVER_NOT_LOADED
    fx = fakenvml.prepare(tmp_path, node)
    env = fake_env(fx)
    d = Daemon(tmp_path, env)
    address = d.base.removeprefix("http://")
    try:
        doc = fetch_status(d)
        out = drain.enforce(doc, settings(tmp_path))
        assert out.verdict.status == "unknown" and out.verdict.exit_code == 2 == check_exit_code(address, env)
    finally:
        d.stop()
    out = drain.enforce(None, settings(tmp_path))  # the daemon is gone: nothing could be read
    assert out.verdict.exit_code == 2 == check_exit_code(address, env)
    assert fake.calls() == []


@pytest.mark.daemon
def test_check_drain_resume_from_the_command_line(tmp_path, fake):
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    env = fake_env(fx)
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules: {ecc_uncorrectable: {clear: 0}}\n")  # resolve at the first clean reading
    d = Daemon(tmp_path, env, args=["--config", str(config)])
    state = tmp_path / "state" / "check-state.json"
    env = {**env, "PATH": os.environ["PATH"], "FAKE_SCONTROL_LOG": str(fake.log),
           "FAKE_SCONTROL_STATE": str(fake.state)}

    def check(*extra):
        argv = [sys.executable, "-m", "gpuwatch", "check", "--web.listen-address", d.base.removeprefix("http://"),
                "--drain", "--resume", "--node", NODE, "--state-file", str(state), "--log.format", "json", *extra]
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
        return result.returncode, result.stdout, [json.loads(line) for line in result.stderr.splitlines()
                                                  if line.startswith("{")]

    try:
        d.wait_value("gpuwatch_poll_success", 1, tier="slow")
        assert check()[:2] == (0, "gpuwatch: OK (2 GPUs)\n") and fake.calls() == []
        node.gpus[1].ecc_errors = {(0, 0): 0, (1, 0): 2, (0, 1): 0, (1, 1): 2}
        fx.write(node)
        d.wait_value("gpuwatch_anomaly", 1, gpu="1", uuid=node.gpus[1].uuid, rule="ecc_uncorrectable",
                     severity="critical")
        rc, out, events = check("--dry-run")
        assert rc == 1 and fake.updates() == []
        assert out.splitlines()[1].startswith(f"gpuwatch: DRY RUN: would drain node {NODE} (Reason=gpuwatch: GPU 1 ")
        rc, out, events = check()
        first, second = out.splitlines()
        assert rc == 1 and first.startswith("gpuwatch: CRITICAL: GPU 1 ecc_uncorrectable: ")
        assert second.startswith(f"gpuwatch: drained node {NODE} (Reason=gpuwatch: GPU 1 ecc_uncorrectable: ")
        [event] = [e for e in events if e["event"] == "slurm_drain"]
        assert (event["node"], event["action"], event["dry_run"]) == (NODE, "drain", False)
        assert fake.node()["state"] == "IDLE+DRAIN"
        # healthy again (GPU reset): resumed once healthy for --resume-after (0 here: at once)
        node.gpus[1].ecc_errors = {(0, 0): 0, (1, 0): 0, (0, 1): 0, (1, 1): 2}
        fx.write(node)
        d.wait_value("gpuwatch_anomaly", None, gpu="1", uuid=node.gpus[1].uuid, rule="ecc_uncorrectable",
                     severity="critical", timeout=30)  # cleared: healthy from the next look on
        assert check("--resume-after", "0", "--min-interval", "0")[0] == 0
        assert fake.node()["state"] == "IDLE" and fake.updates()[-1] == ["update", f"NodeName={NODE}", "State=RESUME"]
        rc, out, _ = check("--resume-after", "soon")
        assert (rc, out) == (78, "")
    finally:
        d.stop()


@pytest.mark.daemon
def test_a_driver_requested_reboot_drains_through_check_drain(tmp_path, fake):
    """The driver asks for a node reboot (field 230 = 2, with XID 154): recovery_action_required fires at the
    next slow poll (hold 0) and `gpuwatch check --drain` drains the node with a reason that names the action;
    the XID 154 itself fires nothing (it is informational: the action is the rule's)."""
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    env = fake_env(fx)
    d = Daemon(tmp_path, env)
    env = {**env, "PATH": os.environ["PATH"], "FAKE_SCONTROL_LOG": str(fake.log),
           "FAKE_SCONTROL_STATE": str(fake.state)}
    argv = [sys.executable, "-m", "gpuwatch", "check", "--web.listen-address", d.base.removeprefix("http://"),
            "--drain", "--node", NODE, "--state-file", str(tmp_path / "state" / "check-state.json")]
    try:
        d.wait_value("gpuwatch_gpu_feature_supported", 1, gpu="1", uuid=node.gpus[1].uuid, feature="recovery_action")
        assert d.value("gpuwatch_recovery_action", gpu="1", uuid=node.gpus[1].uuid) is None  # none: no series
        node.gpus[1].recovery_action = 2  # NVML_GPU_RECOVERY_ACTION_NODE_REBOOT
        node.add_xid(gpu=1, xid=154)
        fx.write(node)
        d.wait_value("gpuwatch_anomaly", 1, gpu="1", uuid=node.gpus[1].uuid, rule="recovery_action_required",
                     severity="critical")
        result = subprocess.run(argv, capture_output=True, text=True, timeout=30, env=env)
    finally:
        d.stop()
    reason = "gpuwatch: GPU 1 recovery_action_required: the driver asks for recovery action node_reboot: drain the " \
             "node and reboot it"
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.splitlines() == [
        "gpuwatch: CRITICAL: GPU 1 recovery_action_required: GPU 1 the driver asks for recovery action node_reboot: "
        "drain the node and reboot it",
        f"gpuwatch: drained node {NODE} (Reason={reason})"]
    assert fake.updates() == [["update", f"NodeName={NODE}", "State=DRAIN", f"Reason={reason}"]]
    assert fake.node()["state"] == "IDLE+DRAIN" and fake.node()["reason"] == reason


@pytest.mark.parametrize("text", ['{"healthy_since": 1' + "0" * 400 + ', "last_action": 5.0}',
                                  '{"healthy_since": NaN, "last_action": -Infinity}',
                                  '{"healthy_since": -1, "last_action": 1e300, "last_action_kind": 3}',
                                  '{"last_action": ' + "9" * 5000 + "}"])
def test_a_state_file_with_times_no_clock_gives_is_a_fresh_start(tmp_path, text):
    """Times of the state file are 0 or later and finite: a 400-digit number (float() overflowed), NaN or a
    negative time (json reads them) is forgotten, the rest of the file kept, never an exception."""
    from gpuwatch.drain import load_memory

    path = tmp_path / "state.json"
    path.write_text(text)
    memory, why = load_memory(str(path))
    assert memory.healthy_since is None and memory.last_action_kind is None
    assert memory.last_action in (None, 5.0)
    assert why is None or "cannot read the state file" in why
