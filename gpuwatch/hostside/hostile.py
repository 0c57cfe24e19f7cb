"""Host text gpuwatch does not write is data, never a reason to fail: the numbers in it and its bad lines.

Every parser of a host file (cgroup pseudo-files, the mapping directory, scontrol's answers) reads numbers
with :func:`natural` — ASCII digits only, a bounded length, a range — so a 5000-digit number, a Unicode
digit, a sign, NaN or an infinity is a bad value, not an exception (``int()`` raises on more than 4300
digits). What is bad is skipped, what is valid next to it is kept; :class:`Malformed` counts the skip in
``gpuwatch_collector_errors_total{group,error="malformed_input"}`` and logs one ``host_input_skipped``
warning per source (a file, a command's answer) per hour, then a summary of how often it recurred.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable
from typing import Any

from gpuwatch.logs import Repeats, get_logger

ERROR = "malformed_input"
# The kernel's whitespace: ASCII. str.strip() also strips \x1c-\x1f, \x85 and Unicode spaces, which would make
# "0\x1f" a CPU: strip(SPACE) leaves them, and the value is bad.
SPACE = " \t\n\r\f\v"
_WORDS = re.compile(r"[^ \t\n\r\f\v]+")
WARN_EVERY = 3600.0  # seconds: one warning per source in this interval, then one summary line
_MAX_SHOWN = 80  # characters of the bad text the warning shows


def words(text: str) -> list[str]:
    """``text`` split at the kernel's whitespace (SPACE) only: ``str.split()`` also splits at \\x1c-\\x1f, \\x85
    and Unicode spaces, which would make ``"c\\u3000195:3\\xa0rwm"`` a devices.list line and ``"1\\x1f200"`` two
    PIDs; here they stay inside a word, which is then bad."""
    return _WORDS.findall(text)


def lines(text: str) -> list[str]:
    """``text`` split at newlines only (``str.splitlines()`` also splits at \\x1c-\\x1e, \\x85, \\u2028...)."""
    return text.split("\n")


class NotRegular(OSError):
    """Something other than a regular file (a FIFO, a socket, a device, a directory) where a file of the kernel's
    is: every /proc and sysfs attribute is one, and a FIFO's open or read would block the reader for good."""


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """Up to ``limit`` bytes of the regular file ``path``, opened without blocking; NotRegular when it is not a
    regular file (it is not read), OSError when it cannot be opened or read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegular(f"{os.fspath(path)} is not a regular file")
        chunks, left = [], limit
        while left > 0:  # a large seq_file (cgroup.procs) may come in parts
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def natural(text: str, maximum: int) -> int | None:
    """``text`` as a whole number 0..maximum: ASCII digits only (no sign, no space, no "_", no Unicode
    digit), no longer than ``maximum`` is; None otherwise — never an exception, whatever the length."""
    if not text or len(text) > len(str(maximum)) or not (text.isascii() and text.isdigit()):
        return None
    value = int(text)
    return value if value <= maximum else None


def finite(text: str, maximum: float) -> float | None:
    """``text`` as a number 0..maximum (``1e3`` and fractions allowed); None for NaN, an infinity, a
    negative, more than ``maximum`` or no number at all, and for what float() takes that no kernel writes: a
    Unicode digit (``"١٢"``), an underscore (``"1_000"``), a Unicode or control-character space (``"3\xa0"``,
    ``"1\x1f"``)."""
    if len(text) > 64 or not text.isascii() or "_" in text or text.strip(SPACE) != text.strip():
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and 0 <= value <= maximum else None


def shown(text: str) -> str:
    """A bad line as a warning shows it: at most 80 characters, control characters and all escaped."""
    return ascii(text[:_MAX_SHOWN]) + ("..." if len(text) > _MAX_SHOWN else "")


Report = Callable[[str, str], None]  # (source: a file's path or a command, what was wrong)


class Malformed:
    """``report(source, reason)``: one source's input had something bad in it, skipped. Counted as
    ``(group, "malformed_input")`` in the reader's errors list of this read; logged once per source
    per hour (gpuwatch.logs.Repeats: later ones become one summary line with the count)."""

    def __init__(self, group: str, errors: list[tuple[str, str]], logger: Any = None,
                 monotonic: Callable[[], float] | None = None) -> None:
        self._group = group
        self._errors = errors
        log = logger if logger is not None else get_logger(component=group)
        self._repeats = Repeats(log, burst=1, interval=WARN_EVERY, **({"monotonic": monotonic} if monotonic else {}))

    def __call__(self, source: str, reason: str) -> None:
        self._errors.append((self._group, ERROR))
        self._repeats.log("warning", "host_input_skipped", ("malformed", source), group=self._group, source=source,
                          reason=reason, hint="the bad part is skipped and everything valid in it is kept; "
                                              "find what writes this file or answer")

    def flush(self) -> None:
        """Summaries of the sources whose hour is over; their keys are forgotten (a job's files go with it)."""
        self._repeats.flush()
