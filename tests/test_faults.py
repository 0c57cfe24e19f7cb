"""Fault injection against the real `gpuwatch` process: hostile input and an unlucky environment.

Each case breaks something around the daemon — malformed HTTP, NVML text that is not UTF-8, an
unreadable or non-UTF-8 configuration (at start and at SIGHUP), a log reader that goes away, a
full disk under stderr, wall-clock steps, an XID storm — and then checks that the daemon still
serves correct metrics for every GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys

import fakenvml
import pytest
from daemon import Daemon, fake_env, parse, stop_process, wait_for

# The real process under faults of its own (requests, logs, clock steps, config files): marked daemon, one by
# one; the corrupted identity and the XID storm are behaviour of the agent, in-process (inproc).

FAKETIME_LIB = next((p for p in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                                 "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1") if os.path.exists(p)), None)


def serves_every_gpu(metrics: dict, node: fakenvml.FakeNode) -> None:
    """The daemon is up and reports each GPU's temperature as the fake library has it."""
    assert metrics[("gpuwatch_backend_up", (("backend", "nvml"),))] == 1
    assert metrics[("gpuwatch_gpus", ())] == len(node.gpus)
    for i, gpu in enumerate(node.gpus):
        uuid = next(dict(k[1])["uuid"] for k in metrics if k[0] == "gpuwatch_gpu_up" and dict(k[1])["gpu"] == str(i))
        assert metrics[("gpuwatch_gpu_up", (("gpu", str(i)), ("uuid", uuid)))] == 1
        key = ("gpuwatch_temperature_celsius", (("gpu", str(i)), ("sensor", "gpu"), ("uuid", uuid)))
        assert metrics[key] == gpu.temperature


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def raw_request(base: str, data: bytes) -> bytes:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        chunks = []
        while chunk := s.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


@pytest.fixture()
def node_daemon(tmp_path):
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    started = []

    def start(args=(), node_=None, env_extra=None):
        env = {**fake_env(fx), **(env_extra or {})}
        if node_ is not None:
            fx.write(node_)
        d = Daemon(tmp_path, env, list(args))
        started.append(d)
        d.wait_value("gpuwatch_poll_success", 1, tier="fast")
        return d

    start.node, start.fx = node, fx
    yield start
    for d in started:
        d.stop()


# -- HTTP -------------------------------------------------------------------------------------------

MALFORMED = [
    (b"garbage\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET /metrics\r\n\r\n", b"HTTP/1.0 400 "),  # HTTP/0.9: no version, no headers
    (b"GET /metrics HTTP/1.1 extra\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET /metrics HTTP/1.x\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET /metrics FTP/1.1\r\n\r\n", b"HTTP/1.0 400 "),
    (b"\r\n\r\n", b"HTTP/1.0 400 "),
    (b"\xff\xfe\x00garbage \x80\x81 HTTP/1.1\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET /metrics HTTP/9.9\r\n\r\n", b"HTTP/1.0 505 "),  # a well-formed version gpuwatch does not speak
]


@pytest.mark.daemon
def test_malformed_request_lines_get_a_status_line_and_the_daemon_serves_on(node_daemon):
    """Every malformed request line is answered with a status line and headers (not the stdlib's
    bare HTML body), and /metrics is still right afterwards."""
    d = node_daemon()
    for request, status in MALFORMED:
        answer = raw_request(d.base, request)
        assert answer.startswith(status), (request, answer[:120])
        head, _, body = answer.partition(b"\r\n\r\n")
        assert b"Content-Type: text/plain" in head and b"<" not in body, (request, answer[:200])
    assert d.proc.poll() is None
    serves_every_gpu(d.metrics(), node_daemon.node)
    assert not [e for e in d.events() if e.get("level") == "error" or "<not json>" == e["event"]]


# -- NVML text --------------------------------------------------------------------------------------

