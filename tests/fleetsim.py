"""A fleet on one machine: one Prometheus scraping real `gpuwatch run` processes over the fake
libnvidia-ml.so.1 as N distinct nodes (each process serves many targets, each with its own ``instance``
and topology labels), the shipped rules loaded; the dashboards' queries as Grafana sends them.

What tests/test_fleet.py, test_scaling.py and test_dashboards.py start or read, and what bench/fleet.py
measures at scale (bench imports it from here: the tests import nothing from bench/). ``new_fleet``,
``quick`` and ``rules_for_tests`` make a small fleet and the shipped alert and recording rules quick for
the tests (promtool's cases in alerts/tests/ and deploy/prometheus/tests/ check the holds and intervals as
shipped).
"""

from __future__ import annotations

import json
import re
import shutil
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import fakehost
import fakenvml
import pytest
import yaml
from daemon import fake_env, stop_process, wait_for

ROOT = Path(__file__).resolve().parents[1]
# what one Prometheus over the whole site loads; a shard of a sharded fleet all but SITE_RULES, which its
# global tier loads instead (docs/scaling.md)
SITE_RULES = ROOT / "alerts" / "gpuwatch-site.rules.yml"
RULE_FILES = (ROOT / "alerts" / "gpuwatch.rules.yml", ROOT / "deploy" / "prometheus" / "recording.rules.yml",
              ROOT / "deploy" / "prometheus" / "budgets.rules.yml", SITE_RULES)
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
MAX_SAMPLES = 50_000_000  # Prometheus' default --query.max-samples


