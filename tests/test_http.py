"""HTTP endpoints over a real listening server: landing page, metrics, health, errors."""

import gzip
import os
import socket
import sys
import threading
import urllib.error
import urllib.request

import pytest
from daemon import wait_for

import gpuwatch.logs as logs
import gpuwatch.web.server as server
from gpuwatch.clock import FakeClock
from gpuwatch.poller import Poller
from gpuwatch.store import Store
from gpuwatch.testing import ScriptedBackend, registry_for
from gpuwatch.web import App, HttpServers
from gpuwatch.web.request import RequestHandler


@pytest.fixture()
def node():
    clock = FakeClock()
    backend = ScriptedBackend(2)
    store = Store(clock, backend.name)
    poller = Poller(backend, store, clock)
    app = App(registry_for(store, clock), store.snapshot, clock.monotonic, "/metrics", lambda tier: 6.0 if tier == "fast" else 90.0)
    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    host, port = servers.servers[0].server_address[:2]
    yield clock, backend, store, poller, f"http://{host}:{port}"
    servers.close()


def get(url, headers=None, method="GET"):
    request = urllib.request.Request(url, headers=headers or {}, method=method)
    try:
        with urllib.request.urlopen(request, timeout=5) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


def test_healthz_follows_the_fast_poll(node):
    clock, backend, store, poller, base = node
    status, _, body = get(base + "/healthz")
    assert status == 503 and b"backend scripted down" in body
    poller.poll_fast()
    status, _, body = get(base + "/healthz")
    assert status == 200 and body.startswith(b"ok: 2 GPUs")
    clock.advance(7)
    status, _, body = get(base + "/healthz")
    assert status == 503 and body == b"last fast poll completed 7.0 s ago (staleness bound 6 s)\n"


def test_metrics_text_openmetrics_and_gzip(node):
    clock, backend, store, poller, base = node
    poller.poll_fast()
    status, headers, body = get(base + "/metrics")
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b'gpuwatch_gpu_up{gpu="1",uuid="GPU-00000000-0000-4000-8000-000000000001"} 1.0' in body
    status, headers, body = get(base + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert body.endswith(b"# EOF\n")
    status, headers, body = get(base + "/metrics", {"Accept-Encoding": "gzip"})
    assert headers.get("Content-Encoding") == "gzip"
    assert b"gpuwatch_power_watts" in gzip.decompress(body)


def test_landing_page_404_and_405(node):
    _, _, _, _, base = node
    status, headers, body = get(base + "/")
    assert status == 200 and b'<a href="/metrics">' in body
    status, _, body = get(base + "/nope")
    assert status == 404 and b"/metrics" in body
    status, headers, _ = get(base + "/metrics", method="POST")
    assert status == 405 and headers["Allow"] == "GET, HEAD"


def test_port_in_use_raises_oserror():
    clock = FakeClock()
    store = Store(clock, "scripted")
    app = App(registry_for(store, clock), store.snapshot, clock.monotonic, "/metrics", lambda tier: 6.0 if tier == "fast" else 90.0)
    first = HttpServers(["127.0.0.1:0"], app)
    port = first.servers[0].server_address[1]
    try:
        with pytest.raises(OSError):
            HttpServers([f"127.0.0.1:{port}"], app)
    finally:
        first.close()


def test_connection_threads_are_kept_for_the_next_scrape_and_bounded():
    """Sequential scrapes are served by one kept thread (no thread start per scrape); a burst of slow requests
    gets a thread each, of which at most KEPT_WORKERS stay; close ends the kept ones."""
    import threading

    from daemon import wait_for

    from gpuwatch.web.server import KEPT_WORKERS

    release = threading.Event()
    served: list[int] = []

    def app(environ, start_response):
        served.append(threading.get_ident())
        if environ["PATH_INFO"] == "/slow":
            release.wait(10)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]

    def conns():
        return [t for t in threading.enumerate() if t.name == "gpuwatch-http-conn"]

    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    host, port = servers.servers[0].server_address[:2]
    try:
        server = servers.servers[0]
        for _ in range(10):
            assert get(f"http://{host}:{port}/")[0] == 200
            # the client has its bytes before the thread is back waiting: wait for it, then scrape again
            wait_for(lambda: server._idle == 1, what="the connection's thread to wait for the next one")
        assert len(set(served)) == 1 and len(conns()) == 1
        burst = [threading.Thread(target=get, args=(f"http://{host}:{port}/slow",)) for _ in range(KEPT_WORKERS + 4)]
        for t in burst:
            t.start()
        wait_for(lambda: len(served) == 10 + len(burst), what="every slow request in the app at once")
        assert len(conns()) == KEPT_WORKERS + 4
        release.set()
        for t in burst:
            t.join(10)
        wait_for(lambda: len(conns()) == KEPT_WORKERS, what="the threads beyond the kept ones to end")
        assert get(f"http://{host}:{port}/")[0] == 200 and len(conns()) == KEPT_WORKERS
    finally:
        release.set()
        servers.close()
    wait_for(lambda: not conns(), what="close to end the kept threads")


