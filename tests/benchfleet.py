"""bench/fleet.py for the tests that start a small fleet (test_fleet.py, test_scaling.py): its module,
a Fleet in a temporary directory, and the shipped alert and recording rules made quick (promtool's
cases in alerts/tests/ and deploy/prometheus/tests/ check the holds and intervals as shipped)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_fleet", ROOT / "bench" / "fleet.py")
fleet_bench = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
sys.modules["bench_fleet"] = fleet_bench  # its dataclasses look their module up
_spec.loader.exec_module(fleet_bench)  # type: ignore[union-attr]


def new_fleet(work: Path):
    if shutil.which("prometheus") is None:
        pytest.fail("prometheus is missing: scripts/test installs it (Debian package prometheus)")
    return fleet_bench.Fleet(work, interval="2s")


def quick(text: str, holds: bool = True) -> str:
    """A rule file's text with its groups' own intervals (1m, 5m) taken out, so that every group runs at
    the global evaluation interval, the accounting's subquery sampling every second instead of on whole
    minutes, and (``holds``) every alert's for: at 0s."""
    text = re.sub(r"^    interval: \S+\n", "", text, flags=re.MULTILINE).replace("[5m:1m]", "[5m:1s]")
    return re.sub(r"^(\s+)for: \S+$", r"\1for: 0s", text, flags=re.MULTILINE) if holds else text


def rules_for_tests(work: Path) -> list[Path]:
    """quick() copies of alerts/gpuwatch.rules.yml and deploy/prometheus/recording.rules.yml."""
    copies = []
    for path in fleet_bench.RULE_FILES[:2]:
        copy = work / path.name
        copy.write_text(quick(path.read_text()))
        copies.append(copy)
    return copies
