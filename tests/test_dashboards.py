"""The Grafana dashboards in deploy/grafana: lint-style structural checks, then every panel query run
against a real Prometheus that scrapes two real gpuwatch processes.

The structural checks follow grafana/dashboard-linter's rules (shared/reference/ecosystem-conventions.md
§5.3); their exclusions live in the `.lint` block of deploy/grafana/README.md. The live test starts a
simulated node with fans (`--backend simulated --sim.faults true`) and an NVML node over the fake
library (tests/fakenvml) with the faults the fault panels exist for: a lost GPU, uncorrected ECC errors,
a pending row remap, an XID, SW power cap + SW thermal slowdown, and for the Jobs dashboard workloads:
processes on two GPUs that a fake /proc attributes to Slurm jobs (one GPU idle, with allocated_idle's hold
set to 0 so that it fires at once) and, sharing the busy GPU, a process gpuwatch cannot attribute (no job,
no user). Prometheus 2.42 scrapes both every second; each target of each panel, with Grafana's variables
substituted, must return data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import fakenvml
import fleetsim
import pytest
import yaml
from daemon import Daemon, fake_env, stop_process, wait_for
from fleetsim import quick

from gpuwatch.exporter.catalogue import CATALOGUE

YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml's parser where PyYAML has it: the same documents, faster

ROOT = Path(__file__).resolve().parents[1]
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD_FILES = {
    "gpuwatch-node": GRAFANA / "dashboards" / "gpuwatch-node.json",
    "gpuwatch-fleet": GRAFANA / "dashboards" / "gpuwatch-fleet.json",
    "gpuwatch-jobs": GRAFANA / "dashboards" / "gpuwatch-jobs.json",
}
TITLES = {"gpuwatch-node": "gpuwatch / Node", "gpuwatch-fleet": "gpuwatch / Fleet", "gpuwatch-jobs": "gpuwatch / Jobs"}
DS = {"type": "prometheus", "uid": "${datasource}"}
# Grafana unit ids (packages/grafana-data/src/valueFormats/categories.ts): the base units of gpuwatch's
# metrics, plain numbers for counts and states, and rpm for the fan RPM gauge.
ALLOWED_UNITS = {"celsius", "watt", "joule", "percentunit", "bytes", "Bps", "hertz", "s", "none", "short", "rotrpm"}
STANDARD_METRICS = {"up"}  # plus process_* (prometheus_client's process collector)
RECORDING_RULES = ROOT / "deploy" / "prometheus" / "recording.rules.yml"
# the series the shipped recording rules record: dashboards may read them (the Fleet's aggregates do)
RECORDED = {rule["record"] for group in yaml.load(RECORDING_RULES.read_text(), Loader=YAML_LOADER)["groups"]
            for rule in group["rules"]}
WORKLOAD_RECORDED = {name for name in RECORDED if "workload" in name.split(":")[0]}  # per (instance, workload)
FLEET_LEVELS = {"job", "job_rule", "job_reason", "rack", "room", "pdu"}  # recorded without an instance
RECORDED_LABELS: dict[str, set[str]] = {}
for _group in yaml.load(RECORDING_RULES.read_text(), Loader=YAML_LOADER)["groups"]:
    for _rule in _group["rules"]:
        RECORDED_LABELS.setdefault(_rule["record"], set()).update(_rule.get("labels") or {})
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "state-timeline", "row"}

VARIABLES = {
    "job": "label_values(gpuwatch_gpu_info, job)",
    "instance": 'label_values(gpuwatch_gpu_info{job=~"$job"}, instance)',
    "gpu": 'label_values(gpuwatch_gpu_info{job=~"$job", instance=~"$instance"}, gpu)',
}
# The Fleet and Jobs dashboards read recorded series only, their variables too: they work on a global
# store that receives the shards' recordings and no raw series (docs/scaling.md, tests/test_scaling.py).
RECORDED_VARIABLES = {
    "job": "label_values(instance:gpuwatch_gpus_by_state:count, job)",
    "instance": 'label_values(instance:gpuwatch_gpus_by_state:count{job=~"$job"}, instance)',
    "user": 'label_values(workload:gpuwatch_gpus:sum{job=~"$job", instance=~"$instance"}, user)',
    "job_id": 'label_values(workload:gpuwatch_gpus:sum{job=~"$job", instance=~"$instance", user=~"$user"}, job_id)',
}
EXTRA_VARIABLES = {"gpuwatch-node": ["gpu"], "gpuwatch-fleet": [], "gpuwatch-jobs": ["user", "job_id"]}
# "All" of user and job_id must match the empty value too: a process gpuwatch cannot attribute (scheduler
# unknown) has no user and no job id, and a plain process (scheduler none) no job id.
ALL_VALUES = {"user": ".*", "job_id": ".*"}


def load(uid: str) -> dict:
    return json.loads(DASHBOARD_FILES[uid].read_text())


all_panels = fleetsim.all_panels  # every panel, those of collapsed rows too


def query_panels(dashboard: dict) -> list[dict]:
    return [p for p in all_panels(dashboard) if p["type"] != "row"]


def lint_exclusions() -> dict[str, set[tuple[str, str]]]:
    """The `.lint` block of deploy/grafana/README.md: rule -> {(dashboard title, panel title)}."""
    text = (GRAFANA / "README.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if b.startswith("# .lint")]
    assert len(blocks) == 1, "deploy/grafana/README.md needs exactly one ```yaml block starting with '# .lint'"
    doc = yaml.load(blocks[0], Loader=YAML_LOADER)
    out = {}
    for rule, body in doc["exclusions"].items():
        assert body.get("reason", "").strip(), f"lint exclusion {rule} needs a reason"
        out[rule] = {(e["dashboard"], e["panel"]) for e in body["entries"]}
    return out


# ------------------------------------------------------------------------------ a small PromQL scanner

TOKEN = re.compile(r"""
    (?P<str>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<var>\$\{?\w+\}?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<num>\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)
  | (?P<punct>[(){},])
  | (?P<op>==|!=|>=|<=|=~|!~|[-+*/%^<>=])
  | (?P<ws>\s+)