def test_a_client_that_stops_reading_costs_one_send_timeout(monkeypatch, capsys):
    """The response is buffered: when its send times out (the client does not read), what is left is dropped,
    not sent again at the flush and at the close (each would hold the connection's thread REQUEST_TIMEOUT
    more, three in all); one debug line, and the thread is free for the next connection."""
    body = b"x" * 60_000  # under the 64 KiB buffer: it all waits in the buffer for one send

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))])
        return [body]

    monkeypatch.setattr(server, "REQUEST_TIMEOUT", 0.5)
    timeouts = []
    send = socket.socket.send

    def counted(self, data, *flags):
        try:
            return send(self, data, *flags)
        except TimeoutError:
            timeouts.append(threading.current_thread().name)
            raise

    monkeypatch.setattr(socket.socket, "send", counted)
    setup = RequestHandler.setup

    def small_buffer(self):
        self.request.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        setup(self)

    monkeypatch.setattr(RequestHandler, "setup", small_buffer)
    logs.configure("debug", "json")
    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    host, port = servers.servers[0].server_address[:2]
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    try:
        client.connect((host, port))
        client.sendall(b"GET / HTTP/1.0\r\n\r\n")
        wait_for(lambda: servers.servers[0]._idle == 1, what="the connection's thread free again")
    finally:
        client.close()
        servers.close()
        logs.configure("info", "json")
    assert timeouts == ["gpuwatch-http-conn"]
    errors = [line for line in capsys.readouterr().err.splitlines() if "http_connection_error" in line]
    assert len(errors) == 1


# -- gpuwatch's own request parser (http.server and wsgiref are not loaded) -------------------------

@pytest.fixture()
def echo():
    """A server whose app answers with the WSGI environ it got (the CGI-style keys), as lines."""
    def app(environ, start_response):
        keys = sorted(k for k in environ if k.isupper())
        body = "".join(f"{k}={environ[k]}\n" for k in keys).encode("utf-8", "backslashreplace")
        start_response("200 OK", [("Content-Type", "text/plain"), ("X-Scheme", environ["wsgi.url_scheme"])])
        return [body]

    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    yield servers.servers[0].server_address[:2]
    servers.close()