def test_a_gpu_whose_identity_is_not_utf8_stays_up_with_the_others(inproc):
    """A corrupted InfoROM: GPU 1's serial and name (and the driver version) hold bytes that are not UTF-8. Both GPUs stay up,
    the bad bytes become U+FFFD, each is counted once, and one log line says so (not one per poll)."""
    node = fakenvml.FakeNode.h200(2)
    node.gpus[1].serial = "PSN\udcb0\udcff42"
    node.gpus[1].name = "NVIDIA H200\udc80"
    node.driver_version = "590.48\udcfe"
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    d.wait_for(lambda: d.value("gpuwatch_poll_success", tier="slow") == 1)
    metrics = d.metrics()
    serves_every_gpu(metrics, node)
    info = [dict(k[1]) for k in metrics if k[0] == "gpuwatch_gpu_info" and dict(k[1])["gpu"] == "1"]
    assert info[0]["serial"] == "PSN\ufffd\ufffd42" and info[0]["name"] == "NVIDIA H200\ufffd"
    assert [dict(k[1])["driver_version"] for k in metrics if k[0] == "gpuwatch_driver_info"] == ["590.48\ufffd"]
    errors = sum(v for k, v in metrics.items() if k[0] == "gpuwatch_poll_errors_total"
                 and ("error", "invalid_utf8") in k[1])
    assert errors == 3  # the driver version and two texts of GPU 1, counted at discovery
    lines = [e for e in d.events() if e["event"] == "nvml_invalid_text"]
    assert sorted(tuple(e["texts"]) for e in lines) == [("driver_version",), ("name", "serial")]
    assert not [e for e in d.events() if "Traceback" in json.dumps(e) or e["event"] == "<not json>"]


# -- configuration ------------------------------------------------------------------------------------