def get_json(url: str, timeout: float = 30.0) -> dict:
    """The API's JSON document, also for a query it refuses (400/422 carry {"status": "error", ...})."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return json.loads(exc.read() or b'{"status": "error", "error": "HTTP %d"}' % exc.code)


@dataclass
class Node:
    """One gpuwatch process over its own fake node (what ``margin`` and ``watts`` make of it)."""

    name: str
    process: subprocess.Popen
    address: str


@dataclass
class Server:
    """One Prometheus on loopback: its HTTP API."""

    name: str
    process: subprocess.Popen | None
    base: str

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None, stats: bool = False) -> dict:
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        if stats:
            params["stats"] = "all"
        return get_json(self.base + "/api/v1/query?" + urllib.parse.urlencode(params))

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}", "stats": "all"}
        return get_json(self.base + "/api/v1/query_range?" + urllib.parse.urlencode(params), timeout=120)

    def result(self, expr: str) -> list[dict]:
        document = self.query(expr)
        assert document["status"] == "success", document
        return document["data"]["result"]


@dataclass
class Fleet:
    workdir: Path
    interval: str = "15s"
    nodes: dict[str, Node] = field(default_factory=dict)
    prometheus: subprocess.Popen | None = None
    base: str = ""
    servers: list[Server] = field(default_factory=list)
    main: Server | None = None

    def node(self, name: str, gpus: int = 8, margin: float = 25.0, watts: float = 600.0,
             hot_gpu: int | None = None, throttled: bool = False, jobs: int = 0, args: tuple[str, ...] = ()) -> Node:
        """A gpuwatch process over an H200 x ``gpus`` fake node: every GPU at ``watts`` of 700 W and
        ``margin`` °C of T.Limit margin (headroom to slowdown = margin + 2 on an H200), GPU ``hot_gpu``
        at 3 °C; ``throttled``: every GPU in SW thermal slowdown; ``jobs``: that many Slurm jobs hold
        the GPUs, round robin (a prolog's mapping directory: gpuwatch_gpu_job_info of each), each with a
        host side (a cgroup and a process: gpuwatch_job_cpu_seconds_total, ...); ``args``: more of gpuwatch's
        flags."""
        work = self.workdir / name
        node = fakenvml.FakeNode.h200(gpus)
        for i, gpu in enumerate(node.gpus):
            gpu.power_mw = int(watts * 1000)
            gpu.margin_temperature = 3 if i == hot_gpu else int(margin)
            gpu.temperature = 87 - gpu.margin_temperature - 2
            if throttled:
                gpu.clocks_event_reasons = 0x20  # nvmlClocksEventReasonSwThermalSlowdown
        fx = fakenvml.prepare(work, node, counts=False)
        extra = []
        if jobs:
            mapping = work / "jobs"
            mapping.mkdir()
            for i in range(gpus):
                (mapping / str(i)).write_text(f"{7000 + i % jobs}\n")
            extra = ["--attribution.hpc-job-mapping-dir", str(mapping), *self._host_side(work, jobs)]
        log = open(work / "gpuwatch.log", "w")
        argv = [sys.executable, "-m", "gpuwatch", "run", "--web.listen-address", "127.0.0.1:0", "--log.format", "json",
                "--log.level", "info", *extra, *args]
        process = subprocess.Popen(argv, env=fake_env(fx), stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)

        def listening() -> str | None:
            if process.poll() is not None:
                raise AssertionError(f"gpuwatch {name} exited: {(work / 'gpuwatch.log').read_text()[-2000:]}")
            for line in (work / "gpuwatch.log").read_text().splitlines():
                if '"started"' in line:
                    return str(json.loads(line)["listen"][0])
            return None
        address = wait_for(listening, 60, f"gpuwatch {name} to listen")
        self.nodes[name] = Node(name, process, str(address))
        return self.nodes[name]

    @staticmethod
    def _host_side(work: Path, jobs: int) -> list[str]:
        """Each job's host side, for the jobs group: a cgroup v2 job with a data-loader process in a fake
        /proc (tests/fakehost.py), so that gpuwatch_job_cpu_seconds_total and friends exist per job."""
        proc, cgroup = work / "proc", work / "cgroup"
        fakehost.proc_stat(proc)
        for j in range(jobs):
            job_id, pid = 7000 + j, 10_000 + j
            fakehost.fake_process(proc, pid, user=100.0, system=5.0, iowait=1.0, read_bytes=10**9,
                                  cgroup=f"0::/system.slice/slurmstepd.scope/job_{job_id}/step_0/user/task_0\n")
            job = fakehost.slurm_v2_job(cgroup, job_id, [pid], cpus=f"{j}")
            (job / "cpu.stat").write_text("usage_usec 105000000\nuser_usec 100000000\nsystem_usec 5000000\n")
        return ["--attribution.proc-root", str(proc), "--attribution.cgroup-root", str(cgroup),
                "--no-collector.kubernetes"]

    def static_configs(self, targets: list[tuple[str, str, dict[str, str]]]) -> list[dict]:
        """``targets``: (instance, node process name, topology labels) as Prometheus static_configs."""
        return [{"targets": [self.nodes[proc].address], "labels": {"instance": instance, **labels}}
                for instance, proc, labels in targets]

    def start_prometheus(self, targets: list[tuple[str, str, dict[str, str]]], rule_files: list[Path]) -> None:
        """The fleet's Prometheus: scrapes ``targets`` (instance, node process name, topology labels)."""
        config = {"global": {"scrape_interval": self.interval, "evaluation_interval": self.interval},
                  "scrape_configs": [{"job_name": "gpuwatch", "static_configs": self.static_configs(targets)}],
                  "rule_files": [str(p) for p in rule_files]}
        self.main = self.server("prometheus", config)
        self.prometheus, self.base = self.main.process, self.main.base

    def server(self, name: str, config: dict, flags: tuple[str, ...] = ()) -> Server:
        """Another Prometheus (a shard, a global store) with its own ``config``, beside the fleet's."""
        port = _free_port()
        work = self.workdir / name
        work.mkdir(exist_ok=True)
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        log = open(work / "prometheus.log", "w")
        process = subprocess.Popen(
            [shutil.which("prometheus") or "prometheus", f"--config.file={work / 'prometheus.yml'}",
             f"--storage.tsdb.path={work / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}", *flags],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        server = Server(name, process, f"http://127.0.0.1:{port}")
        self.servers.append(server)
        wait_for(server.ready, 60, f"Prometheus {name} to be ready")
        return server

    def query(self, expr: str, at: float | None = None, stats: bool = False) -> dict:
        return self._main().query(expr, at, stats)

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        return self._main().query_range(expr, start, end, step)

    def result(self, expr: str) -> list[dict]:
        return self._main().result(expr)

    def _main(self) -> Server:
        assert self.main is not None, "start_prometheus first"
        return self.main

    def stop(self) -> None:
        for server in reversed(self.servers):  # the shards before the store they flush their remote_write to
            stop_process(server.process)
        for node in self.nodes.values():
            stop_process(node.process)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def layout(count: int, nodes_per_rack: int = 10, racks_per_room: int = 10) -> list[tuple[str, dict[str, str]]]:
    """(instance, topology labels) of ``count`` nodes: node-00001 in rack r001 of room hall-01, ..."""
    out = []
    for i in range(count):
        rack = i // nodes_per_rack
        room = rack // racks_per_room
        out.append((f"node-{i + 1:05d}:19400", {"rack": f"r{rack + 1:03d}", "row": f"{room + 1:02d}-{rack % 2}",
                                                "room": f"hall-{room + 1:02d}", "pdu": f"pdu-r{rack + 1:03d}"}))
    return out


# -- the dashboards' queries ---------------------------------------------------------------------
def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those of collapsed rows too."""
    found = []
    for p in dashboard["panels"]:
        found.append(p)
        found.extend(p.get("panels", []))  # panels of a collapsed row
    return found


def panels(dashboard: dict) -> list[dict]:
    """The panels with queries."""
    return [p for p in all_panels(dashboard) if p.get("targets")]


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's variables ($name, ${name}, ${name:format}) replaced by ``values``."""
    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in values, f"unknown variable ${name} in {expr!r}"
        return values[name]
    return re.sub(r"\$(?:\{(\w+)(?::\w+)?\}|(\w+))", one, expr)


def dashboard_queries(one_node: str) -> list[dict]:
    """Every target of every dashboard: uid, title, refId, expr (with Grafana's values), default range."""
    queries = []
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        hours = _hours(d.get("time", {}).get("from", "now-3h"))
        # what Grafana sends for one selected node: the value regex-escaped, inside a PromQL string
        node = re.escape(one_node).replace("\\", "\\\\")
        values = {"job": "gpuwatch", "instance": ".+" if d["uid"] != "gpuwatch-node" else node,
                  "gpu": ".+", "user": ".*", "job_id": ".*", "__rate_interval": "1m", "__interval": "1m",
                  "__interval_ms": "60000", "__range": f"{int(hours * 3600)}s", "__range_s": str(int(hours * 3600)),
                  "datasource": "prometheus"}
        for p in panels(d):
            for t in p["targets"]:
                queries.append({"uid": d["uid"], "title": p["title"], "ref": t["refId"],
                                "expr": substitute(t["expr"], values), "raw": t["expr"], "hours": hours,
                                "instant": bool(t.get("instant")), "points": int(p.get("maxDataPoints", 1000))})
    return queries


def global_queries(one_node: str) -> list[dict]:
    """The queries of the dashboards a global store serves (Fleet and Jobs: recorded series only)."""
    queries = [q for q in dashboard_queries(one_node) if q["uid"] in ("gpuwatch-fleet", "gpuwatch-jobs")]
    assert len(queries) > 40
    return queries


def _hours(text: str) -> float:
    match = re.fullmatch(r"now-(\d+)([mhd])", text)
    return 3.0 if not match else int(match.group(1)) * {"m": 1 / 60, "h": 1, "d": 24}[match.group(2)]


def reads_recorded(expr: str) -> bool:
    return bool(re.search(r"\b[a-z_]+:gpuwatch_[a-z0-9_]+:[a-z0-9_]+", expr))


def rule_groups(fleet: Fleet, looks: int = 1, every: float = 10.0) -> list[dict]:
    """Each group's evaluation time: the median of ``looks`` looks ``every`` seconds apart (one
    evaluation varies with what else the machine does: compaction, the scrapes), and the largest."""
    seen: dict[str, list[float]] = {}
    for i in range(looks):
        if i:
            time.sleep(every)  # a benchmark sampling Prometheus' own figures over time
        for g in get_json(fleet.base + "/api/v1/rules")["data"]["groups"]:
            seen.setdefault(g["name"], []).append(g["evaluationTime"])
    doc = get_json(fleet.base + "/api/v1/rules")
    return [{"group": g["name"], "interval_s": g["interval"],
             "evaluation_ms": statistics.median(seen.get(g["name"], [g["evaluationTime"]])) * 1e3,
             "evaluation_max_ms": max(seen.get(g["name"], [g["evaluationTime"]])) * 1e3,
             "share_of_interval": statistics.median(seen.get(g["name"], [g["evaluationTime"]])) / g["interval"],
             "rules": len(g["rules"]),
             "slowest": sorted(((r.get("record") or r.get("alert") or r.get("name"), r["evaluationTime"] * 1e3)
                                for r in g["rules"]), key=lambda x: -x[1])[:4]}
            for g in doc["data"]["groups"]]


def new_fleet(work: Path):
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is missing: scripts/test installs it (Debian package prometheus)")
    return Fleet(work, interval="2s")


def quick(text: str, holds: bool = True) -> str:
    """A rule file's text with its groups' own intervals (1m, 5m) taken out, so that every group runs at
    the global evaluation interval, the accounting's subquery sampling every second instead of on whole
    minutes, and (``holds``) every alert's for: at 0s."""
    text = re.sub(r"^    interval: \S+\n", "", text, flags=re.MULTILINE).replace("[5m:1m]", "[5m:1s]")
    return re.sub(r"^(\s+)for: \S+$", r"\1for: 0s", text, flags=re.MULTILINE) if holds else text


def rules_for_tests(work: Path, site: bool = True) -> list[Path]:
    """quick() copies of alerts/gpuwatch.rules.yml and deploy/prometheus/recording.rules.yml, and (``site``:
    one Prometheus over the whole site, not a shard) of alerts/gpuwatch-site.rules.yml."""
    copies = []
    for path in (*RULE_FILES[:2], *([SITE_RULES] if site else [])):
        copy = work / path.name
        copy.write_text(quick(path.read_text()))
        copies.append(copy)
    return copies
