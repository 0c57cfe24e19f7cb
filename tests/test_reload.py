"""SIGHUP reloads rule settings without a gap in /metrics; a bad file keeps the old settings."""

import os
import signal

import pytest
from daemon import Daemon, wait_for

pytestmark = pytest.mark.daemon  # SIGHUP reaches the real process


def test_sighup_applies_rule_settings_and_survives_a_bad_file(tmp_path):
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules:\n  power_capped:\n    enabled: true\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    d = Daemon(tmp_path, env, ["--config", str(config), "--backend", "simulated", "--sim.gpus", "2"])
    try:
        onsets = ("gpuwatch_anomaly_onsets_total", (("rule", "power_capped"),))  # one per enabled rule
        wait_for(lambda: onsets in d.metrics())
        config.write_text("rules:\n  power_capped:\n    enabled: false\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: [e for e in d.events() if e["event"] == "reloaded"])
        wait_for(lambda: onsets not in d.metrics())
        config.write_text("rules:\n  power_capped:\n    enabled: maybe\n")
        d.proc.send_signal(signal.SIGHUP)
        failed = wait_for(lambda: [e for e in d.events() if e["event"] == "reload_failed"])
        assert "rules.power_capped.enabled: expected true or false" in failed[0]["error"]
        assert d.proc.poll() is None and d.get("/metrics")[0] == 200
    finally:
        assert d.stop() == 0
