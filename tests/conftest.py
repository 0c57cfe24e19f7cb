import os
import subprocess
import sys

import fakenvml
import pytest
from daemon import Daemon, fake_env
from inproc import InProc

from gpuwatch import logs

# The fakes that are Python scripts (tests/fakes/scontrol, ...) start as `#!/usr/bin/env python3`: this
# interpreter's directory first on PATH, as in an activated virtualenv, so that they start in a tenth of
# the time a version manager's shim takes (pyenv's is a shell script).
os.environ["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")])

# What the markers mean (pyproject.toml registers them): a test that starts one of these programs must
# carry the marker, or it fails here; the inner loop is `pytest -m "not daemon and not stack"`.
STACK_PROGRAMS = {"prometheus", "promtool", "prometheus-alertmanager", "alertmanager", "amtool",
                  "victoria-metrics", "vmalert", "vmagent"}
_current: list[pytest.Item] = []


def _started_marker(argv) -> str | None:
    """"daemon" when ``argv`` runs gpuwatch (its command or ``python -m gpuwatch``), "stack" when it is
    Prometheus, Alertmanager or promtool; None otherwise."""
    if isinstance(argv, (str, bytes, os.PathLike)):
        argv = [argv]
    words = [os.fsdecode(a) for a in argv]
    if not words:
        return None
    if os.path.basename(words[0]) in STACK_PROGRAMS:
        return "stack"
    if os.path.basename(words[0]) == "gpuwatch" or any(
            a == "-m" and b in ("gpuwatch", "gpuwatch.cli") for a, b in zip(words, words[1:])):
        return "daemon"
    return None


_popen_init = subprocess.Popen.__init__


def _checked_popen_init(self, args, *rest, **kwargs):
    marker = _started_marker(args)
    if marker is not None and _current:
        item = _current[-1]
        if item.get_closest_marker(marker) is None:
            raise AssertionError(f"{item.nodeid} starts {os.fsdecode(args[0] if isinstance(args, list) else args)} "
                                 f"but is not marked {marker!r} (pytest.mark.{marker}: see pyproject.toml)")
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _checked_popen_init


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.append(item)
    try:
        yield
    finally:
        _current.pop()


@pytest.fixture(autouse=True)
def _quiet_logs(capsys):
    """Logs go to stderr as JSON lines in tests, like under journald."""
    logs.configure("debug", "json")
    yield


@pytest.fixture()
def start(tmp_path):
    """start(node, old_driver=False, args=None): `gpuwatch run` over a fake node (``daemon.fx`` is its
    FakeNvmlEnv, to rewrite the node or read the call counts); stopped at the end of the test."""
    daemons = []

    def start(node, old_driver=False, args=None):
        fx = fakenvml.prepare(tmp_path, node, old_driver=old_driver)
        daemon = Daemon(tmp_path, fake_env(fx), args)
        daemon.fx = fx
        daemons.append(daemon)
        return daemon

    yield start
    for daemon in daemons:
        daemon.stop()


@pytest.fixture()
def inproc(tmp_path):
    """inproc(node=None, old_driver=False, args=None, backend=None, clock=None): the agent in-process on
    simulated time (inproc.InProc), over a fake NVML node in a child process or the backend given; the
    same reading API as ``start``'s daemons (``wait_value`` advances simulated time). Closed at the end."""
    made = []

    def make(node=None, old_driver=False, args=None, backend=None, clock=None, environ=None, nvml_env=None):
        agent = InProc(tmp_path / f"inproc{len(made)}", node, old_driver, args, backend, clock, environ, nvml_env)
        made.append(agent)
        return agent

    yield make
    for agent in made:
        agent.stop()


@pytest.fixture()
def interned(monkeypatch):
    """``interned()`` starts counting: it returns the list of strings ``sys.intern`` adds to the interpreter's
    table from then on (one already there is not added). pathlib interns every part of every Path it makes."""
    def start() -> list[str]:
        added: list[str] = []
        real = sys.intern

        def counting(text: str) -> str:
            kept = real(text)
            if kept is text:  # not interned before: an insertion into the table
                added.append(text)
            return kept

        monkeypatch.setattr(sys, "intern", counting)
        return added
    return start
