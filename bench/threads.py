"""Where a whole gpuwatch process's CPU goes, thread by thread: the figure bench.py gives, taken apart.

    .venv/bin/python bench/threads.py                         # 8 x L40S, 2 s polls, no scrapes (the idle node)
    .venv/bin/python bench/threads.py --poll 0.5 --scrape 1   # the busy cadence, a scrape a second
    .venv/bin/python bench/threads.py --path /healthz ...     # the HTTP stack's share without the render
    .venv/bin/python bench/threads.py --scrape 15 --changing  # readings that change every poll (bench.py's Changer)

Runs gpuwatch from bench.py's virtual environment (``bench/bench.py --only gpuwatch --gpus 8`` makes it;
install this tree into it first as bench.py does) over the fake node, and reads each thread's time on a CPU
in nanoseconds from ``/proc/PID/task/TID/schedstat`` at the start and the end of the window, with its
number of timeslices (how often the thread was woken or preempted). Python 3.11 does not give its threads
names the kernel sees; for this measurement only, a ``sitecustomize`` put on the measured process's path
names each thread after its Python name (``prctl(PR_SET_NAME)``, 15 characters). The process's own figure
is bench.py's: utime + stime (/proc/PID/stat's figure, in nanoseconds) minus the CPU time spent inside the
fake library; the events thread's row includes the fake library's wait, which sleeps until the state
file changes (as a real driver blocks in the kernel until an event comes) and looks at it every 100 ms even so
(until 2026-12-06 it polled the file every 10 ms: 100 wake-ups a second).
"""

from __future__ import annotations

import argparse
import http.client
import json
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # it puts tests/ on the path: its fakes, daemon.wait_for

wait_for = bench.wait_for

NAMING = """\
import ctypes, threading
_prctl = ctypes.CDLL(None).prctl
_inner = threading.Thread._bootstrap_inner
def _named(self):
    _prctl(15, self.name[-15:].encode(), 0, 0, 0)  # PR_SET_NAME
    _inner(self)
threading.Thread._bootstrap_inner = _named
"""


def threads(pid: int) -> dict[int, tuple[str, int, int]]:
    """TID -> (name, nanoseconds on a CPU, timeslices)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            ns, _, slices = (int(x) for x in (task / "schedstat").read_text().split())
            out[int(task.name)] = ((task / "comm").read_text().strip(), ns, slices)
        except (OSError, ValueError):
            continue  # a thread that ended
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--node", choices=sorted(bench.NODES), default="pcie")
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--scrape", type=float, default=0.0, help="seconds between scrapes; 0: none")
    ap.add_argument("--path", default="/metrics")
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--changing", action="store_true", help="readings change at every poll (bench.py's Changer)")
    args = ap.parse_args(argv)
    python = {"gpuwatch": bench.OUT / "gpuwatch-venv" / "bin" / "python"}
    if not python["gpuwatch"].exists():
        ap.error("no bench/out/gpuwatch-venv: run bench/bench.py --only gpuwatch --gpus 8 --nodes pcie --quick once")
    site = Path(tempfile.mkdtemp(prefix="gpuwatch-threads-"))
    (site / "sitecustomize.py").write_text(NAMING)
    spawn = bench.spawn
    bench.spawn = lambda argv, env, **kw: spawn(argv, {**env, "PYTHONPATH": str(site)}, **kw)
    exp = bench.start("gpuwatch", python, args.gpus, args.poll, bench.OUT / "runs" / "threads", args.node)
    stop = threading.Event()

    def scraper() -> None:
        while args.scrape and not stop.wait(args.scrape):
            conn = http.client.HTTPConnection("127.0.0.1", exp.port, timeout=30)
            try:
                conn.request("GET", args.path, headers=bench.PROMETHEUS_HEADERS)
                conn.getresponse().read()
            finally:
                conn.close()

    changer = bench.Changer(exp.fx, exp.node, args.poll) if args.changing else None
    try:
        wait_for(lambda: exp.counters()[0] / args.gpus >= max(10.0, 10 / args.poll), 120, "warm-up polls")
        before, (polls0, lib0), cpu0 = threads(exp.proc.pid), exp.counters(), exp.cpu_seconds()
        thread = threading.Thread(target=scraper, daemon=True)
        thread.start()
        stop.wait(args.seconds)
        stop.set()
        thread.join()
        after, (polls1, lib1), cpu1 = threads(exp.proc.pid), exp.counters(), exp.cpu_seconds()
    finally:
        if changer is not None:
            changer.close()
        exp.stop()
    seconds = args.seconds
    polls = (polls1 - polls0) / args.gpus
    own = (cpu1 - cpu0) - (lib1 - lib0)
    rows = []
    for tid, (name, ns, slices) in sorted(after.items()):
        _, ns0, slices0 = before.get(tid, (name, 0, 0))
        rows.append({"tid": tid, "name": name, "cpu_ms_per_s": round((ns - ns0) / 1e6 / seconds, 3),
                     "wakes_per_s": round((slices - slices0) / seconds, 2)})
    print(json.dumps({"node": args.node, "gpus": args.gpus, "poll": args.poll, "scrape": args.scrape,
                      "changing": args.changing,
                      "path": args.path, "seconds": seconds, "polls": polls,
                      "own_cpu_ms_per_s": round(own / seconds * 1e3, 3),
                      "library_cpu_ms_per_s": round((lib1 - lib0) / seconds * 1e3, 3),
                      "threads": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
