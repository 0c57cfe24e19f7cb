"""gpuwatch's own HTTP/1.x request parser: ``RequestHandler`` reads the requests of a connection and
answers each from the WSGI app (``gpuwatch.web.server`` serves it), keeping HTTP/1.1 connections open.

http.server and wsgiref parse headers through the ``email`` package and import ``html``, ``http.client``
and ``email`` (1.4 MB of resident memory, 23 modules), and cost a scrape about 0.05 ms of CPU more.
"""

from __future__ import annotations

import io
import re
import socket
import sys
import time
from collections.abc import Callable
from socketserver import BaseRequestHandler
from typing import Any
from urllib.parse import unquote

from gpuwatch import logs


def log() -> Any:
    return logs.get_logger(component="http")  # at the time of the event: logs.configure() may come later


def reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", None) or exc or type(exc).__name__)


_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: a method, a header's name
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_FIELD_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")  # RFC 9110 field-value: no CR, LF, NUL or other controls
_CONTROLS = re.compile(rb"[\x00-\x1f\x7f]")
_ABSOLUTE = re.compile(rb"https?://[^/?]*", re.IGNORECASE)  # an absolute-form target's scheme and authority
_DIGITS = re.compile(r"[0-9]+")
MAX_LINE = 65536  # bytes of the request line and of each header line (as http.server)
MAX_HEADERS = 100
# bytes of a whole request head (request line and headers): Prometheus sends under 1 KiB; 100 lines of 64 KiB
# each were 6.5 MB held per connection, 1.7 GB at the connections a listener keeps (nginx allows 32 KiB)
MAX_HEAD = 65536
LINGER_SECONDS, LINGER_BYTES = 1.0, 1 << 20  # what the client still sends after a closing answer, read and dropped
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(seconds: float) -> str:
    """RFC 9110's IMF-fixdate (English names whatever the locale)."""
    t = time.gmtime(seconds)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


def _remaining(deadline: float, late: str) -> float:
    """Seconds left before ``deadline`` (monotonic); TimeoutError(``late``) once none are: a step of a
    connection has that long in all, however slowly its bytes come."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError(late)
    return left


class _BadRequest(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Incomplete(Exception):
    """The client closed its side before the end of the request's head: nothing to answer (RFC 9112 §8)."""


_REASONS = {400: "Bad Request", 414: "URI Too Long", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 505: "HTTP Version Not Supported"}


