"""sd_notify over a real AF_UNIX datagram socket, path and abstract."""

import os
import socket

import pytest

from gpuwatch.sdnotify import Notifier


def receiver(address):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2)
    return sock


def test_sends_ready_and_status_to_a_path_socket(tmp_path):
    path = str(tmp_path / "notify")
    sock = receiver(path)
    notifier = Notifier({"NOTIFY_SOCKET": path})
    assert notifier.send(READY=1, STATUS="8 GPUs, 0 anomalies, last poll 1.4 s ago")
    assert sock.recv(4096) == b"READY=1\nSTATUS=8 GPUs, 0 anomalies, last poll 1.4 s ago"
    notifier.close()
    sock.close()


def test_abstract_namespace_socket():
    name = f"gpuwatch-test-{os.getpid()}"
    sock = receiver("\0" + name)
    notifier = Notifier({"NOTIFY_SOCKET": "@" + name})
    assert notifier.send(WATCHDOG=1)
    assert sock.recv(4096) == b"WATCHDOG=1"
    sock.close()


def test_without_notify_socket_nothing_happens_and_watchdog_follows_env():
    assert not Notifier({}).send(READY=1)
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "30000000"}).watchdog_seconds == 30.0
    assert Notifier({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}).watchdog_seconds is None


@pytest.mark.daemon
def test_daemon_notifies_ready_status_watchdog_and_stopping_even_with_a_wedged_gpu(tmp_path):
    """READY after the first discovery; WATCHDOG keeps coming while an NVML call hangs (no restart loop)."""
    import fakenvml
    from daemon import Daemon, fake_env, wait_for

    sock = receiver(str(tmp_path / "notify"))
    sock.settimeout(0.2)
    node = fakenvml.FakeNode.h200(2)
    fx = fakenvml.prepare(tmp_path, node)
    env = fake_env(fx)
    env.update(NOTIFY_SOCKET=str(tmp_path / "notify"), WATCHDOG_USEC="1000000")
    messages = []

    def drain():
        while True:
            try:
                messages.append(sock.recv(4096).decode())
            except OSError:
                return messages

    d = Daemon(tmp_path, env)
    try:
        wait_for(lambda: any("READY=1" in m for m in drain()), what="READY=1")
        ready = next(m for m in messages if "READY=1" in m)
        assert "STATUS=2 GPUs, 0 anomalies, last poll" in ready
        node.block("nvmlDeviceGetTemperatureV", None, gpu=0)
        fx.write(node)
        d.wait_value("gpuwatch_poll_success", 0, tier="fast")
        count = len([m for m in drain() if m == "WATCHDOG=1"])
        wait_for(lambda: len([m for m in drain() if m == "WATCHDOG=1"]) >= count + 3, what="watchdog pings")
    finally:
        # still wedged: SIGTERM must stop gpuwatch promptly all the same (no wait on the stuck thread)
        assert d.stop() == 0
    assert drain()[-1] == "STOPPING=1"
    assert [e for e in d.events() if e["event"] == "stopped"]
    sock.close()


def test_the_daemon_freezes_what_it_built_and_collects_the_young_generation_less_often():
    """What the run loop does once the first poll is done (gpuwatch.cli.run._tune_gc)."""
    import gc

    from gpuwatch.cli.run import GC_THRESHOLD_YOUNG, _tune_gc

    before = gc.get_threshold()
    try:
        _tune_gc()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (GC_THRESHOLD_YOUNG, before[1], before[2])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_the_main_loop_sleeps_until_its_next_duty():
    """Without systemd's notify socket the main loop has no duty and sleeps until a signal; with it, until
    the next STATUS= line or watchdog look (a quarter of the watchdog's period), whichever is first."""
    from gpuwatch.cli.run import STATUS_SECONDS, _idle_seconds

    assert _idle_seconds(Notifier({})) is None
    assert _idle_seconds(Notifier({"WATCHDOG_USEC": "60000000"})) is None  # no socket to ping
    assert _idle_seconds(Notifier({"NOTIFY_SOCKET": "/x"})) == STATUS_SECONDS
    assert _idle_seconds(Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "60000000"})) == STATUS_SECONDS
    assert _idle_seconds(Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "2000000"})) == 0.5
