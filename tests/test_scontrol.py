"""The one scontrol runner (gpuwatch/scontrol.py), used by the allocation reader and the drain command."""

import os
import stat
import sys

import pytest

from gpuwatch import scontrol
from gpuwatch.scontrol import ScontrolError


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
