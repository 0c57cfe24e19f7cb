"""`gpuwatch demo`, the README's first command: a complete, contract-conform /metrics for 8 GPUs."""

import os
import shutil
import subprocess

import pytest
from daemon import Daemon, parse

from gpuwatch import live
from gpuwatch.backends.simulated import SimulatedBackend
from gpuwatch.clock import FakeClock
from gpuwatch.poller import Poller
from gpuwatch.store import Store


@pytest.mark.daemon
@pytest.mark.stack
def test_demo_serves_eight_gpus_and_passes_promtool(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
    env["PYTHONUNBUFFERED"] = "1"
    d = Daemon(tmp_path, env, command="demo")
    try:
        d.wait_value("gpuwatch_poll_success", 1, tier="fast")
        status, body = d.get("/metrics")
        samples = parse(body)
        assert samples[("gpuwatch_gpus", ())] == 8
        assert samples[("gpuwatch_backend_up", (("backend", "simulated"),))] == 1
        assert len({dict(k[1])["uuid"] for k in samples if k[0] == "gpuwatch_gpu_up"}) == 8
        assert [k for k in samples if k[0] == "gpuwatch_fan_speed_ratio"]
        assert [k for k in samples if k[0] == "gpuwatch_anomaly_onsets_total"]
        result = subprocess.run([shutil.which("promtool"), "check", "metrics"], input=body,
                                capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
        assert d.get("/healthz")[0] == 200
    finally:
        assert d.stop() == 0  # SIGTERM stops it cleanly


def test_live_view_lists_every_gpu_and_marks_a_lost_one():
    clock = FakeClock()
    backend = SimulatedBackend(clock, gpu_count=3)
    store = Store(clock, backend.name)
    poller = Poller(backend, store, clock)
    poller.poll_fast()
    store.set_gpu_up(store.snapshot().gpus[1].identity.uuid, False)
    lines = live.render(store.snapshot(), clock.monotonic(), 6.0)
    assert lines[0].startswith("gpuwatch · 3 GPUs · backend up")
    assert lines[1] == live.HEADER
    assert len(lines) == 5
    assert lines[3].rstrip().endswith("LOST")
    assert "°C" in lines[2] and " W" in lines[2] and "MHz" in lines[2]
