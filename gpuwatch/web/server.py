"""HTTP endpoints: ``/`` landing page, the metrics path, ``/healthz``.

A small WSGI app served by socketserver's threading TCP server and gpuwatch's own request parser
(``gpuwatch.web.request``), one server per listen address.
Nothing here touches a backend: every answer is built from the store's latest snapshot.

``HttpServers`` puts the web configuration file (``gpuwatch.webconfig``, docs/security.md) in
front of the app: TLS (and mTLS) on every listener, basic auth on every path, the configured
response headers, and ``--web.max-requests``: at most that many requests are worked on at once,
the next one gets 503 at once. A failed TLS handshake, a plain HTTP request on a TLS listener, a
malformed request or a client that goes away is a debug event, never a traceback or a dead thread.
"""

from __future__ import annotations

import errno
import select
import selectors
import socket
import sys
import threading
import time
from collections.abc import Iterable
from queue import SimpleQueue
from socketserver import TCPServer, ThreadingMixIn
from typing import Any

from gpuwatch.config import parse_listen_address
from gpuwatch.logs import Repeats
from gpuwatch.web.app import StartResponse, WsgiApp, reply
from gpuwatch.web.auth import Authenticator
from gpuwatch.web.config import REALM, WebConfig, WebConfigSource
from gpuwatch.web.request import RequestHandler, log, reason


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
            log().debug("http_request_rejected", reason="max_requests", max_requests=self._max,
                         peer=environ.get("REMOTE_ADDR"), path=environ.get("PATH_INFO"))
            return reply(respond, "503 Service Unavailable",
                          f"too many parallel requests (at most {self._max}, --web.max-requests); "
                          "try again later\n".encode(), extra=[("Retry-After", "1")], head=head)
        try:
            if config is not None and config.users:
                user = self._auth.verify(config.users, environ.get("HTTP_AUTHORIZATION"))
                if user is None:
                    log().debug("http_unauthorized", peer=environ.get("REMOTE_ADDR"), path=environ.get("PATH_INFO"),
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


REQUEST_TIMEOUT = 30.0  # seconds for a TLS handshake, a request's head (from its first byte), a response's send
KEEPALIVE_SECONDS = 300.0  # an idle kept-alive connection is closed after this (Prometheus' client: 5 minutes)
# Connections kept open after a response at most, per listener (each holds a thread while it waits for its
# next request): Prometheus servers, vmagents and a person with curl need a handful; the connections beyond
# get answered and closed (``Connection: close``), as HTTP/1.0's are.
KEEPALIVE_MAX = 16
# Connections open at once at most, per listener (each holds a thread): a flood of connections that send
# nothing holds 30 s each; past this they are closed as they come, one rate-limited warning (Prometheus
# servers and people need a few; --web.max-requests bounds the requests worked on among them).
MAX_CONNECTIONS = 256
PLAIN_ON_TLS = (b"HTTP/1.0 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n\r\n"
                b"Client sent an HTTP request to an HTTPS server.\n")


# Connection threads kept waiting for the next connection after theirs (per listener): a scrape then costs no
# thread start (about 0.3 ms of CPU on the bench's VM, a third of a scrape's overhead besides the render); a
# burst of more connections than that gets threads of its own, as many as it needs, which end with them.
KEPT_WORKERS = 4


_OUT_OF_RESOURCES = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))  # accept() cannot take any
ACCEPT_BACKOFF_SECONDS = 0.1  # the accept loop's pause after accept() failed (EMFILE): not a spin, soon again


