"""The grace group's reader: Grace CPU, SysIO and module power and the Grace cap from hwmon.

``root`` (``--collector.grace.hwmon-root``, default /sys/class/hwmon) holds one ``hwmon<N>`` entry
per sensor chip. A Grace socket's power sensors each have a ``power1_oem_info`` (in the entry's
``device/`` directory, where DCGM reads it, or in the entry itself) whose text names them:

=========================  ================  ==================
power1_oem_info            value file        reading
=========================  ================  ==================
CPU Power Socket N         power1_average    sensor cpu, µW
SysIO Power Socket N       power1_average    sensor sysio, µW
Module Power Socket N      power1_average    sensor module, µW
Grace Power Socket N       power1_cap        the cap, µW
=========================  ================  ==================

Other chips (coretemp, nvme, acpitz, ...) have no power1_oem_info and are passed over without a
word. A Grace sensor whose files cannot be read or whose text is not a number of microwatts from 0
to 100 kW (garbage, bytes that are not UTF-8, a negative or absurd number, a file missing) is left
out: one warning names the file (again at most once an hour while it stays bad), the read counts
an error (gpuwatch_collector_errors_total{group="grace"}), and every valid sensor is kept. So is a
power1_oem_info that names a Grace sensor with a socket number the kernel never writes (a leading zero,
a Unicode digit or space: ``Socket 00``, ``Socket ٠``), and a sensor file that is not a regular file
(a FIFO would block the read). Two entries naming the same sensor and socket: the first in the
entries' sorted order whose reading is valid is kept, the later ones are reported as duplicates.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable

from gpuwatch.groups.grace import GraceSensor
from gpuwatch.hostside.hostile import SPACE, NotRegular, natural, read_regular
from gpuwatch.logs import get_logger

_NAME = re.compile(r"(CPU|SysIO|Module|Grace) Power Socket (0|[1-9][0-9]{0,2})", re.ASCII)  # the kernel's
_GRACE = re.compile(r"(CPU|SysIO|Module|Grace) Power Socket(\s.*)?", re.DOTALL)  # a Grace name, maybe a bad one
_SENSOR = {"CPU": "cpu", "SysIO": "sysio", "Module": "module", "Grace": "cap"}
_MAX_MICROWATTS = 100_000 * 1_000_000  # 100 kW: nothing on one socket draws that; more is garbage
_MAX_BYTES = 256  # a sensor file holds one short line; more is not a sensor's
_WARN_EVERY = 3600.0  # seconds between two warnings about the same file
_MAX_ENTRIES = 4096  # hwmon entries looked at per read: a runaway directory costs no more than this


class GraceHwmon:
    """``read() -> tuple[GraceSensor, ...] | None``: None when the node has no Grace sensor at all."""

    def __init__(self, root: str, monotonic: Callable[[], float],
                 errors: list[tuple[str, str]] | None = None) -> None:
        self._root = os.fspath(root)  # text, joined with os.path: a Path interns each hwmon name (pathlib)
        self._monotonic = monotonic
        self._errors = errors if errors is not None else []
        self._warned: dict[str, float] = {}  # file -> monotonic time of its last warning
        self._log = get_logger(component="grace")

    def read(self) -> tuple[GraceSensor, ...] | None:
        try:
            entries = sorted(e for e in os.listdir(self._root) if e.startswith("hwmon"))[:_MAX_ENTRIES]
        except OSError:  # no hwmon class at all (a container without /sys, a non-Linux host)
            return None
        found: dict[tuple[str, str], GraceSensor] = {}
        first: dict[tuple[str, str], str] = {}  # the power1_oem_info of the sensor kept
        seen = False
        for entry in entries:
            named = self._name(os.path.join(self._root, entry))
            if named is None:
                continue
            seen = True
            directory, sensor, socket = named
            if (sensor, socket) in found:  # not read: the sensor kept is the first valid one, whatever this says
                self._bad(os.path.join(directory, "power1_oem_info"),
                          f"names the same sensor as {first[(sensor, socket)]}")
                continue
            value = self._microwatts(os.path.join(directory, "power1_cap" if sensor == "cap" else "power1_average"))
            if value is not None:
                found[(sensor, socket)] = GraceSensor(sensor, socket, value / 1e6)
                first[(sensor, socket)] = os.path.join(directory, "power1_oem_info")
        if not seen:
            return None
        return tuple(sorted(found.values(), key=lambda s: (s.sensor, int(s.socket))))

    def _name(self, entry: str) -> tuple[str, str, str] | None:
        """(the directory of the sensor's files, sensor, socket) of a Grace entry; None for any other."""
        for directory in (os.path.join(entry, "device"), entry):
            path = os.path.join(directory, "power1_oem_info")
            try:
                raw = _small(path)
            except NotRegular:
                self._bad(path, "not a regular file")
                return None
            if raw is None:
                continue
            try:
                text = raw.decode("utf-8").strip(SPACE)
            except UnicodeDecodeError:
                self._bad(path, "not UTF-8 text")
                return None
            match = _NAME.fullmatch(text)
            if match is None:
                if _GRACE.fullmatch(text):
                    self._bad(path, "not a socket number as the kernel writes it")
                return None  # otherwise some other chip's power sensor: not ours
            return directory, _SENSOR[match.group(1)], match.group(2)
        return None

    def _microwatts(self, path: str) -> int | None:
        try:
            raw = _small(path)
        except NotRegular:
            self._bad(path, "not a regular file")
            return None
        if raw is None:
            self._bad(path, "missing or unreadable")
            return None
        try:
            text = raw.decode("ascii").strip(SPACE)
        except UnicodeDecodeError:
            text = ""
        if not text.removeprefix("-").isdigit():  # ASCII digits: not int()'s "1_000" or its control-character spaces
            self._bad(path, "not a number")
            return None
        value = natural(text, _MAX_MICROWATTS)
        if value is None:
            self._bad(path, "out of range")
        return value

    def _bad(self, path: str, why: str) -> None:
        self._errors.append(("grace", "bad_sensor"))
        key = str(path)
        now = self._monotonic()
        last = self._warned.get(key)
        if last is not None and now - last < _WARN_EVERY:
            return
        if last is None and len(self._warned) >= _MAX_ENTRIES:
            return
        self._warned[key] = now
        self._log.warning("grace_sensor_skipped", file=key, reason=why,
                          hint="the sensor is left out; the node's other Grace sensors are still read")


def _small(path: str) -> bytes | None:
    """The first bytes of a sysfs file, or None when it cannot be read (absent, EACCES, EIO); NotRegular when it
    is no regular file (hostile.read_regular)."""
    try:
        return read_regular(path, _MAX_BYTES)
    except NotRegular:
        raise
    except OSError:
        return None
