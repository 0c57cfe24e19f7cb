"""A fleet on one machine: one Prometheus scraping N gpuwatch targets, the shipped rules loaded, every
dashboard query and rule group timed.

    .venv/bin/python bench/fleet.py                    # 500 targets from 5 gpuwatch processes (~12 min)
    .venv/bin/python bench/fleet.py --targets 100 --settle 120

The targets are served by a few real `gpuwatch run` processes over the fake libnvidia-ml.so.1
(tests/fakenvml), 8 H200s each: Prometheus scrapes each process as many targets, each with its own
``instance`` and topology labels (rack, row, room, pdu; 10 nodes a rack, 10 racks a room), so its
head, rules and queries see N distinct nodes. Every 15 s, as shipped: alerts/gpuwatch.rules.yml,
deploy/prometheus/recording.rules.yml and budgets.rules.yml. After ``--settle`` seconds of data:

- every panel query of every dashboard in deploy/grafana (variables as Grafana sends them for "All";
  the Node dashboard for one node), instant and as a range query over the data there is: wall time
  p50 and max of ``--repeat`` runs, and the samples it touched (Prometheus' query stats,
  ``stats=all``: totalQueryableSamples), scaled to 1,000 and 10,000 nodes over the dashboard's
  default range at Grafana's step (the range over ~1,000 points, at least 15 s), against
  Prometheus' 50M ``--query.max-samples``;
- each rule group's last evaluation time against its interval (/api/v1/rules);
- head series (/api/v1/status/tsdb) and Prometheus' RSS.

``Fleet`` is also what tests/test_fleet.py starts (small, with per-process faults): a real
Prometheus over real gpuwatch processes. Results: a table, bench/out/fleet.json; docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fakehost  # noqa: E402
import fakenvml  # noqa: E402
from daemon import fake_env, stop_process, wait_for  # noqa: E402

OUT = ROOT / "bench" / "out"
RULE_FILES = (ROOT / "alerts" / "gpuwatch.rules.yml", ROOT / "deploy" / "prometheus" / "recording.rules.yml",
              ROOT / "deploy" / "prometheus" / "budgets.rules.yml")
DASHBOARDS = sorted((ROOT / "deploy" / "grafana" / "dashboards").glob("*.json"))
MAX_SAMPLES = 50_000_000  # Prometheus' default --query.max-samples


def _get(url: str, timeout: float = 30.0) -> dict:
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
        return _get(self.base + "/api/v1/query?" + urllib.parse.urlencode(params))

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict:
        params = {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step:g}", "stats": "all"}
        return _get(self.base + "/api/v1/query_range?" + urllib.parse.urlencode(params), timeout=120)

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
        for server in self.servers:
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


def _hours(text: str) -> float:
    match = re.fullmatch(r"now-(\d+)([mhd])", text)
    return 3.0 if not match else int(match.group(1)) * {"m": 1 / 60, "h": 1, "d": 24}[match.group(2)]


def reads_recorded(expr: str) -> bool:
    return bool(re.search(r"\b[a-z_]+:gpuwatch_[a-z0-9_]+:[a-z0-9_]+", expr))


def measure_queries(fleet: Fleet, nodes: int, repeat: int, data_seconds: float) -> list[dict]:
    out = []
    end = time.time()
    for q in dashboard_queries(layout(1)[0][0]):
        walls, samples, error = [], 0, None
        for _ in range(repeat):
            t0 = time.perf_counter()
            doc = fleet.query(q["expr"], stats=True)
            walls.append(time.perf_counter() - t0)
            if doc.get("status") != "success":
                error = doc.get("error")
                break
            samples = int(doc["data"].get("stats", {}).get("samples", {}).get("totalQueryableSamples", 0))
        entry = {k: q[k] for k in ("uid", "title", "ref", "hours")} | {
            "recorded": reads_recorded(q["raw"]), "instant_p50_ms": statistics.median(walls) * 1e3,
            "instant_max_ms": max(walls) * 1e3, "instant_samples": samples, "error": error}
        # What the query would touch on a fleet of N nodes over the dashboard's default range: samples
        # grow with the nodes and, for a range query, with its steps (Grafana's: the range over the
        # panel's data points, ~1,000 or its maxDataPoints, at least the 15 s scrape interval), for an instant one over
        # [$__range] with the data it covers (here only data_seconds of it).
        range_seconds = q["hours"] * 3600
        if not q["instant"]:
            step = max(15.0, data_seconds / 250)
            t0 = time.perf_counter()
            doc = fleet.query_range(q["expr"], end - data_seconds, end, step)
            entry["range_ms"] = (time.perf_counter() - t0) * 1e3
            range_samples = int(doc["data"].get("stats", {}).get("samples", {}).get("totalQueryableSamples", 0)) \
                if doc.get("status") == "success" else 0
            entry["range_samples"] = range_samples
            measured_steps = data_seconds / step + 1
            grafana_steps = range_seconds / max(15.0, range_seconds / q["points"]) + 1
            per_node = range_samples / nodes * grafana_steps / measured_steps
        elif "$__range" in q["raw"]:
            entry["range_samples"] = None
            per_node = samples / nodes * range_seconds / min(data_seconds, range_seconds)
        else:
            entry["range_samples"] = None
            per_node = samples / nodes
        for fleet_nodes in (1_000, 10_000):
            entry[f"samples_at_{fleet_nodes}"] = int(per_node * fleet_nodes)
        entry["within_max_samples_at_10000"] = entry["samples_at_10000"] <= MAX_SAMPLES
        out.append(entry)
    return out


def rule_groups(fleet: Fleet, looks: int = 1, every: float = 10.0) -> list[dict]:
    """Each group's evaluation time: the median of ``looks`` looks ``every`` seconds apart (one
    evaluation varies with what else the machine does: compaction, the scrapes), and the largest."""
    seen: dict[str, list[float]] = {}
    for i in range(looks):
        if i:
            time.sleep(every)  # a benchmark sampling Prometheus' own figures over time
        for g in _get(fleet.base + "/api/v1/rules")["data"]["groups"]:
            seen.setdefault(g["name"], []).append(g["evaluationTime"])
    doc = _get(fleet.base + "/api/v1/rules")
    return [{"group": g["name"], "interval_s": g["interval"],
             "evaluation_ms": statistics.median(seen.get(g["name"], [g["evaluationTime"]])) * 1e3,
             "evaluation_max_ms": max(seen.get(g["name"], [g["evaluationTime"]])) * 1e3,
             "share_of_interval": statistics.median(seen.get(g["name"], [g["evaluationTime"]])) / g["interval"],
             "rules": len(g["rules"]),
             "slowest": sorted(((r.get("record") or r.get("alert") or r.get("name"), r["evaluationTime"] * 1e3)
                                for r in g["rules"]), key=lambda x: -x[1])[:4]}
            for g in doc["data"]["groups"]]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", type=int, default=500)
    ap.add_argument("--processes", type=int, default=5, help="gpuwatch processes serving the targets")
    ap.add_argument("--settle", type=float, default=300.0, help="seconds of data before measuring")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each instant query")
    ap.add_argument("--jobs-per-node", type=int, default=1,
                    help="Slurm jobs holding each node's 8 GPUs (1: one 8-GPU job a node; 8: one a GPU)")
    ap.add_argument("--out", default=str(OUT / "fleet.json"))
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gw-fleet-"))
    fleet = Fleet(work)
    started = time.time()
    try:
        names = [fleet.node(f"p{i}", margin=25 + (i % 3), jobs=args.jobs_per_node).name for i in range(args.processes)]
        targets = [(instance, names[i % len(names)], labels) for i, (instance, labels) in
                   enumerate(layout(args.targets))]
        fleet.start_prometheus(targets, list(RULE_FILES))
        wait_for(lambda: len(fleet.result('up{job="gpuwatch"} == 1')) == args.targets, 180, "every target up")
        up_at = time.time()
        time.sleep(args.settle)  # a benchmark: the window of data the queries then read (nothing waits on it)
        data_seconds = time.time() - up_at
        queries = measure_queries(fleet, args.targets, args.repeat, data_seconds)
        groups = rule_groups(fleet, looks=7)
        tsdb = _get(fleet.base + "/api/v1/status/tsdb")["data"]["headStats"]
        result = {"targets": args.targets, "gpus": args.targets * 8, "processes": args.processes,
                  "jobs_per_node": args.jobs_per_node,
                  "data_seconds": data_seconds, "head_series": tsdb["numSeries"],
                  "prometheus_rss_mb": rss_mb(fleet.prometheus.pid) if fleet.prometheus else None,
                  "rule_groups": groups, "queries": queries, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": {"cpus": os.cpu_count()}, "wall_s": time.time() - started}
    finally:
        fleet.stop()
        shutil.rmtree(work, ignore_errors=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{args.targets} targets ({args.targets * 8} GPUs) from {args.processes} gpuwatch processes, "
          f"{result['head_series']:,} head series, Prometheus RSS {result['prometheus_rss_mb']:.0f} MB")
    for g in groups:
        print(f"  rule group {g['group']}: {g['evaluation_ms']:.1f} ms (median; max {g['evaluation_max_ms']:.1f}) of "
              f"{g['interval_s']:g} s ({g['share_of_interval']:.1%}); slowest: "
              + ", ".join(f"{name} {ms:.1f} ms" for name, ms in g["slowest"][:3]))
    worst = sorted(queries, key=lambda q: -q["instant_max_ms"])[:8]
    for q in worst:
        print(f"  {q['uid']} {q['title']!r} {q['ref']}: instant p50 {q['instant_p50_ms']:.1f} ms, max "
              f"{q['instant_max_ms']:.1f} ms, {q['instant_samples']:,} samples; at 10,000 nodes over "
              f"{q['hours']:g} h {q['samples_at_10000']:,}")
    over = [q for q in queries if not q["within_max_samples_at_10000"]]
    print(f"  {len(queries)} queries, {sum(q['recorded'] for q in queries)} read recorded series, "
          f"{len(over)} over 50M samples at 10,000 nodes, {sum(bool(q['error']) for q in queries)} errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
