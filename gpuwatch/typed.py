"""Values a person types, read as they are meant: numbers in ASCII, durations, listen addresses.

``float()`` and ``int()`` also take ``"1_000"``, ``"١٢"`` (other scripts' digits) and Unicode spaces around a
number, which no one means in a configuration; Python refuses to spell a whole number of more than 4300 digits,
so a message never shows one. Used by gpuwatch.config (and through it by the commands).
"""

from __future__ import annotations

import re
from typing import Any

from gpuwatch.errors import ConfigError
from gpuwatch.yamlfile import whole_number

DEFAULT_PORT = 19400

SPACE = " \t\n\r\f\v"  # ASCII's: str.strip() also strips Unicode spaces
NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?", re.ASCII)
WHOLE = re.compile(r"[+-]?\d+", re.ASCII)


def shown(value: Any) -> str:
    """``repr(value)`` for a message, cut short (a 5000-digit number has no repr: Python refuses to spell it)."""
    if isinstance(value, int) and not isinstance(value, bool) and not -10**30 < value < 10**30:
        return whole_number(value)
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def number(value: Any, pattern: re.Pattern[str]) -> Any:
    """``value`` itself (an int or a float from YAML), or a text that ``pattern`` matches, stripped; ValueError
    for anything else (a bool, other text)."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, str):
        value = value.strip(SPACE)
        if not pattern.fullmatch(value):
            raise ValueError
    return value


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", re.ASCII)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(name: str, value: Any) -> float:
    """Seconds from ``90``, ``90s``, ``10m``, ``1h30m``, ``1.5h``, ``500ms`` or ``1d``."""
    try:
        seconds = float(number(value, NUMBER))
    except OverflowError:
        seconds = float("inf")
    except (TypeError, ValueError):
        text = value.strip(SPACE).lower() if isinstance(value, str) else ""
        if not text or _DURATION_PART.sub("", text):
            raise ConfigError(f"{name}: {shown(value)} is not a duration (e.g. 90s, 10m, 1h30m)") from None
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))
    if not 0 < seconds < float("inf"):
        raise ConfigError(f"{name}: must be longer than 0 and finite, got {shown(value)}")
    return seconds


def parse_listen_address(value: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT`` (all interfaces) or ``[IPv6]:PORT`` -> (host, port)."""
    text = str(value).strip(SPACE)
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ConfigError(f"web.listen-address: {value!r} is not HOST:PORT (e.g. :{DEFAULT_PORT})")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        import ipaddress  # here: a daemon listening on no IPv6 literal does not load it (gpuwatch/__init__.py)

        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"web.listen-address: {value!r}: {host!r} is not an IPv6 address") from None
    elif ":" in host:
        raise ConfigError(f"web.listen-address: {value!r}: write IPv6 addresses in brackets, e.g. [::1]:{DEFAULT_PORT}")
    if not WHOLE.fullmatch(port_text) or not port_text.isdigit():  # ASCII digits, no sign, no "1_0"
        raise ConfigError(f"web.listen-address: {value!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not 0 <= port <= 65535:
        raise ConfigError(f"web.listen-address: {value!r}: port must be 0-65535")
    return host, port