def ask(address, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    with socket.create_connection(address, timeout=10) as client:
        client.sendall(request)
        client.shutdown(socket.SHUT_WR)  # no more requests: a kept-alive connection ends after this answer
        answer = b""
        while chunk := client.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("iso-8859-1").split("\r\n")
    return status.encode(), dict(line.split(": ", 1) for line in lines), body


def ask_once(app, request: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """``request`` to a server of its own for ``app``, started and closed around it."""
    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    try:
        return ask(servers.servers[0].server_address[:2], request)
    finally:
        servers.close()


def test_a_request_while_another_thread_imports_ssl_is_answered(echo, monkeypatch):
    """While another thread imports ssl for the first time (gRPC through asyncio, at the kubelet client's first
    read), its module is in sys.modules without SSLSocket yet: a scrape at that moment was closed without an
    answer (the connection's setup raised AttributeError; found by bench/soak.py: its first scrape, one start in
    a few dozen)."""
    import types

    monkeypatch.setitem(sys.modules, "ssl", types.ModuleType("ssl"))  # half made: none of its names yet
    status, _, body = ask(echo, b"GET /x HTTP/1.1\r\nHost: h\r\n\r\n")
    assert status == b"HTTP/1.1 200 OK"
    assert b"PATH_INFO=/x" in body


def test_the_environ_holds_the_request(echo):
    status, headers, body = ask(echo, b"GET /a%20b/%C3%A9?x=1&y=%20 HTTP/1.1\r\nHost: h\r\nAccept: a\r\n"
                                      b"X-Twice: 1\r\nx-twice:  2 \r\nContent-Type: text/x\r\n"
                                      b"Content-Length: 0\r\nX-Latin: \xe9\r\n\r\n")
    assert status == b"HTTP/1.1 200 OK" and headers["X-Scheme"] == "http"
    assert headers["Content-Length"] == str(len(body)) and headers["Date"].endswith(" GMT")
    environ = dict(line.split("=", 1) for line in body.decode().splitlines())
    assert environ["REQUEST_METHOD"] == "GET" and environ["SERVER_PROTOCOL"] == "HTTP/1.1"
    assert environ["PATH_INFO"] == "/a b/\xc3\xa9" and environ["QUERY_STRING"] == "x=1&y=%20"  # WSGI: ISO-8859-1
    assert environ["HTTP_HOST"] == "h" and environ["HTTP_ACCEPT"] == "a" and environ["HTTP_X_TWICE"] == "1,2"
    assert environ["CONTENT_TYPE"] == "text/x" and environ["CONTENT_LENGTH"] == "0"
    assert "HTTP_CONTENT_TYPE" not in environ and environ["HTTP_X_LATIN"] == "\xe9"
    assert environ["REMOTE_ADDR"] == "127.0.0.1" and environ["SERVER_PORT"] == str(echo[1])


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"GET / HTTP/1.1\r\nno colon here\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET / HTTP/1.1\r\n: empty name\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET / HTTP/1.1\r\nA: 1\r\n folded\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(101)) + b"\r\n", b"HTTP/1.0 431 "),
    (b"GET / HTTP/1.1\r\nA: " + b"x" * 70000 + b"\r\n\r\n", b"HTTP/1.0 431 "),
    # lines within every other limit, over 64 KiB in all (99 lines of 65,000 bytes were 6.5 MB held per
    # connection before): 431
    (b"GET / HTTP/1.1\r\n" + b"".join(b"X-%d: " % i + b"a" * 30000 + b"\r\n" for i in range(3)) + b"\r\n",
     b"HTTP/1.0 431 "),
    (b"GET / HTTP/1.1\r\nA: " + b"x" * 40000 + b"\r\nB: " + b"y" * 30000 + b"\r\n\r\n", b"HTTP/1.0 431 "),
    (b"GET /" + b"x" * 70000 + b" HTTP/1.1\r\n\r\n", b"HTTP/1.0 414 "),
    (b"GET / HTTP/2.0\r\n\r\n", b"HTTP/1.0 505 "),
    (b"G(T / HTTP/1.1\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET / HTTP/1.1\r\nAccept: a\rX-Injected: yes\r\n\r\n", b"HTTP/1.0 400 "),  # a bare CR in a value
    (b"GET / HTTP/1.1\r\nA: x\x00y\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET /a\x01b HTTP/1.1\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", b"HTTP/1.0 400 "),
    (b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", b"HTTP/1.0 400 "),
])
def test_malformed_headers_get_an_error_status_and_the_server_serves_on(echo, request_bytes, status):
    answer = ask(echo, request_bytes)
    assert answer[0].startswith(status.strip()), answer[0]
    assert answer[1]["Content-Type"] == "text/plain; charset=utf-8" and answer[2].startswith(status.split()[1])
    assert ask(echo, b"GET / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(100)) + b"\r\n")[0] \
        == b"HTTP/1.1 200 OK"  # 100 header lines are fine


def test_an_app_that_raises_gets_a_500_and_one_error_line(capsys):
    def broken(environ, start_response):
        raise ValueError("a bug")

    logs.configure("info", "json")
    status, _, body = ask_once(broken, b"GET / HTTP/1.1\r\n\r\n")
    assert status == b"HTTP/1.1 500 Internal Server Error" and b"log" in body
    assert [line for line in capsys.readouterr().err.splitlines() if "http_handler_failed" in line]


def test_a_bug_in_a_connections_thread_is_an_error_with_its_traceback_and_the_server_serves_on(echo, monkeypatch,
                                                                                               capsys):
    """What a connection's thread raises besides a client's failed read or send (OSError, ValueError) closes the
    connection without an answer: a gpuwatch bug, logged as an error with its traceback (it was a debug line,
    and the ssl race above went unseen for a day), once a minute per kind; the next connection is served."""
    import json

    original = RequestHandler.setup
    failures = [RuntimeError("a bug in setup"), RuntimeError("the same bug again")]

    def setup(self):
        if failures:
            raise failures.pop(0)
        original(self)

    monkeypatch.setattr(RequestHandler, "setup", setup)
    logs.configure("info", "json")
    for _ in range(2):
        with socket.create_connection(echo, timeout=10) as client:
            client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            assert client.recv(65536) == b""  # closed without an answer
    assert ask(echo, b"GET /x HTTP/1.1\r\n\r\n")[0] == b"HTTP/1.1 200 OK"
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines() if "http_connection_failed" in line]
    assert len(lines) == 1, lines  # the second of the same kind within the minute is counted, not written
    assert lines[0]["level"] == "error" and "RuntimeError: a bug in setup" in lines[0]["error"]
    assert "a gpuwatch bug" in lines[0]["hint"] and "Traceback" in lines[0]["exception"]


def test_no_thread_for_a_connection_is_a_warning_not_a_bug_and_the_server_serves_on(echo, monkeypatch, capsys):
    """A process at its limit of threads (TasksMax, a pod's pids limit) cannot start one for a connection: that
    connection is closed, with a warning that says so (not ``http_connection_failed``'s "a gpuwatch bug"), and
    the next one is served once a thread can be had."""
    import json
    import threading

    original = threading.Thread.start
    refusals = [RuntimeError("can't start new thread")]

    def start(self):
        if self.name == "gpuwatch-http-conn" and refusals:
            raise refusals.pop()
        original(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    logs.configure("info", "json")
    with socket.create_connection(echo, timeout=10) as client:
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert client.recv(65536) == b""  # closed: no thread to answer it
    assert ask(echo, b"GET /x HTTP/1.1\r\n\r\n")[0] == b"HTTP/1.1 200 OK"
    events = [json.loads(line) for line in capsys.readouterr().err.splitlines() if line.startswith("{")]
    warned = [e for e in events if e["event"] == "http_thread_start_failed"]
    assert len(warned) == 1 and warned[0]["level"] == "warning" and "TasksMax" in warned[0]["hint"]
    assert not [e for e in events if e["level"] in ("error", "critical")]


def test_the_landing_page_escapes_as_html_escape():
    import html

    from hypothesis import given
    from hypothesis import strategies as st

    from gpuwatch.web.app import escape

    @given(st.text())
    def same(text):
        assert escape(text) == html.escape(text)

    same()


def test_a_head_request_gets_errors_without_a_body_and_an_unfinished_one_no_answer(echo):
    status, headers, body = ask(echo, b"HEAD / HTTP/1.1\r\n" + b"".join(b"H%d: v\r\n" % i for i in range(101)) + b"\r\n")
    assert status.startswith(b"HTTP/1.0 431 ") and body == b"" and int(headers["Content-Length"]) > 0
    with socket.create_connection(echo, timeout=10) as client:  # the client ends its side within the head
        client.sendall(b"GET / HTTP/1.1\r\nA: b")
        client.shutdown(socket.SHUT_WR)
        assert client.recv(65536) == b""
    status, _, body = ask(echo, b"\r\nGET / HTTP/1.1\r\nContent-Length: 0, 0\r\n\r\n")  # one empty line first
    assert status == b"HTTP/1.1 200 OK" and b"CONTENT_LENGTH=0\n" in body


# -- kept-alive connections and the deadlines of a request ------------------------------------------

def _answers(client: socket.socket) -> bytes:
    answer = b""
    while chunk := client.recv(65536):
        answer += chunk
    return answer


def test_an_http_1_1_connection_serves_request_after_request(echo):
    """As Prometheus scrapes: one connection, no handshake or accept per scrape; pipelined requests are answered
    in order."""
    import http.client

    connection = http.client.HTTPConnection(*echo, timeout=10)
    try:
        sockets = []
        for path in ("/one", "/two", "/three"):
            connection.request("GET", path)
            response = connection.getresponse()
            body = response.read()
            assert response.status == 200 and response.version == 11 and f"PATH_INFO={path}\n".encode() in body
            assert response.getheader("Connection") is None and not response.will_close
            sockets.append(connection.sock)
        assert sockets[0] is not None and sockets[0] is sockets[1] is sockets[2]  # never reconnected
    finally:
        connection.close()
    with socket.create_connection(echo, timeout=10) as client:
        client.sendall(b"GET /a HTTP/1.1\r\n\r\nHEAD /b HTTP/1.1\r\n\r\nGET /c HTTP/1.1\r\nConnection: close\r\n\r\n"
                       b"GET /never HTTP/1.1\r\n\r\n")
        answer = _answers(client)
    assert answer.count(b"HTTP/1.1 200 OK\r\n") == 3 and b"PATH_INFO=/never" not in answer
    first, second = answer.index(b"PATH_INFO=/a\n"), answer.index(b"PATH_INFO=/c\n")
    assert first < second and b"PATH_INFO=/b" not in answer  # HEAD: no body
    assert answer.count(b"Connection: close\r\n") == 1


@pytest.mark.parametrize("request_bytes", [
    b"GET / HTTP/1.0\r\n\r\n",  # HTTP/1.0: one request per connection
    b"GET / HTTP/1.1\r\nConnection: Keep-Alive, close\r\n\r\n",
    b"GET / HTTP/1.1\r\nContent-Length: 5\r\n\r\nhello",  # a body is never read: it would be the next request
    b"GET / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
])
def test_a_connection_that_cannot_be_kept_is_closed_after_its_answer(echo, request_bytes):
    with socket.create_connection(echo, timeout=10) as client:
        client.sendall(request_bytes)  # no half-close: the server ends the connection itself
        answer = _answers(client)
    assert answer.count(b" 200 OK\r\n") == 1
    assert answer.startswith(b"HTTP/1.0 200 OK") or b"\r\nConnection: close\r\n" in answer


def test_absolute_form_targets_and_headers_with_underscores(echo):
    status, _, body = ask(echo, b"GET HTTP://node-7:9400/a/b?x=1 HTTP/1.1\r\nX-User: real\r\nX_User: spoof\r\n\r\n")
    environ = dict(line.split("=", 1) for line in body.decode().splitlines())
    assert status == b"HTTP/1.1 200 OK" and environ["PATH_INFO"] == "/a/b" and environ["QUERY_STRING"] == "x=1"
    assert environ["HTTP_X_USER"] == "real"  # X_User would have the same WSGI key: dropped
    for target, path, query in ((b"http://node-7", "/", ""), (b"https://node-7?x", "/", "x")):
        environ = dict(line.split("=", 1) for line in ask(echo, b"GET " + target + b" HTTP/1.1\r\n\r\n")[2]
                       .decode().splitlines())
        assert (environ["PATH_INFO"], environ["QUERY_STRING"]) == (path, query)


class _Clock:
    """time for gpuwatch.web.request: monotonic time moved by the test, and how often it was read."""

    def __init__(self):
        import time

        self.now, self.calls = 1000.0, 0
        self.time, self.gmtime = time.time, time.gmtime

    def monotonic(self):
        self.calls += 1
        return self.now


def test_a_head_that_trickles_in_is_cut_at_its_deadline_not_a_timeout_per_byte(echo, monkeypatch, capsys):
    """slowloris: a read timeout per recv let a client that sends a byte at a time hold a thread forever. The
    whole head has REQUEST_TIMEOUT from its first byte (the clock is the test's: no waits)."""
    import gpuwatch.web.request as request

    clock = _Clock()
    monkeypatch.setattr(request, "time", clock)
    logs.configure("debug", "json")
    try:
        with socket.create_connection(echo, timeout=10) as client:
            client.sendall(b"GET / HTTP/1.1\r\n")
            # read 4 times: the wait for the first bytes (2), the head's deadline, the wait for the next line
            wait_for(lambda: clock.calls >= 4, what="the server to wait for the rest of the head")
            clock.now += server.REQUEST_TIMEOUT + 1  # the next line comes after the head's deadline
            client.sendall(b"X-A: 1\r\n")
            assert _answers(client) == b""  # closed, not answered
        wait_for(lambda: "the request's head did not arrive in time" in capsys.readouterr().err,
                 what="the debug line of the cut connection")
    finally:
        logs.configure("info", "json")


def test_a_response_that_is_not_taken_is_given_up_at_its_deadline(monkeypatch):
    import gpuwatch.web.request as request

    clock = _Clock()
    sent = []
    body = b"x" * 4_000_000  # sent in parts of 64 KiB below

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [body]

    real_send = socket.socket.send

    def send(self, data, *flags):  # each part sent moves the clock on: the fourth would be after the deadline
        sent.append(len(data))
        clock.now += server.REQUEST_TIMEOUT / 2.5
        return real_send(self, data[:65536], *flags)

    monkeypatch.setattr(request, "time", clock)
    monkeypatch.setattr(socket.socket, "send", send)
    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    try:
        with socket.create_connection(servers.servers[0].server_address[:2], timeout=10) as client:
            client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            answer = _answers(client)
        assert answer.startswith(b"HTTP/1.1 200 OK") and len(sent) == 3 and len(answer) < len(body)
    finally:
        servers.close()


def test_kept_connections_are_bounded_closed_when_idle_and_ended_by_the_server(echo, monkeypatch):
    import http.client

    monkeypatch.setattr(server, "KEEPALIVE_MAX", 1)
    first = http.client.HTTPConnection(*echo, timeout=10)
    second = http.client.HTTPConnection(*echo, timeout=10)
    try:
        first.request("GET", "/")
        response = first.getresponse()
        response.read()
        assert not response.will_close
        # one kept connection at most: a second one open at the same time is answered and closed
        second.request("GET", "/")
        response = second.getresponse()
        response.read()
        assert response.will_close and response.getheader("Connection") == "close"
    finally:
        first.close()
        second.close()
    # an idle kept connection is closed after KEEPALIVE_SECONDS (here at once)
    monkeypatch.setattr(server, "KEEPALIVE_SECONDS", 0.0)
    with socket.create_connection(echo, timeout=10) as client:
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert _answers(client).startswith(b"HTTP/1.1 200 OK")  # then the server's end: no second request came


def test_closing_the_server_ends_its_kept_connections():
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    servers = HttpServers(["127.0.0.1:0"], app)
    servers.start()
    try:
        client = socket.create_connection(servers.servers[0].server_address[:2], timeout=10)
        client.sendall(b"GET / HTTP/1.1\r\n\r\n")
        assert client.recv(65536).startswith(b"HTTP/1.1 200 OK")  # kept: it waits KEEPALIVE_SECONDS (300 s)
    finally:
        servers.close()
    with client:
        assert _answers(client) == b""  # ended by the close, not by the idle timeout
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "gpuwatch-http-conn"],
             what="the connection's thread to end")


