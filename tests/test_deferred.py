"""What libraries import but gpuwatch never runs is imported only when used: asyncio (structlog,
APScheduler), OpenSSL through ssl and hashlib (prometheus_client's HTTP servers, http.client).

Each case runs in a fresh interpreter: what a process has imported cannot be undone in this one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest


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


# -- importlib.metadata: APScheduler's plugin look-up and the binding's version ---------------------

def test_the_agent_loads_without_importlib_metadata_and_its_answers_are_the_same():
    """importlib.metadata (email, zipfile, csv, bz2, lzma, tempfile...) is not imported by the daemon, nor
    http.server, wsgiref and html (gpuwatch.web.server parses requests itself);
    the versions read without it equal its own answers; APScheduler's scheduler runs a job all the same."""
    out = run("""
import sys, threading
import gpuwatch.cli.run, gpuwatch.agent, gpuwatch.web.server, gpuwatch.exporter.render
from gpuwatch.schedule import IntervalTrigger, SteadyScheduler, utc_now
from gpuwatch.exporter.render import binding_version
import apscheduler
print([m for m in ("importlib.metadata", "zipfile", "csv", "email", "html", "http.server", "http.client", "wsgiref")
       if m in sys.modules] or "none")
ran = threading.Event()
scheduler = SteadyScheduler(timezone="UTC")
scheduler.add_job(ran.set, IntervalTrigger(seconds=60, timezone="UTC"), next_run_time=utc_now())
scheduler.start()
print(ran.wait(60), SteadyScheduler._trigger_plugins, "importlib.metadata" in sys.modules)
scheduler.shutdown()
ours = (binding_version(), apscheduler.release)
from importlib import metadata
print(ours == (metadata.version("nvidia-ml-py"), metadata.version("APScheduler").split("-")[0]))
""")
    assert out == ["none", "True", "{}", "False", "True"]


