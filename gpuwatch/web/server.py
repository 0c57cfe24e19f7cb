"""HTTP endpoints: ``/`` landing page, the metrics path, ``/healthz``.

A small WSGI app served by the stdlib's threading WSGI server, one server per listen address.
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
from collections.abc import Iterable
from queue import SimpleQueue
from socketserver import ThreadingMixIn
from typing import IO, Any, cast

from gpuwatch import logs
from gpuwatch.config import parse_listen_address
from gpuwatch.deferred import deferred
from gpuwatch.web.app import StartResponse, WsgiApp, reply
from gpuwatch.web.auth import Authenticator
from gpuwatch.web.config import REALM, WebConfig, WebConfigSource

with deferred("ssl"):  # http.server -> http.client imports ssl for its HTTPS client: OpenSSL, 5 MB, unused here
    from wsgiref.simple_server import ServerHandler, WSGIRequestHandler, WSGIServer


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


class _ServerHandler(ServerHandler):
    def log_exception(self, exc_info: Any) -> None:
        exc = exc_info[1]
        if isinstance(exc, OSError):  # the client went away or timed out, a TLS error mid-response
            _log().debug("http_connection_error", error=_reason(exc))
            self.request_handler.write_failed = True  # type: ignore[attr-defined]  # set by _Handler.handle
        else:  # a bug in the app: worth a traceback, in the log's own format
            _log().error("http_handler_failed", error=repr(exc), exc_info=exc_info)


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110 token: what a method may be


class _Handler(WSGIRequestHandler):
    # Errors found while parsing the request line are answered as HTTP/1.0 (with a status line and
    # headers), not in the stdlib's HTTP/0.9 default, which is a bare body.
    default_request_version = "HTTP/1.0"
    # The response is buffered and sent when wsgiref flushes after the body (one send for status line,
    # headers and a body up to the buffer's size): unbuffered, each header line and the body went out in a
    # send of its own, five system calls of loopback TCP a scrape, a quarter of a request's CPU.
    wbufsize = 1 << 16
    write_failed = False  # a send of the response failed (a client that stopped reading, or went away)
    error_content_type = "text/plain; charset=utf-8"
    error_message_format = "%(code)d %(message)s\n"

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes are not worth a log line each

    def parse_request(self) -> bool:
        """The stdlib's parser, which answers 400/505 itself, plus what it lets through: an empty
        request line, HTTP/0.9's version-less ``GET /`` and a method that is not a token get 400 too."""
        words = self.raw_requestline.split()
        if len(words) in (0, 2):
            self.command, self.request_version, self.close_connection = "", self.default_request_version, True
            self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
            self.send_error(400, "Bad request line: expected METHOD PATH HTTP/1.x" if words else "Empty request line")
            return False
        if not super().parse_request():
            return False
        if not _TOKEN.fullmatch(self.command or ""):
            self.send_error(400, "Bad request method: not an HTTP token")
            return False
        return True

    def finish(self) -> None:
        """StreamRequestHandler's flush and close, with one try at sending: after a failed send what the
        buffer still holds is dropped (the socket made non-blocking first), not sent again at the flush
        and at the close, each of which would wait REQUEST_TIMEOUT more for a client that does not read."""
        try:
            if not self.write_failed and not self.wfile.closed:
                try:
                    self.wfile.flush()  # what http.server's error answers left in the buffer
                except OSError:
                    self.write_failed = True
            if self.write_failed:
                self.connection.settimeout(0.0)
            self.wfile.close()
        except OSError:  # the close's flush of what was dropped
            pass
        finally:
            self.rfile.close()

    def get_environ(self) -> dict[str, Any]:
        environ = super().get_environ()
        ssl = sys.modules.get("ssl")  # a TLS listener loaded it (gpuwatch.web.config.server_context)
        if ssl is not None and isinstance(self.connection, ssl.SSLSocket):
            environ["HTTPS"] = "on"  # wsgi.url_scheme = https
        return environ

    def handle(self) -> None:
        # WSGIRequestHandler.handle with a ServerHandler that logs through structlog
        self.raw_requestline = self.rfile.readline(65537)
        if not self.raw_requestline:
            return  # the client closed the connection without sending anything
        if len(self.raw_requestline) > 65536:
            self.requestline = ""
            self.request_version = ""
            self.command = ""
            self.send_error(414)
            return
        if not self.parse_request():
            return
        handler = _ServerHandler(self.rfile, cast(IO[bytes], self.wfile), self.get_stderr(), self.get_environ(),
                                 multithread=False)
        handler.request_handler = self  # type: ignore[attr-defined]
        handler.run(self.server.get_app())  # type: ignore[attr-defined]


# Connection threads kept waiting for the next connection after theirs (per listener): a scrape then costs no
# thread start (about 0.3 ms of CPU on the bench's VM, a third of a scrape's overhead besides the render); a
# burst of more connections than that gets threads of its own, as many as it needs, which end with them.
KEPT_WORKERS = 4


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = socket.SOMAXCONN  # a burst of scrapes waits in the backlog, it is not dropped
    web: WebConfigSource | None = None  # set when the listener speaks TLS

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


def _make_server(address: str, app: WsgiApp, web: WebConfigSource | None = None) -> WSGIServer:
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


def _make(cls: type[_Server], host: str, port: int, app: WsgiApp, web: WebConfigSource | None) -> WSGIServer:
    server = cls((host, port), _Handler)
    server.set_app(app)
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
        self.servers: list[WSGIServer] = []
        try:
            for address in addresses:
                self.servers.append(_make_server(address, self.app, tls_source))
        except OSError:
            self.close()
            raise
        self._threads = [
            threading.Thread(target=s.serve, name=f"gpuwatch-http-{i}", daemon=True)  # type: ignore[attr-defined]
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
                server.stop()  # type: ignore[attr-defined]  # also ends the kept connection threads
                if thread is not None and thread.is_alive():
                    thread.join(timeout=5)
            finally:
                server.server_close()
                wake = getattr(server, "_wake_w", None)
                if wake is not None:
                    wake.close()
