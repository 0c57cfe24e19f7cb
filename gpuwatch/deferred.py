"""Modules that a library imports but uses only in code gpuwatch never runs: imported on first use.

structlog (``structlog.stdlib``, ``structlog._native``) imports asyncio for its async log methods
(``ainfo``...) and APScheduler (``apscheduler.util``) takes ``asyncio.iscoroutinefunction`` for its
asyncio and Tornado executors. gpuwatch is a daemon of threads that uses neither, and asyncio is
4.5 MB of resident memory (its modules, the event-loop machinery, their data): a tenth of the agent
on an 8-GPU node. While such a library loads, ``with deferred("asyncio", functions=...)`` puts a
stand-in in ``sys.modules``: the library's ``import asyncio`` binds the stand-in, whose first
attribute read imports the real module (and hands the attribute over from then on); the names in
``functions`` are handed out as functions that import the real module when called. Afterwards
``import asyncio`` anywhere gets the real module, as always. Where the module is already imported
(grpc's ``grpc.aio`` on a Kubernetes node, a test runner), nothing is deferred.

Only libraries that use the module as ``import asyncio`` / ``from asyncio import name`` may load in the
block: the stand-in is not a package (``import asyncio.events`` there fails with ModuleNotFoundError) and
has no ``__spec__``. structlog 26 and APScheduler 3.11 are tested so (tests/test_deferred.py); ``load``
imports a library that needs more as usual, with the real module.
"""

from __future__ import annotations

import importlib
import sys
import threading
import types
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

_lock = threading.Lock()


def _real(name: str) -> types.ModuleType:
    with _lock:
        if isinstance(sys.modules.get(name), LoadedOnUse):
            del sys.modules[name]
        return importlib.import_module(name)


class LoadedOnUse(types.ModuleType):
    """A stand-in for a module: its first read of a public attribute imports the real module.

    Dunder names are the import system's questions (``from asyncio import x`` first asks for
    ``__path__``): they are answered as for a plain module without importing anything.
    """

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)
        return getattr(_real(self.__name__), attribute)


def _forwarder(module: str, function: str) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        return getattr(_real(module), function)(*args, **kwargs)

    call.__name__ = call.__qualname__ = function
    call.__module__ = module
    return call


def load(library: str, name: str, functions: Collection[str] = ()) -> types.ModuleType:
    """``import library`` with ``name`` deferred (``deferred``); where the library needs more of ``name``
    than the stand-in serves (an ImportError while it loads), imported again as usual."""
    try:
        with deferred(name, functions):
            return importlib.import_module(library)
    except ImportError:
        return importlib.import_module(library)


@contextmanager
def deferred(name: str, functions: Collection[str] = ()) -> Iterator[None]:
    """Within the block, ``import name`` binds a stand-in that imports the real module on first use."""
    if name in sys.modules:
        yield
        return
    stand_in = LoadedOnUse(name)
    for function in functions:
        setattr(stand_in, function, _forwarder(name, function))
    sys.modules[name] = stand_in
    try:
        yield
    finally:
        with _lock:
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]
