"""systemd's notify protocol in a few lines of stdlib: READY=1, STATUS=, WATCHDOG=1, STOPPING=1.

One datagram of newline-separated KEY=VALUE to the AF_UNIX socket named in $NOTIFY_SOCKET
(a leading '@' means the abstract namespace). Without $NOTIFY_SOCKET every call does nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping


class Notifier:
    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address or None
        self._socket: socket.socket | None = None
        self.watchdog_seconds: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_seconds = int(usec) / 1e6

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, **fields: str | int) -> bool:
        """Send one message, e.g. ``send(READY=1, STATUS="8 GPUs")``; False if it could not be sent."""
        if self._address is None:
            return False
        payload = "\n".join(f"{key}={value}" for key, value in fields.items()).encode()
        try:
            if self._socket is None:
                self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._socket.sendto(payload, self._address)
            return True
        except OSError:
            return False

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
