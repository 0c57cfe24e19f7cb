"""The one scontrol runner (gpuwatch/scontrol.py), used by the allocation reader and the drain command."""

import json
import os
import stat
import sys

import pytest
from fakehost import slurm_v2_job
from structlog.testing import capture_logs

from gpuwatch import scontrol
from gpuwatch.clock import FakeClock
from gpuwatch.hostside import cgroups
from gpuwatch.hostside.slurm_allocations import SlurmAllocations
from gpuwatch.model import GpuState
from gpuwatch.scontrol import ScontrolError
from gpuwatch.testing import identity


def fake(tmp_path, body):
    path = tmp_path / "scontrol"
    path.write_text(f"#!{sys.executable}\nimport os, sys, time\n{body}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_runs_an_argv_in_the_c_locale_with_stdin_closed(tmp_path, monkeypatch):
    monkeypatch.setenv("LC_ALL", "de_DE.UTF-8")
    command = fake(tmp_path, "print(os.environ['LC_ALL'], sys.argv[1:], sys.stdin.read() == '')")
    assert scontrol.run(command, ["show", "node", "gpu 01; rm -rf /"], 5.0) == (
        "C ['show', 'node', 'gpu 01; rm -rf /'] True\n")


def test_bytes_that_are_not_utf8_are_characters_not_an_exception(tmp_path):
    command = fake(tmp_path, "sys.stdout.buffer.write(b'Reason=caf\\xe9\\n')")
    assert scontrol.run(command, [], 5.0) == "Reason=caf\ufffd\n"


def test_a_failure_says_its_kind(tmp_path):
    command = fake(tmp_path, "sys.stderr.write('slurm_load_node error:\\n  Invalid node name\\n'); sys.exit(1)")
    with pytest.raises(ScontrolError) as failed:
        scontrol.run(command, ["show", "node", "x"], 5.0)
    assert (failed.value.kind, failed.value.code, failed.value.said) == (
        scontrol.EXITED, 1, "slurm_load_node error: Invalid node name")
    assert str(failed.value) == f"`{command} show node` exited with 1: slurm_load_node error: Invalid node name"
    with pytest.raises(ScontrolError) as failed:
        scontrol.run(str(tmp_path / "nowhere"), [], 5.0)
    assert failed.value.kind == scontrol.MISSING and "not found on PATH" in str(failed.value)
    plain = tmp_path / "plain"
    plain.write_text("not a program")
    with pytest.raises(ScontrolError) as failed:
        scontrol.run(str(plain), [], 5.0)
    assert failed.value.kind == scontrol.UNRUNNABLE and str(failed.value).startswith(f"cannot run {plain}: ")


def test_a_hung_scontrol_is_killed_at_its_timeout(tmp_path):
    command = fake(tmp_path, "time.sleep(60)")
    with pytest.raises(ScontrolError) as failed:
        scontrol.run(command, ["show", "job", "1"], 0.3)
    assert failed.value.kind == scontrol.TIMEOUT and "did not finish within 0.3 s" in str(failed.value)
    assert os.path.exists(command)


# -- the allocation reader's use of it (gpuwatch/hostside/slurm_allocations.py) -------------------------------

def job_answers(tmp_path, answers):
    """A fake scontrol answering ``show job --details --oneliner ID`` with ``answers[ID]`` (rewritable: a
    JSON file next to it) and "Invalid job id" for others; each call's job id appended to a calls file."""
    state, calls = tmp_path / "answers.json", tmp_path / "calls"
    state.write_text(json.dumps(answers))
    command = fake(tmp_path, f"open({str(calls)!r}, 'a').write(sys.argv[-1] + '\\n')\n"
                             f"import json; answers = json.load(open({str(state)!r}))\n"
                             "if sys.argv[-1] not in answers:\n"
                             "    sys.exit('slurm_load_jobs error: Invalid job id specified')\n"
                             "print(answers[sys.argv[-1]])")

    def asked():
        return calls.read_text().split() if calls.exists() else []
    return command, state, asked


def record(job, node="gpu07", idx="1"):
    return (f"JobId={job} UserId=bob(1001) NodeList={node} Nodes={node} CPU_IDs=0-7 Mem=1 "
            f"GRES=gpu:a100:1(IDX:{idx}) MinCPUsNode=1")


def reader(command, clock, errors, backoff=60):
    return SlurmAllocations({"node-name": "gpu07", "scontrol": command, "scontrol-timeout": 5,
                             "scontrol-backoff": backoff}, None, clock.monotonic, errors,
                            user_name=lambda uid: str(uid))


def gpus(n=4):
    return [GpuState(identity(i, minor_number=i), {}, True) for i in range(n)]


def test_one_jobs_bad_answer_stays_with_that_job(tmp_path):
    """Job 41's answer is garbage and job 43's names another node: they are asked again once per backoff,
    each logged once (no scontrol_recovered/failed pair per period), and job 42 next to them is resolved
    at the first read. They used to back scontrol off for every job: 42 was never asked."""
    command, state, asked = job_answers(tmp_path, {"41": "slurm_load_jobs error: something odd \x01",
                                                   "42": record(42), "43": record(43, node="gpu08")})
    root = tmp_path / "cgroup"
    for job in (41, 42, 43):
        slurm_v2_job(root, job, [])
    clock, errors = FakeClock(), []
    with capture_logs() as events:
        slurm = reader(command, clock, errors)
        for period in range(4):
            errors.clear()
            allocations, complete = slurm.read(cgroups.scan(root), gpus())
            assert [(a.job_id, a.uuid) for a in allocations] == [("42", identity(1).uuid)] and not complete
            assert sorted(errors) == [("slurm", "scontrol_node_unknown"), ("slurm", "scontrol_unparsable")]
            clock.advance(30)  # within the backoff: neither is asked again, nor counted
            errors.clear()
            assert slurm.read(cgroups.scan(root), gpus())[1] is False and errors == []
            assert asked() == ["41", "42", "43"] + ["41", "43"] * period
            clock.advance(31)
    warnings = [(e["event"], e["job_id"]) for e in events if e["log_level"] == "warning"]
    assert warnings == [("scontrol_unparsable", "41"), ("scontrol_node_unknown", "43")]
    assert not [e for e in events if e["event"] == "scontrol_recovered"]
    unparsable = next(e for e in events if e["event"] == "scontrol_unparsable")
    assert "'slurm_load_jobs error: something odd \\x01'" in unparsable["error_detail"]

    state.write_text(json.dumps({"41": record(41, idx="0"), "42": record(42), "43": record(43, idx="2")}))
    errors.clear()
    allocations, complete = slurm.read(cgroups.scan(root), gpus())  # fixed: resolved at its next try
    assert {(a.job_id, a.uuid) for a in allocations} == {(str(41 + i), identity(i).uuid) for i in range(3)}
    assert complete and errors == []
    clock.advance(61)
    assert slurm.read(cgroups.scan(root), gpus())[1] and len(asked()) == 3 + 2 * 4  # cached for their life


def test_a_bad_job_waits_its_own_backoff_and_a_failing_scontrol_still_backs_off_every_job(tmp_path):
    command, state, asked = job_answers(tmp_path, {"41": "garbage", "42": record(42)})
    root = tmp_path / "cgroup"
    slurm_v2_job(root, 41, [])
    clock, errors = FakeClock(), []
    slurm = reader(command, clock, errors)
    assert slurm.read(cgroups.scan(root), gpus()) == ((), False) and asked() == ["41"]
    clock.advance(10)
    slurm_v2_job(root, 42, [])  # a job that starts while 41 waits is asked at once
    allocations, complete = slurm.read(cgroups.scan(root), gpus())
    assert [a.job_id for a in allocations] == ["42"] and not complete and asked() == ["41", "42"]
    # scontrol itself fails (slurmctld down): that is every job's problem, one call per backoff
    fail = tmp_path / "down"
    fail.write_text(f"#!{sys.executable}\nimport sys\n"
                    "sys.exit('slurm_load_jobs error: Unable to contact slurm controller (connect failure)')\n")
    fail.chmod(0o755)
    slurm_v2_job(root, 43, [])
    slurm_v2_job(root, 44, [])
    errors.clear()
    down = reader(str(fail), clock, errors)
    assert down.read(cgroups.scan(root), gpus()) == ((), False) and errors == [("slurm", "scontrol_failed")]
    errors.clear()
    clock.advance(30)
    assert down.read(cgroups.scan(root), gpus()) == ((), False) and errors == []


def test_a_wrong_node_name_costs_one_call_a_backoff_and_bad_answers_never_hold_back_a_good_job(tmp_path):
    """Every job is asked at once, whatever the others answered: bad answers (here: no part on this node)
    never hold back a good job. While no job has been found on this node (a wrong --collector.slurm.node-name
    answers every job so), only one of the jobs that answered badly is asked again a backoff, the longest
    waiting first: one call, not one per job. A left-over job's "Invalid job id" proves nothing. Each bad job
    is logged once (an hour), without a recovered/failed pair per backoff."""
    command, state, asked = job_answers(tmp_path, {str(j): record(j, node="gpu08") for j in (41, 42, 43)})
    root = tmp_path / "cgroup"
    for job in (40, 41, 42, 43):  # 40 ended: scontrol says "Invalid job id"
        slurm_v2_job(root, job, [])
    clock, errors = FakeClock(), []
    with capture_logs() as events:
        slurm = reader(command, clock, errors)
        for _ in range(4):
            assert slurm.read(cgroups.scan(root), gpus()) == ((), False)
            clock.advance(61)
    assert asked() == ["40", "41", "42", "43", "41", "42", "43"]  # all at once, then one a backoff
    warnings = [(e["event"], e.get("job_id")) for e in events if e["log_level"] == "warning"]
    assert warnings == [("scontrol_node_unknown", str(j)) for j in (41, 42, 43)]
    assert not [e for e in events if e["event"] == "scontrol_recovered"]

    (tmp_path / "calls").unlink()
    state.write_text(json.dumps({**{str(j): record(j, node="gpu08") for j in (41, 42, 43)}, "44": record(44)}))
    slurm_v2_job(root, 44, [])
    slurm = reader(command, clock, errors)  # the node name right, three odd jobs scanned before the good one
    allocations, complete = slurm.read(cgroups.scan(root), gpus())
    assert [a.job_id for a in allocations] == ["44"] and not complete  # at the first read
    assert asked() == ["40", "41", "42", "43", "44"]
    clock.advance(61)
    slurm.read(cgroups.scan(root), gpus())
    assert asked()[5:] == ["41", "42", "43"]  # the node name known right: each odd job on its own backoff
