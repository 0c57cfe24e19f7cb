"""asyncio, which structlog and APScheduler import but gpuwatch never runs, is imported only when used.

Each case runs in a fresh interpreter: what a process has imported cannot be undone in this one.
"""

from __future__ import annotations

import subprocess
import sys


def run(code: str) -> list[str]:
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_the_agent_loads_without_asyncio():
    """The daemon's whole import graph (the commands, the poller with APScheduler, structlog, the NVML
    backend, the HTTP server) leaves asyncio out; "import asyncio" afterwards is the real module."""
    out = run("""
import sys
import gpuwatch.cli.run, gpuwatch.poller, gpuwatch.backends.nvml.backend, gpuwatch.web.server, structlog.stdlib
print("asyncio" in sys.modules)
import asyncio
print(type(asyncio).__name__, asyncio.run(asyncio.sleep(0, "ran")))
""")
    assert out == ["False", "module", "ran"]


def test_structlog_async_methods_load_asyncio_on_first_use():
    out = run("""
import sys
import gpuwatch.logs as logs, structlog
logs.configure("info", "json")
log = structlog.stdlib.get_logger()
print("asyncio" in sys.modules)
import asyncio
async def main():
    await log.ainfo("async_line")  # structlog's own reference to asyncio, loaded on this first use
    return structlog.stdlib.asyncio.get_running_loop is asyncio.get_running_loop
print(asyncio.run(main()))
""")
    assert out == ["False", "True"]


def test_apscheduler_tells_coroutine_functions_apart_through_the_stand_in():
    """APScheduler binds asyncio.iscoroutinefunction at import; the stand-in hands out a function that
    imports asyncio when called and answers as asyncio does."""
    out = run("""
import sys, functools
import gpuwatch.poller
from apscheduler.util import iscoroutinefunction_partial
print("asyncio" in sys.modules)
async def co(): pass
def plain(): pass
print(iscoroutinefunction_partial(functools.partial(co)), iscoroutinefunction_partial(plain), "asyncio" in sys.modules)
""")
    assert out == ["False", "True", "False", "True"]


def test_a_module_already_imported_is_not_deferred():
    """Where asyncio is loaded first (grpc.aio on a Kubernetes node), structlog binds the real module."""
    out = run("""
import asyncio, types
import gpuwatch.logs, structlog.stdlib, gpuwatch.poller, apscheduler.util
print(structlog.stdlib.asyncio is asyncio, apscheduler.util.iscoroutinefunction is asyncio.iscoroutinefunction)
""")
    assert out == ["True", "True"]


def test_the_stand_in_serves_from_imports_and_refuses_nothing_else():
    out = run("""
import sys
from gpuwatch.deferred import LoadedOnUse, deferred
with deferred("json", functions=("dumps",)):
    import json
    from json import dumps, loads  # dumps: the forwarder; loads: imports the real json on this read
print(isinstance(json, LoadedOnUse), "json" in sys.modules, dumps([1]), loads("[2]"), json.JSONDecodeError.__name__)
print(type(sys.modules["json"]).__name__, hasattr(json, "__path__"))
""")
    assert out == ["True", "True", "[1]", "[2]", "JSONDecodeError", "module", "False"]


def test_a_library_that_needs_more_than_the_stand_in_serves_is_loaded_as_usual(tmp_path):
    """A future structlog or APScheduler that imports asyncio's submodules at package level: load() gets the
    ImportError the stand-in causes and imports the library again with the real asyncio: a node starts."""
    (tmp_path / "needs_more").mkdir()
    (tmp_path / "needs_more" / "__init__.py").write_text("import asyncio.events\nOK = asyncio.events.get_event_loop_policy\n")
    out = run(f"""
import sys
sys.path.insert(0, {str(tmp_path)!r})
from gpuwatch.deferred import load
library = load("needs_more", "asyncio")
print(type(sys.modules["asyncio"]).__name__, callable(library.OK))
""")
    assert out == ["module", "True"]
