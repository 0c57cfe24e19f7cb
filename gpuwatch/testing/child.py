"""A backend in a child process, answering over a pipe: for a backend that must be loaded at process
start, such as NVML over tests/fakenvml's libnvidia-ml.so.1 (``LD_LIBRARY_PATH`` is read when a
process starts), or one that should not share the test's process.

``ChildBackend(config, env)`` starts a Python running this module's ``main()`` with ``env``; the child builds
the backend from ``config`` exactly as the daemon does (gpuwatch.agent.make_backend, on the real
clock) and answers every Backend method; BackendUnavailable and DeviceLost come back as themselves,
any other exception as a ChildError naming its type. Frames are pickles, each after its length.
"""

from __future__ import annotations

import copyreg
import os
import pickle
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


class ChildBackend:
    """The Backend protocol, answered by a backend in a child process (see the module docstring).

    Calls are serialised (one request in flight); ``stop()`` ends the child (``close()`` only closes
    the backend in it, which may be opened again, as the protocol says).
    """

    def __init__(self, config: Config, env: Mapping[str, str] | None = None, stderr: IO[Any] | None = None) -> None:
        self.name = config.backend
        self._lock = threading.Lock()
        self._proc = subprocess.Popen([sys.executable, "-c", CHILD], env=dict(env or os.environ),
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr)
        assert self._proc.stdin is not None and self._proc.stdout is not None
        self._to, self._from = self._proc.stdin, self._proc.stdout
        self.name = self._call("__init__", config)

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:
            if self._proc.poll() is not None:
                raise ChildError(f"the backend's child process exited with {self._proc.returncode}")
            try:
                _send(self._to, (method, args))
                ok, value = _receive(self._from)
            except (EOFError, OSError) as exc:
                raise ChildError(f"the backend's child process went away ({exc})") from None
        if ok:
            return value
        raise _decode_error(*value)

    def open(self) -> DriverInfo:
        return self._call("open")

    def close(self) -> None:
        if self._proc.poll() is None:
            self._call("close")

    def discover(self) -> list[DiscoveredGpu]:
        return self._call("discover")

    def read_fast(self, uuid: str) -> FastSample:
        return self._call("read_fast", uuid)

    def read_slow(self, uuid: str) -> SlowSample:
        return self._call("read_slow", uuid)

    def wait_events(self, timeout_seconds: float) -> list[XidEvent]:
        return self._call("wait_events", timeout_seconds)

    def stop(self, timeout: float = 10.0) -> int:
        """End the child (closing its backend first); its exit status."""
        if self._proc.poll() is None:
            try:
                self._to.close()  # end of input: the child closes its backend and exits
            except OSError:
                pass
            try:
                self._proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._from.close()
        return self._proc.returncode

    def __enter__(self) -> ChildBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve(requests: IO[bytes], answers: IO[bytes]) -> None:
    """The child's loop: build the backend from the first request's Config, then answer until end of input."""
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
            if method == "__init__":
                config: Config = args[0]
                logs.configure(config.log_level, "json")
                backend = make_backend(config, SystemClock())
                result: Any = backend.name
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


if __name__ == "__main__":  # pragma: no cover
    main()