def test_odd_lengths_and_later_versions(echo):
    """A Content-Length of 5,000 zeros is none (kept); of 5,000 nines a body (answered, closed: Python's int()
    refuses more than 4,300 digits, which once left it unanswered); HTTP/1.2 is answered as 1.1 (RFC 9110)."""
    for digits, kept in ((b"0" * 5000, True), (b"9" * 5000, False)):
        with socket.create_connection(echo, timeout=10) as client:
            client.sendall(b"GET / HTTP/1.1\r\nContent-Length: " + digits + b"\r\n\r\n")
            if kept:
                client.shutdown(socket.SHUT_WR)
            answer = _answers(client)
        assert answer.startswith(b"HTTP/1.1 200 OK") and (b"Connection: close" in answer) != kept
    status, headers, _ = ask(echo, b"GET / HTTP/1.2\r\n\r\n")
    assert status == b"HTTP/1.1 200 OK" and "Connection" not in headers


def test_a_closing_answer_is_not_lost_to_the_bytes_the_client_still_sends(echo):
    """Closed with the rest of a 70 KB request line (or a body) unread, the kernel sent a reset and the client
    could lose the 414 (about 1 in 10 on a busy machine): the server lingers, reading what still comes."""
    for i in range(30):
        request = (b"GET /" + b"x" * 70000 + b" HTTP/1.1\r\n\r\n" if i % 2 else
                   b"GET / HTTP/1.1\r\nContent-Length: 200000\r\n\r\n" + b"b" * 200000)
        with socket.create_connection(echo, timeout=10) as client:
            client.sendall(request)
            answer = _answers(client)
        assert answer.startswith(b"HTTP/1.0 414 " if i % 2 else b"HTTP/1.1 200 OK"), (i, answer[:40])


