"""SIGHUP reloads rule settings without a gap in /metrics; a bad file keeps the old settings."""

import os
import signal

from daemon import Daemon, wait_for


def test_sighup_applies_rule_settings_and_survives_a_bad_file(tmp_path):
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules:\n  power_capped:\n    enabled: true\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    d = Daemon(tmp_path, env, ["--config", str(config), "--backend", "simulated", "--sim.gpus", "2"])
    try:
        wait_for(lambda: [k for k in d.metrics() if k[0] == "gpuwatch_anomaly" and ("rule", "power_capped") in k[1]])
        config.write_text("rules:\n  power_capped:\n    enabled: false\n")
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: [e for e in d.events() if e["event"] == "reloaded"])
        wait_for(lambda: not [k for k in d.metrics() if k[0] == "gpuwatch_anomaly" and ("rule", "power_capped") in k[1]])
        config.write_text("rules:\n  power_capped:\n    enabled: maybe\n")
        d.proc.send_signal(signal.SIGHUP)
        failed = wait_for(lambda: [e for e in d.events() if e["event"] == "reload_failed"])
        assert "rules.power_capped.enabled: expected true or false" in failed[0]["error"]
        assert d.proc.poll() is None and d.get("/metrics")[0] == 200
    finally:
        assert d.stop() == 0