class RequestHandler(BaseRequestHandler):
    """The requests of one connection, served to the WSGI app: HTTP/1.1 keeps the connection open for the next
    (as Prometheus and vmagent scrape: no TCP or TLS handshake and no accept per scrape), HTTP/1.0 closes it.

    What it takes: a request line ``METHOD TARGET HTTP/1.x`` (a token method; HTTP/0.9's version-less line, an
    empty line or other words are 400, a version other than 1.x is 505, a target with a control byte 400, a line
    over 64 KiB 414; one empty line before it is passed over; an absolute-form target ``http://host/path`` is
    its path), then header lines ``name: value`` (a token name; a line without one, an obsolete folded line, a
    value with CR, NUL or another control byte, a Content-Length that is not one number: 400; more than 100
    lines, one over 64 KiB or a head over 64 KiB in all: 431), up to an empty line. A header whose name has an
    underscore is dropped (it would share its WSGI key with the name spelt with a dash: ``X_User`` posing as
    ``X-User``), as nginx and gunicorn do. Bytes that are not ASCII are read as ISO-8859-1, as WSGI says. A
    body is never read (every path is GET or HEAD): a request that announces one is answered and the
    connection closed after it. Errors are answered with a status line, plain-text headers and ``CODE
    message`` (no body to HEAD), and close the connection.

    Deadlines (the server's ``request_timeout`` and ``keepalive_seconds``): a request's
    head must arrive whole within ``request_timeout`` of its first byte, and a response must be sent within
    ``request_timeout`` (a client that trickles one byte at a time, or reads that way, holds the connection's
    thread that long at most, not a timeout per byte); a kept connection waits ``keepalive_seconds`` for the
    next request. A request whose head is not finished in time, or that the client leaves unfinished, is not
    answered."""

    write_failed = False  # a send of the response failed (a client that stopped reading, or went away)
    head_request = False  # the request's method is HEAD: answers without a body

    def setup(self) -> None:
        self._buffer = bytearray()
        self._pos = 0
        self._deadline = 0.0
        server: Any = self.server  # a gpuwatch.web.server._Server
        self._timeout, self._idle = float(server.request_timeout), float(server.keepalive_seconds)
        # A TLS listener loaded ssl before it served (gpuwatch.web.config.server_context). Another thread may be
        # importing it right now (gRPC, through asyncio, at the kubelet client's first read): its module is in
        # sys.modules half made, without SSLSocket yet, and no socket of this process is one then.
        sslsocket = getattr(sys.modules.get("ssl"), "SSLSocket", None)
        self._tls = sslsocket is not None and isinstance(self.request, sslsocket)

    def handle(self) -> None:
        wait = self._timeout  # for the first request: a client that connects sends at once
        while self._serve(wait):
            wait = self._idle

    def _serve(self, wait: float) -> bool:
        """Read and answer one request; whether the connection is kept for another."""
        self.head_request = False
        try:
            request = self._read_request(wait)
        except _Incomplete:
            return False
        except _BadRequest as exc:
            self._send("HTTP/1.0", f"{exc.code} {_REASONS[exc.code]}",
                       [("Content-Type", "text/plain; charset=utf-8"), ("Connection", "close")],
                       f"{exc.code} {exc.message}\n".encode())
            self._linger()
            return False
        except OSError as exc:  # a head not finished in time, a connection reset, a TLS error
            log().debug("http_connection_error", error=reason(exc))
            return False
        if request is None:
            return False  # the client closed the connection, or kept it idle too long, between requests
        environ, version, keep = request
        keep = keep and self.server.keep_alive()  # type: ignore[attr-defined]  # a _Server's
        answer: list[Any] = []

        def start_response(status: str, headers: list[tuple[str, str]],
                           exc_info: Any = None) -> Callable[[bytes], None]:
            answer[:] = [status, headers]
            return self._unbuffered_write

        try:
            result = self.server.app(environ, start_response)  # type: ignore[attr-defined]  # a _Server's
            try:
                body = b"".join(result)
            finally:
                close = getattr(result, "close", None)
                if close is not None:
                    close()
            if not answer:
                raise RuntimeError("the application returned without calling start_response")
        except Exception as exc:  # a bug in the app: worth a traceback, in the log's own format
            log().error("http_handler_failed", error=repr(exc), exc_info=True)
            self._send(version, "500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8"),
                                                              ("Connection", "close")],
                       b"500 internal error: see gpuwatch's log\n")
            self._linger()
            return False
        headers = answer[1]
        if not keep and version == "HTTP/1.1":
            headers = [*headers, ("Connection", "close")]
        self._send(version, answer[0], headers, body)
        if not keep:
            self._linger()
        return keep and not self.write_failed

    def _linger(self) -> None:
        """Before a close after an answer: the end of our side, then what the client still sends (a body, a
        request line's rest, pipelined requests) read and dropped, ``LINGER_SECONDS`` and ``LINGER_BYTES`` at
        most. Closed with bytes unread, the kernel answers with a reset, and the client may lose the answer it
        was sent (Go's server and Apache linger likewise). Not on TLS, where the end of one side is the end of
        the session."""
        if self.write_failed or self._tls:
            return
        try:
            self.request.shutdown(socket.SHUT_WR)
            deadline, total = time.monotonic() + LINGER_SECONDS, 0
            while total < LINGER_BYTES:
                self.request.settimeout(_remaining(deadline, "lingered long enough"))
                chunk = self.request.recv(65536)
                if not chunk:
                    return
                total += len(chunk)
        except OSError:  # the client went away, or kept sending past the linger (TimeoutError): the close ends it
            return

    def _unbuffered_write(self, data: bytes) -> None:  # WSGI's write(): no app of gpuwatch's calls it
        raise RuntimeError("write() is not supported: return the body")

    def _fill(self, deadline: float) -> bool:
        """Receive more of the request before ``deadline`` (TimeoutError after it); False at the client's end."""
        self.request.settimeout(_remaining(deadline, "the request's head did not arrive in time"))
        chunk = self.request.recv(65536)
        if not chunk:
            return False
        if self._pos:  # what was read before is passed: keep only what is left
            del self._buffer[:self._pos]
            self._pos = 0
        self._buffer += chunk
        return True

    def _line(self, code: int, message: str) -> bytes:
        buffer = self._buffer
        while True:
            end = buffer.find(b"\n", self._pos, self._pos + MAX_LINE)
            if end >= 0:
                line = bytes(buffer[self._pos:end + 1])
                self._pos = end + 1
                return line
            if len(buffer) - self._pos >= MAX_LINE:
                raise _BadRequest(code, message)
            if not self._fill(self._deadline):
                raise _Incomplete()

    def _read_request(self, wait: float) -> tuple[dict[str, Any], str, bool] | None:
        """(WSGI environ, the response's HTTP version, whether the connection may be kept after it), or None
        when the client closed the connection or sent nothing for ``wait`` seconds before a request."""
        if self._pos >= len(self._buffer):  # nothing of the next request yet: wait for its first bytes
            try:
                if not self._fill(time.monotonic() + wait):
                    return None
            except TimeoutError:
                return None
        self._deadline = time.monotonic() + self._timeout  # the whole head from here
        try:
            line = self._line(414, "Request line too long")
            if line in (b"\r\n", b"\n"):  # RFC 9112 §2.2: one empty line before the request line is passed over
                line = self._line(414, "Request line too long")
        except _Incomplete:
            return None
        words = line.split()
        if len(words) != 3:
            raise _BadRequest(400, "Bad request line: expected METHOD PATH HTTP/1.x" if words else "Empty request line")
        method, target, version = words
        number = _VERSION.fullmatch(version)
        if number is None:
            raise _BadRequest(400, f"Bad request version {version.decode('iso-8859-1')!r}")
        if number.group(1) != b"1":
            raise _BadRequest(505, f"HTTP version not supported: {version.decode('iso-8859-1')}")
        self.head_request = method == b"HEAD"
        if not _TOKEN.fullmatch(method):
            raise _BadRequest(400, "Bad request method: not an HTTP token")
        if _CONTROLS.search(target):
            raise _BadRequest(400, "Bad request target: a control character")
        absolute = _ABSOLUTE.match(target)  # RFC 9112 §3.2.2: a server accepts the absolute form (proxies send it)
        if absolute is not None:
            target = target[absolute.end():] or b"/"
            if not target.startswith(b"/"):  # only a query after the authority
                target = b"/" + target
        headers: dict[str, str] = {}
        size = len(line)
        for _ in range(MAX_HEADERS + 1):
            header = self._line(431, "Line too long")
            if header in (b"\r\n", b"\n"):
                break
            size += len(header)
            if size > MAX_HEAD:
                raise _BadRequest(431, f"Request head over {MAX_HEAD} bytes")
            if header[:1] in (b" ", b"\t"):
                raise _BadRequest(400, "Bad header: obsolete line folding")
            name, colon, value = header.partition(b":")
            if not colon or not _TOKEN.fullmatch(name):
                raise _BadRequest(400, "Bad header line: expected NAME: VALUE")
            value = value.rstrip(b"\r\n").strip(b" \t")
            if not _FIELD_VALUE.fullmatch(value):
                raise _BadRequest(400, "Bad header value: a control character")
            if b"_" in name:
                continue  # its WSGI key is the one of the name with a dash: dropped, as nginx and gunicorn do
            key = "HTTP_" + name.decode("ascii").upper().replace("-", "_")
            text = value.decode("iso-8859-1")
            headers[key] = f"{headers[key]},{text}" if key in headers else text
        else:
            raise _BadRequest(431, "Too many headers")
        length = headers.get("HTTP_CONTENT_LENGTH")
        if length is not None:  # RFC 9112 §6.3: one number (repeated, the same number)
            numbers = {part.strip(" \t") for part in length.split(",")}
            if len(numbers) != 1 or not all(_DIGITS.fullmatch(number) for number in numbers):
                raise _BadRequest(400, "Bad Content-Length: not one number")
            length = headers["HTTP_CONTENT_LENGTH"] = numbers.pop()
        protocol = version.decode("ascii")
        modern = number.group(2) != b"0"  # HTTP/1.1, or a later 1.x answered as 1.1 (RFC 9110 §2.5)
        keep = (modern and "HTTP_TRANSFER_ENCODING" not in headers
                and (length is None or not length.strip("0"))  # a body, never read, would be the next request
                and "close" not in (token.strip(" \t").lower()
                                    for token in headers.get("HTTP_CONNECTION", "").split(",")))
        path, _, query = target.decode("iso-8859-1").partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method.decode("ascii"), "SCRIPT_NAME": "", "PATH_INFO": unquote(path, "iso-8859-1"),
            "QUERY_STRING": query, "SERVER_PROTOCOL": protocol,
            "SERVER_NAME": self.server.server_name, "SERVER_PORT": str(self.server.server_port),  # type: ignore[attr-defined]
            "REMOTE_ADDR": self.client_address[0] if isinstance(self.client_address, tuple) else "",
            "wsgi.version": (1, 0), "wsgi.input": io.BytesIO(), "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        for field in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if "HTTP_" + field in headers:
                environ[field] = headers.pop("HTTP_" + field)
        environ.update(headers)
        environ["wsgi.url_scheme"] = "https" if self._tls else "http"
        if self._tls:
            environ["HTTPS"] = "on"
        return environ, "HTTP/1.1" if modern else "HTTP/1.0", keep

    def _send(self, version: str, status: str, headers: list[tuple[str, str]], body: bytes) -> None:
        """The response in one send where it fits the socket's buffer (never a small head and its body apart:
        the body would wait for the head's ACK), within ``request_timeout`` in all."""
        lines = [f"{version} {status}", f"Date: {http_date(time.time())}"]
        lines += [f"{name}: {value}" for name, value in headers]
        if not any(name.lower() == "content-length" for name, _ in headers):
            lines.append(f"Content-Length: {len(body)}")
        # a CR, LF or NUL in a header would end it early (a second guard: the request's values have none)
        head = "\r\n".join(line.replace("\r", " ").replace("\n", " ").replace("\0", " ") for line in lines)
        data = (head + "\r\n\r\n").encode("iso-8859-1", "replace")
        if not self.head_request:
            data += body
        deadline = time.monotonic() + self._timeout
        view = memoryview(data)
        try:
            while view:
                self.request.settimeout(_remaining(deadline, "the response was not taken in time"))
                view = view[self.request.send(view):]
        except OSError as exc:  # the client went away or does not read, a TLS error mid-response
            log().debug("http_connection_error", error=reason(exc))
            self.write_failed = True