def test_connections_past_the_limit_are_closed_as_they_come_with_one_warning(echo, monkeypatch, capsys):
    """Each open connection holds a thread (one that sends nothing: 30 s); past MAX_CONNECTIONS per listener
    they are closed at once and said once, and the listener serves again when some end."""
    monkeypatch.setattr(server, "MAX_CONNECTIONS", 2)
    logs.configure("info", "json")
    held = [socket.create_connection(echo, timeout=10) for _ in range(2)]  # open, silent
    try:
        wait_for(lambda: len([t for t in threading.enumerate() if t.name == "gpuwatch-http-conn"]) >= 2,
                 what="both held connections served")
        for _ in range(3):
            with socket.create_connection(echo, timeout=10) as extra:
                try:
                    extra.sendall(b"GET / HTTP/1.1\r\n\r\n")
                    assert extra.recv(100) == b""  # closed, not answered
                except OSError:  # or reset
                    pass
    finally:
        for connection in held:
            connection.close()
    def served():
        try:
            return ask(echo, b"GET / HTTP/1.1\r\n\r\n")[0] == b"HTTP/1.1 200 OK"
        except OSError:  # closed (reset, or before the request was through) while the held ones still count
            return False

    wait_for(served, what="served again")
    refused = [line for line in capsys.readouterr().err.splitlines() if "http_connections_refused" in line]
    assert len(refused) == 1 and '"max_connections": 2' in refused[0]


