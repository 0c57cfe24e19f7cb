"""HTTP endpoints: ``/`` landing page, the metrics path, ``/healthz``.

A small WSGI app served by socketserver's threading TCP server and gpuwatch's own request parser
(``_Handler``), one server per listen address.
Nothing here touches a backend: every answer is built from the store's latest snapshot.

``HttpServers`` puts the web configuration file (``gpuwatch.webconfig``, docs/security.md) in
front of the app: TLS (and mTLS) on every listener, basic auth on every path, the configured
response headers, and ``--web.max-requests``: at most that many requests are worked on at once,
the next one gets 503 at once. A failed TLS handshake, a plain HTTP request on a TLS listener, a
malformed request or a client that goes away is a debug event, never a traceback or a dead thread.
"""

from __future__ import annotations

import re
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from queue import SimpleQueue
from socketserver import StreamRequestHandler, TCPServer, ThreadingMixIn
from typing import Any
from urllib.parse import unquote

from gpuwatch import logs
from gpuwatch.config import parse_listen_address
from gpuwatch.web.app import StartResponse, WsgiApp, reply
from gpuwatch.web.auth import Authenticator
from gpuwatch.web.config import REALM, WebConfig, WebConfigSource


class Guard:
    """WSGI middleware: parallel-request limit, basic auth and the configured headers, on every path.

    node_exporter (exporter-toolkit) asks for credentials on every path, /healthz included; so does
    gpuwatch. The limit counts requests being worked on (auth checks included, so a flood of bad
    passwords cannot spend more than ``max_requests`` threads on bcrypt); 0 means no limit.
    """

    def __init__(self, app: WsgiApp, source: WebConfigSource | None = None, max_requests: int = 0) -> None:
        if max_requests < 0:
            raise ValueError("max_requests must be 0 (no limit) or more")
        self._app = app
        self._source = source
        self._max = max_requests
        self._slots = threading.BoundedSemaphore(max_requests) if max_requests > 0 else None
        self._auth = Authenticator()

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        config = self._source.current() if self._source is not None else None
        head = environ.get("REQUEST_METHOD") == "HEAD"
        respond = start_response
        if config is not None and config.headers:
            respond = _with_headers(start_response, config.headers)
        if self._slots is not None and not self._slots.acquire(blocking=False):
            _log().debug("http_request_rejected", reason="max_requests", max_requests=self._max,
                         peer=environ.get("REMOTE_ADDR"), path=environ.get("PATH_INFO"))
            return reply(respond, "503 Service Unavailable",
                          f"too many parallel requests (at most {self._max}, --web.max-requests); "
                          "try again later\n".encode(), extra=[("Retry-After", "1")], head=head)
        try:
            if config is not None and config.users:
                user = self._auth.verify(config.users, environ.get("HTTP_AUTHORIZATION"))
                if user is None:
                    _log().debug("http_unauthorized", peer=environ.get("REMOTE_ADDR"), path=environ.get("PATH_INFO"),
                                 credentials="HTTP_AUTHORIZATION" in environ)
                    return reply(respond, "401 Unauthorized", b"Unauthorized\n",
                                  extra=[("WWW-Authenticate", f'Basic realm="{REALM}"')], head=head)
                environ["REMOTE_USER"] = user
            return self._app(environ, respond)
        finally:
            if self._slots is not None:
                self._slots.release()


def _with_headers(start_response: StartResponse, extra: tuple[tuple[str, str], ...]) -> StartResponse:
    def respond(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        present = {name.lower() for name, _ in headers}
        return start_response(status, headers + [(n, v) for n, v in extra if n.lower() not in present], exc_info)

    return respond


def _log() -> Any:
    return logs.get_logger(component="http")  # at the time of the event: logs.configure() may come later


REQUEST_TIMEOUT = 30.0  # seconds a connection may take per read or write (TLS handshake included)
PLAIN_ON_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
                b"Client sent an HTTP request to an HTTPS server.\n")


def _reason(exc: BaseException) -> str:
    return str(getattr(exc, "reason", None) or exc or type(exc).__name__)


_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: a method, a header's name
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
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


_REASONS = {400: "Bad Request", 414: "URI Too Long", 431: "Request Header Fields Too Large",
            500: "Internal Server Error", 505: "HTTP Version Not Supported"}


