"""Logging never raises into its caller, and repeated events are rate-limited per key."""

from __future__ import annotations

import io
import json
import subprocess
import sys

from gpuwatch import logs
from gpuwatch.clock import FakeClock


class Broken(io.StringIO):
    """A stream whose reader went away."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_broken_stream_drops_and_counts_lines_instead_of_raising():
    logs.configure("info", "json", stream=Broken())
    before = logs.dropped_lines()
    log = logs.get_logger(component="test")
    log.warning("xid_event", gpu="0", xid=79)
    log.info("reloaded")
    assert logs.dropped_lines() == before + 2


def test_a_processor_that_fails_on_a_value_loses_the_line_not_the_caller():
    class Unprintable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    stream = io.StringIO()
    logs.configure("info", "json", stream=stream)
    before = logs.dropped_lines()
    logs.get_logger().info("odd", value=Unprintable())
    logs.get_logger().info("fine")
    assert logs.dropped_lines() == before + 1
    assert [json.loads(line)["event"] for line in stream.getvalue().splitlines()] == ["fine"]


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_repeats_writes_a_burst_then_one_summary_per_interval():
    stream = io.StringIO()
    logs.configure("info", "json", stream=stream)
    clock = FakeClock()
    repeats = logs.Repeats(logs.get_logger(), burst=3, interval=60.0, monotonic=clock.monotonic)
    for _ in range(1000):
        repeats.log("warning", "xid_event", ("xid", "GPU-a", 13), gpu="0", xid=13)
    repeats.log("warning", "xid_event", ("xid", "GPU-b", 79), gpu="1", xid=79)  # another key: its own burst
    assert [(e["gpu"], e.get("repeated")) for e in lines(stream)] == [("0", None)] * 3 + [("1", None)]
    repeats.flush()  # the window is not over: nothing yet
    assert len(lines(stream)) == 4
    clock.advance(60)
    repeats.flush()
    summary = lines(stream)[4:]
    assert summary == [{**summary[0], "event": "xid_event", "gpu": "0", "xid": 13, "repeated": 997,
                        "window_seconds": 60.0}]
    repeats.log("warning", "xid_event", ("xid", "GPU-a", 13), gpu="0", xid=13)  # a new window starts
    assert lines(stream)[-1].get("repeated") is None and len(lines(stream)) == 6


def test_repeats_writes_the_summary_before_the_next_event_after_the_interval():
    stream = io.StringIO()
    logs.configure("info", "json", stream=stream)
    clock = FakeClock()
    repeats = logs.Repeats(logs.get_logger(), burst=1, interval=10.0, monotonic=clock.monotonic)
    for _ in range(5):
        repeats.log("error", "poll_failed", ("fast", "GPU-a"), gpu="0", error="ValueError: x", exc_info=False)
    clock.advance(11)
    repeats.log("error", "poll_failed", ("fast", "GPU-a"), gpu="0", error="ValueError: x", exc_info=False)
    assert [e.get("repeated") for e in lines(stream)] == [None, 4, None]
    assert "exc_info" not in lines(stream)[1]


OPTIONAL_PRETTY = """
import sys
sys.path.insert(0, sys.argv[1])
import gpuwatch.logs as logs
loaded = sorted(n for n in ("rich", "better_exceptions", "colorama") if sys.modules.get(n) is not None)
import rich  # still there for anything else in the process
logs.configure("info", "console")
try:
    1 / 0
except ZeroDivisionError:
    logs.get_logger(component="test").exception("boom")
print(loaded, rich.MARK)
"""


def test_structlog_loads_without_the_pretty_printers_it_would_import(tmp_path):
    """structlog.dev imports rich, better_exceptions and colorama where installed (~5 MB): gpuwatch hides them
    while structlog loads; they stay importable, and the console format prints a plain traceback."""
    for name in ("rich", "better_exceptions", "colorama"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"MARK = {name!r}\n")
    done = subprocess.run([sys.executable, "-c", OPTIONAL_PRETTY, str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[] rich"
    assert "boom" in done.stderr and "ZeroDivisionError" in done.stderr
