"""`gpuwatch check` against a running daemon: 0 healthy, 1 critical anomaly, 2 cannot tell."""

import os
import subprocess
import sys

import fakenvml
import pytest
from daemon import Daemon, fake_env

pytestmark = pytest.mark.daemon  # `gpuwatch check` against a real daemon: exit codes


def check(d_or_address, env=None):
    address = d_or_address if isinstance(d_or_address, str) else d_or_address.base.removeprefix("http://")
    env = env or {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "check", "--web.listen-address", address],
                            capture_output=True, text=True, timeout=30, env=env)
    return result.returncode, result.stdout


def test_check_reports_ok_then_a_critical_anomaly(tmp_path):
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    d = Daemon(tmp_path, fake_env(fx))
    try:
        d.wait_value("gpuwatch_poll_success", 1, tier="slow")
        assert check(d) == (0, "gpuwatch: OK (2 GPUs)\n")
        node.gpus[1].ecc_errors = {(0, 0): 0, (1, 0): 3, (0, 1): 0, (1, 1): 3}
        fx.write(node)
        d.wait_value("gpuwatch_anomaly", 1, gpu="1", uuid=node.gpus[1].uuid, rule="ecc_uncorrectable",
                     severity="critical")
        rc, out = check(d)
        assert rc == 1
        assert out.startswith("gpuwatch: CRITICAL: GPU 1 ecc_uncorrectable: ")
    finally:
        d.stop()


def test_check_cannot_tell_when_the_backend_is_down_or_the_daemon_is_gone(tmp_path):
    node = fakenvml.FakeNode.h200(1)
    node.init_error = 9
    fx = fakenvml.prepare(tmp_path, node)
    d = Daemon(tmp_path, fake_env(fx))
    address = d.base.removeprefix("http://")
    try:
        rc, out = check(d)
        assert rc == 2 and out.startswith("gpuwatch: UNKNOWN: backend nvml down: NVML: Driver Not Loaded")
    finally:
        d.stop()
    rc, out = check(address)
    assert rc == 2 and "cannot read the daemon's status" in out and "systemctl status gpuwatch" in out


@pytest.mark.parametrize("document,why", [
    ([], "a JSON list, not an object"),
    ("ok", "a JSON str, not an object"),
    ({"status": "ok"}, "no list of gpus"),
    ({"status": "ok", "gpus": [], "anomalies": [1]}, "an anomaly without severity, rule and summary"),
    ({"status": "critical", "gpus": [], "anomalies": [{"severity": "critical", "rule": "x"}]},
     "an anomaly without severity"),
    ({"status": "ok", "gpus": [], "anomalies": {}}, "anomalies is not a list"),
    ({"status": "stale", "backend": "up"}, "backend is not an object"),
    ({"status": "stale", "backend": {"up": True}, "polls": []}, "polls is not an object"),
])
def test_an_answer_that_is_not_a_status_document_is_unknown(document, why):
    """Another program on the port, a proxy's page: UNKNOWN (exit 2) for check and the drain logic alike,
    not a traceback (exit 1, which is the check's CRITICAL)."""
    from gpuwatch.status import verdict

    v = verdict(document)
    assert (v.status, v.exit_code) == ("unknown", 2)
    assert v.detail == f"the answer is not gpuwatch's status document: {why}" or why in v.detail
