"""A backend in a child process, answering over a pipe: for a backend that must be loaded at process
start, such as NVML over tests/fakenvml's libnvidia-ml.so.1 (``LD_LIBRARY_PATH`` is read when a
process starts), or one that should not share the test's process.

``ChildBackend(config, env)`` starts a Python running this module's ``main()`` with ``env``; the child builds
the backend from ``config`` exactly as the daemon does (gpuwatch.agent.make_backend, on the real
clock) and answers every Backend method; BackendUnavailable and DeviceLost come back as themselves,
any other exception as a ChildError naming its type. Frames are pickles, each after its length.

Starting Python and importing gpuwatch takes about a second; ``ChildBackend(config, env,
server=ForkServer.shared(env))`` instead forks the child from a server process that has imported
everything (but loaded no NVML library: pynvml loads it at the first nvmlInit) and that was started
with ``env``'s ``LD_LIBRARY_PATH``; the child then takes ``env`` as its whole environment. That is for a
library that reads its environment when it is called, as tests/fakenvml's does at nvmlInit; one that takes
the environment its process started with (NVIDIA's mock, in Go) needs a process of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import copyreg
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import threading
import types
from collections.abc import Mapping
from typing import IO, Any

from gpuwatch.config import Config
from gpuwatch.errors import BackendUnavailable, DeviceLost
from gpuwatch.model import DiscoveredGpu, DriverInfo, FastSample, SlowSample, XidEvent

_LENGTH = struct.Struct("!Q")
# the samples' read-only mappings travel as what they wrap


def _mappingproxy(wrapped: dict[Any, Any]) -> types.MappingProxyType[Any, Any]:
    return types.MappingProxyType(wrapped)


copyreg.pickle(types.MappingProxyType, lambda m: (_mappingproxy, (dict(m),)))


CHILD = "from gpuwatch.testing.child import main; main()"
SERVER = "import sys; from gpuwatch.testing.child import server_main; server_main(int(sys.argv[1]))"


class ChildError(RuntimeError):
    """An exception other than BackendUnavailable or DeviceLost raised in the child (a backend bug)."""


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_LENGTH.pack(len(data)) + data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    head = stream.read(_LENGTH.size)
    if len(head) < _LENGTH.size:
        raise EOFError("the backend's child process went away")
    size = _LENGTH.unpack(head)[0]
    data = stream.read(size)
    if len(data) < size:
        raise EOFError("the backend's child process went away mid-answer")
    return pickle.loads(data)


def _encode_error(exc: BaseException) -> tuple[str, tuple[Any, ...]]:
    if isinstance(exc, BackendUnavailable):
        return "unavailable", (exc.reason, exc.message, exc.hint)
    if isinstance(exc, DeviceLost):
        return "lost", (exc.uuid, str(exc))
    return "error", (f"{type(exc).__name__}: {exc}",)


def _decode_error(kind: str, args: tuple[Any, ...]) -> Exception:
    if kind == "unavailable":
        return BackendUnavailable(*args)
    if kind == "lost":
        return DeviceLost(*args)
    return ChildError(*args)


class ForkServer:
    """A process that forks backend children on request (see the module docstring); one per
    ``LD_LIBRARY_PATH`` with ``shared``, ended at exit."""

    _shared: dict[str, ForkServer] = {}
    _shared_lock = threading.Lock()

    def __init__(self, env: Mapping[str, str]) -> None:
        self._lock = threading.Lock()
        self._control, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._proc = subprocess.Popen([sys.executable, "-c", SERVER, str(theirs.fileno())], env=dict(env),
                                      pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL)
        theirs.close()

    @classmethod
    def shared(cls, env: Mapping[str, str]) -> ForkServer:
        key = env.get("LD_LIBRARY_PATH", "")
        with cls._shared_lock:
            server = cls._shared.get(key)
            if server is None or server._proc.poll() is not None:
                server = cls._shared[key] = cls(env)
                atexit.register(server.stop)
            return server

    def fork(self, env: Mapping[str, str], channel: socket.socket, stderr: IO[Any] | None) -> None:
        """A child with environment ``env`` that serves on ``channel`` and writes its output to ``stderr``."""
        fds = [channel.fileno(), (stderr or sys.stderr).fileno()]
        with self._lock:
            socket.send_fds(self._control, [pickle.dumps(dict(env))], fds)

    def stop(self) -> None:
        self._control.close()  # end of requests: the server exits
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


class ChildBackend:
    """The Backend protocol, answered by a backend in a child process (see the module docstring).

    Calls are serialised (one request in flight); ``stop()`` ends the child (``close()`` only closes
    the backend in it, which may be opened again, as the protocol says).
    """

    def __init__(self, config: Config, env: Mapping[str, str] | None = None, stderr: IO[Any] | None = None,
                 server: ForkServer | None = None) -> None:
        self.name = config.backend
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: socket.socket | None = None
        if server is None:
            self._proc = subprocess.Popen([sys.executable, "-c", CHILD], env=dict(env or os.environ),
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
            assert self._proc.stdin is not None and self._proc.stdout is not None
            self._to, self._from = self._proc.stdin, self._proc.stdout
        else:
            self._channel, theirs = socket.socketpair()
            server.fork(dict(env or os.environ), theirs, stderr)
            theirs.close()
            self._to, self._from = self._channel.makefile("wb"), self._channel.makefile("rb")
        self._gone = False
        self.pid: int = self._call("__pid__")
        self.configure(config)

    def configure(self, config: Config) -> None:
        """A new backend in the same child, built from ``config`` (the one it had is closed first): the
        library the process loaded stays loaded, as it would in a daemon whose configuration changed."""
        self.name = self._call("__init__", config)

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._gone or (self._proc is not None and self._proc.poll() is not None):
                raise ChildError("the backend's child process has ended")
            try:
                _send(self._to, (method, args))
                ok, value = _receive(self._from)
            except (EOFError, OSError) as exc:  # OSError: a socket timeout too (stop())
                self._gone = True
                raise ChildError(f"the backend's child process went away ({exc})") from None
        if ok:
            return value
        raise _decode_error(*value)

    def open(self) -> DriverInfo:
        return self._call("open")

    def close(self) -> None:
        if not self._gone:
            self._call("close")

    def discover(self) -> list[DiscoveredGpu]:
        return self._call("discover")

    def read_fast(self, uuid: str) -> FastSample:
        return self._call("read_fast", uuid)

    def read_slow(self, uuid: str) -> SlowSample:
        return self._call("read_slow", uuid)

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        return self._call("wait_events", timeout_seconds)

    def stop(self, timeout: float = 10.0) -> None:
        """End the child, its backend closed first (what it wrote, call counts included, is there on return);
        a child that does not answer within ``timeout`` (a call that hangs) is killed."""
        if not self._gone:
            if self._channel is not None:
                self._channel.settimeout(timeout)
            try:
                self._call("__stop__")
            except ChildError:
                if self._channel is not None:  # a forked child is not ours to wait for: killed by its pid
                    with contextlib.suppress(OSError):
                        os.kill(self.pid, signal.SIGKILL)
            self._gone = True
        for stream in (self._to, self._from):
            try:
                stream.close()
            except OSError:
                pass
        if self._channel is not None:
            self._channel.close()
        if self._proc is not None:
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def __enter__(self) -> ChildBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The child's loop: build the backend from the first request's Config, then answer until end of input
    or ``__stop__``; the backend is closed before the answer to ``__stop__``."""
    from gpuwatch import logs
    from gpuwatch.agent import make_backend
    from gpuwatch.clock import SystemClock

    backend: Any = None
    while True:
        try:
            method, args = _receive(requests)
        except EOFError:
            break
        try:
            if method == "__pid__":
                result: Any = os.getpid()
            elif method == "__init__":
                config: Config = args[0]
                logs.configure(config.log_level, "json")
                if backend is not None:
                    backend.close()
                backend = make_backend(config, SystemClock())
                result = backend.name
            elif method == "__stop__":
                if backend is not None:
                    backend.close()
                    backend = None
                _send(answers, (True, None))
                break
            else:
                result = getattr(backend, method)(*args)
        except Exception as exc:
            _send(answers, (False, _encode_error(exc)))
        else:
            _send(answers, (True, result))
    if backend is not None:
        backend.close()


def main() -> None:
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # whatever a library prints goes to stderr, never into the answers
    serve(sys.stdin.buffer, answers)


def server_main(control_fd: int) -> None:
    """The fork server: import what a backend child needs, then fork one per request until end of input."""
    import gpuwatch.agent
    import gpuwatch.backends.nvml  # noqa: F401  (pynvml too; it loads no library before nvmlInit)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the children are nobody's to wait for: reaped at once
    control = socket.socket(fileno=control_fd)
    while True:
        message, fds, _flags, _address = socket.recv_fds(control, 1 << 20, 2)
        if not message:
            return
        if os.fork() == 0:
            try:
                control.close()
                os.environ.clear()
                os.environ.update(pickle.loads(message))
                channel_fd, output_fd = fds
                os.dup2(output_fd, 1)
                os.dup2(output_fd, 2)
                os.close(output_fd)
                channel = socket.socket(fileno=channel_fd)
                serve(channel.makefile("rb"), channel.makefile("wb"))
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(0)
        for fd in fds:
            os.close(fd)


if __name__ == "__main__":  # pragma: no cover
    main()
