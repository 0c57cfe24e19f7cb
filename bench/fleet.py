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

from daemon import wait_for  # noqa: E402
from fleetsim import (  # noqa: E402  (tests/fleetsim.py: the fleet the tests start, here at scale)
    MAX_SAMPLES,
    RULE_FILES,
    Fleet,
    dashboard_queries,
    get_json,
    layout,
    reads_recorded,
    rule_groups,
)

OUT = ROOT / "bench" / "out"

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