def test_dist_version_reads_the_first_dist_info_on_the_path_as_importlib_metadata_does(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    for where, version in ((first, "1.2.3"), (second, "9.9")):
        (where / "Some_Dist-0.dist-info").mkdir(parents=True)  # the directory's version is not read
        (where / "Some_Dist-0.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: some-dist\nVersion: {version}\n\nVersion: not a header\n")
    (second / "other.dist-info").mkdir()
    out = run(f"""
import sys
sys.path[:0] = [{str(tmp_path / "missing")!r}, {str(first)!r}, {str(second)!r}]
from gpuwatch.deferred import dist_version
print(dist_version("some-dist"), dist_version("SOME.DIST"), "importlib.metadata" in sys.modules)
from importlib import metadata
print(metadata.version("some-dist"))
try:
    dist_version("no-such-dist")
except metadata.PackageNotFoundError:
    print("PackageNotFoundError")
""")
    assert out == ["1.2.3", "1.2.3", "False", "1.2.3", "PackageNotFoundError"]


@pytest.mark.parametrize("layout", ["plain", "upper", "egg-info first", "zip first"])
def test_dist_version_answers_as_importlib_metadata_in_other_layouts(tmp_path, layout):
    """A dist-info without a version in its name, an upper-case one, an egg-info or a zip before the
    dist-info: the same answer as importlib.metadata (from its own reading where it is not a plain
    dist-info), and importlib.metadata is not imported for the first two."""
    import zipfile

    first, second = tmp_path / "first", tmp_path / "second"
    second.mkdir()
    (second / "demo_dist-9.0.dist-info").mkdir()
    (second / "demo_dist-9.0.dist-info" / "METADATA").write_text("Name: demo-dist\nVersion: 9.0\n")
    path = [first, second]
    if layout in ("plain", "upper"):
        where = first / ("demo_dist.dist-info" if layout == "plain" else "DEMO_DIST-2.0.DIST-INFO")
        where.mkdir(parents=True)
        (where / "METADATA").write_text("Name: demo-dist\nVersion: 2.0\n")
    elif layout == "egg-info first":
        (first / "demo_dist.egg-info").mkdir(parents=True)
        (first / "demo_dist.egg-info" / "PKG-INFO").write_text("Name: demo-dist\nVersion: 3.0.dev0\n")
    else:
        path[0] = tmp_path / "dists.zip"
        with zipfile.ZipFile(path[0], "w") as archive:
            archive.writestr("demo_dist-0.5.dist-info/METADATA", "Name: demo-dist\nVersion: 0.5\n")
    out = run(f"""
import sys
sys.path[:0] = {[str(p) for p in path]!r}
from gpuwatch.deferred import dist_version
ours = dist_version("demo-dist")
loaded = "importlib.metadata" in sys.modules
from importlib import metadata
print(ours, ours == metadata.version("demo-dist"), loaded)
""")
    expected = {"plain": "2.0", "upper": "2.0", "egg-info first": "3.0.dev0", "zip first": "0.5"}[layout]
    assert out == [expected, "True", str(layout not in ("plain", "upper"))]


def test_the_stand_in_answers_other_entry_point_groups_as_importlib_metadata():
    """Another thread importing importlib.metadata while APScheduler loads gets the stand-in's functions:
    only APScheduler's plugin groups are empty there."""
    out = run("""
from gpuwatch.deferred import without_plugins
entry_points = without_plugins()["entry_points"]
ours = entry_points(group="console_scripts"), entry_points(group="apscheduler.triggers")
from importlib import metadata
print(ours[0] == metadata.entry_points(group="console_scripts"), len(ours[0]) > 0, ours[1] == ())
""")
    assert out == ["True", "True", "True"]


def test_apscheduler_loads_without_multiprocessing_and_its_process_pool_still_works():
    """gpuwatch uses APScheduler's thread pool only; its process pool module loads without multiprocessing
    (which comes on first use) and catches what a broken process pool raises, as before."""
    out = run("""
import os, sys
import gpuwatch.schedule
print([m for m in ("multiprocessing", "concurrent.futures.process", "tempfile", "shutil") if m in sys.modules]
      or "none")
from apscheduler.executors import pool
executor = pool.ProcessPoolExecutor(max_workers=1)  # multiprocessing.get_context through the stand-in
print(executor._pool.submit(os.getpid).result(timeout=60) != os.getpid())
from concurrent.futures.process import BrokenProcessPool
print(issubclass(BrokenProcessPool, pool.BrokenProcessPool))
executor.shutdown()
""")
    assert out == ["none", "True", "True"]


# -- OpenSSL: ssl, hashlib, and prometheus_client's package __init__ ---------------------------------

OPENSSL = ("ssl", "_ssl", "hashlib", "_hashlib", "urllib.request", "prometheus_client.exposition")


def test_the_agent_loads_without_openssl_and_prometheus_client_completes_on_first_use():
    """The daemon's import graph loads neither ssl nor hashlib (OpenSSL's libcrypto: 5 MB); prometheus_client
    is there without its __init__ until one of its own names is read, then whole, in the same object."""
    out = run(f"""
import sys
import gpuwatch.cli.run, gpuwatch.agent, gpuwatch.web.server, gpuwatch.exporter.render
print([m for m in {OPENSSL!r} if m in sys.modules] or "none")
package = sys.modules["prometheus_client"]
print(type(package).__name__, "process_collector" in vars(package), "Counter" in vars(package))
from prometheus_client.core import GaugeMetricFamily  # a custom collector's import: its siblings "from . import"
import prometheus_client.multiprocess
print(type(package).__name__, [m for m in {OPENSSL!r} if m in sys.modules] or "none")
from prometheus_client import Counter, CollectorRegistry, generate_latest
registry = CollectorRegistry()
Counter("ran", "once", registry=registry).inc()
print(type(sys.modules["prometheus_client"]).__name__, sys.modules["prometheus_client"] is package,
      "prometheus_client.exposition" in sys.modules, b"ran_total 1.0" in generate_latest(registry))
""")
    assert out == ["none", "PackageOnUse", "True", "False", "PackageOnUse", "none", "module", "True", "True", "True"]


def test_a_package_without_its_init_runs_it_once_on_the_first_read_of_its_own_names(tmp_path):
    """parts_of: submodules import without the __init__; the first read of a name only the __init__ makes
    runs it once (its own reads and ``from . import`` inside it pass through); an __init__ that fails is
    an import that failed (the next import tries again); an installed package that is not there is an
    ImportError."""
    pkg = tmp_path / "heavy"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import os\nRUNS = int(os.environ.get('RUNS', '0')) + 1\nos.environ['RUNS'] = str(RUNS)\n"
        "if os.environ.get('FAIL') == str(RUNS):\n    raise RuntimeError('init failed')\n"
        "from . import part, other\nNAME = part.VALUE + other.VALUE\n")
    (pkg / "part.py").write_text("VALUE = 'a'\n")
    (pkg / "other.py").write_text("from . import part\nVALUE = 'b'\n")  # a sibling read: not the __init__
    out = run(f"""
import os, sys
sys.path.insert(0, {str(tmp_path)!r})
from gpuwatch.deferred import parts_of
os.environ["FAIL"] = "1"
package = parts_of("heavy")
from heavy.other import VALUE
print(VALUE, os.environ.get("RUNS", "0"), type(package).__name__)
try:
    from heavy import NAME
except RuntimeError as exc:
    print("failed:", exc.args[0].replace(" ", "_"), "heavy" in sys.modules)
import heavy
print(heavy.NAME, heavy.RUNS, heavy.part is sys.modules["heavy.part"], heavy is not package)
print(parts_of("heavy") is heavy, heavy.NAME, os.environ["RUNS"])
try:
    parts_of("not_installed_anywhere")
except ImportError as exc:
    print("ImportError", exc.name)
""")
    assert out == ["b", "0", "PackageOnUse", "failed:", "init_failed", "False", "ab", "2", "True", "True",
                   "True", "ab", "2", "ImportError", "not_installed_anywhere"]


