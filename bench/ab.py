"""Two gpuwatch trees side by side: this working tree and an older commit, both whole processes over fake nodes
of their own, their CPU measured in the same seconds (as bench.py --paired measures gpuwatch beside
nvitop-exporter): for a change whose effect is smaller than what the VM's neighbours do from one window to
the next.

    .venv/bin/python bench/ab.py --base c7faaaa                      # 8 x L40S, 2 s polls, a scrape every 15 s
    .venv/bin/python bench/ab.py --base c7faaaa --rounds 3 --window 150

The base is checked out with ``git worktree`` and installed, without its dependencies, into a copy of
bench.py's virtual environment (bench/out/gpuwatch-venv, made by bench.py; this tree is installed into it
first, as bench.py does); both run with their defaults. Each round is a window with the fake node's readings
steady, then one with them changing every poll (bench.py's Changer). Prints one JSON line per window: µs of
CPU per GPU per poll, the fake library's own CPU left out, for ``new`` and ``base``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # it puts tests/ on the path: its fakes


def install(python: Path, tree: Path) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--force-reinstall",
                    "--no-deps", str(tree)], check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to measure this tree against")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--node", choices=sorted(bench.NODES), default="pcie")
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--scrape", type=float, default=15.0)
    ap.add_argument("--window", type=float, default=150.0)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    venv = bench.OUT / "gpuwatch-venv"
    if not (venv / "bin" / "python").exists():
        ap.error("no bench/out/gpuwatch-venv: run bench/bench.py --only gpuwatch --gpus 8 --nodes pcie --quick once")
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-ab-"))
    tree, base_venv = work / "tree", work / "venv"
    git = ["git", "-C", str(bench.ROOT), "worktree"]
    subprocess.run([*git, "add", "-q", "--detach", str(tree), args.base], check=True)
    exps: list[bench.Exporter] = []
    try:
        install(venv / "bin" / "python", bench.ROOT)
        shutil.copytree(venv, base_venv, symlinks=True)
        install(base_venv / "bin" / "python", tree)
        for name, python in (("new", venv / "bin" / "python"), ("base", base_venv / "bin" / "python")):
            exp = bench.start("gpuwatch", {"gpuwatch": python}, args.gpus, args.poll, work / name, args.node)
            exp.name = name
            exps.append(exp)
        for exp in exps:
            bench.wait_for(lambda exp=exp: exp.counters()[0] / args.gpus >= 10, 120, "warm-up polls")
        for _ in range(args.rounds):
            for changing in (False, True):
                changers = [bench.Changer(exp.fx, exp.node, args.poll) for exp in exps] if changing else []
                try:
                    figures = bench.cpu_windows(exps, args.gpus, args.window, args.scrape)
                finally:
                    for changer in changers:
                        changer.close()
                        changer.fx.write(changer.node)
                row = {exp.name: round(f["cpu_us_per_gpu_poll"], 1) for exp, f in zip(exps, figures)}
                print(json.dumps({**row, "changing": changing}), flush=True)
    finally:
        for exp in exps:
            exp.stop()
        subprocess.run([*git, "remove", "--force", str(tree)], check=False)
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
