"""gpuwatch's own HTTP/1.x request parser: ``RequestHandler`` reads one request from a connection,
answers it from the WSGI app (``gpuwatch.web.server`` serves it), and closes.

http.server and wsgiref parse headers through the ``email`` package and import ``html``, ``http.client``
and ``email`` (1.4 MB of resident memory, 23 modules), and cost a scrape about 0.05 ms of CPU more.
"""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable
from socketserver import StreamRequestHandler
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
_DIGITS = re.compile(r"[0-9]+")
MAX_LINE = 65536  # bytes of the request line and of each header line (as http.server)
MAX_HEADERS = 100
_DAYS = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_MONTHS = ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec")


def http_date(seconds: float) -> str:
    """RFC 9110's IMF-fixdate (English names whatever the locale)."""
    t = time.gmtime(seconds)
    return (f"{_DAYS[t.tm_wday]}, {t.tm_mday:02d} {_MONTHS[t.tm_mon - 1]} {t.tm_year} "
            f"{t.tm_hour:02d}:{t.tm_min:02d}:{t.tm_sec:02d} GMT")


class _BadRequest(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Incomplete(Exception):
    """The client closed its side before the end of the request's head: nothing to answer (RFC 9112 §8)."""


_REASONS = {400: "Bad Request", 414: "URI Too Long", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 505: "HTTP Version Not Supported"}


class RequestHandler(StreamRequestHandler):
    """One request per connection (answered as HTTP/1.0, then closed), served to the WSGI app.

    What it takes: a request line ``METHOD TARGET HTTP/1.x`` (a token method; HTTP/0.9's version-less line, an
    empty line or other words are 400, a version other than 1.x is 505, a target with a control byte 400, a line
    over 64 KiB 414; one empty line before it is passed over), then header lines ``name: value`` (a token name;
    a line without one, an obsolete folded line, a value with CR, NUL or another control byte, a Content-Length
    that is not one number: 400; more than 100 lines or one over 64 KiB: 431), up to an empty line. A request
    whose head the client did not finish is not answered. Bytes that are not ASCII are read as ISO-8859-1, as
    WSGI says. A body is never read (every path is GET or HEAD). Errors are answered with a status line, plain-
    text headers and ``CODE message`` (no body to HEAD)."""

    # The response is buffered and sent at the end (one send for status line, headers and a body up to the
    # buffer's size): unbuffered, each header line and the body went out in a send of its own.
    wbufsize = 1 << 16
    write_failed = False  # a send of the response failed (a client that stopped reading, or went away)

    head_request = False  # the request's method is HEAD: answers without a body

    def handle(self) -> None:
        try:
            environ = self._read_request()
        except _Incomplete:
            return
        except _BadRequest as exc:
            self._send(f"{exc.code} {_REASONS[exc.code]}", [("Content-Type", "text/plain; charset=utf-8"),
                                                           ("Connection", "close")],
                       f"{exc.code} {exc.message}\n".encode())
            return
        if environ is None:
            return  # the client closed the connection without sending anything
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
            self._send("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")],
                       b"500 internal error: see gpuwatch's log\n")
            return
        self._send(answer[0], answer[1], body)

    def _unbuffered_write(self, data: bytes) -> None:  # WSGI's write(): no app of gpuwatch's calls it
        raise RuntimeError("write() is not supported: return the body")

    def _line(self, code: int, message: str) -> bytes:
        line = self.rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise _BadRequest(code, message)
        if not line.endswith(b"\n"):
            raise _Incomplete()
        return line

    def _read_request(self) -> dict[str, Any] | None:
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
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            header = self._line(431, "Line too long")
            if header in (b"\r\n", b"\n"):
                break
            if header[:1] in (b" ", b"\t"):
                raise _BadRequest(400, "Bad header: obsolete line folding")
            name, colon, value = header.partition(b":")
            if not colon or not _TOKEN.fullmatch(name):
                raise _BadRequest(400, "Bad header line: expected NAME: VALUE")
            value = value.rstrip(b"\r\n").strip(b" \t")
            if not _FIELD_VALUE.fullmatch(value):
                raise _BadRequest(400, "Bad header value: a control character")
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
            headers["HTTP_CONTENT_LENGTH"] = numbers.pop()
        path, _, query = target.decode("iso-8859-1").partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": method.decode("ascii"), "SCRIPT_NAME": "", "PATH_INFO": unquote(path, "iso-8859-1"),
            "QUERY_STRING": query, "SERVER_PROTOCOL": version.decode("ascii"),
            "SERVER_NAME": self.server.server_name, "SERVER_PORT": str(self.server.server_port),  # type: ignore[attr-defined]
            "REMOTE_ADDR": self.client_address[0] if isinstance(self.client_address, tuple) else "",
            "wsgi.version": (1, 0), "wsgi.input": self.rfile, "wsgi.errors": sys.stderr,
            "wsgi.multithread": True, "wsgi.multiprocess": False, "wsgi.run_once": False,
        }
        for field in ("CONTENT_TYPE", "CONTENT_LENGTH"):
            if "HTTP_" + field in headers:
                environ[field] = headers.pop("HTTP_" + field)
        environ.update(headers)
        ssl = sys.modules.get("ssl")  # a TLS listener loaded it (gpuwatch.web.config.server_context)
        tls = ssl is not None and isinstance(self.connection, ssl.SSLSocket)
        environ["wsgi.url_scheme"] = "https" if tls else "http"
        if tls:
            environ["HTTPS"] = "on"
        return environ

    def _send(self, status: str, headers: list[tuple[str, str]], body: bytes) -> None:
        lines = [f"HTTP/1.0 {status}", f"Date: {http_date(time.time())}"]
        lines += [f"{name}: {value}" for name, value in headers]
        if not any(name.lower() == "content-length" for name, _ in headers):
            lines.append(f"Content-Length: {len(body)}")
        # a CR, LF or NUL in a header would end it early (a second guard: the request's values have none)
        head = "\r\n".join(line.replace("\r", " ").replace("\n", " ").replace("\0", " ") for line in lines)
        try:
            self.wfile.write((head + "\r\n\r\n").encode("iso-8859-1", "replace"))
            if not self.head_request:
                self.wfile.write(body)
            self.wfile.flush()
        except OSError as exc:  # the client went away or timed out, a TLS error mid-response
            log().debug("http_connection_error", error=reason(exc))
            self.write_failed = True

    def finish(self) -> None:
        """StreamRequestHandler's flush and close, with one try at sending: after a failed send what the
        buffer still holds is dropped (the socket made non-blocking first), not sent again at the close,
        which would wait REQUEST_TIMEOUT more for a client that does not read."""
        try:
            if self.write_failed:
                self.connection.settimeout(0.0)
            self.wfile.close()
        except OSError:  # the close's flush of what was dropped
            pass
        finally:
            self.rfile.close()