""", re.X)
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset"} | GROUPING
AGGREGATORS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
               "count_values"}
COUNTER_FUNCTIONS = {"rate", "irate", "increase"}


@dataclass
class Selector:
    metric: str
    matchers: str  # the text between the braces, whitespace removed
    function: str | None  # innermost enclosing function


@dataclass
class Range:
    duration: str
    function: str | None
    step: str | None = None  # a subquery's resolution: [duration:step]


def scan(expr: str) -> tuple[list[Selector], list[Range]]:
    """Metric selectors and range durations of a PromQL expression, with their enclosing function."""
    tokens = []
    pos = 0
    for m in TOKEN.finditer(expr):
        assert m.start() == pos, f"cannot tokenize {expr[pos:pos + 20]!r} in {expr!r}"
        pos = m.end()
        if m.lastgroup != "ws":
            tokens.append((m.lastgroup, m.group()))
    assert pos == len(expr), f"cannot tokenize {expr[pos:pos + 20]!r} in {expr!r}"
    tokens.append(("end", ""))
    selectors, ranges, stack = [], [], []

    def innermost() -> str | None:
        return next((f for f in reversed(stack) if f), None)

    def skip_group(i: int) -> int:  # tokens[i] == "(": return the index after the matching ")"
        while tokens[i][1] != ")":
            i += 1
        return i + 1

    i = 0
    while tokens[i][0] != "end":
        kind, text = tokens[i]
        following = tokens[i + 1][1]
        if kind == "ident":
            if text in GROUPING and following == "(":
                i = skip_group(i + 1)
            elif text in AGGREGATORS and following in ("by", "without"):
                i = skip_group(i + 2)
                assert tokens[i][1] == "(", expr
                stack.append(text)
                i += 1
            elif following == "(":
                stack.append(text)
                i += 2
            elif text.lower() in KEYWORDS | {"inf", "nan"}:
                i += 1
            else:
                i += 1
                matchers = ""
                if tokens[i][1] == "{":
                    start = i + 1
                    while tokens[i][1] != "}":
                        i += 1
                    matchers = "".join(t for _, t in tokens[start:i])
                    i += 1
                selectors.append(Selector(text, matchers, innermost()))
        elif kind == "range":
            duration, colon, step = text[1:-1].partition(":")
            ranges.append(Range(duration, innermost(), step if colon else None))
            i += 1
        elif text == "(":
            stack.append(None)
            i += 1
        elif text == ")":
            stack.pop()
            i += 1
        else:
            assert text != "{", f"selector without a metric name in {expr!r}"
            i += 1
    assert not stack, f"unbalanced parentheses in {expr!r}"
    return selectors, ranges


def test_scanner_understands_the_constructs_the_dashboards_use():
    sels, ranges = scan('topk(10, sum by (job, instance) (rate(a_total{job=~"$job"}[$__rate_interval]))) '
                        '* on(instance, uuid) group_left(name) b{x="y"} or vector(0)')
    assert [(s.metric, s.function) for s in sels] == [("a_total", "rate"), ("b", None)]
    assert sels[1].matchers == 'x="y"'
    assert [(r.duration, r.function) for r in ranges] == [("$__rate_interval", "rate")]
    sels, ranges = scan('sum(sum_over_time((a{x="y"} * on(uuid) group_left() rate(b_total[$__rate_interval]))'
                        '[$__range:$__interval])) * $__interval_ms / 1000')
    assert [(s.metric, s.function) for s in sels] == [("a", "sum_over_time"), ("b_total", "rate")]
    assert [(r.duration, r.step, r.function) for r in ranges] == [
        ("$__rate_interval", None, "rate"), ("$__range", "$__interval", "sum_over_time")]


# ---------------------------------------------------------------------------------- structural checks

@pytest.mark.parametrize("uid", sorted(DASHBOARD_FILES))
def test_dashboard_model(uid):
    text = DASHBOARD_FILES[uid].read_text()
    d = json.loads(text)
    assert d["uid"] == uid
    assert d["title"] == TITLES[uid]
    assert d["schemaVersion"] == 39
    assert d["editable"] is False
    assert d.get("id") is None
    assert "__inputs" not in d and "__requires" not in d
    assert "DS_PROMETHEUS" not in text, "file provisioning never substitutes ${DS_PROMETHEUS}"
    assert d.get("description")


@pytest.mark.parametrize("uid", sorted(DASHBOARD_FILES))
def test_variables(uid):
    variables = {v["name"]: v for v in load(uid)["templating"]["list"]}
    expected = ["datasource", "job", "instance"] + EXTRA_VARIABLES[uid]
    assert list(variables) == expected
    ds = variables["datasource"]
    assert (ds["type"], ds["query"], ds["label"]) == ("datasource", "prometheus", "Data source")
    for name in expected[1:]:
        v = variables[name]
        query = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert v["type"] == "query", name
        wanted = (VARIABLES if uid == "gpuwatch-node" else RECORDED_VARIABLES)[name]
        assert query == wanted and v["definition"] == wanted, name
        if uid != "gpuwatch-node":
            assert re.match(r"label_values\(([a-z_:]+)", query).group(1) in RECORDED, name  # type: ignore[union-attr]
        assert v["datasource"] == DS, name
        if (uid, name) == ("gpuwatch-node", "instance"):  # one node: never the whole fleet's per-GPU series
            assert (v["multi"], v["includeAll"], v["refresh"], v.get("allValue")) == (False, False, 2, None)
            continue
        all_value = ALL_VALUES.get(name, ".+")
        assert (v["multi"], v["includeAll"], v["allValue"], v["refresh"]) == (True, True, all_value, 2), name
        assert v.get("label"), name


@pytest.mark.parametrize("uid", sorted(DASHBOARD_FILES))
def test_panels(uid):
    d = load(uid)
    panels = all_panels(d)
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    titles = set()
    for p in panels:
        where = f"{uid} panel {p.get('id')} {p.get('title')!r}"
        assert p["type"] in PANEL_TYPES, where
        assert p.get("title", "").strip(), where
        assert p.get("description", "").strip(), where
        assert p["title"] not in titles, f"{where}: duplicate title"
        titles.add(p["title"])
        g = p["gridPos"]
        assert all(isinstance(g[k], int) for k in "xywh"), where
        assert g["x"] >= 0 and g["y"] >= 0 and g["w"] >= 1 and g["h"] >= 1 and g["x"] + g["w"] <= 24, where
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{where} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        if p["type"] == "row":
            assert not p.get("targets"), where
            continue
        assert p["datasource"] == DS, where
        assert p["targets"], where
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert unit in ALLOWED_UNITS, f"{where}: unit {unit!r}"
        for o in p["fieldConfig"].get("overrides", []):
            for prop in o["properties"]:
                if prop["id"] == "unit":
                    assert prop["value"] in ALLOWED_UNITS, f"{where}: override unit {prop['value']!r}"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert t["datasource"] == DS, where
            assert t["expr"].strip(), where


def _known_labels(metric: str) -> set[str]:
    if metric in CATALOGUE:
        return set(CATALOGUE[metric].labels) | {"job", "instance"}
    if metric in RECORDED:  # its rules' static labels, the labels its level keeps (job_rule: rule), topology
        level = metric.split(":")[0]
        parts = level.split("_")
        kept = set(parts[1:]) | ({"severity"} if level.endswith("_rule") else set())
        if "workload" in parts:
            kept |= {"scheduler", "job_id", "user"}
        if parts[0] == "gpu":
            kept |= {"gpu", "uuid"}
        return {"job", "instance", "rack", "row", "room", "pdu"} | RECORDED_LABELS.get(metric, set()) | kept
    return {"job", "instance"}


@pytest.mark.parametrize("uid", sorted(DASHBOARD_FILES))
def test_queries_follow_the_lint_rules(uid):
    d = load(uid)
    exclusions = lint_exclusions()
    used = {rule: set() for rule in exclusions}
    per_gpu_panels = 0
    for p in query_panels(d):
        key = (d["title"], p["title"])
        for t in p["targets"]:
            where = f"{uid} {p['title']!r} {t['refId']}: {t['expr']}"
            selectors, ranges = scan(t["expr"])
            assert selectors, where
            if uid == "gpuwatch-jobs":  # every panel shows the selected users' and jobs' workloads only
                assert any(s.metric in ("gpuwatch_gpu_job_info", *WORKLOAD_RECORDED) and 'user=~"$user"' in s.matchers
                           and 'job_id=~"$job_id"' in s.matchers for s in selectors), \
                    f"{where}: no gpuwatch_gpu_job_info{{user=~\"$user\", job_id=~\"$job_id\"}} or workload: series"
            if any(s.metric in CATALOGUE and "gpu" in CATALOGUE[s.metric].labels for s in selectors):
                per_gpu_panels += 1
            if uid != "gpuwatch-node":  # the Fleet and Jobs dashboards read recorded series only (issue 12)
                raw = sorted({s.metric for s in selectors if s.metric not in RECORDED})
                assert not raw, f"{where}: reads {raw} raw: a recording rule holds at 10,000 nodes (bench/fleet.py)"
            for s in selectors:
                # every metric is gpuwatch's (counters with _total, as exposed) or a standard one
                assert (s.metric in CATALOGUE or s.metric in STANDARD_METRICS or s.metric in RECORDED
                        or s.metric.startswith("process_")), f"{where}: unknown metric {s.metric}"
                # target-job-rule / target-instance-rule; fleet-level recorded series have no instance
                fleet_level = s.metric in RECORDED and s.metric.split(":")[0] in FLEET_LEVELS
                assert 'job=~"$job"' in s.matchers and (fleet_level or 'instance=~"$instance"' in s.matchers), \
                    f"{where}: {s.metric} lacks job/instance matchers"
                if fleet_level:
                    assert "instance selection does not apply" in p["description"], \
                        f"{where}: say that the instance selection does not apply to {s.metric}"
                if uid == "gpuwatch-node" and s.metric in CATALOGUE and "gpu" in CATALOGUE[s.metric].labels:
                    assert 'gpu=~"$gpu"' in s.matchers, f"{where}: per-GPU {s.metric} lacks gpu=~\"$gpu\""
                for label in re.findall(r"([A-Za-z_]\w*)(?:=~|!~|!=|=)", s.matchers):
                    assert label in _known_labels(s.metric), f"{where}: {s.metric} has no label {label}"
                # target-counter-agg-rule
                if s.metric.endswith("_total") and s.function not in COUNTER_FUNCTIONS:
                    assert key in exclusions.get("target-counter-agg-rule", set()), \
                        f"{where}: {s.metric} outside rate/irate/increase"
                    used["target-counter-agg-rule"].add(key)
                if s.metric in CATALOGUE and CATALOGUE[s.metric].type == "counter":
                    assert s.metric.endswith("_total"), where
            # target-rate-interval-rule
            for r in ranges:
                if r.step is not None:  # a subquery: integrates over the time range at Grafana's step
                    assert (r.duration, r.step) == ("$__range", "$__interval"), where
                    assert r.function and r.function.endswith("_over_time"), where
                    continue
                if r.function in COUNTER_FUNCTIONS and r.duration != "$__rate_interval":
                    assert r.duration == "$__range" and key in exclusions.get("target-rate-interval-rule", set()), \
                        f"{where}: [{r.duration}] in {r.function}()"
                    used["target-rate-interval-rule"].add(key)
                assert r.duration in ("$__rate_interval", "$__range", "$__interval"), where
    for rule, entries in exclusions.items():
        mine = {e for e in entries if e[0] == d["title"]}
        assert mine <= used[rule], f"unneeded {rule} exclusions: {sorted(mine - used[rule])}"
    assert per_gpu_panels or uid != "gpuwatch-node"


def test_dashboards_cover_the_brief():
    node = {p["title"]: p for p in query_panels(load("gpuwatch-node"))}
    fleet = {p["title"]: p for p in query_panels(load("gpuwatch-fleet"))}

    def exprs(panel):
        return " ".join(t["expr"] for t in panel["targets"])

    assert "gpuwatch_temperature_threshold_celsius" in exprs(node["Temperature against thresholds"])
    fans = node["Fan speed against target"]
    assert "gpuwatch_fan_target_speed_ratio" in exprs(fans)
    assert "passively cooled" in fans["description"] and "not an error" in fans["description"]
    assert node["Clock event (throttle) reasons"]["type"] == "state-timeline"
    assert node["Anomalies"]["type"] == "state-timeline"
    assert all(t.get("instant") for t in node["XID errors"]["targets"] + node["ECC and row remapping"]["targets"])
    for title in ("Healthy GPUs", "Throttling GPUs", "Lost GPUs", "Nodes needing attention", "Exporters down"):
        assert fleet[title]["type"] == "stat"
    # ranked per node from each node's extreme GPU, recorded with its gpu, uuid (and model): one series a node
    assert exprs(fleet["Hottest GPUs, one per node"]).startswith("topk(10, instance:gpuwatch_temperature_celsius:top1{")
    assert exprs(fleet["Least thermal headroom, one per node"]).startswith(
        "bottomk(10, instance:gpuwatch_thermal_headroom_celsius:bottom1{")
    # tables list what needs attention only (sparse recordings), not one row per node or GPU
    assert "instance:gpuwatch_node_problem:active{" in exprs(fleet["Nodes needing attention: what"])
    assert "gpu_rule:gpuwatch_anomaly_since_timestamp_seconds:firing{" in exprs(fleet["GPUs needing attention"])
    # Fleet at 10,000 nodes: what grows with the nodes and the range reads recorded series; per-node views
    # are top-k / bottom-k or tables (issue 12; bench/fleet.py measures them)
    assert "instance_reason:gpuwatch_clocks_event_seconds:rate5m" in exprs(fleet["Throttle time, top nodes"])
    assert "instance:gpuwatch_energy_joules:rate5m" in exprs(fleet["Energy in the time range, top nodes"])
    assert "rack:gpuwatch_power_budget:ratio" in exprs(fleet["Power by rack against budget"])
    assert "rack:gpuwatch_energy_joules:rate5m" in exprs(fleet["Energy per rack in the time range"])
    for panel in fleet.values():
        if panel["type"] == "timeseries":
            for t in panel["targets"]:
                assert re.search(r"\b(topk|bottomk)\(|\b(job|job_rule|job_reason):gpuwatch_", t["expr"]), \
                    f"{panel['title']}: a time series per node does not hold at 10,000 nodes"
    assert "gpuwatch_clocks_event_active{" not in " ".join(exprs(p) for p in fleet.values())

    jobs = {p["title"]: p for p in query_panels(load("gpuwatch-jobs"))}
    assert "workload:gpuwatch_memory_used_bytes:sum{" in exprs(jobs["Running jobs"])
    for title, rule in (("Idle allocated GPUs", "allocated_idle"), ("Input-bound GPUs", "input_bound")):
        assert exprs(jobs[title]).startswith("time() - gpu_workload_rule:gpuwatch_anomaly_since_timestamp_seconds:firing{")
        assert f'rule="{rule}"' in exprs(jobs[title])
    # totals: the 5-minute recordings of the accounting group, summed over the range (no subquery)
    groups = {g["name"]: g for g in yaml.load(RECORDING_RULES.read_text(), Loader=YAML_LOADER)["groups"]}
    accounting = groups["gpuwatch-accounting"]
    assert accounting["interval"] == "5m" and all("[5m:1m]" in r["expr"] for r in accounting["rules"])
    for title, record, factor in (("GPU-hours per job", "workload:gpuwatch_gpu_seconds:sum5m", " / 3600"),
                                  ("GPU-hours per user", "workload:gpuwatch_gpu_seconds:sum5m", " / 3600"),
                                  ("Energy per job", "workload:gpuwatch_energy_joules:sum5m", ""),
                                  ("Energy per user", "workload:gpuwatch_energy_joules:sum5m", "")):
        expr = exprs(jobs[title])
        assert f"sum_over_time({record}{{" in expr and f"[$__range])){factor}" in expr, title
        assert ":$__interval]" not in expr and all(t["instant"] for t in jobs[title]["targets"]), title
    # one line per job: few enough points that the range queries hold at tens of thousands of jobs
    for panel in jobs.values():
        if panel["type"] == "timeseries" and "job_id" in exprs(panel) + " ".join(
                t.get("legendFormat", "") for t in panel["targets"]):
            assert panel.get("maxDataPoints") == 300, panel["title"]
    # the per-job time series read per-workload recordings (a day of every GPU's series joined with
    # gpuwatch_gpu_job_info would touch billions of samples at 10,000 nodes: bench/fleet.py)
    for title, record in (("Power per job", "workload:gpuwatch_power_watts:sum"),
                          ("Power drawn by jobs", "workload:gpuwatch_power_watts:sum"),
                          ("GPU utilization per job", "workload:gpuwatch_utilization_ratio:avg"),
                          ("SM activity per job", "workload:gpuwatch_sm_active_ratio:avg"),
                          ("GPU busy against CPU saturation and I/O wait per job", "workload:gpuwatch_gpu_busy_ratio:avg")):
        assert record in exprs(jobs[title]), title
    for title in ("Running jobs", "Idle allocated GPUs", "Input-bound GPUs"):
        assert jobs[title]["type"] == "table", title


_substitute = fleetsim.substitute  # Grafana's variables replaced (an unknown one fails)


STATIC_VALUES = {"job": "gpuwatch", "instance": ".+", "gpu": ".+", "user": ".*", "job_id": ".*", "__range_s": "600",
                 "__rate_interval": "30s", "__interval": "5s", "__interval_ms": "5000", "__range": "10m"}


@pytest.mark.stack
@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed (apt-get install prometheus)")
def test_every_query_parses_with_promtool(tmp_path):
    rules = []
    for uid in sorted(DASHBOARD_FILES):
        for p in query_panels(load(uid)):
            for t in p["targets"]:
                rules.append({"record": f"dashboard:check:{len(rules)}", "expr": _substitute(t["expr"], STATIC_VALUES)})
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_provisioning_files():
    dash = yaml.load((GRAFANA / "provisioning" / "dashboards" / "gpuwatch.yml").read_text(), Loader=YAML_LOADER)
    assert dash["apiVersion"] == 1
    (provider,) = dash["providers"]
    assert provider["type"] == "file" and provider["folder"] == "GPU"
    assert provider["options"]["foldersFromFilesStructure"] is False
    ds = yaml.load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml").read_text(), Loader=YAML_LOADER)
    assert ds["apiVersion"] == 1
    (source,) = ds["datasources"]
    assert source["type"] == "prometheus" and source["uid"]
    for path in DASHBOARD_FILES.values():  # dashboards pick the datasource through their variable
        assert source["uid"] not in path.read_text()


# ------------------------------------------------------------------------- live: gpuwatch + Prometheus

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, workdir: Path, targets: list[str]) -> None:
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        config = workdir / "prometheus.yml"
        # The shipped recording rules, which Fleet panels read, and the example budgets (rack r12), with
        # their groups' own intervals (1m, 5m) taken out: here every group runs every second, like the
        # scrapes, and the accounting samples the workloads every second instead of on whole minutes.
        rules = []
        for path in (RECORDING_RULES, RECORDING_RULES.parent / "budgets.rules.yml"):
            copy = workdir / path.name
            copy.write_text(quick(path.read_text(), holds=False))
            rules.append(str(copy))
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "gpuwatch", "static_configs": [{"targets": targets}]}],
            "rule_files": rules,
        }))
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [shutil.which("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir)
        wait_for(self._ready, 30, "Prometheus /-/ready")

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"prometheus exited with {self.proc.returncode}:\n{self.log_path.read_text()}")
        try:
            with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def query(self, expr: str) -> dict:
        url = self.base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read())

    def result(self, expr: str) -> list[dict]:
        answer = self.query(expr)
        assert answer["status"] == "success", f"{expr}: {answer}"
        return answer["data"]["result"]

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


def _fault_node() -> fakenvml.FakeNode:
    node = fakenvml.FakeNode.h200(3)
    g0, g1 = node.gpus[0], node.gpus[1]
    g0.ecc_errors = {(0, 0): 0, (1, 0): 2, (0, 1): 0, (1, 1): 2}  # 2 uncorrected, volatile and lifetime
    g0.remapped_rows = (0, 1, 1, 0)  # one row remapped for an uncorrectable error, pending a reset
    node.add_xid(gpu=0, xid=48)  # double-bit ECC error
    g0.fabric = (3, 0, 0, 1 | 2 << 4)  # fabric registered; health: degraded bandwidth, routes healthy
    g1.clocks_event_reasons = 0x4 | 0x20  # sw_power_cap + sw_thermal_slowdown
    g1.throttle_ns = {**g1.throttle_ns, 74: 5_000_000_000, 75: 1_000_000_000}
    g1.retired_pages_pending = 0  # so that the page-retirement column has a series
    # workloads (the Jobs dashboard): GPU 0 idle (0 %) under Slurm job 4242, GPU 1 busy under job 4343 and
    # shared with a process that has no /proc entry (scheduler unknown, no job id, no user) and whose memory NVML
    # does not report (as for processes in other containers)
    g0.add_process(JOBS["4242"]["pid"], 5 * GIB)
    g1.add_process(JOBS["4343"]["pid"], 20 * GIB)
    g1.add_process(4999, None)
    g0.memory_used, g1.memory_used = 5 * GIB, 21 * GIB
    g1.utilization = (85, 40)
    g1.gpm = {**fakenvml.GPM_IDLE, 1: 85.0, 2: 70.0, 3: 35.0, 5: 45.0, 10: 40.0}  # busy: its SMs work too
    return node


GIB = 2**30
SLURM_CGROUP = "0::/system.slice/slurmstepd.scope/job_{}/step_0/user/task_0\n"
# uids without a passwd entry: the daemon resolves names with the real passwd database and shows these as numbers
JOBS = {"4242": {"pid": 4100, "uid": 54321, "gpu": "0", "watts": 120},
        "4343": {"pid": 4200, "uid": 54322, "gpu": "1", "watts": 650}}


def _fake_proc(root: Path) -> Path:
    for job_id, job in JOBS.items():
        d = root / str(job["pid"])
        d.mkdir(parents=True)
        (d / "cgroup").write_text(SLURM_CGROUP.format(job_id))
        (d / "status").write_text(f"Name:\tpython\nUid:\t{job['uid']}\t{job['uid']}\t{job['uid']}\t{job['uid']}\n")
    return root


class EnergyMeter(threading.Thread):
    """Advances the fake GPUs' energy counters at each job's power while the stack runs."""

    def __init__(self, fx: fakenvml.FakeNvmlEnv, node: fakenvml.FakeNode) -> None:
        super().__init__(daemon=True)
        self.fx, self.node, self.stopping = fx, node, threading.Event()

    def run(self) -> None:
        last = time.monotonic()
        while not self.stopping.wait(0.25):
            now = time.monotonic()
            for job in JOBS.values():
                self.node.gpus[int(job["gpu"])].energy_mj += int(job["watts"] * (now - last) * 1000)
            last = now
            self.fx.write(self.node)

    def stop(self) -> None:
        self.stopping.set()
        self.join(5)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Two gpuwatch processes and a Prometheus scraping them every second."""
    if shutil.which("prometheus") is None:
        pytest.skip("prometheus not installed (apt-get install prometheus; Debian bookworm ships 2.42)")
    root = tmp_path_factory.mktemp("dashboards")
    started = []
    try:
        sim_env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWATCH_")}
        sim_env["PYTHONUNBUFFERED"] = "1"
        sim_env["PYTHONPATH"] = os.pathsep.join([str(ROOT), sim_env.get("PYTHONPATH", "")])
        (root / "sim").mkdir()
        sim_config = root / "sim" / "gpuwatch.yml"  # the tour's input-bound job (GPU 0): at once, not after 5 min
        sim_config.write_text("rules: {input_bound: {hold: 0, every: 0}}\n")
        sim = Daemon(root / "sim", sim_env, ["--backend", "simulated", "--sim.faults", "true", "--sim.gpus", "4",
                                             "--config", str(sim_config)])
        started.append(sim)
        (root / "mig").mkdir()
        mig = Daemon(root / "mig", sim_env, ["--backend", "simulated", "--sim.profile", "h100-mig", "--sim.gpus", "2"])
        started.append(mig)
        (root / "gb200").mkdir()  # Blackwell and Grace: NVLink5, power smoothing, C2C, module power
        gb200 = Daemon(root / "gb200", sim_env, ["--backend", "simulated", "--sim.profile", "gb200", "--sim.gpus", "2"])
        started.append(gb200)

        node = _fault_node()
        fx = fakenvml.prepare(root / "nvml", node, counts=False)
        config = root / "nvml" / "gpuwatch.yml"
        config.write_text("rules: {allocated_idle: {hold: 0}}\n")  # fire at once, not after 30 idle minutes
        nvml = Daemon(root / "nvml", fake_env(fx), ["--config", str(config), "--node.rack", "r12",
                                                     "--attribution.proc-root", str(_fake_proc(root / "proc"))])
        started.append(nvml)
        nvml.wait_value("gpuwatch_gpus", 3)
        node.gpus[2].lost = True  # falls off the bus after discovery: stays listed with gpu_up 0
        fx.write(node)
        nvml.wait_value("gpuwatch_gpu_up", 0, gpu="2", uuid=node.gpus[2].uuid)
        meter = EnergyMeter(fx, node)
        meter.start()
        started.append(meter)
        nvml.wait_value("gpuwatch_anomaly", 1, gpu="0", uuid=node.gpus[0].uuid, rule="allocated_idle",
                        severity="warning")

        instances = {"sim": sim.base.removeprefix("http://"), "nvml": nvml.base.removeprefix("http://"),
                     "mig": mig.base.removeprefix("http://"), "gb200": gb200.base.removeprefix("http://")}
        prom = Prometheus(root, sorted(instances.values()))
        started.append(prom)
        # a few scrapes of both targets, so that rate() over 30 s has two samples
        wait_for(lambda: len([r for r in prom.result('count_over_time(up{job="gpuwatch"}[30s]) >= 3 and up == 1')])
                 == len(instances), 30, "three successful scrapes of every gpuwatch target")
        yield prom, instances
    finally:
        for process in reversed(started):
            process.stop()


