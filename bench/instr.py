"""What each part of a poll cycle costs in instructions and in cache lines fetched from memory: figures that
do not move with the VM's neighbours, beside bench.py's CPU seconds that do.

    .venv/bin/python bench/instr.py [--gpus 8] [--node l40s|h200] [--poll 2] [--scrape 15] [--cycles 30]
                                    [--changing] [--warm] [--json]

Runs the daemon's own wiring in-process (gpuwatch.agent.Agent over the fake libnvidia-ml.so.1, a FakeClock
moved one poll interval per cycle, the rules' history full, the collector tuned as the daemon tunes it)
under valgrind's callgrind with its cache simulation. A cycle is what the daemon does in one poll
interval: the slow and the host polls when due, the fast poll, the rules at their cadence (Poller.poll_fast
runs them), the scrape's share (an exposition rendered and gzipped every ``--scrape`` seconds). Between
cycles a sweep over 32 MiB evicts the simulated caches, as a busy host's other work does while the daemon
sleeps (``--warm``: no sweep, the cost back to back). Each part ends with a call of ``getppid``, before
which callgrind writes out what was counted since the last one (``--dump-before``): every part's cost,
measured in the one run, the caches as the whole cycle leaves them. Per part and cycle, minus the
instructions spent inside the fake library (its functions' own cost):

- ``Ir``: instructions executed (the hot cost; about 0.14 ns each on the bench's VM, Python 3.11);
- ``LLm``: last-level cache misses, instructions and data (the cold cost: each a line fetched from memory,
  of the order of 100 ns);
- ``I1m``, ``D1m``: first-level misses (lines from L2 or the last level).

``--changing`` moves every GPU's readings between cycles as bench.py's Changer does (the fake library
reads its state file again then: the library's cost, subtracted). Needs valgrind (Debian: ``apt-get install
valgrind``); a run of 30 cycles at 8 GPUs takes about a minute and a quarter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import fakenvml  # noqa: E402

SWEEP_BYTES = 32 * 2**20
EVENTS = ("Ir", "I1mr", "ILmr", "Dr", "D1mr", "DLmr", "Dw", "D1mw", "DLmw")


PARTS = ("slow", "host", "fast", "rules", "scrape")


def child(args: argparse.Namespace) -> None:
    import bench  # bench.change: its Changer's step (imported in the set-up, outside the measured cycles)
    from gpuwatch import logs
    from gpuwatch.agent import Agent
    from gpuwatch.cli.run import _tune_gc
    from gpuwatch.clock import FakeClock
    from gpuwatch.config import Config

    logs.configure("error", "json")
    node = getattr(fakenvml.FakeNode, args.node)(args.gpus)
    fx = fakenvml.FakeNvmlEnv(Path(args.lib_dir), Path(os.environ["FAKE_NVML_STATE"]), None)
    rng = random.Random(1)
    config = Config(poll_interval=args.poll)
    clock = FakeClock()
    agent = Agent(config, clock=clock)
    poller = agent.poller
    slow_every = max(1, round(config.poll_slow_interval / config.poll_interval))
    scrape_every = max(1, round(args.scrape / args.poll)) if args.scrape else 0
    sweep, zeros = bytearray(SWEEP_BYTES), bytes(SWEEP_BYTES // 64)
    labels: list[str] = []  # the part each dump holds, in the order callgrind writes them
    measuring = False

    def mark(label: str) -> None:
        if measuring:
            labels.append(label)
            os.getppid()  # callgrind dumps before it (--dump-before=getppid)

    evaluate = poller._evaluate

    def rules() -> None:  # the rules, inside poll_fast: a part of their own
        mark("fast")
        evaluate()  # type: ignore[misc]
        mark("rules")

    poller._evaluate = rules

    def cycle(i: int) -> None:
        clock.advance(config.poll_interval)
        if args.changing:
            bench.change(node, rng, config.poll_interval)
            fx.write(node)
        if not args.warm:
            sweep[::64] = zeros  # every line written: the caches hold the sweep's lines
        mark("other")
        if i % slow_every == 0:
            poller.poll_slow()
            mark("slow")
            poller.poll_host()
            mark("host")
        poller.poll_fast()
        mark("fast")
        if scrape_every and i % scrape_every == 0:
            agent.exposition.render(openmetrics=False, compress=True)
            mark("scrape")

    cycle(0)
    _tune_gc()  # as the daemon does after its first poll
    for i in range(1, int(config.rules_window / config.poll_interval) + 10):  # the rules' history full
        cycle(i)
    measuring = True
    os.getppid()  # the set-up and the warm-up: dump 1
    for i in range(args.cycles):
        cycle(i)
    print(json.dumps(labels))


def totals(out: Path) -> tuple[dict[str, int], dict[str, int]]:
    """(the dump's totals, the cost of the calls into the fake library, inclusive: what its functions and
    the libc functions they call cost, as bench.py's FAKE_NVML_CPU counts it) from a callgrind dump."""
    events: list[str] = []
    total: dict[str, int] = {}
    library = dict.fromkeys(EVENTS, 0)
    names: dict[str, str] = {}
    caller = callee = ""
    call_into_library = False

    def name(text: str) -> str:  # "(3) /path" defines a compressed name, "(3)" uses it
        m = re.match(r"\((\d+)\)(?: (.*))?", text)
        if m is None:
            return text
        if m.group(2):
            names[m.group(1)] = m.group(2)
        return names.get(m.group(1), "")

    for line in out.read_text(errors="replace").splitlines():
        if line.startswith("events:"):
            events = line.split()[1:]
        elif line.startswith("summary:") or line.startswith("totals:"):
            total = dict(zip(events, (int(x) for x in line.split()[1:]), strict=False))
        elif line.startswith("ob="):
            caller = name(line[3:])
        elif line.startswith("cob="):
            callee = name(line[4:])
        elif line.startswith("calls="):  # the next cost line is the call's inclusive cost
            target = callee or caller
            call_into_library = "libnvidia-ml" in target and "libnvidia-ml" not in caller
            callee = ""
        elif line[:1].isdigit() or line[:1] in "+-*":
            if call_into_library:
                call_into_library = False
                for event, value in zip(events, line.split()[1:], strict=False):
                    library[event] += int(value)
    return total, library


def measure(args: argparse.Namespace, fx: fakenvml.FakeNvmlEnv, workdir: Path) -> dict[str, dict[str, int]]:
    """part -> event -> the sum over the measured cycles."""
    out = workdir / "callgrind.out"
    argv = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--I1=32768,8,64", "--D1=32768,8,64",
            "--LL=8388608,16,64", "--compress-strings=no", "--compress-pos=no", "--dump-before=getppid",
            f"--callgrind-out-file={out}", sys.executable, __file__, "--child", "--lib-dir", str(fx.lib_dir),
            "--gpus", str(args.gpus), "--node", args.node, "--poll", str(args.poll), "--scrape", str(args.scrape),
            "--cycles", str(args.cycles)]
    argv += ["--changing"] * args.changing + ["--warm"] * args.warm
    env = {**fx.env, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "0"}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # compiling the imports is no part of a cycle: let them be cached
    done = subprocess.run(argv, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"valgrind run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    labels = json.loads(done.stdout.strip().splitlines()[-1])
    (workdir / "parts.json").write_text(json.dumps(labels))  # the part of each dump, for callgrind_annotate
    dumps = sorted(workdir.glob("callgrind.out.*"), key=lambda p: int(p.name.rsplit(".", 1)[1]))
    if len(dumps) != len(labels) + 1:  # the first: set-up and warm-up
        raise SystemExit(f"{len(dumps)} dumps for {len(labels)} parts: is getppid called elsewhere?")
    parts: dict[str, dict[str, int]] = {}
    for label, dump in zip(labels, dumps[1:], strict=True):
        total, library = totals(dump)
        into = parts.setdefault(label, dict.fromkeys(EVENTS, 0))
        for name in EVENTS:
            into[name] += total.get(name, 0) - library.get(name, 0)
    return parts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--node", choices=["h200", "l40s"], default="l40s", help="h200: HGX (NVLink, GPM); l40s: PCIe")
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--scrape", type=float, default=15.0, help="seconds between scrapes; 0: none")
    ap.add_argument("--cycles", type=int, default=30)
    ap.add_argument("--changing", action="store_true", help="readings change at every cycle")
    ap.add_argument("--warm", action="store_true", help="no cache sweep between cycles")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--lib-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args)
        return 0
    workdir = Path(tempfile.mkdtemp(prefix="gpuwatch-instr-"))
    fx = fakenvml.prepare(workdir, getattr(fakenvml.FakeNode, args.node)(args.gpus), counts=False)
    parts = measure(args, fx, workdir)
    rows = {}
    for part in (*PARTS, "other"):
        sums = parts.get(part)
        if sums is None:
            continue
        per = {name: value / args.cycles for name, value in sums.items()}
        rows[part] = {"Ir": round(per["Ir"]), "I1m": round(per["I1mr"]), "D1m": round(per["D1mr"] + per["D1mw"]),
                      "LLm": round(per["ILmr"] + per["DLmr"] + per["DLmw"])}
    whole = {key: sum(row[key] for part, row in rows.items() if part != "other") for key in ("Ir", "I1m", "D1m", "LLm")}
    result = {"gpus": args.gpus, "node": args.node, "poll_s": args.poll, "scrape_s": args.scrape,
              "cycles": args.cycles, "changing": args.changing, "warm": args.warm,
              "per_cycle": rows, "cycle": whole}
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{args.gpus} x {args.node}, {args.poll:g} s polls, a scrape every {args.scrape:g} s, "
          f"{'changing' if args.changing else 'steady'} readings, {'warm' if args.warm else 'cold'}, "
          f"{args.cycles} cycles; per cycle, the fake library's own cost left out:")
    print(f"{'part':<8}{'Ir':>12}{'I1m':>9}{'D1m':>9}{'LLm':>8}")
    for part, row in (*rows.items(), ("cycle", whole)):
        print(f"{part:<8}{row['Ir']:>12,}{row['I1m']:>9,}{row['D1m']:>9,}{row['LLm']:>8,}")
    print(f"callgrind's dumps (the part of each in parts.json): {workdir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
