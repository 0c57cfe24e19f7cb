import fakenvml
import pytest
from daemon import Daemon, fake_env

from gpuwatch import logs


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