def _values(instances: dict[str, str]) -> dict[str, str]:
    # what Grafana sends for a multi-value selection: regex-escaped values, (a|b), as a PromQL string
    regex = "(" + "|".join(re.escape(i).replace("\\", "\\\\") for i in sorted(instances.values())) + ")"
    return {**STATIC_VALUES, "instance": regex}


@pytest.mark.daemon
@pytest.mark.stack
def test_every_panel_query_returns_data(stack):
    prom, instances = stack
    values = _values(instances)
    pending = {}
    for uid in sorted(DASHBOARD_FILES):
        for p in query_panels(load(uid)):
            for t in p["targets"]:
                pending[(uid, p["title"], t["refId"])] = _substitute(t["expr"], values)
    assert len(pending) > 40
    empty: dict = {}

    def all_answer() -> bool:
        for key, expr in list(pending.items()):
            if prom.result(expr):  # status success, or the assertion says why not
                del pending[key]
                empty.pop(key, None)
            else:
                empty[key] = expr
        return not pending

    try:
        # 75 s: the accounting panels sum windows sampled at whole minutes, a minute at most after the first scrape
        wait_for(all_answer, 75, "every panel query to return data")
    except AssertionError:
        raise AssertionError("panel queries without data:\n" + "\n".join(
            f"{uid} {title!r} {ref}: {expr}" for (uid, title, ref), expr in sorted(empty.items()))) from None


