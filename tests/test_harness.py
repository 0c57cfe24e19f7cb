"""gpuwatch.testing.Harness: the agent's jobs on simulated time, as the poller's scheduler runs them."""

from __future__ import annotations

import json

import pytest
from daemon import isolated_env

from gpuwatch.errors import BackendUnavailable
from gpuwatch.model import XidEvent
from gpuwatch.testing import Harness, ScriptedBackend
from gpuwatch.web.app import App

ISOLATED = isolated_env({})  # no host side of this machine


def harness(backend=None, *args):
    return Harness(backend=backend or ScriptedBackend(2), environ=ISOLATED,
                   args=["--poll.interval", "2", "--poll.slow-interval", "30", *args])


def test_the_jobs_run_at_the_scheduler_s_instants():
    """Fast polls from the start every interval (each with the rules), slow polls one interval after the
    start (the first fast poll ran the first slow one), the host job at the start and every slow interval;
    no other job (the rules have no timer of their own: gpuwatch.poller.Poller.jobs)."""
    h = harness()
    h.advance(0)
    assert h.runs == {"fast": 1, "slow": 0, "host": 1}
    assert h.backend.calls["read_slow"] == 2  # the first fast poll's slow poll
    h.advance(60)
    assert h.now() == 60
    assert h.runs == {"fast": 31, "slow": 2, "host": 3}
    assert h.backend.calls["read_fast"] == 2 * 31 and h.backend.calls["read_slow"] == 2 * 3
    assert h.agent.alive() is None
    h.close()
    assert h.backend.calls["close"] >= 1


def test_a_backend_that_cannot_open_is_retried_with_backoff_on_simulated_time():
    backend = ScriptedBackend(1)
    backend.open_error = BackendUnavailable("driver_not_loaded", "NVML: Driver Not Loaded", "modprobe nvidia")
    h = harness(backend)
    h.advance(30)
    assert backend.calls["open"] == 5  # at 0, 2, 6, 14 and 30 s: the backoff doubles from one interval
    assert h.status()["status"] == "unknown"
    backend.open_error = None
    h.run_until(lambda: h.snapshot().backend_up, timeout=60, what="the backend up")
    assert h.now() == 62  # the next try: 30 + 32 s
    h.advance(95 - 62)
    assert h.runs["host"] == 5  # at 0, 30 and 60 s, woken by the discovery at 62 s, then at 90 s as scheduled


def test_events_are_drained_after_each_job_and_a_lost_gpu_fires():
    backend = ScriptedBackend(2)
    h = harness(backend)
    h.advance(4)
    uuid = backend.gpus[1].identity.uuid
    backend.events.append(XidEvent(uuid, 79, h.clock.wall()))
    backend.lost.add(uuid)
    h.advance(2)
    assert h.snapshot().gpus[1].xid_counts == {79: 1}
    h.run_until(lambda: [a for a in h.anomalies() if a.rule == "gpu_lost"], timeout=30, what="gpu_lost")
    assert {(a.rule, a.gpu) for a in h.anomalies()} >= {("gpu_lost", "1"), ("xid_critical", "1")}
    assert h.status()["status"] == "critical"


def test_scrape_and_status_are_what_the_http_app_serves():
    h = harness()
    h.advance(10)
    agent = h.agent
    app = App(agent.exposition, agent.store.snapshot, h.clock.monotonic, h.config.telemetry_path, h.config.staleness)
    answers = {}

    def get(path):
        body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": path},
                            lambda status, headers: answers.__setitem__(path, status)))
        return body.decode()

    assert get("/metrics") == h.scrape()
    assert answers["/metrics"] == "200 OK"
    assert json.loads(get("/api/v1/status")) == h.status()


def test_time_only_goes_forward():
    with pytest.raises(ValueError):
        harness().advance(-1)
