"""Run the real `gpuwatch` process (over the fake libnvidia-ml.so.1) and read what it serves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import fakenvml
from prometheus_client.parser import text_string_to_metric_families


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> int:
    """SIGTERM, then SIGKILL after ``timeout``; the exit status."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def parse(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_for(condition: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> object:
    """Poll ``condition`` until it returns something truthy (no fixed sleeps in tests)."""
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


class Daemon:
    """`gpuwatch run` on 127.0.0.1:<free port>, logs as JSON lines in a file."""

    def __init__(self, workdir: Path, env: dict[str, str], args: list[str] | None = None,
                 command: str = "run") -> None:
        self.workdir = workdir
        self.log_path = workdir / "gpuwatch.log"
        argv = [sys.executable, "-m", "gpuwatch", command, "--web.listen-address", "127.0.0.1:0",
                "--poll.interval", "0.25", "--poll.slow-interval", "1", "--log.format", "json",
                "--log.level", "debug"] + (args or [])
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        started = wait_for(lambda: self._started(), what="gpuwatch to start listening")
        host_port = started["listen"][0]
        self.base = f"http://{host_port}"

    def _started(self) -> dict | None:
        if self.proc.poll() is not None:
            raise AssertionError(f"gpuwatch exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        for event in self.events():
            if event.get("event") == "started":
                return event
        return None

    def events(self) -> list[dict]:
        result = []
        for line in self.log_path.read_text().splitlines():
            try:
                result.append(json.loads(line))
            except ValueError:
                result.append({"event": "<not json>", "line": line})
        return result

    def get(self, path: str, timeout: float = 5.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=timeout) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def metrics(self) -> dict:
        status, body = self.get("/metrics")
        assert status == 200, body
        return parse(body)

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics().get((name, tuple(sorted(labels.items()))))

    def wait_value(self, name: str, expected: float | None, timeout: float = 20.0, **labels: str) -> None:
        wait_for(lambda: self.value(name, **labels) == expected, timeout,
                 f"{name}{labels} == {expected} (now {self.value(name, **labels)})")

    def stop(self) -> int:
        rc = stop_process(self.proc)
        self._log.close()
        return rc


def fake_env(fx: fakenvml.FakeNvmlEnv) -> dict[str, str]:
    return isolated_env(fx.env)


def isolated_env(base: dict[str, str]) -> dict[str, str]:
    """``base`` (an environment that names the NVML library to load) for a gpuwatch that reads no part
    of this machine but that library."""
    env = dict(base)
    env.pop("GPUWATCH_CONFIG", None)
    env["PYTHONUNBUFFERED"] = "1"
    # The host groups read no part of this machine: no cgroups (no jobs), no kubelet, no scontrol;
    # tests that want them pass their own fake trees, socket and scontrol.
    env["GPUWATCH_ATTRIBUTION_CGROUP_ROOT"] = "/nonexistent/gpuwatch-test/cgroup"
    env["GPUWATCH_COLLECTOR_KUBERNETES_SOCKET"] = "/nonexistent/gpuwatch-test/kubelet.sock"
    env["GPUWATCH_COLLECTOR_SLURM_SCONTROL"] = "/nonexistent/gpuwatch-test/scontrol"
    env["GPUWATCH_COLLECTOR_GRACE_HWMON_ROOT"] = "/nonexistent/gpuwatch-test/hwmon"  # no Grace sensors
    # the package under test, whatever the current directory
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    return env