def _panel_result(prom, instances, uid, title, ref="A") -> list[dict]:
    (panel,) = [p for p in query_panels(load(uid)) if p["title"] == title]
    (t,) = [t for t in panel["targets"] if t["refId"] == ref]
    return prom.result(_substitute(t["expr"], _values(instances)))


@pytest.mark.daemon
@pytest.mark.stack
def test_fault_panels_show_the_faults(stack):
    prom, instances = stack
    nvml, sim = instances["nvml"], instances["sim"]

    def scalar(uid, title):
        (sample,) = _panel_result(prom, instances, uid, title)
        return float(sample["value"][1])

    assert scalar("gpuwatch-fleet", "Nodes") == 4
    assert scalar("gpuwatch-fleet", "GPUs") == 11
    assert scalar("gpuwatch-fleet", "Lost GPUs") == 1
    assert scalar("gpuwatch-fleet", "Nodes needing attention") == 1  # the node with the lost GPU: its polls fail
    problems = _panel_result(prom, instances, "gpuwatch-fleet", "Nodes needing attention: what")
    assert {(s["metric"]["instance"], s["metric"]["problem"]) for s in problems} == {(nvml, "poll_failing")}
    assert scalar("gpuwatch-fleet", "Throttling GPUs") >= 1
    assert 1 <= scalar("gpuwatch-fleet", "Healthy GPUs") <= 9  # the fake node's GPU 0 and 2 are not
    assert scalar("gpuwatch-fleet", "Exporters down") == 0

    xids = _panel_result(prom, instances, "gpuwatch-node", "XID errors")
    assert {(s["metric"]["instance"], s["metric"]["gpu"], s["metric"]["xid"]) for s in xids} == {(nvml, "0", "48")}
    ecc = _panel_result(prom, instances, "gpuwatch-node", "ECC and row remapping", "A")
    assert {(s["metric"]["instance"], s["metric"]["gpu"]) for s in ecc if float(s["value"][1]) == 2} == {(nvml, "0")}
    pending = _panel_result(prom, instances, "gpuwatch-node", "ECC and row remapping", "E")
    assert {(s["metric"]["instance"], s["metric"]["gpu"]) for s in pending if float(s["value"][1]) == 1} \
        == {(nvml, "0")}

    firing = _panel_result(prom, instances, "gpuwatch-node", "Anomalies")
    rules = {(s["metric"]["instance"], s["metric"]["gpu"], s["metric"]["rule"]) for s in firing}
    assert {(nvml, "0", "ecc_uncorrectable"), (nvml, "0", "row_remap_pending"), (nvml, "0", "xid_critical")} <= rules

    inventory = _panel_result(prom, instances, "gpuwatch-node", "GPU inventory")
    lost = {(s["metric"]["instance"], s["metric"]["gpu"], s["metric"]["name"])
            for s in inventory if float(s["value"][1]) == 0}
    assert lost == {(nvml, "2", "NVIDIA H200")}

    throttled = _panel_result(prom, instances, "gpuwatch-node", "Clock event (throttle) reasons")
    assert {(nvml, "1", "sw_power_cap"), (nvml, "1", "sw_thermal_slowdown")} <= {
        (s["metric"]["instance"], s["metric"]["gpu"], s["metric"]["reason"]) for s in throttled}

    # MIG instances only on the MIG node: the H100's four, on each of its two GPUs
    mig_info = _panel_result(prom, instances, "gpuwatch-node", "MIG instance SM activity")
    assert {s["metric"]["instance"] for s in mig_info} == {instances["mig"]}
    assert len(mig_info) == 8
    # NVLink error leaders (a recording rule): the HGX node, whose links count no error
    leaders = _panel_result(prom, instances, "gpuwatch-fleet", "NVLink error leaders")
    assert nvml in {s["metric"]["instance"] for s in leaders}
    # Blackwell and Grace only on the GB200 node: its two GPUs' NVLink5 BER (0), power-smoothing lifetime (92 %),
    # 10 C2C links each, and module power above the GPU's own
    gb200 = instances["gb200"]
    ber = _panel_result(prom, instances, "gpuwatch-node", "NVLink5 effective bit error rate")
    assert {(s["metric"]["instance"], float(s["value"][1])) for s in ber} == {(gb200, 0.0)} and len(ber) == 2
    lifetime = _panel_result(prom, instances, "gpuwatch-node", "Power-smoothing lifetime")
    assert {(s["metric"]["instance"], float(s["value"][1])) for s in lifetime} == {(gb200, 0.92)}
    c2c = _panel_result(prom, instances, "gpuwatch-node", "NVLink-C2C links to the Grace CPU")
    assert {(s["metric"]["instance"], s["metric"]["state"], float(s["value"][1])) for s in c2c} == \
        {(gb200, "active", 10.0), (gb200, "inactive", 0.0)}
    module = {s["metric"]["gpu"]: float(s["value"][1])
              for s in _panel_result(prom, instances, "gpuwatch-node", "Module and GPU power (Grace)", "A")}
    alone = {s["metric"]["gpu"]: float(s["value"][1])
             for s in _panel_result(prom, instances, "gpuwatch-node", "Module and GPU power (Grace)", "B")}
    assert set(module) == set(alone) == {"0", "1"} and all(module[g] > alone[g] > 0 for g in module)
    # fans only where there are fans: the simulated RTX 6000 node, not the passively cooled H200s
    fans = _panel_result(prom, instances, "gpuwatch-node", "Fan speed against target")
    assert {s["metric"]["instance"] for s in fans} == {sim}
    assert all(s["metric"]["name"] for s in fans)  # the name join works


