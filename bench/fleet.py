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

``Fleet`` (tests/fleetsim.py) is also what tests/test_fleet.py starts (small, with per-process faults): a
real Prometheus over real gpuwatch processes. Results: a table, bench/out/fleet.json; docs/performance.md.

``--global-tier`` runs docs/scaling.md's step 3 instead (what tests/test_global_tier.py runs small): two
Prometheus shards (deploy/prometheus/sharding/shard.example.yml as shipped, rooms by hashmod, every rule
file but alerts/gpuwatch-site.rules.yml, every 15 s) remote-writing (deploy/victoriametrics/remote-write.yml)
to VictoriaMetrics single-node, and vmalert evaluating global.rules.yml and gpuwatch-site.rules.yml against
it, both with the flags of deploy/victoriametrics/*.default (addresses and paths here; the alerts go to a
sink). It measures the store's ingestion (samples/s: vm_rows_inserted_total over the second half of
``--settle``), series, memory (RSS) and disk (the data directory, and bytes a stored sample), vmalert's
evaluation time per group, the shards' head series and RSS, and every Fleet and Jobs query against the
store (instant p50 and max of ``--repeat`` runs, and over the data there is as a range query).

    .venv/bin/python bench/fleet.py --global-tier      # 500 targets, two shards (~10 min)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import urllib.request  # noqa: E402

import yaml  # noqa: E402
from daemon import wait_for  # noqa: E402
from fleetsim import (  # noqa: E402  (tests/fleetsim.py: the fleet the tests start, here at scale)
    MAX_SAMPLES,
    RULE_FILES,
    SITE_RULES,
    Fleet,
    Server,
    dashboard_queries,
    get_json,
    layout,
    reads_recorded,
    rule_groups,
)
from promstack import VictoriaMetrics, VmAlert, Webhook  # noqa: E402

OUT = ROOT / "bench" / "out"
SHARDING = ROOT / "deploy" / "prometheus" / "sharding"
VM = ROOT / "deploy" / "victoriametrics"

def measure_queries(fleet: Fleet | Server, nodes: int, repeat: int, data_seconds: float,
                    stats: bool = True) -> list[dict]:
    """Every dashboard query's times against ``fleet`` (its Prometheus, or a Server: a global store); with
    ``stats`` (Prometheus' query statistics) the samples each touches, scaled to 1,000 and 10,000 nodes;
    without (a store that keeps no such statistics), the Fleet and Jobs queries' times only."""
    out = []
    end = time.time()
    for q in dashboard_queries(layout(1)[0][0]):
        if not stats and q["uid"] not in ("gpuwatch-fleet", "gpuwatch-jobs"):
            continue
        walls, samples, error = [], 0, None
        for _ in range(repeat):
            t0 = time.perf_counter()
            doc = fleet.query(q["expr"], stats=stats)
            walls.append(time.perf_counter() - t0)
            if doc.get("status") != "success":
                error = doc.get("error")
                break
            samples = int(doc["data"].get("stats", {}).get("samples", {}).get("totalQueryableSamples", 0))
        entry = {k: q[k] for k in ("uid", "title", "ref", "hours")} | {
            "recorded": reads_recorded(q["raw"]), "instant_p50_ms": statistics.median(walls) * 1e3,
            "instant_max_ms": max(walls) * 1e3, "instant_samples": samples, "error": error}
        if not stats:
            entry["result_series"] = len(doc["data"]["result"]) if doc.get("status") == "success" else None
            step = max(15.0, data_seconds / 250)
            t0 = time.perf_counter()
            doc = fleet.query_range(q["expr"], end - data_seconds, end, step)
            entry["range_ms"] = (time.perf_counter() - t0) * 1e3
            if doc.get("status") != "success":
                entry["error"] = entry["error"] or doc.get("error")
            out.append(entry)
            continue
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


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return math.nan


def _metrics(base: str) -> dict[str, float]:
    """A Prometheus-format /metrics page: each series (name{labels}) -> value."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as response:
        text = response.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


def _sum(metrics: dict[str, float], prefix: str, contains: str = "") -> float:
    return sum(v for k, v in metrics.items() if k.startswith(prefix) and contains in k)


def _du(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def global_tier(args: argparse.Namespace, work: Path) -> dict:
    """Two shards -> VictoriaMetrics <- vmalert over args.targets targets: the store's figures."""
    fleet = Fleet(work)
    sink = Webhook()  # vmalert's notifier: the alerts are not what is measured
    stopping: list = []
    started = time.time()
    try:
        names = [fleet.node(f"p{i}", margin=25 + (i % 3), jobs=args.jobs_per_node).name for i in range(args.processes)]
        targets = [(instance, names[i % len(names)], labels) for i, (instance, labels) in
                   enumerate(layout(args.targets))]
        file_sd = work / "file_sd.yml"
        file_sd.write_text(yaml.safe_dump(fleet.static_configs(targets)))
        vm = VictoriaMetrics(work, VM / "victoria-metrics.default")
        stopping.append(vm)
        (remote,) = yaml.safe_load((VM / "remote-write.yml").read_text())["remote_write"]
        remote["url"] = vm.base + "/api/v1/write"
        shards = []
        for n in range(2):
            config = yaml.safe_load((SHARDING / "shard.example.yml").read_text())
            config["global"]["external_labels"]["prometheus"] = f"shard-{n}"
            config["rule_files"] = [str(p) for p in RULE_FILES if p != SITE_RULES]
            del config["alerting"]
            (job,) = config["scrape_configs"]
            job["file_sd_configs"] = [{"files": [str(file_sd)]}]
            job["relabel_configs"][1]["regex"] = str(n)
            config["remote_write"] = [remote]
            shards.append(fleet.server(f"shard-{n}", config))
        vmalert = VmAlert(work, VM / "vmalert.default", [SHARDING / "global.rules.yml", SITE_RULES], vm.base,
                          sink.url.removeprefix("http://").rstrip("/"))
        stopping.append(vmalert)
        store = Server("victoria-metrics", vm.proc, vm.base)
        wait_for(lambda: sum(len(s.result('up{job="gpuwatch"} == 1')) for s in shards) == args.targets, 180,
                 "every target up on its shard")
        up_at = time.time()
        time.sleep(args.settle / 2)  # a benchmark: the window of data (nothing waits on it)
        rows0, t0 = _sum(_metrics(vm.base), "vm_rows_inserted_total", "promremotewrite"), time.time()
        time.sleep(args.settle / 2)
        rows1, t1 = _sum(_metrics(vm.base), "vm_rows_inserted_total", "promremotewrite"), time.time()
        data_seconds = time.time() - up_at
        queries = measure_queries(store, args.targets, args.repeat, data_seconds, stats=False)
        m = _metrics(vm.base)
        stored_rows = _sum(m, "vm_rows{", 'type="storage/')
        stored_bytes = _sum(m, "vm_data_size_bytes{", 'type="storage/')
        series = get_json(vm.base + "/api/v1/series/count")["data"][0]
        rules = _metrics(vmalert.base)
        groups = {}
        for key, value in rules.items():
            if key.startswith("vmalert_iteration_duration_seconds_sum{"):
                group = key.split('group="', 1)[1].split('"', 1)[0]
                count = rules.get(key.replace("_sum{", "_count{"), 0)
                groups[group] = value / count * 1e3 if count else math.nan
        return {"mode": "global-tier", "targets": args.targets, "gpus": args.targets * 8, "processes": args.processes,
                "jobs_per_node": args.jobs_per_node, "data_seconds": data_seconds,
                "shards": [{"name": s.name, "targets": len(s.result('up{job="gpuwatch"}')),
                            "head_series": get_json(s.base + "/api/v1/status/tsdb")["data"]["headStats"]["numSeries"],
                            "rss_mb": rss_mb(s.process.pid) if s.process else None} for s in shards],
                "store": {"ingest_samples_per_s": (rows1 - rows0) / (t1 - t0), "series": series,
                          "rss_mb": rss_mb(vm.proc.pid), "disk_bytes": _du(work / "vm"),
                          "stored_samples": stored_rows, "bytes_per_sample": stored_bytes / stored_rows
                          if stored_rows else None, "flags": vm.proc.args[1:]},
                "vmalert": {"rss_mb": rss_mb(vmalert.proc.pid), "group_evaluation_ms": groups},
                "queries": queries, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "machine": {"cpus": os.cpu_count()}, "wall_s": time.time() - started}
    finally:
        fleet.stop()  # the shards first: they flush their remote_write queue to the store on the way out
        for process in reversed(stopping):
            process.stop()
        sink.close()


def report_global(result: dict) -> None:
    store = result["store"]
    print(f"{result['targets']} targets ({result['gpus']} GPUs) from {result['processes']} gpuwatch processes over "
          + ", ".join(f"{s['name']} ({s['targets']} targets, {s['head_series']:,} head series, {s['rss_mb']:.0f} MB)"
                      for s in result["shards"]))
    print(f"  VictoriaMetrics: {store['ingest_samples_per_s']:,.0f} samples/s in, {store['series']:,} series, "
          f"RSS {store['rss_mb']:.0f} MB, {store['disk_bytes'] / 1e6:.1f} MB on disk after "
          f"{result['data_seconds']:.0f} s ({store['bytes_per_sample'] or math.nan:.2f} bytes a stored sample)")
    print(f"  vmalert: RSS {result['vmalert']['rss_mb']:.0f} MB; "
          + ", ".join(f"{g} {ms:.1f} ms" for g, ms in result["vmalert"]["group_evaluation_ms"].items()))
    for q in sorted(result["queries"], key=lambda q: -q["instant_max_ms"]):
        error = f"  ERROR {q['error']}" if q["error"] else ""
        print(f"  {q['uid']} {q['title']!r} {q['ref']}: instant p50 {q['instant_p50_ms']:.1f} ms, max "
              f"{q['instant_max_ms']:.1f} ms; range {q.get('range_ms') or 0:.1f} ms{error}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--targets", type=int, default=500)
    ap.add_argument("--processes", type=int, default=5, help="gpuwatch processes serving the targets")
    ap.add_argument("--settle", type=float, default=300.0, help="seconds of data before measuring")
    ap.add_argument("--repeat", type=int, default=5, help="runs of each instant query")
    ap.add_argument("--jobs-per-node", type=int, default=1,
                    help="Slurm jobs holding each node's 8 GPUs (1: one 8-GPU job a node; 8: one a GPU)")
    ap.add_argument("--global-tier", action="store_true",
                    help="two shards remote-writing to VictoriaMetrics with vmalert (docs/scaling.md, step 3)")
    ap.add_argument("--out", default=None, help="bench/out/fleet.json (fleet-global.json with --global-tier)")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="gw-fleet-"))
    if args.global_tier:
        try:
            result = global_tier(args, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        out = Path(args.out or OUT / "fleet-global.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2))
        report_global(result)
        return 0
    args.out = args.out or str(OUT / "fleet.json")
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
        tsdb = get_json(fleet.base + "/api/v1/status/tsdb")["data"]["headStats"]
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
