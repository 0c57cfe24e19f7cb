"""Modules that a library imports but uses only in code gpuwatch never runs: imported on first use.

Two ways, for two shapes of library (``deferred`` and ``parts_of``, below).

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

prometheus_client's package ``__init__`` imports its own HTTP servers, push-gateway client and ASGI
app (``prometheus_client.exposition``), which import ``ssl``, ``hashlib``, ``urllib.request`` at
module level and read ``ssl`` constants in default arguments: OpenSSL's libcrypto mapped and
initialised, 5 MB of resident memory, for code gpuwatch never calls (it serves with its own server).
``parts_of("prometheus_client")`` puts the package in ``sys.modules`` without running its
``__init__``: its submodules (``prometheus_client.registry``, ``.process_collector``...) import as
usual; the first read of a name the ``__init__`` defines (``from prometheus_client import Counter``
anywhere, later) runs it then, in the same module object, as ``import prometheus_client`` would have.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import threading
import types
from collections.abc import Callable, Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

_lock = threading.RLock()  # re-entered: a package's __init__ reads its own names while it runs
_running: set[str] = set()  # the packages whose __init__ runs now


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
def deferred(name: str, functions: Collection[str] = (),
             answers: Mapping[str, Callable[..., Any]] | None = None) -> Iterator[None]:
    """Within the block, ``import name`` binds a stand-in that imports the real module on first use.

    ``answers``: names handed out as the functions given, which answer without the real module (see
    ``without_plugins``)."""
    if name in sys.modules:
        yield
        return
    stand_in = LoadedOnUse(name)
    for function in functions:
        setattr(stand_in, function, _forwarder(name, function))
    for attribute, answer in (answers or {}).items():
        setattr(stand_in, attribute, answer)
    sys.modules[name] = stand_in
    try:
        yield
    finally:
        with _lock:
            if sys.modules.get(name) is stand_in:
                del sys.modules[name]


class PackageOnUse(types.ModuleType):
    """A package whose ``__init__`` has not run yet: it runs at the first read of a name it does not have.

    Its ``__path__``, ``__spec__``, ``__file__`` are set as for any package (submodules import through
    them); a submodule once imported is an attribute as usual, and one not imported yet is a plain miss
    (the import system then imports it). Reads during the ``__init__`` itself (``from . import x`` asks
    for ``x`` first) find what exists so far, as in a normal import. Dunder names other than ``__all__``
    never run it (prometheus_client's ``__init__`` defines none). Not for ``importlib.reload`` before
    its first use (the reload's run would start a second, nested one).
    """

    def __getattr__(self, attribute: str) -> Any:
        if attribute.startswith("__") and attribute.endswith("__") and attribute != "__all__":
            raise AttributeError(attribute)  # the import system's questions: answered as by a plain package
        if importlib.machinery.PathFinder.find_spec(f"{self.__name__}.{attribute}", list(self.__path__)):
            # a submodule not imported yet (``from . import values`` in one of its siblings): a plain miss, so
            # the import system imports it; running the __init__ here would nest it in that sibling's import
            raise AttributeError(attribute)
        with _lock:  # another thread waits here for the __init__ to end; its own reads pass through
            if type(self) is PackageOnUse and self.__name__ not in _running:
                _running.add(self.__name__)
                try:
                    spec = self.__spec__
                    assert spec is not None and spec.loader is not None
                    spec.loader.exec_module(self)
                except BaseException:
                    if sys.modules.get(self.__name__) is self:  # as a failed import: the next one tries again
                        del sys.modules[self.__name__]
                    raise
                finally:
                    _running.discard(self.__name__)
                    self.__class__ = types.ModuleType  # type: ignore[assignment]  # a plain module from now on
        try:
            return self.__dict__[attribute]
        except KeyError:
            raise AttributeError(f"module {self.__name__!r} has no attribute {attribute!r}") from None


def parts_of(package: str) -> types.ModuleType:
    """``package`` in ``sys.modules`` with its ``__init__`` not run until one of its own names is read
    (``PackageOnUse``); the package as it is where it was imported already. Raises ImportError where it
    is not installed."""
    with _lock:
        module = sys.modules.get(package)
        if module is not None:
            return module
        spec = importlib.util.find_spec(package)
        if spec is None or spec.loader is None or spec.submodule_search_locations is None:
            raise ImportError(f"{package} is not an installed package", name=package)
        module = importlib.util.module_from_spec(spec)
        module.__class__ = PackageOnUse
        sys.modules[package] = module
        return module


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()  # PEP 503, with dist-info's underscores


def dist_version(name: str) -> str:
    """``importlib.metadata.version(name)``, read from the first ``<name>[-version].dist-info/METADATA`` in
    the directories of ``sys.path``, matched as importlib.metadata matches them (in directory order, names
    normalised, case-insensitive); where the first match is not a plain dist-info (an egg-info), where an
    entry before it is not a plain directory (a zip, an ``.egg``), or where none is found
    (PackageNotFoundError), importlib.metadata's own answer.

    importlib.metadata imports email, zipfile, csv, bz2, lzma, tempfile and importlib.resources (about
    1.3 MB of resident memory, 15 modules that nothing else in the daemon uses) for what is one line of a
    file here: the version of nvidia-ml-py in gpuwatch_build_info, APScheduler's own at its import."""
    metadata = _metadata_file(_normalized(name))
    if metadata is not None:
        try:
            with open(metadata, encoding="utf-8") as file:
                for line in file:
                    if line.startswith("Version:"):
                        return line[len("Version:"):].strip()
                    if not line.strip():  # the end of the headers
                        break
        except (OSError, ValueError):
            pass
    # not the stand-in of ``without_plugins``, whose ``version`` is this function
    return _real("importlib.metadata").version(name)  # raises PackageNotFoundError where there is none


def _metadata_file(wanted: str) -> str | None:
    """The METADATA of the first dist-info named ``wanted`` on sys.path; None where importlib.metadata must
    answer (the first match is an egg-info, a zip or an ``.egg`` comes first, or there is none)."""
    for entry in sys.path:
        where = entry or "."
        if entry.lower().endswith(".egg") or os.path.isfile(where):  # what only importlib.metadata reads
            return None
        try:
            children = os.listdir(where)
        except OSError:  # a directory gone or unreadable: nothing found there
            continue
        for child in children:
            low = child.lower()  # "Name-1.0.dist-info", "name.egg-info": the name before the version
            if low.endswith((".dist-info", ".egg-info")) and _normalized(low.rpartition(".")[0].partition("-")[0]) \
                    == wanted:
                return os.path.join(where, child, "METADATA") if low.endswith(".dist-info") else None
    return None


def _entry_points(**params: Any) -> Any:
    """APScheduler's plugin groups: none; any other question (another thread's import in the window):
    importlib.metadata's answer."""
    if str(params.get("group", "")).startswith("apscheduler."):
        return ()
    return _real("importlib.metadata").entry_points(**params)


def without_plugins() -> Any:
    """``deferred("importlib.metadata", answers=without_plugins())`` while APScheduler 3 loads: its scheduler
    class looks up its plugins (entry points of every installed distribution) at import, by alias ("interval",
    "threadpool"...); gpuwatch hands it trigger, executor and job store objects and never an alias, so the
    look-up finds none and importlib.metadata is not imported (``dist_version`` answers APScheduler's
    ``version``)."""
    return {"entry_points": _entry_points, "version": dist_version}