@pytest.mark.parametrize("header,compressed", [
    ("gzip", True), ("GZIP", True), ("x-gzip", True), ("deflate, gzip;q=1.0, br", True), ("gzip ; q=0.5", True),
    ("*", True), ("identity, *;q=0.1", True),
    ("gzip;q=0", False), ("identity, gzip;q=0", False), ("gzip;q=0.000", False), ("gzip;q=0, *", False),
    ("*;q=0", False), ("x-nogzip", False), ("nogzip, identity", False), ("identity", False), ("", False),
    ("gzip;q=x", False),
])
def test_the_body_is_gzip_exactly_when_accept_encoding_allows_it(header, compressed):
    """RFC 9110 12.5.3: codings by name, any case, with q-values; q=0 refuses (a substring test sent gzip to
    "gzip;q=0" and "x-nogzip", and none to "GZIP")."""
    clock = FakeClock()
    store = Store(clock, ScriptedBackend(1).name)
    app = App(registry_for(store, clock), store.snapshot, clock.monotonic, "/metrics", lambda tier: 6.0)
    got: dict = {}
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "HTTP_ACCEPT_ENCODING": header},
                        lambda status, headers, exc_info=None: got.update(headers=dict(headers))))
    assert (got["headers"].get("Content-Encoding") == "gzip") is compressed
    text = gzip.decompress(body) if compressed else body
    assert text.startswith(b"# HELP")