class _Handler(StreamRequestHandler):
    """One request per connection (answered as HTTP/1.0, then closed), served to the WSGI app.

    gpuwatch's own request parser instead of http.server + wsgiref: they parse headers through the
    ``email`` package and import ``html``, ``http.client``, ``email`` (1.4 MB of resident memory, 23
    modules) and cost a scrape about 0.2 ms of CPU more. What it takes: a request line ``METHOD TARGET
    HTTP/1.x`` (a token method; HTTP/0.9's version-less line, an empty line or other words are 400, a
    version other than 1.x is 505, a line over 64 KiB 414), then header lines ``name: value`` (a token
    name; a line without one, or an obsolete folded line, is 400; more than 100 lines or one over 64 KiB
    is 431), up to an empty line. Bytes that are not ASCII are read as ISO-8859-1, as WSGI says.
    A body is never read (every path is GET or HEAD). Errors are answered with a status line, plain-text
    headers and ``CODE message``."""

    # The response is buffered and sent at the end (one send for status line, headers and a body up to the
    # buffer's size): unbuffered, each header line and the body went out in a send of its own.
    wbufsize = 1 << 16
    write_failed = False  # a send of the response failed (a client that stopped reading, or went away)

    def handle(self) -> None:
        try:
            environ = self._read_request()
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
            _log().error("http_handler_failed", error=repr(exc), exc_info=True)
            self._send("500 Internal Server Error", [("Content-Type", "text/plain; charset=utf-8")],
                       b"500 internal error: see gpuwatch's log\n")
            return
        self._send(answer[0], answer[1], body)

    def _unbuffered_write(self, data: bytes) -> None:  # WSGI's write(): no app of gpuwatch's calls it
        raise RuntimeError("write() is not supported: return the body")

    def _line(self) -> bytes:
        line = self.rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            raise _BadRequest(431, "Line too long")
        return line

    def _read_request(self) -> dict[str, Any] | None:
        line = self.rfile.readline(MAX_LINE + 1)
        if not line:
            return None
        if len(line) > MAX_LINE:
            raise _BadRequest(414, "Request line too long")
        words = line.split()
        if len(words) != 3:
            raise _BadRequest(400, "Bad request line: expected METHOD PATH HTTP/1.x" if words else "Empty request line")
        method, target, version = words
        number = _VERSION.fullmatch(version)
        if number is None:
            raise _BadRequest(400, f"Bad request version {version.decode('iso-8859-1')!r}")
        if number.group(1) != b"1":
            raise _BadRequest(505, f"HTTP version not supported: {version.decode('iso-8859-1')}")
        if not _TOKEN.fullmatch(method):
            raise _BadRequest(400, "Bad request method: not an HTTP token")
        headers: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            header = self._line()
            if header in (b"\r\n", b"\n", b""):
                break
            if header[:1] in (b" ", b"\t"):
                raise _BadRequest(400, "Bad header: obsolete line folding")
            name, colon, value = header.partition(b":")
            if not colon or not _TOKEN.fullmatch(name):
                raise _BadRequest(400, "Bad header line: expected NAME: VALUE")
            key = "HTTP_" + name.decode("ascii").upper().replace("-", "_")
            text = value.strip().decode("iso-8859-1")
            headers[key] = f"{headers[key]},{text}" if key in headers else text
        else:
            raise _BadRequest(431, "Too many headers")
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
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("iso-8859-1", "replace")
        try:
            self.wfile.write(head)
            self.wfile.write(body)
            self.wfile.flush()
        except OSError as exc:  # the client went away or timed out, a TLS error mid-response
            _log().debug("http_connection_error", error=_reason(exc))
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


# Connection threads kept waiting for the next connection after theirs (per listener): a scrape then costs no
# thread start (about 0.3 ms of CPU on the bench's VM, a third of a scrape's overhead besides the render); a
# burst of more connections than that gets threads of its own, as many as it needs, which end with them.
KEPT_WORKERS = 4


