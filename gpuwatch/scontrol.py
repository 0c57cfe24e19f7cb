"""The one way gpuwatch runs Slurm's ``scontrol``: used by the allocation reader
(gpuwatch/hostside/slurm_allocations.py) and the drain command (gpuwatch/drain.py).

An argv, never a shell; ``LC_ALL=C`` (Slurm's messages and dates in one language, whatever the
node's locale); stdin closed; a timeout after which the process is killed; output decoded as
UTF-8 with replacement (a byte that is not UTF-8 is a character, never an exception).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Sequence

MISSING, TIMEOUT, UNRUNNABLE, EXITED = "missing", "timeout", "unrunnable", "exited"


class ScontrolError(Exception):
    """scontrol could not answer: ``kind`` is MISSING (not found), TIMEOUT (killed after the
    timeout), UNRUNNABLE (any other OSError) or EXITED (a non-zero exit: ``code``, and ``said``, its message)."""

    def __init__(self, kind: str, message: str, said: str = "", code: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.said = said
        self.code = code


def _text(raw: bytes | None) -> str:
    return (raw or b"").decode("utf-8", errors="replace")


def run(command: str, args: Sequence[str], timeout: float) -> str:
    """``command args...``'s standard output; ScontrolError when it does not answer."""
    argv = [command, *args]
    shown = " ".join(argv[:3])
    try:
        done = subprocess.run(argv, capture_output=True, timeout=timeout, env=dict(os.environ, LC_ALL="C"),
                              stdin=subprocess.DEVNULL, check=False)
    except FileNotFoundError:
        raise ScontrolError(MISSING, f"{command} not found on PATH ({os.environ.get('PATH', os.defpath)})") from None
    except subprocess.TimeoutExpired:
        raise ScontrolError(TIMEOUT, f"`{shown}` did not finish within {timeout:g} s") from None
    except OSError as exc:
        raise ScontrolError(UNRUNNABLE, f"cannot run {command}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        said = " ".join((_text(done.stderr) or _text(done.stdout)).split()) or "no message"
        raise ScontrolError(EXITED, f"`{shown}` exited with {done.returncode}: {said}", said, done.returncode)
    return _text(done.stdout)