def serve_through_failed_accepts(monkeypatch, *codes: int) -> tuple[bytes, bytes, list[float], list[OSError]]:
    """One request to a server whose first accept() calls fail with ``codes``: (status, body, the accept loop's
    pauses, the failures not raised). The pause is a select() on the loop's wake-up pipe, recorded here."""
    import socketserver

    fails = [OSError(code, os.strerror(code)) for code in codes]
    real_accept = socketserver.TCPServer.get_request

    def get_request(self):
        if fails:
            raise fails.pop()
        return real_accept(self)

    pauses: list[float] = []

    class Select:
        @staticmethod
        def select(r, w, x, timeout):
            pauses.append(timeout)
            return [], [], []

    monkeypatch.setattr(socketserver.TCPServer, "get_request", get_request)
    monkeypatch.setattr(server, "select", Select)
    logs.configure("info", "json")
    app = lambda environ, start_response: server.reply(start_response, "200 OK", b"ok\n")  # noqa: E731
    status, _, body = ask_once(app, b"GET / HTTP/1.0\r\n\r\n")
    return status, body, pauses, fails


def test_an_accept_that_fails_pauses_the_accept_loop_and_is_logged_once(monkeypatch, capsys):
    """Out of descriptors (EMFILE), socketserver's accept fails silently and the queued connection wakes the
    loop at once: it spun a CPU without a word. Now each failure pauses the loop (on its wake-up pipe, so a
    stop still ends it at once) and one warning says why; the connection is served once accept works."""
    import errno

    status, body, pauses, _ = serve_through_failed_accepts(monkeypatch, errno.EMFILE, errno.EMFILE, errno.EMFILE)
    assert status == b"HTTP/1.0 200 OK" and body == b"ok\n"
    assert pauses == [server.ACCEPT_BACKOFF_SECONDS] * 3
    lines = [line for line in capsys.readouterr().err.splitlines() if "http_accept_failed" in line]
    assert len(lines) == 1 and "Too many open files" in lines[0] and "LimitNOFILE" in lines[0]