class _Server(ThreadingMixIn, TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = socket.SOMAXCONN  # a burst of scrapes waits in the backlog, it is not dropped
    web: WebConfigSource | None = None  # set when the listener speaks TLS

    app: WsgiApp
    server_name = ""
    server_port = 0

    def server_bind(self) -> None:
        super().server_bind()
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._workers_lock = threading.Lock()
        self._idle = 0  # kept threads waiting on _work
        self._work: SimpleQueue[tuple[Any, Any] | None] = SimpleQueue()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accept loop: hand the connection to a kept thread that waits, else to a new one."""
        with self._workers_lock:
            if self._idle:
                self._idle -= 1
                self._work.put((request, client_address))
                return
        threading.Thread(target=self._worker, args=(request, client_address), name="gpuwatch-http-conn",
                         daemon=True).start()

    def _worker(self, request: Any, client_address: Any) -> None:
        """Serve a connection, then wait for the next one, unless KEPT_WORKERS already wait (or stopping)."""
        while True:
            self.process_request_thread(request, client_address)  # socketserver's: errors to handle_error
            with self._workers_lock:
                if self._stopping or self._idle >= KEPT_WORKERS:
                    return
                self._idle += 1
            item = self._work.get()
            if item is None:
                return
            request, client_address = item

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the connection's own thread: TLS handshake there, never in the accept loop."""
        peer = client_address[0] if isinstance(client_address, tuple) else str(client_address)
        try:
            request.settimeout(REQUEST_TIMEOUT)
            if self.web is None:
                self.RequestHandlerClass(request, client_address, self)  # type: ignore[arg-type]  # typeshed's Self
                return
            tls = self.web.current().tls
            assert tls is not None and tls.context is not None
            first = request.recv(1, socket.MSG_PEEK)
            if not first:
                return
            if first != b"\x16" and first.isalpha():  # not a TLS handshake record but an HTTP method
                _log().debug("http_plain_request_on_tls_listener", peer=peer)
                _drain_head(request)
                request.sendall(PLAIN_ON_TLS)
                return
            try:
                connection = tls.context.wrap_socket(request, server_side=True)
            except (OSError, ValueError) as exc:
                _log().debug("tls_handshake_failed", peer=peer, error=_reason(exc))
                return
            try:
                self.RequestHandlerClass(connection, client_address, self)  # type: ignore[arg-type]  # typeshed's Self
            finally:
                try:
                    connection.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                connection.close()
        except (OSError, ValueError) as exc:
            _log().debug("http_connection_error", peer=peer, error=_reason(exc))

    def serve(self) -> None:
        """socketserver's serve_forever without its wake-up every poll_interval to look for a shutdown:
        the accept loop sleeps on the listening socket and a wake-up pipe together, and ``stop``
        writes to the pipe (an idle exporter's HTTP thread then costs nothing between scrapes)."""
        wake_r, self._wake_w = socket.socketpair()
        try:
            with selectors.DefaultSelector() as selector:
                selector.register(self, selectors.EVENT_READ)
                selector.register(wake_r, selectors.EVENT_READ)
                while not self._stopping:
                    for key, _ in selector.select():
                        if key.fileobj is wake_r:
                            return
                        self._handle_request_noblock()  # type: ignore[attr-defined]  # socketserver's own step
        finally:
            wake_r.close()

    _stopping = False
    _wake_w: socket.socket | None = None

    def stop(self) -> None:
        """Ends ``serve`` from another thread, and the kept threads that wait."""
        self._stopping = True
        with self._workers_lock:
            waiting, self._idle = self._idle, 0
        for _ in range(waiting):
            self._work.put(None)
        wake = self._wake_w
        if wake is not None:
            try:
                wake.send(b"x")
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        # socketserver would print a traceback to stderr; nothing a client does deserves one
        exc = sys.exc_info()[1]
        _log().debug("http_connection_error", peer=str(client_address), error=_reason(exc) if exc else "unknown")


def _drain_head(sock: socket.socket, limit: int = 65536) -> None:
    """Read what a plain HTTP client sent up to the end of its headers, so that closing does not reset."""
    tail, total = b"", 0
    while total < limit:
        chunk = sock.recv(4096)
        if not chunk:
            return
        total += len(chunk)
        tail = tail[-3:] + chunk
        if b"\r\n\r\n" in tail:
            return


class _Server6(_Server):
    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # ":PORT" means every interface, IPv4 too (dual stack), as node_exporter does.
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _make_server(address: str, app: WsgiApp, web: WebConfigSource | None = None) -> _Server:
    host, port = parse_listen_address(address)
    if host == "":
        try:
            return _make(_Server6, "::", port, app, web)
        except OSError:
            return _make(_Server, "0.0.0.0", port, app, web)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if family == socket.AF_INET6:
        class _V6Only(_Server):
            address_family = socket.AF_INET6
        return _make(_V6Only, host, port, app, web)
    return _make(_Server, host, port, app, web)


def _make(cls: type[_Server], host: str, port: int, app: WsgiApp, web: WebConfigSource | None) -> _Server:
    server = cls((host, port), _Handler)
    server.app = app
    server.web = web
    return server


class HttpServers:
    """One listening server per address, each served by a daemon thread.

    ``web_config`` (from ``gpuwatch.webconfig.load``) adds TLS, basic auth and headers, and is
    re-read while serving when its files change; ``max_requests`` limits the requests worked on at
    once over all addresses (0: no limit; --web.max-requests, default 40 as node_exporter).
    """

    def __init__(self, addresses: Iterable[str], app: WsgiApp, web_config: WebConfig | None = None,
                 max_requests: int = 40) -> None:
        self.web_config = web_config
        source = WebConfigSource(web_config) if web_config is not None else None
        self.app = Guard(app, source, max_requests)
        tls_source = source if web_config is not None and web_config.tls is not None else None
        self.servers: list[_Server] = []
        try:
            for address in addresses:
                self.servers.append(_make_server(address, self.app, tls_source))
        except OSError:
            self.close()
            raise
        self._threads = [
            threading.Thread(target=s.serve, name=f"gpuwatch-http-{i}", daemon=True)
            for i, s in enumerate(self.servers)
        ]

    @property
    def scheme(self) -> str:
        return "https" if self.web_config is not None and self.web_config.tls is not None else "http"

    def bound(self) -> list[str]:
        result = []
        for server in self.servers:
            host, port = server.server_address[:2]
            host = host.decode() if isinstance(host, bytes) else str(host)
            result.append(f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
        return result

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def alive(self) -> bool:
        return all(thread.is_alive() for thread in self._threads)

    def close(self) -> None:
        threads = getattr(self, "_threads", [None] * len(self.servers))
        for server, thread in zip(self.servers, threads):
            try:
                server.stop()  # also ends the kept connection threads
                if thread is not None and thread.is_alive():
                    thread.join(timeout=5)
            finally:
                server.server_close()
                wake = getattr(server, "_wake_w", None)
                if wake is not None:
                    wake.close()
