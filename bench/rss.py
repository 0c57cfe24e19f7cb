"""Resident memory of gpuwatch after N polls, the bench's way, for one tree or two side by side.

    .venv/bin/python bench/rss.py                                   # this tree, PCIe and HGX, 8 and 64 GPUs
    git worktree add /tmp/old v0.1.0
    .venv/bin/python bench/rss.py --trees /tmp/old . --nodes pcie  # an older tree beside this one

One `gpuwatch run` at a time over the bench's fake node (bench.py's ``start``: 0.5 s polls), a scrape a second,
until NVML's temperature call counts ``--polls`` polls per GPU; then VmRSS, RssAnon and RssFile from
/proc/PID/status (MB of 10^6 bytes, as bench.py's figure). A tree's package is found first because the
process runs in a directory holding a link to it (``python -m`` puts the current directory first on the
path). Only the memory: bench.py measures CPU and latency beside nvitop-exporter.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from daemon import wait_for  # noqa: E402

import bench  # noqa: E402


def measure(tree: Path, gpus: int, kind: str, polls: int, python: Path) -> dict[str, float]:
    work = Path(tempfile.mkdtemp(prefix="gpuwatch-rss-"))
    (work / "gpuwatch").symlink_to(tree.resolve() / "gpuwatch")
    exp = bench.start("gpuwatch", {"gpuwatch": python}, gpus, 0.5, work, kind)
    stop = threading.Event()

    def scrape() -> None:
        while not stop.wait(1.0):
            exp.get()

    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        wait_for(lambda: exp.counters()[0] / gpus >= polls, 60 + polls, f"{polls} polls")
        status = Path(f"/proc/{exp.proc.pid}/status").read_text().splitlines()
        return {line.split(":")[0]: int(line.split()[1]) * 1024 / 1e6 for line in status
                if line.startswith(("VmRSS:", "RssAnon:", "RssFile:"))}
    finally:
        stop.set()
        scraper.join()
        exp.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trees", type=Path, nargs="+", default=[ROOT], help="source trees (each with gpuwatch/)")
    ap.add_argument("--nodes", choices=sorted(bench.NODES), nargs="+", default=["pcie", "hgx"])
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--polls", type=int, default=300)
    args = ap.parse_args()
    python = ROOT / ".venv" / "bin" / "python"
    for kind in args.nodes:
        for gpus in args.gpus:
            for tree in args.trees:
                mb = measure(tree, gpus, kind, args.polls, python)
                print(f"{kind:5} x{gpus:<3} {str(tree):30} " + "  ".join(f"{k} {v:5.1f} MB" for k, v in mb.items()),
                      flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
