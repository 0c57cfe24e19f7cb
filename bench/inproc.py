"""Where a poll's CPU goes, in-process: the supporting figures beside bench.py's whole-process ones.

    .venv/bin/python bench/inproc.py [--gpus 8] [--node h200|l40s] [--rounds 300]

Runs itself again in a child whose environment loads the fake libnvidia-ml.so.1 (LD_LIBRARY_PATH
must be set before Python starts), builds the daemon's own wiring (gpuwatch.agent.Agent, NVML
backend, defaults) on a FakeClock moved one fast interval per poll, so that the rules' history
holds what a real daemon's holds, and measures with time.process_time, per GPU per fast poll, minus
the CPU time the fake library itself reports (FAKE_NVML_CPU):

- the backend's read of one GPU (NvmlBackend.read_fast), and the NVML calls it makes;
- the fast poll without the rules (read every GPU, store the samples, the poll's own figures);
- the rule engine's evaluation, once per poll (rules with ``every`` run at some polls only: the
  figures are means);
- rendering the exposition of a new snapshot (what the first scrape after a poll costs).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fakenvml  # noqa: E402


def child(rounds: int) -> dict:
    from gpuwatch import logs
    from gpuwatch.agent import Agent
    from gpuwatch.clock import FakeClock
    from gpuwatch.config import Config

    logs.configure("error", "json")
    counts_path = os.environ["FAKE_NVML_COUNTS"]

    def library_s() -> float:
        return fakenvml.read_cpu_seconds(counts_path)

    config = Config()
    clock = FakeClock()
    agent = Agent(config, clock=clock)
    poller, backend = agent.poller, agent.backend
    poller.poll_fast()
    uuids = [g.identity.uuid for g in agent.store.snapshot().gpus]
    gpus = len(uuids)
    slow_every = round(config.poll_slow_interval / config.poll_interval)

    def timed(fn) -> float:
        l0 = library_s()  # reading the counts file is not part of the measured call
        c0 = time.process_time()
        fn()
        c1 = time.process_time()
        return (c1 - c0) - (library_s() - l0)

    def poll(i: int) -> None:
        clock.advance(config.poll_interval)
        if i % slow_every == 0:
            poller.poll_slow()

    for i in range(int(config.rules_window / config.poll_interval) + 10):  # the rules' history full
        poll(i)
        poller.poll_fast()
    read, whole, rules, render = [], [], [], []
    calls0 = fakenvml.read_counts(counts_path)
    for i in range(rounds):
        poll(i)
        read.append(timed(lambda: [backend.read_fast(u) for u in uuids]) / gpus)
        whole.append(timed(lambda: poller._poll("fast")) / gpus)  # poll_fast without its rules
        rules.append(timed(agent.evaluate_rules) / gpus)
        render.append(timed(lambda: agent.exposition.render(openmetrics=True, compress=True)) / gpus)
        clock.advance(1e-3)  # a new snapshot freshness key for the next render
    calls1 = fakenvml.read_counts(counts_path)
    per_poll = {k: (v - calls0.get(k, 0)) / (2 * rounds * gpus) for k, v in calls1.items()
                if v - calls0.get(k, 0)}  # read_fast + the fast poll each read once
    med = statistics.mean  # means: rules with `every` run at some polls only
    return {"gpus": gpus, "rounds": rounds, "us_per_gpu_per_poll": {
        "backend_read_fast": med(read) * 1e6, "poll_fast_read_and_store": med(whole) * 1e6,
        "rules_evaluate": med(rules) * 1e6, "render_new_snapshot": med(render) * 1e6},
        "nvml_calls_per_gpu_per_fast_poll": round(sum(per_poll.values()), 2), "by_call": per_poll}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--node", choices=["h200", "l40s"], default="h200",
                    help="h200: HGX (NVLink, GPM); l40s: PCIe, neither")
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.rounds)))
        return 0
    fx = fakenvml.prepare(Path(tempfile.mkdtemp()), getattr(fakenvml.FakeNode, args.node)(args.gpus))
    env = {**fx.env, "FAKE_NVML_CPU": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, __file__, "--child", "--rounds", str(args.rounds)], env=env,
                         capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
