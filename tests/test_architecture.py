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
    assert {m for m in importers_of("pynvml") if not m.startswith("gpuwatch.backends.nvml.")} == set()


def test_only_the_schedule_uses_apscheduler():
    assert importers_of("apscheduler") == {"gpuwatch.schedule"}


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
    assert long == {}


def test_the_engine_names_no_group():
    """What the poller, the NVML backend, the exporter and the agent need to know of a group is in its
    declaration (events, attributed, host, ...) or the Selection: a group is added in its own module only."""
    from gpuwatch.groups import ALL

    engine = ("gpuwatch.poller", "gpuwatch.agent", "gpuwatch.backends.nvml", "gpuwatch.exporter")
    named = []
    for name, path in modules():
        if name.startswith(engine):
            named += [f"{name}:{node.lineno} {node.value!r}" for node in ast.walk(ast.parse(path.read_text()))
                      if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in ALL]
    assert named == []


def test_every_family_is_emitted_by_exactly_one_unit():
    """A family's samples come from one place: one group's render, or one joint unit (groups/joint.py)."""
    emitters: dict[str, set[str]] = {}
    for name, path in modules():
        if not name.startswith("gpuwatch.groups."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "emit"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                unit = next((f.name for f in ast.walk(ast.parse(path.read_text()))
                             if isinstance(f, ast.FunctionDef) and f.lineno <= node.lineno <= (f.end_lineno or 0)
                             and name == "gpuwatch.groups.joint"), name)
                emitters.setdefault(node.args[0].value, set()).add(unit)
    assert "gpuwatch_gpu_job_info" in emitters
    assert {family: units for family, units in emitters.items() if len(units) > 1} == {}
    exporter = {arg.value for name, path in modules() if name.startswith("gpuwatch.exporter")
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
                and not (isinstance(node.func, ast.Name) and node.func.id == "Spec")  # a declaration
                for arg in node.args if isinstance(arg, ast.Constant)}
    assert exporter & emitters.keys() == set()  # the renderer emits no group's family of its own


def test_no_rule_family_imports_another():
    """A rule family (a module of gpuwatch/rules/ with a RULES tuple) imports what families share from
    gpuwatch/rules/common.py and the contract from base, never from another family."""
    rules = PACKAGE / "rules"
    families = {path.stem for path in rules.glob("*.py")
                if any(isinstance(node, (ast.Assign, ast.AnnAssign)) and "RULES" in ast.unparse(node).split("=")[0]
                       for node in ast.parse(path.read_text()).body)}
    assert {"fan", "thermal", "throttle", "health", "interconnect", "workload", "node"} <= families
    found = []
    for family in sorted(families):
        for node in ast.walk(ast.parse((rules / f"{family}.py").read_text())):
            if isinstance(node, ast.ImportFrom):
                base = "gpuwatch.rules" if node.level else node.module or ""  # a relative import: from the package
                if node.level and node.module:
                    base += "." + node.module
                names = [base] + [f"{base}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            found += [f"{family} imports {name}" for name in names
                      if any(name == f"gpuwatch.rules.{other}" or name.startswith(f"gpuwatch.rules.{other}.")
                             for other in families - {family})]
    assert found == []


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