def run_once(env, *args, timeout=60):
    return subprocess.run([sys.executable, "-m", "gpuwatch", "run", *args], env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("content,message", [
    (b"# fan curve: 40 \xb0C at idle\npoll:\n  interval: 2\n", "is not UTF-8: byte 0xb0 at line 1, column 17"),
    (b"poll:\n  interval: 2\n  interval: 5\n", "key 'interval' is given twice"),
    (b"poll: [unclosed\n", "is not valid YAML"),
    (b"poll: " + b"[" * 3000 + b"]" * 3000 + b"\n", "nests too deeply"),
])
@pytest.mark.daemon
def test_unreadable_configs_exit_78_with_one_line(tmp_path, content, message):
    config = tmp_path / "gpuwatch.yml"
    config.write_bytes(content)
    result = run_once(fake_env(fakenvml.prepare(tmp_path, fakenvml.FakeNode.h200(1))), "--config", str(config))
    assert result.returncode == 78, result.stderr
    assert message in result.stderr and str(config) in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.daemon
def test_a_config_that_is_a_directory_exits_78(tmp_path):
    result = run_once(fake_env(fakenvml.prepare(tmp_path, fakenvml.FakeNode.h200(1))), "--config", str(tmp_path))
    assert result.returncode == 78 and "cannot read it: Is a directory" in result.stderr, result.stderr


@pytest.mark.daemon
def test_reload_with_unreadable_configs_keeps_the_old_one(node_daemon, tmp_path):
    """SIGHUP with a non-UTF-8, a duplicate-key and a vanished file: reload_failed each time, the
    daemon keeps its settings (power_capped stays disabled) and serves on."""
    config = tmp_path / "gpuwatch.yml"
    config.write_text("rules:\n  power_capped: {enabled: false}\n")
    d = node_daemon(["--config", str(config)])
    onsets = ("gpuwatch_anomaly_onsets_total", (("rule", "power_capped"),))
    assert onsets not in d.metrics()
    bad = [b"rules:\n  power_capped: {enabled: true}\n# 85 \xb0C\n",
           b"rules:\n  power_capped: {enabled: true}\nrules: {}\n"]
    for n, content in enumerate(bad, 1):
        config.write_bytes(content)
        d.proc.send_signal(signal.SIGHUP)
        wait_for(lambda n=n: len([e for e in d.events() if e["event"] == "reload_failed"]) == n, what="reload_failed")
    config.unlink()
    d.proc.send_signal(signal.SIGHUP)
    failed = wait_for(lambda: [e for e in d.events() if e["event"] == "reload_failed"][2:], what="third failure")
    errors = [e["error"] for e in d.events() if e["event"] == "reload_failed"]
    assert "is not UTF-8: byte 0xb0 at line 3" in errors[0]
    assert "key 'rules' is given twice" in errors[1]
    assert "cannot read it: No such file" in failed[0]["error"]
    assert d.proc.poll() is None
    metrics = d.metrics()
    serves_every_gpu(metrics, node_daemon.node)
    assert onsets not in metrics  # the old settings stay


# -- logging ----------------------------------------------------------------------------------------------

@pytest.mark.daemon
def test_a_log_reader_that_goes_away_loses_lines_not_the_daemon(tmp_path):
    """stderr is a pipe whose reader exits after `started` (journald restarted): every later log call
    gets EPIPE. XID events are still counted (the events thread lives on), SIGHUP still reloads, the
    lost lines are counted, and SIGTERM still stops it cleanly."""
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    args = [sys.executable, "-m", "gpuwatch", "run", "--web.listen-address", "127.0.0.1:0", "--poll.interval",
            "0.25", "--poll.slow-interval", "1", "--log.format", "json", "--log.level", "debug"]
    proc = subprocess.Popen(args, env=fake_env(fx), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            stdin=subprocess.DEVNULL)
    try:
        for line in proc.stderr:
            event = json.loads(line)
            if event["event"] == "started":
                break
        proc.stderr.close()  # the reader is gone: the next write gets EPIPE
        base = f"http://{event['listen'][0]}"

        def metrics():
            import urllib.request
            with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
                return parse(r.read().decode())

        uuid = node.gpus[1].uuid
        for xid in (79, 13):
            node.add_xid(gpu=1, xid=xid)
            fx.write(node)
            count = 1 if xid == 79 else 2
            wait_for(lambda count=count: metrics().get(("gpuwatch_xid_events_total", (("gpu", "1"), ("uuid", uuid))))
                     == count,
                     what=f"{count} XID events counted")
        proc.send_signal(signal.SIGHUP)  # logs `reloaded` into the broken pipe
        wait_for(lambda: metrics()[("gpuwatch_log_dropped_total", ())] >= 3, what="dropped lines counted")
        assert proc.poll() is None
        m = metrics()
        serves_every_gpu(m, node)
        assert m[("gpuwatch_xid_errors_total", (("gpu", "1"), ("uuid", uuid), ("xid", "13")))] == 1
    finally:
        assert stop_process(proc) == 0


@pytest.mark.daemon
def test_stderr_on_a_full_device_does_not_stop_the_start(tmp_path):
    """Every log line gets ENOSPC (stderr is /dev/full): the daemon starts and serves anyway."""
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    port = free_port()
    args = [sys.executable, "-m", "gpuwatch", "run", "--web.listen-address", f"127.0.0.1:{port}",
            "--poll.interval", "0.25", "--log.format", "json"]
    with open("/dev/full", "w") as full:
        proc = subprocess.Popen(args, env=fake_env(fx), stdout=full, stderr=full, stdin=subprocess.DEVNULL)
    try:
        import urllib.error
        import urllib.request

        def get():
            if proc.poll() is not None:
                raise AssertionError(f"gpuwatch exited with {proc.returncode}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    return parse(r.read().decode())
            except (urllib.error.URLError, ConnectionError):
                return None

        metrics = wait_for(lambda: (m := get()) and m.get(("gpuwatch_poll_success", (("tier", "fast"),))) == 1 and m,
                           what="serving fresh data")
        serves_every_gpu(metrics, node)
        assert metrics[("gpuwatch_log_dropped_total", ())] >= 1  # `started` at least
    finally:
        assert stop_process(proc) == 0


def test_an_xid_storm_is_counted_whole_and_logged_in_summaries(inproc):
    """1,000 XID 13 events on GPU 0 and one XID 79 on GPU 1: every event is counted; the log holds a few
    xid_event lines per GPU and code (then a summary with `repeated`), not one per event."""
    node = fakenvml.FakeNode.h200(2)
    d = inproc(node)
    d.wait_value("gpuwatch_poll_success", 1, tier="fast")
    for _ in range(1000):
        node.add_xid(gpu=0, xid=13)
    node.add_xid(gpu=1, xid=79)
    d.write(node)
    labels = dict(gpu="0", uuid=node.gpus[0].uuid)
    d.wait_value("gpuwatch_xid_events_total", 1000, **labels)
    d.wait_value("gpuwatch_xid_errors_total", 1, gpu="1", uuid=node.gpus[1].uuid, xid="79")
    assert d.value("gpuwatch_xid_errors_total", xid="13", **labels) == 1000
    lines = [e for e in d.events() if e["event"] == "xid_event"]
    assert len([e for e in lines if e["gpu"] == "0"]) <= 3
    assert [e["xid"] for e in lines if e["gpu"] == "1"] == [79]
    serves_every_gpu(d.metrics(), node)


# -- clock steps ---------------------------------------------------------------------------------------------

@pytest.mark.daemon
def test_wall_clock_steps_do_not_stall_or_burst_the_polls(node_daemon, tmp_path):
    """libfaketime steps the daemon's wall clock back 5 minutes, then forward 10 (the monotonic clock
    runs on): polls keep coming at their interval, /healthz stays 200, no burst of catch-up polls."""
    if FAKETIME_LIB is None or shutil.which("faketime") is None:
        pytest.fail("libfaketime is missing: scripts/test installs it (Debian package faketime)")
    offset = tmp_path / "faketime"
    offset.write_text("+0\n")
    # libfaketime re-reads the offset file at most once a second (FAKETIME_NO_CACHE re-read it on every clock
    # call of every thread: the daemon spent its CPU in open/read/close and made too few polls on 2 cores)
    d = node_daemon(env_extra={"LD_PRELOAD": FAKETIME_LIB, "FAKETIME_TIMESTAMP_FILE": str(offset),
                               "FAKETIME_CACHE_DURATION": "1", "FAKETIME_DONT_FAKE_MONOTONIC": "1"})
    fx = node_daemon.fx
    per_poll = len(node_daemon.node.gpus)  # nvmlDeviceGetTemperatureV calls per fast poll

    def polls() -> int:
        return fx.counts()["nvmlDeviceGetTemperatureV"] // per_poll

    health: list[int] = []

    def polled(count: int) -> bool:
        health.append(d.get("/healthz")[0])
        return polls() >= count

    for step in ("-300", "+600"):  # seconds from the real time: back 300 s, then forward 900 s
        before = polls()
        offset.write_text(step + "\n")
        # 8 polls of 0.25 s (the daemon under libfaketime on a loaded 2-core CI machine is slower than that); a
        # stall would take the whole step (300 s) and fail the deadline
        wait_for(lambda before=before: polled(before + 8), timeout=60, what=f"8 polls after a {step} s step")
        assert polls() - before < 60  # a burst of catch-up polls would be hundreds (600 s / 0.25 s)
    assert set(health) == {200}
    steps = [e["seconds"] for e in d.events() if e["event"] == "clock_step"]
    assert len(steps) == 2 and -301 < steps[0] < -299 and 899 < steps[1] < 901, steps
    serves_every_gpu(d.metrics(), node_daemon.node)
    assert d.proc.poll() is None