class _Log:
    """The http logger as it is at the time of each event (logs.configure may come after the server's start)."""

    def __getattr__(self, level: str) -> Any:
        return getattr(log(), level)


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
        self._repeats = Repeats(_Log(), burst=1)  # the listener's warnings and errors, each kind once a minute
        # the connections accepted and not closed yet (after a TLS handshake, the TLS socket for the raw one):
        # MAX_CONNECTIONS and KEEPALIVE_MAX count them, stop() ends them
        self._open: set[Any] = set()
        self._work: SimpleQueue[tuple[Any, Any] | None] = SimpleQueue()
        super().__init__(*args, **kwargs)

    def process_request(self, request: Any, client_address: Any) -> None:
        """In the accept loop: hand the connection to a kept thread that waits, else to a new one; close it
        at once when MAX_CONNECTIONS are open."""
        with self._workers_lock:
            full = len(self._open) >= MAX_CONNECTIONS
            if not full:
                self._open.add(request)
        if full:
            self._repeats.log("warning", "http_connections_refused", "full", max_connections=MAX_CONNECTIONS,
                              hint="more connections than gpuwatch serves at once are open to this listener: a "
                                   "client that opens many without closing them, or a flood; they are closed")
            self.shutdown_request(request)
            return
        with self._workers_lock:
            if self._idle:
                self._idle -= 1
                self._work.put((request, client_address))
                return
        try:
            threading.Thread(target=self._worker, args=(request, client_address), name="gpuwatch-http-conn",
                             daemon=True).start()
        except BaseException as exc:  # the connection is closed and not counted
            with self._workers_lock:
                self._open.discard(request)
            if not isinstance(exc, RuntimeError):
                raise  # socketserver closes it
            # no thread to be had (the unit's TasksMax, the pod's pids limit)
            self._repeats.log("warning", "http_thread_start_failed", "thread", error=str(exc),
                              hint="gpuwatch cannot start a thread for this connection: the process is at its "
                                   "limit of threads (systemd's TasksMax, a container's pids limit, ulimit -u); "
                                   "the connection is closed")
            self.shutdown_request(request)

    def _worker(self, request: Any, client_address: Any) -> None:
        """Serve a connection, then wait for the next one, unless KEPT_WORKERS already wait (or stopping)."""
        while True:
            try:
                self.process_request_thread(request, client_address)  # socketserver's: errors to handle_error
            finally:
                with self._workers_lock:
                    self._open.discard(request)  # a TLS one's: discarded after its session
            with self._workers_lock:
                if self._stopping or self._idle >= KEPT_WORKERS:
                    return
                self._idle += 1
            item = self._work.get()
            if item is None:
                return
            request, client_address = item

    @property
    def request_timeout(self) -> float:  # RequestHandler's deadlines: this module's, at the time of the request
        return REQUEST_TIMEOUT

    @property
    def keepalive_seconds(self) -> float:
        return KEEPALIVE_SECONDS

    def keep_alive(self) -> bool:
        """Whether a connection may stay open after its response (RequestHandler asks before each)."""
        return not self._stopping and len(self._open) <= KEEPALIVE_MAX

    def _wrapped(self, request: Any, connection: Any) -> bool:
        """The TLS socket stands for the raw one in ``_open`` (the raw one is detached: stop() could not end it
        through it); False when stop() came first."""
        with self._workers_lock:
            self._open.discard(request)
            if self._stopping:
                return False
            self._open.add(connection)
            return True

    def finish_request(self, request: Any, client_address: Any) -> None:
        """Runs in the connection's own thread: TLS handshake there, never in the accept loop."""
        if self._stopping:
            return
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
                log().debug("http_plain_request_on_tls_listener", peer=peer)
                _drain_head(request, time.monotonic() + REQUEST_TIMEOUT)
                request.sendall(PLAIN_ON_TLS)
                return
            try:  # the handshake as a whole within the socket's timeout (CPython's ssl: one deadline a call)
                connection = tls.context.wrap_socket(request, server_side=True)
            except (OSError, ValueError) as exc:
                log().debug("tls_handshake_failed", peer=peer, error=reason(exc))
                return
            try:
                if self._wrapped(request, connection):
                    self.RequestHandlerClass(connection, client_address, self)  # type: ignore[arg-type]  # typeshed's Self
            finally:
                with self._workers_lock:
                    self._open.discard(connection)
                try:
                    connection.shutdown(socket.SHUT_WR)
                except OSError:
                    pass
                connection.close()
        except (OSError, ValueError) as exc:
            log().debug("http_connection_error", peer=peer, error=reason(exc))

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
                        if self._accept_failed:  # out of descriptors: the connection stays queued, the socket
                            self._accept_failed = False  # readable; without a pause this loop spins a CPU
                            if wake_r in select.select([wake_r], [], [], ACCEPT_BACKOFF_SECONDS)[0]:
                                return
        finally:
            wake_r.close()

    _stopping = False
    _wake_w: socket.socket | None = None
    _accept_failed = False

    def get_request(self) -> tuple[Any, Any]:
        try:
            return super().get_request()
        except OSError as exc:  # socketserver drops it silently
            if exc.errno not in _OUT_OF_RESOURCES:
                raise  # one connection's own failure (ECONNABORTED, EPROTO...): it left the queue; the next one
            self._accept_failed = True  # out of resources: the queued connection wakes the loop at once
            self._repeats.log("warning", "http_accept_failed", ("accept", exc.errno), error=reason(exc),
                              hint="gpuwatch cannot accept connections: out of file descriptors (raise the unit's "
                                   "LimitNOFILE) or of memory; it retries every "
                                   f"{ACCEPT_BACKOFF_SECONDS:g} s")
            raise

    def stop(self) -> None:
        """Ends ``serve`` from another thread, the kept threads that wait and the connections kept open."""
        self._stopping = True
        with self._workers_lock:
            waiting, self._idle = self._idle, 0
            for connection in self._open:  # its thread sees the end at once (one in a response: cut short)
                try:  # the plain socket's shutdown, also of a TLS one (SSLSocket.shutdown unwraps it under its thread)
                    socket.socket.shutdown(connection, socket.SHUT_RDWR)
                except OSError:
                    pass
        for _ in range(waiting):
            self._work.put(None)
        wake = self._wake_w
        if wake is not None:
            try:
                wake.send(b"x")
            except OSError:
                pass

    def handle_error(self, request: Any, client_address: Any) -> None:
        """socketserver's hook for what a connection's thread raised (the connection is then closed without an
        answer). Nothing a client does deserves a traceback: a failed read or send (OSError) or a bad TLS record
        (ValueError) is a debug event. Anything else is a gpuwatch bug: an error with its traceback, once a minute
        per kind of exception (then one line with the count)."""
        exc = sys.exc_info()[1]
        if exc is None or isinstance(exc, (OSError, ValueError)):
            log().debug("http_connection_error", peer=str(client_address), error=reason(exc) if exc else "unknown")
            return
        self._repeats.log("error", "http_connection_failed", ("bug", type(exc).__name__), peer=str(client_address),
                          error=f"{type(exc).__name__}: {exc}", exc_info=True,  # the one in flight: kept by no one
                          hint="a gpuwatch bug: the connection was closed without an answer; please report it "
                               "with this log line")


def _drain_head(sock: socket.socket, deadline: float, limit: int = 65536) -> None:
    """Read what a plain HTTP client sent up to the end of its headers, so that closing does not reset; until
    ``deadline`` (monotonic) at most, however slowly it comes (TimeoutError after it)."""
    tail, total = b"", 0
    while total < limit:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("the request's head did not arrive in time")
        sock.settimeout(remaining)
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
    server = cls((host, port), RequestHandler)
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
