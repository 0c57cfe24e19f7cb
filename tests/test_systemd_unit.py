"""The shipped unit passes systemd's own analyzers: `verify` silent, `security` exposure <= 2.0."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[1] / "deploy" / "systemd" / "gpuwatch.service"



@pytest.fixture(autouse=True)
def _need_systemd_analyze():
    if shutil.which("systemd-analyze") is None:
        pytest.fail("systemd-analyze is missing: scripts/test installs it (Debian package systemd)")


def unit_copy(tmp_path):
    """The unit with ExecStart pointing at the gpuwatch of this environment (verify needs it to exist)."""
    gpuwatch = Path(sys.executable).with_name("gpuwatch")
    assert gpuwatch.exists()
    text = UNIT.read_text().replace("/opt/gpuwatch/bin/gpuwatch", str(gpuwatch))
    path = tmp_path / "gpuwatch.service"
    path.write_text(text)
    return path


def test_systemd_analyze_verify_prints_nothing(tmp_path):
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit_copy(tmp_path))],
                            capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stdout == "" and result.stderr == "", result.stdout + result.stderr


def test_security_exposure_is_two_or_better(tmp_path):
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", str(unit_copy(tmp_path))],
                            capture_output=True, text=True)
    match = re.search(r"Overall exposure level for gpuwatch.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 2.0, result.stdout


def test_unit_runs_without_root_and_stops_restart_loops_on_bad_config():
    text = UNIT.read_text()
    for line in ("Type=notify", "DynamicUser=yes", "CapabilityBoundingSet=", "DevicePolicy=closed",
                 "ProtectSystem=strict", "Restart=on-failure", "RestartPreventExitStatus=78", "WatchdogSec=60s",
                 "SystemCallFilter=@system-service"):
        assert re.search(rf"^{re.escape(line)}$", text, re.M), line
