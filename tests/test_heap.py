"""gpuwatch.heap: glibc's malloc keeps less of what the daemon freed (its arenas limited, trimmed once a minute)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuwatch import heap
from gpuwatch.clock import FakeClock

ROOT = Path(__file__).resolve().parents[1]
GLIBC = heap._glibc() is not None
# The child processes' malloc as glibc's defaults make it: none of the caller's tuning or another allocator.
CLEAN_ENV = {k: v for k, v in os.environ.items()
             if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "LD_PRELOAD", "PYTHONMALLOC"))}


@pytest.fixture(params=[ValueError("unrecognized configuration name"), OSError(22, "Invalid argument")],
                ids=["macos", "musl"])
def no_glibc(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """The process as it would be over another C library: confstr knows no glibc version (macOS: no such
    name, ValueError; musl: EINVAL)."""
    def confstr(name: str) -> str | None:
        raise request.param
    monkeypatch.setattr(heap.os, "confstr", confstr)
    monkeypatch.setattr(heap, "_libc", None)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_trim_gives_the_free_pages_back_to_the_kernel() -> None:
    # In a process of its own: 40 MB in 100 KB blocks (under malloc's mmap threshold: from the heap), every
    # tenth kept so that the freed ones lie between live ones, where free() alone gives nothing back.
    script = textwrap.dedent("""
        from gpuwatch import heap
        def anon():
            for line in open("/proc/self/status"):
                if line.startswith("RssAnon:"):
                    return int(line.split()[1])
        clock = [0.0]
        trimmer = heap.Trimmer(every=60, monotonic=lambda: clock[0])
        blocks = [bytearray(100_000) for _ in range(400)]
        kept = blocks[::10]
        del blocks
        before = anon()
        clock[0] = 60.0
        print(trimmer.maybe_trim(), before, anon(), len(kept))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**CLEAN_ENV, "PYTHONPATH": str(ROOT)}).stdout.split()
    trimmed, before, after = out[0], int(out[1]), int(out[2])
    assert trimmed == "True"
    assert before - after > 20_000, (before, after)  # kB: most of the 36 MB freed


def test_trims_once_a_period_of_the_injected_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    class Lib:
        def malloc_trim(self, pad: int) -> int:
            calls.append(pad)
            return 1

    monkeypatch.setattr(heap, "_libc", Lib())
    clock = FakeClock()
    trimmer = heap.Trimmer(every=60, monotonic=clock.monotonic)
    done = []
    for seconds in (0, 59.5, 0.5, 1, 58.5, 1):  # at 0, 59.5, 60, 61, 119.5, 120.5 s
        clock.advance(seconds)
        done.append(trimmer.maybe_trim())
    assert done == [False, False, True, False, False, True]
    assert calls == [0, 0] and trimmer.trims == 2


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.parametrize(("env", "arenas"), [({}, 2), ({"MALLOC_ARENA_MAX": "4"}, 4),
                                             ({"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}, 4)],
                         ids=["default", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES"])
def test_the_arenas_are_limited_unless_the_operator_chose_a_number(env: dict[str, str], arenas: int) -> None:
    # In a process of its own: 12 threads, each of which takes an arena at its first malloc unless capped;
    # malloc_stats() writes one "Arena N:" line per arena to stderr. (mallopt answers 1 to any parameter.)
    script = textwrap.dedent("""
        import ctypes, sys, threading
        from gpuwatch import heap
        print(heap.limit_arenas())
        hold = threading.Barrier(13)
        def work():
            block = bytearray(100_000)
            hold.wait()
        threads = [threading.Thread(target=work) for _ in range(12)]
        for t in threads:
            t.start()
        hold.wait()
        for t in threads:
            t.join()
        sys.stdout.flush()
        ctypes.CDLL(None).malloc_stats()
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**CLEAN_ENV, **env, "PYTHONPATH": str(ROOT)})
    assert run.stdout.split() == [str(not env)]
    assert sum(line.startswith("Arena ") for line in run.stderr.splitlines()) == arenas


def test_another_c_library_gets_neither_and_no_error(no_glibc: None) -> None:
    clock = FakeClock()
    trimmer = heap.Trimmer(every=60, monotonic=clock.monotonic)
    clock.advance(60)
    assert heap.limit_arenas({}) is False
    assert trimmer.maybe_trim() is False and trimmer.trims == 0