@pytest.mark.daemon
def test_a_plain_daemon_never_maps_openssl(tmp_path):
    """`gpuwatch run` over the fake library, scraped in both formats, gzip, and /healthz and /status:
    libcrypto and libssl are not in its address space (the TLS and basic-auth daemon loads them:
    tests/test_webconfig.py::test_the_daemon_serves_mtls_and_basic_auth_and_check_speaks_them)."""
    import urllib.request

    import fakenvml
    from daemon import Daemon, fake_env, wait_for

    fx = fakenvml.prepare(tmp_path, fakenvml.FakeNode.h200(2))
    d = Daemon(tmp_path, fake_env(fx))
    try:
        wait_for(lambda: "\ngpuwatch_temperature_celsius{" in d.get("/metrics")[1], what="a first reading")
        for accept in ("application/openmetrics-text; version=1.0.0", "text/plain;version=0.0.4", ""):
            request = urllib.request.Request(d.base + "/metrics", headers={"Accept": accept,
                                                                            "Accept-Encoding": "gzip"})
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200 and response.read()
        assert d.get("/healthz")[0] == 200 and d.get("/api/v1/status")[0] == 200
        maps = open(f"/proc/{d.proc.pid}/maps").read()
        assert "libcrypto" not in maps and "libssl" not in maps and "_hashlib" not in maps
    finally:
        d.stop()


def test_ipaddress_and_tzlocals_windows_table_load_on_first_use():
    """pathlib imports urllib.parse, which imports ipaddress (0.3 MB): under gpuwatch it is imported where a
    URL with a bracketed host is parsed, or an [IPv6]:port configured. tzlocal's Windows zone table likewise.
    (An editable install's path finder imports pathlib at startup: the child forgets those modules first.)"""
    out = run("""
import sys
for name in ("ipaddress", "urllib.parse", "pathlib"):
    sys.modules.pop(name, None)
import gpuwatch.cli.run, gpuwatch.poller, gpuwatch.backends.nvml.backend, gpuwatch.web.server
print("ipaddress" in sys.modules, "tzlocal.windows_tz" in sys.modules)
from urllib.parse import urlsplit
print(urlsplit("http://[::1]:9400/metrics").hostname, "ipaddress" in sys.modules)
try:
    urlsplit("http://[nope]/")
except ValueError:
    print("ValueError")
from gpuwatch.config import parse_listen_address
print(parse_listen_address("[::1]:9400") == ("::1", 9400))
from tzlocal import utils
print(len(utils.windows_tz.tz_win) > 100, "tzlocal.windows_tz" in sys.modules)
""")
    assert out == ["False", "False", "::1", "True", "ValueError", "True", "True", "True"]