def test_an_accept_that_fails_for_its_own_connection_is_no_pause(monkeypatch, capsys):
    """ECONNABORTED and its kin are one queued connection's failure (it left the queue): no pause, no warning."""
    import errno

    status, _, pauses, left = serve_through_failed_accepts(monkeypatch, errno.ECONNABORTED)
    assert status == b"HTTP/1.0 200 OK" and left == [] and pauses == []
    assert "http_accept_failed" not in capsys.readouterr().err


def test_the_daemon_raises_its_soft_descriptor_limit_to_the_hard_one():
    """As Go daemons do: systemd's soft 1024 is what four listeners' kept connections take by themselves."""
    import subprocess
    import sys

    code = ("import resource; resource.setrlimit(resource.RLIMIT_NOFILE, (100, 4096)); "
            "from gpuwatch.cli.run import raise_descriptor_limit; raise_descriptor_limit(); "
            "print(*resource.getrlimit(resource.RLIMIT_NOFILE))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["4096", "4096"]


def test_the_descriptor_limit_is_never_lowered(monkeypatch):
    import resource

    from gpuwatch.cli.run import raise_descriptor_limit

    set_to = []
    monkeypatch.setattr(resource, "setrlimit", lambda which, limits: set_to.append(limits))
    for soft, hard in ((2_000_000, 4_000_000), (1 << 20, resource.RLIM_INFINITY), (4096, 4096)):
        monkeypatch.setattr(resource, "getrlimit", lambda which, limits=(soft, hard): limits)
        raise_descriptor_limit()
    monkeypatch.setattr(resource, "getrlimit", lambda which: (1024, 1 << 30))
    raise_descriptor_limit()
    assert set_to == [(1 << 20, 1 << 30)]  # only the last: raised, to 2^20 at most


def test_a_telemetry_path_that_is_not_ascii_is_served_where_clients_ask_for_it():
    """--web.telemetry-path /métriques: a client sends its UTF-8 bytes (percent-encoded or not); PATH_INFO holds
    them as ISO-8859-1 characters (PEP 3333), which the configured path did not equal: always 404."""
    clock = FakeClock()
    store = Store(clock, "scripted")
    app = App(registry_for(store, clock), store.snapshot, clock.monotonic, "/m\u00e9triques",
              lambda tier: 6.0 if tier == "fast" else 90.0)
    for target in (b"/m%C3%A9triques", "/m\u00e9triques".encode()):
        status, headers, body = ask_once(app, b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
        assert status == b"HTTP/1.1 200 OK" and headers["Content-Type"].startswith("text/plain"), (target, status)
        assert b"\n# TYPE gpuwatch_" in body
    status, _, _ = ask_once(app, b"GET /m%E9triques HTTP/1.1\r\nHost: x\r\n\r\n")  # ISO-8859-1's spelling: not it
    assert status == b"HTTP/1.1 404 Not Found"