@pytest.mark.daemon
@pytest.mark.stack
def test_jobs_panels_show_the_jobs(stack):
    prom, instances = stack
    nvml = instances["nvml"]
    uid = "gpuwatch-jobs"

    def scalar(title):
        (sample,) = _panel_result(prom, instances, uid, title)
        return float(sample["value"][1])

    def by_job(title, values=None):
        (panel,) = [p for p in query_panels(load(uid)) if p["title"] == title]
        result = prom.result(_substitute(panel["targets"][0]["expr"], values or _values(instances)))
        return {(s["metric"].get("scheduler"), s["metric"].get("job_id", ""), s["metric"].get("user", "")):
                float(s["value"][1]) for s in result}

    sim = instances["sim"]
    assert scalar("Jobs") == 4  # slurm 4242, slurm 4343, the unattributed process; the simulator's 4300
    assert scalar("GPUs held") == 3
    assert scalar("Held GPUs idle") == 1
    assert scalar("Power drawn by jobs") > 0

    # one row per node and workload: the GPUs it holds there (GPU 1 split between 4343 and the unattributed
    # process), the frame buffer its processes use (none reported for the unattributed one)
    held, memory, power, busy = ({(s["metric"]["instance"], s["metric"]["scheduler"], s["metric"].get("job_id", ""),
                                   s["metric"].get("user", "")): float(s["value"][1])
                                  for s in _panel_result(prom, instances, uid, "Running jobs", ref)
                                  if s["metric"]["instance"] == nvml}  # Prometheus omits empty labels
                                 for ref in "ABCD")
    a, b, unattributed = (nvml, "slurm", "4242", "54321"), (nvml, "slurm", "4343", "54322"), (nvml, "unknown", "", "")
    assert held == {a: 1, b: 0.5, unattributed: 0.5}
    assert memory == {a: 5 * GIB, b: 20 * GIB}
    assert set(power) == set(held) and power[b] == pytest.approx(power[unattributed]) and power[a] > 0
    assert busy[a] == 0 and busy[b] == pytest.approx(0.70)  # SM activity (GPM)

    idle = _panel_result(prom, instances, uid, "Idle allocated GPUs")
    assert {(s["metric"]["instance"], s["metric"]["gpu"], s["metric"]["job_id"], s["metric"]["user"]) for s in idle} \
        == {(nvml, "0", "4242", "54321")}
    assert all(0 <= float(s["value"][1]) < 600 for s in idle)  # firing for: seconds since the onset

    # the simulator's Slurm job 4300: allocated GPU 0 (no process), at 35 % while its loaders keep 97 % of its
    # 16 CPUs busy: input_bound (hold 0 here)
    starved = _panel_result(prom, instances, uid, "Input-bound GPUs")
    assert {(s["metric"]["instance"], s["metric"]["gpu"], s["metric"]["job_id"], s["metric"]["user"])
            for s in starved} == {(sim, "0", "4300", "sim")}
    (fed,) = [p for p in query_panels(load(uid)) if p["title"] == "GPU busy against CPU saturation and I/O wait per job"]
    busy, cpus, wait = ({s["metric"].get("job_id", ""): float(s["value"][1])
                         for s in prom.result(_substitute(t["expr"], _values(instances)))} for t in fed["targets"])
    # (the CPU share is a rate over $__rate_interval, 30 s here, of a counter a few seconds old: Prometheus
    # extrapolates it to only part of the window, so it is below 0.97 now; the I/O share is a ratio of two
    # such rates, exact already)
    assert busy["4300"] == pytest.approx(0.35, abs=0.05) and 0 < cpus["4300"] <= 1.0
    assert wait["4300"] == pytest.approx(0.05, abs=0.01) and busy["4343"] == pytest.approx(0.70)
    assert {s["metric"]["job_id"] for s in _panel_result(prom, instances, uid, "Storage reads per job")} == {"4300"}

    slurm_a, slurm_b, unknown = ("slurm", "4242", "54321"), ("slurm", "4343", "54322"), ("unknown", "", "")
    utilization = by_job("GPU utilization per job")
    assert utilization[slurm_a] == 0 and utilization[slurm_b] == pytest.approx(0.85)
    sm_active = by_job("SM activity per job")  # GPM: GPU 1 computes at 70 % of its SMs, GPU 0 not at all
    assert sm_active[slurm_a] == 0 and sm_active[slurm_b] == pytest.approx(0.70)
    # GPU 1's power and GPU-hours are split between its two holders
    power = by_job("Power per job")
    assert power[slurm_a] > 0 and power[slurm_b] > 0 and power[slurm_b] == pytest.approx(power[unknown])
    assert by_job("Frame buffer per job") == {slurm_a: 5 * GIB, slurm_b: 20 * GIB}
    # the GPU-hours and energy totals sum 5-minute accounting windows sampled at whole minutes ([5m:1m]): a job
    # whose series began after the last whole minute (the stack started a few seconds ago) is in them from the
    # next minute on
    users = {"54321", "54322", "(none)", "sim"}
    wait_for(lambda: {slurm_a, slurm_b, unknown} <= set(by_job("GPU-hours per job"))
             and {s["metric"]["user"] for s in _panel_result(prom, instances, uid, "GPU-hours per user")} == users,
             75, "every job and user in the accounting windows (the next whole minute)")
    hours = by_job("GPU-hours per job")
    assert hours[slurm_a] > 0 and hours[slurm_a] == pytest.approx(2 * hours[slurm_b]) \
        and hours[slurm_b] == pytest.approx(hours[unknown])
    energy = by_job("Energy per job")
    assert energy[slurm_a] > 0 and energy[slurm_b] == pytest.approx(energy[unknown])
    per_user = {s["metric"]["user"] for s in _panel_result(prom, instances, uid, "GPU-hours per user")}
    assert per_user == users
    assert {s["metric"]["user"] for s in _panel_result(prom, instances, uid, "Energy per user")} == per_user
    # a selected user (Grafana sends the value as a regex): only that user's jobs
    assert set(by_job("GPU-hours per job", {**_values(instances), "user": "54321"})) == {slurm_a}
    assert set(by_job("Running jobs", {**_values(instances), "job_id": "4343"})) == {slurm_b}
