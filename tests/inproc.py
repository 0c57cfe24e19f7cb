"""The agent in-process on simulated time (gpuwatch.testing.Harness), with the reading API of
daemon.Daemon (``value``, ``wait_value``, ``metrics``, ``events``, ``get``), for behaviour tests whose
subject is not the process: a rule that fires, a metric that appears, a GPU that gets lost.

``wait_value`` and ``wait_for`` advance the simulated clock poll by poll (no real waiting); over NVML
the backend runs in a child process (gpuwatch.testing.ChildBackend, forked from a ForkServer per library
variant: no start-up of Python per test) on the fake libnvidia-ml.so.1,
which re-reads the state file on every call (FAKE_NVML_RECHECK_MS=0): a ``write`` is seen by the
next poll.
"""

from __future__ import annotations

import io
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import fakenvml
from daemon import isolated_env, parse

from gpuwatch import logs
from gpuwatch.clock import FakeClock
from gpuwatch.testing import ChildBackend, ForkServer, Harness, load_config
from gpuwatch.web.app import App

# what daemon.Daemon runs with
DAEMON_ARGS = ("--poll.interval", "0.25", "--poll.slow-interval", "1")


class InProc:
    """One agent on simulated time; ``h`` is its Harness, ``fx`` the fake NVML environment (or None)."""

    def __init__(self, workdir: Path, node: fakenvml.FakeNode | None = None, old_driver: bool = False,
                 args: Sequence[str] | None = None, backend: Any = None, clock: FakeClock | None = None,
                 environ: dict[str, str] | None = None, nvml_env: dict[str, str] | None = None,
                 child: ChildBackend | None = None) -> None:
        """Over the fake library serving ``node``, or over the NVML library that ``nvml_env`` (a whole
        environment, LD_LIBRARY_PATH first: NVIDIA's mock, tests/mocknvml.py) loads, or over a new backend
        in ``child`` (a ChildBackend its owner keeps and stops), or over ``backend``."""
        self.workdir = workdir
        self._parsed: tuple[str | None, dict] = (None, {})
        self.log = io.StringIO()
        logs.configure("debug", "json", stream=self.log)
        argv = [*DAEMON_ARGS, *(args or [])]
        self.fx = None
        self._child: ChildBackend | None = None
        self._child_log = None
        if node is not None or nvml_env is not None:
            if node is not None:
                self.fx = fakenvml.prepare(workdir, node, old_driver=old_driver)
                env = isolated_env({**self.fx.env, "FAKE_NVML_RECHECK_MS": "0"})
            else:
                workdir.mkdir(parents=True, exist_ok=True)
                env = dict(nvml_env or {})
            config = load_config(argv, {**env, **(environ or {})})
            self._child_log = open(workdir / "backend.log", "w+")
            # the fake library reads its environment at nvmlInit: its children fork from a server; NVIDIA's
            # mock (Go) takes the environment the process started with, so it gets a process of its own
            server = ForkServer.shared(env) if node is not None else None
            backend = self._child = ChildBackend(config, env, stderr=self._child_log, server=server)
        else:
            config = load_config(argv, {**isolated_env({}), **(environ or {})})
            if child is not None:
                child.configure(config)
                backend = child
        self.h = Harness(config, backend=backend, clock=clock)
        self.config = config
        self.clock = self.h.clock
        self.h.advance(0)  # as a daemon that has started: the jobs due at the start have run

    # -- time
    def advance(self, seconds: float) -> None:
        self.h.advance(seconds)

    def polls(self, count: int = 1) -> None:
        """Advance ``count`` fast poll intervals."""
        self.h.advance(count * self.config.poll_interval)

    def wait_for(self, condition: Callable[[], object], timeout: float = 20.0, what: str = "condition") -> Any:
        return self.h.run_until(condition, timeout, what=what)

    def wait_value(self, name: str, expected: float | None, timeout: float = 20.0, **labels: str) -> None:
        self.wait_for(lambda: self.value(name, **labels) == expected, timeout,
                      f"{name}{labels} == {expected} (now {self.value(name, **labels)})")

    # -- what it serves
    def scrape(self) -> str:
        return self.h.scrape()

    def metrics(self) -> dict:
        text = self.h.scrape()
        if text != self._parsed[0]:  # parsing is what a wait costs most: once per rendered state
            self._parsed = (text, parse(text))
        return dict(self._parsed[1])

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics().get((name, tuple(sorted(labels.items()))))

    def status(self) -> dict:
        return self.h.status()

    def get(self, path: str) -> tuple[int, str]:
        """A GET of the daemon's WSGI application (the HTTP server's answer without the server)."""
        agent = self.h.agent
        app = App(agent.exposition, agent.store.snapshot, self.clock.monotonic, self.config.telemetry_path,
                  self.config.staleness)
        answer: dict[str, Any] = {}

        def start_response(status: str, headers: list[tuple[str, str]]) -> None:
            answer["status"] = int(status.split()[0])

        body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": path}, start_response))
        return answer["status"], body.decode()

    def events(self) -> list[dict]:
        """The log lines (JSON) of the agent and of the backend's child process, as dicts."""
        lines = self.log.getvalue().splitlines()
        if self._child_log is not None:
            self._child_log.flush()
            lines += Path(self._child_log.name).read_text().splitlines()
        result = []
        for line in lines:
            try:
                result.append(json.loads(line))
            except ValueError:
                result.append({"event": "<not json>", "line": line})
        return result

    def write(self, node: fakenvml.FakeNode) -> None:
        assert self.fx is not None
        self.fx.write(node)

    def stop(self) -> None:
        self.h.close()
        if self._child is not None:
            self._child.stop()
            self._child = None
        if self._child_log is not None:
            self._child_log.close()
            self._child_log = None

    close = stop
