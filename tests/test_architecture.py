"""Import rules of the architecture (style.md): data flows backend -> poller -> store -> exporter."""

import ast
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gpuwatch"


@functools.cache
def imports(path):
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return frozenset(found)


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE.parent).with_suffix("").as_posix().replace("/", "."), path


def importers_of(prefix):
    return {name for name, path in modules() if any(i == prefix or i.startswith(prefix + ".") for i in imports(path))}


def test_only_the_nvml_backend_imports_pynvml():
    assert importers_of("pynvml") == {"gpuwatch.backends.nvml"}


def test_only_the_poller_uses_apscheduler():
    assert importers_of("apscheduler") == {"gpuwatch.poller"}


def test_only_the_exporter_imports_prometheus_client():
    assert {m for m in importers_of("prometheus_client") if not m.startswith("gpuwatch.exporter")} == set()


LAYERS = {
    # module prefix: gpuwatch modules it must not import
    "gpuwatch.model": ("gpuwatch.backends", "gpuwatch.poller", "gpuwatch.store", "gpuwatch.exporter", "gpuwatch.cli",
                       "gpuwatch.rules", "gpuwatch.config"),
    "gpuwatch.backends": ("gpuwatch.poller", "gpuwatch.store", "gpuwatch.exporter", "gpuwatch.cli", "gpuwatch.rules"),
    "gpuwatch.store": ("gpuwatch.poller", "gpuwatch.exporter", "gpuwatch.cli", "gpuwatch.backends"),
    "gpuwatch.rules": ("gpuwatch.poller", "gpuwatch.exporter", "gpuwatch.cli", "gpuwatch.backends"),
    "gpuwatch.exporter": ("gpuwatch.poller", "gpuwatch.cli", "gpuwatch.backends"),
    "gpuwatch.poller": ("gpuwatch.exporter", "gpuwatch.cli"),
}


def test_lower_layers_never_import_higher_ones():
    for name, path in modules():
        for prefix, banned in LAYERS.items():
            if name == prefix or name.startswith(prefix + "."):
                bad = {i for i in imports(path) for b in banned if i == b or i.startswith(b + ".")}
                assert not bad, f"{name} imports {bad}"


def test_no_module_imports_another_modules_private_names():
    """A leading underscore means "this module's own": what another module needs is public there."""
    found = []
    for name, path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gpuwatch"):
                found += [f"{name} imports {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_") and a.name != "__version__"]
    assert found == []


def test_no_module_is_over_500_lines():
    long = {name: n for name, path in modules() if (n := len(path.read_text().splitlines())) > 500}
    assert long == {"gpuwatch.backends.nvml": long.get("gpuwatch.backends.nvml"),
                    "gpuwatch.backends.simulated.faults": long.get("gpuwatch.backends.simulated.faults")}


def test_the_tests_import_nothing_from_bench():
    """bench/ may use the tests' fakes and fleet (tests/fleetsim.py); the tests never load bench/ code."""
    tests = Path(__file__).resolve().parent
    bench = {path.stem for path in (tests.parent / "bench").glob("*.py")}
    local = {path.stem for path in tests.glob("*.py")}  # a module of tests/ that has a bench/ namesake
    found = []
    for path in sorted(tests.rglob("*.py")):
        if "build" in path.parts or path == Path(__file__).resolve():
            continue
        text = path.read_text()
        found += [f"{path.name} imports {name}" for name in imports(path)
                  if name.split(".")[0] == "bench" or (name.split(".")[0] in bench - local)]
        found += [f"{path.name} loads a file of bench/" for line in text.splitlines()
                  if "spec_from_file_location" in line and "bench" in line]
    assert found == []
