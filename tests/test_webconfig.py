"""--web.config.file (exporter-toolkit format) and --web.max-requests over real sockets.

Certificates are made at test time with the openssl CLI: a CA, a server certificate for
127.0.0.1/localhost, a client certificate from that CA and one from another CA.
"""

from __future__ import annotations

import base64
import http.client
import os
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import bcrypt
import pytest
from daemon import wait_for

from gpuwatch import config as configuration
from gpuwatch import web as webconfig
from gpuwatch.clock import FakeClock
from gpuwatch.errors import ConfigError
from gpuwatch.poller import Poller
from gpuwatch.store import Store
from gpuwatch.testing import ScriptedBackend, registry_for
from gpuwatch.web import App, HttpServers

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "deploy" / "web-config.example.yml"
PROMTOOL = shutil.which("promtool")
OPENSSL = shutil.which("openssl")
pytestmark = pytest.mark.skipif(OPENSSL is None, reason="needs the openssl CLI to make test certificates")

PASSWORD = "s3cret pass"
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()  # cost 4: fast, still valid for promtool
PLAIN_ON_TLS = b"Client sent an HTTP request to an HTTPS server."

OPENSSL_CNF = """\
[req]
distinguished_name = dn
prompt = no
[dn]
CN = unused
[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
subjectAltName = DNS:prometheus
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """ca, server, client (from ca); other-ca, other-client (from other-ca); other-server (from ca)."""
    d = tmp_path_factory.mktemp("pki")
    (d / "openssl.cnf").write_text(OPENSSL_CNF)
    serial = iter(range(0x1000, 0x2000))

    def run(*args):
        subprocess.run([OPENSSL, *args], cwd=d, check=True, capture_output=True, timeout=30)

    def ca(name):
        run("req", "-x509", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{name}.key", "-out", f"{name}.crt", "-days", "2", "-subj", f"/CN=gpuwatch test {name}",
            "-config", "openssl.cnf", "-extensions", "ca")

    def leaf(name, issuer, kind):
        run("req", "-new", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout",
            f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", "-config", "openssl.cnf")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{issuer}.crt", "-CAkey", f"{issuer}.key",
            "-set_serial", str(next(serial)), "-days", "2", "-out", f"{name}.crt", "-extfile", "openssl.cnf",
            "-extensions", kind)

    ca("ca")
    ca("other-ca")
    leaf("server", "ca", "server")
    leaf("other-server", "ca", "server")
    leaf("client", "ca", "client")
    leaf("other-client", "other-ca", "client")
    return d


def write(directory: Path, text: str, name: str = "web.yml") -> Path:
    path = directory / name
    path.write_text(text)
    return path


def tls_file(pki: Path, directory: Path, extra: str = "", users: bool = False, name: str = "web.yml") -> Path:
    text = f"tls_server_config:\n  cert_file: {pki / 'server.crt'}\n  key_file: {pki / 'server.key'}\n{extra}"
    if users:
        text += f"basic_auth_users:\n  prometheus: '{HASH}'\n"
    return write(directory, text, name)


MTLS = "  client_auth_type: RequireAndVerifyClientCert\n  client_ca_file: {pki}/ca.crt\n"


def make_app():
    clock = FakeClock()
    backend = ScriptedBackend(2)
    store = Store(clock, backend.name)
    Poller(backend, store, clock).poll_fast()
    return App(registry_for(store, clock), store.snapshot, clock.monotonic, "/metrics",
               lambda tier: 6.0 if tier == "fast" else 90.0)


@contextmanager
def serving(web=None, app=None, max_requests=40):
    config = webconfig.load(web) if isinstance(web, Path) else web
    servers = HttpServers(["127.0.0.1:0"], app or make_app(), web_config=config, max_requests=max_requests)
    servers.start()
    try:
        port = servers.servers[0].server_address[1]
        yield servers, f"{servers.scheme}://127.0.0.1:{port}"
    finally:
        servers.close()


def client_context(pki: Path, cert: str | None = None, max_version=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
    if cert is not None:
        context.load_cert_chain(str(pki / f"{cert}.crt"), str(pki / f"{cert}.key"))
    if max_version is not None:
        context.maximum_version = max_version
    return context


def get(url, context=None, auth=None, method="GET", timeout=10):
    headers = {} if auth is None else {"Authorization": webconfig.basic_header(*auth)}
    request = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def refused(url, context):
    """The TLS server refuses the connection: an exception, never an HTTP answer."""
    with pytest.raises((OSError, http.client.HTTPException)):
        get(url, context)



class Logs:
    """What the server logged to stderr (JSON lines, tests/conftest.py), accumulated across reads."""

    def __init__(self, capsys):
        self._capsys = capsys
        self.text = ""

    def read(self) -> str:
        self.text += self._capsys.readouterr().err
        return self.text


def promtool(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, "check", "web-config", str(path)], capture_output=True, text=True, timeout=30)


needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="needs promtool (Debian package prometheus)")


# -- the file -------------------------------------------------------------------------------------

def example_with_test_certificates(pki: Path, directory: Path) -> Path:
    text = EXAMPLE.read_text()
    assert "/etc/gpuwatch/tls/gpuwatch.crt" in text and "/etc/gpuwatch/tls/gpuwatch.key" in text
    text = text.replace("/etc/gpuwatch/tls/gpuwatch.crt", str(pki / "server.crt"))
    text = text.replace("/etc/gpuwatch/tls/gpuwatch.key", str(pki / "server.key"))
    return write(directory, text, "example.yml")


@pytest.mark.stack
@needs_promtool
def test_the_example_passes_promtool_and_loads(pki, tmp_path):
    path = example_with_test_certificates(pki, tmp_path)
    result = promtool(path)
    assert result.returncode == 0 and "SUCCESS" in result.stdout + result.stderr, result.stdout + result.stderr
    loaded = webconfig.load(path)
    assert loaded.tls is not None and loaded.tls.min_version == "TLS12" and not loaded.tls.requires_client_cert
    assert list(loaded.users) == ["prometheus"]
    assert ("X-Content-Type-Options", "nosniff") in loaded.headers
    # its commented-out mTLS lines work too
    text = path.read_text().replace("# client_auth_type:", "client_auth_type:")
    text = text.replace("# client_ca_file: /etc/gpuwatch/tls/scrapers-ca.crt", f"client_ca_file: {pki / 'ca.crt'}")
    mtls = write(tmp_path, text, "example-mtls.yml")
    assert promtool(mtls).returncode == 0
    assert webconfig.load(mtls).tls.requires_client_cert


FULL = """\
tls_server_config:
  cert_file: server.crt
  key_file: server.key
  client_auth_type: RequireAndVerifyClientCert
  client_ca_file: ca.crt
  min_version: TLS12
  max_version: TLS13
  cipher_suites: [TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256, TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256]
  prefer_server_cipher_suites: true
  curve_preferences: [X25519, CurveP256]
http_server_config:
  http2: false
  headers:
    Strict-Transport-Security: max-age=31536000
    X-Content-Type-Options: nosniff
    X-Frame-Options: sameorigin
    X-XSS-Protection: "1; mode=block"
    Content-Security-Policy: "default-src 'none'"
basic_auth_users:
  prometheus: '{hash}'
  "grafana agent": '{hash}'
"""


@pytest.mark.stack
@needs_promtool
def test_every_supported_key_passes_promtool_and_loads(pki):
    # relative file names are relative to the file's folder, as in the toolkit
    path = write(pki, FULL.format(hash=HASH), "full.yml")
    result = promtool(path)
    assert result.returncode == 0, result.stdout + result.stderr
    loaded = webconfig.load(path)
    assert loaded.tls.cert_file == str(pki / "server.crt") and loaded.tls.client_ca_file == str(pki / "ca.crt")
    assert loaded.tls.cipher_suites[1] == "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256"
    assert loaded.tls.curve_preferences == ("X25519", "CurveP256") and loaded.http2 is False
    assert len(loaded.headers) == 5 and set(loaded.users) == {"prometheus", "grafana agent"}
    assert loaded.tls.context.verify_mode == ssl.CERT_REQUIRED


def test_an_empty_file_means_plain_http_without_auth(tmp_path):
    loaded = webconfig.load(write(tmp_path, "# nothing\n"))
    assert loaded.tls is None and not loaded.basic_auth and loaded.headers == ()


INVALID = [
    # (name, file text, words the message must contain, promtool rejects it too)
    ("unknown key", "basic_auth_user: {}\n", ["unknown key 'basic_auth_user'", "basic_auth_users"], True),
    ("unknown tls key", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key, "
     "min_versoin: TLS13}\n", ["unknown key 'tls_server_config.min_versoin'"], True),
    ("newer key", "rate_limit: {interval: 1s, burst: 10}\n", ["rate_limit", "--web.max-requests"], True),
    ("non-bcrypt password", "basic_auth_users: {alice: hunter2}\n",
     ["basic_auth_users.alice", "not a bcrypt hash", "htpasswd"], True),
    ("bcrypt cost in Arabic-Indic digits", "basic_auth_users: {alice: '$2b$\u0660\u0664$"
     "QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi'}\n", ["basic_auth_users.alice", "not a bcrypt hash"],
     True),
    ("a 5000-digit number", "http_server_config: {headers: {X-Frame-Options: " + "9" * 5000 + "}}\n",
     ["more than 4300 digits"], True),
    ("a 400-digit number", "http_server_config: {headers: {X-Frame-Options: " + "9" * 400 + "}}\n",
     ["a whole number of 400 digits"], True),
    ("NUL in cert_file", "tls_server_config: {cert_file: \"{pki}/server\\0.crt\", key_file: {pki}/server.key}\n",
     ["tls_server_config.cert_file", "NUL"], True),
    ("bcrypt cost 3", "basic_auth_users: {alice: '$2y$03$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi'}\n",
     ["cost 03"], True),
    ("missing cert file", "tls_server_config: {cert_file: {pki}/nope.crt, key_file: {pki}/server.key}\n",
     ["tls_server_config.cert_file", "nope.crt", "No such file"], True),
    ("key without cert", "tls_server_config: {key_file: {pki}/server.key}\n", ["cert_file is missing"], True),
    ("key of another certificate", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/client.key}\n",
     ["does not match"], True),
    ("bad min_version", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key, "
     "min_version: TLS14}\n", ["min_version 'TLS14'", "TLS12, TLS13"], True),
    ("YAML syntax error", "tls_server_config: [cert_file: x\n", ["not valid YAML", "line 2"], True),
    ("key twice", "basic_auth_users: {}\nbasic_auth_users: {}\n", ["given twice"], True),
    ("client CA without a policy", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key, "
     "client_ca_file: {pki}/ca.crt}\n", ["client_ca_file", "RequireAndVerifyClientCert"], True),
    ("bad client_auth_type", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key, "
     "client_auth_type: Always}\n", ["client_auth_type 'Always'"], True),
    ("bad header value", "http_server_config: {headers: {X-Frame-Options: DENY}}\n",
     ["X-Frame-Options", "deny, sameorigin"], True),
    ("header not allowed", "http_server_config: {headers: {Server: gpuwatch}}\n", ["'Server' cannot be"], True),
    ("unknown cipher", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key, "
     "cipher_suites: [TLS_FOO]}\n", ["unknown cipher suite 'TLS_FOO'"], True),
    # stricter than the toolkit (promtool accepts these):
    ("mTLS without a CA", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key, "
     "client_auth_type: RequireAndVerifyClientCert}\n", ["needs client_ca_file"], False),
    ("unverified client certificates", "tls_server_config: {cert_file: {pki}/server.crt, key_file: "
     "{pki}/server.key, client_auth_type: RequireAnyClientCert}\n", ["RequireAnyClientCert", "not supported"], False),
    ("min above max", "tls_server_config: {cert_file: {pki}/server.crt, key_file: {pki}/server.key, "
     "min_version: TLS13, max_version: TLS12}\n", ["newer than max_version"], False),
]


@pytest.mark.stack
@pytest.mark.parametrize("name,text,words,promtool_rejects", INVALID, ids=[case[0] for case in INVALID])
def test_invalid_files_raise_a_config_error_naming_the_problem(pki, tmp_path, name, text, words, promtool_rejects):
    path = write(tmp_path, text.replace("{pki}", str(pki)))
    with pytest.raises(ConfigError) as caught:
        webconfig.load(path)
    message = str(caught.value)
    assert message.startswith(f"web config file {path}")
    for word in words:
        assert word in message, message
    if promtool_rejects and PROMTOOL is not None:
        assert promtool(path).returncode != 0, f"promtool accepts {name!r}"


def test_a_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read it: No such file"):
        webconfig.load(tmp_path / "absent.yml")


# -- basic auth -----------------------------------------------------------------------------------

def test_basic_auth_on_every_path_with_the_configured_headers(tmp_path):
    path = write(tmp_path, f"basic_auth_users: {{prometheus: '{HASH}'}}\n"
                           "http_server_config: {headers: {X-Frame-Options: deny}}\n")
    with serving(path) as (_, base):
        for where in ("/metrics", "/healthz", "/api/v1/status", "/", "/nope"):
            status, headers, body = get(base + where)
            assert status == 401 and body == b"Unauthorized\n", where
            assert headers["WWW-Authenticate"] == 'Basic realm="gpuwatch"'
            assert headers["X-Frame-Options"] == "deny"
        assert get(base + "/metrics", auth=("prometheus", "wrong"))[0] == 401
        assert get(base + "/metrics", auth=("grafana", PASSWORD))[0] == 401
        assert get(base + "/metrics", auth=("prometheus", PASSWORD + "x" * 100))[0] == 401  # > 72 bytes: no 500
        status, headers, body = get(base + "/metrics", auth=("prometheus", PASSWORD))
        assert status == 200 and b"gpuwatch_gpu_up" in body and headers["X-Frame-Options"] == "deny"
        assert get(base + "/healthz", auth=("prometheus", PASSWORD))[0] == 200
        status, _, body = get(base + "/metrics", method="HEAD")
        assert status == 401 and body == b""


def test_basic_auth_results_are_cached(tmp_path, monkeypatch):
    calls = []
    real = bcrypt.checkpw
    monkeypatch.setattr(bcrypt, "checkpw", lambda pw, hashed: calls.append(pw) or real(pw, hashed))
    path = write(tmp_path, f"basic_auth_users: {{prometheus: '{HASH}'}}\n")
    with serving(path) as (_, base):
        for _ in range(3):
            assert get(base + "/metrics", auth=("prometheus", PASSWORD))[0] == 200
        assert len(calls) == 1
        for _ in range(2):  # failures are never cached: each wrong guess pays bcrypt
            assert get(base + "/metrics", auth=("prometheus", "guess"))[0] == 401
        assert len(calls) == 3


def test_authorization_header_parsing():
    assert webconfig.parse_basic(webconfig.basic_header("a", "b:c")) == ("a", "b:c")
    assert webconfig.parse_basic("basic " + webconfig.basic_header("u", "")[6:]) == ("u", "")
    for bad in (None, "", "Bearer abc", "Basic !!!", "Basic " + "dXNlcg==", "Basic"):  # "user" has no colon
        assert webconfig.parse_basic(bad) is None
    hashed = webconfig.hash_password("pw", cost=4)
    assert webconfig.Authenticator().verify({"u": hashed}, webconfig.basic_header("u", "pw")) == "u"
    # `gpuwatch check --check.username` with bytes that are not UTF-8 (argv's lone surrogates): sent as those
    # bytes, read back by the server as the same text (it decodes with surrogateescape), not a traceback
    odd = os.fsdecode(b"u\xff")
    assert webconfig.basic_header(odd, "p\u00e9") == "Basic " + base64.b64encode(b"u\xff:p\xc3\xa9").decode()
    assert webconfig.parse_basic(webconfig.basic_header(odd, "p")) == (odd, "p")


def test_a_password_file_that_is_not_utf8_is_read_as_the_server_reads_it(tmp_path):
    """`gpuwatch check --check.password-file`: any bytes (the server's basic auth decodes the header with
    surrogateescape); a strict read said UNKNOWN "cannot read the daemon's status", pointing elsewhere."""
    secret = tmp_path / "password"
    secret.write_bytes(b"p\xe9ss\nignored\n")
    password = webconfig.read_secret(str(secret))
    assert password == os.fsdecode(b"p\xe9ss")
    assert webconfig.parse_basic(webconfig.basic_header("u", password)) == ("u", password)


# -- TLS ------------------------------------------------------------------------------------------

def test_tls_refuses_plain_http_and_bad_clients_and_keeps_serving(pki, tmp_path, capsys):
    logs = Logs(capsys)
    with serving(tls_file(pki, tmp_path)) as (servers, base):
        assert base.startswith("https://")
        assert get(base + "/metrics", client_context(pki))[0] == 200
        port = servers.servers[0].server_address[1]
        # plain HTTP on the TLS listener: a plain 400 that says why, as Go servers answer
        status, _, body = get(f"http://127.0.0.1:{port}/metrics")
        assert status == 400 and PLAIN_ON_TLS in body
        # garbage that is neither TLS nor HTTP, and a client that connects and leaves
        for payload in (b"\x00\x01\x02garbage\r\n\r\n", b""):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
                try:
                    raw.sendall(payload)
                    raw.shutdown(socket.SHUT_WR)
                    assert raw.recv(100) == b""  # closed without an answer
                except OSError:  # or reset, when OpenSSL leaves the garbage unread
                    pass
        # a client that does not trust the server's CA
        refused(base + "/metrics", ssl.create_default_context())
        assert get(base + "/metrics", client_context(pki))[0] == 200
        assert servers.alive()
        wait_for(lambda: logs.read().count('"tls_handshake_failed"') >= 2)
        assert '"http_plain_request_on_tls_listener"' in logs.text
    assert "Traceback" not in logs.read()


def test_a_tls_connection_is_kept_for_the_next_scrape(pki, tmp_path):
    """One handshake for many scrapes, as Prometheus keeps its connection; basic auth asked of each request."""
    with serving(tls_file(pki, tmp_path, users=True)) as (servers, _):
        connection = http.client.HTTPSConnection("127.0.0.1", servers.servers[0].server_address[1],
                                                 context=client_context(pki), timeout=30)
        try:
            seen = []
            for credentials in (("prometheus", PASSWORD), ("prometheus", "wrong"), ("prometheus", PASSWORD)):
                connection.request("GET", "/metrics", headers={"Authorization": webconfig.basic_header(*credentials)})
                response = connection.getresponse()
                response.read()
                seen.append((response.status, connection.sock))
            assert [status for status, _ in seen] == [200, 401, 200]
            assert seen[0][1] is not None and seen[0][1] is seen[1][1] is seen[2][1]  # one connection
        finally:
            connection.close()


def test_closing_the_server_ends_its_kept_tls_connections(pki, tmp_path):
    """The TLS socket stands for the raw one (detached by the wrap) among the connections stop() ends."""
    with serving(tls_file(pki, tmp_path)) as (servers, _):
        connection = http.client.HTTPSConnection("127.0.0.1", servers.servers[0].server_address[1],
                                                 context=client_context(pki), timeout=10)
        try:
            connection.request("GET", "/metrics")
            response = connection.getresponse()
            response.read()
            assert response.status == 200 and not response.will_close  # kept: it would wait 300 s
            servers.close()
            assert connection.sock.recv(100) == b""  # ended by the close, not by the idle timeout
        finally:
            connection.close()
    wait_for(lambda: not [t for t in threading.enumerate() if t.name == "gpuwatch-http-conn"],
             what="the connection's thread to end")


def test_plain_http_trickled_into_a_tls_listener_is_cut_at_the_deadline(pki, tmp_path, monkeypatch):
    """The 400 to plain HTTP on a TLS listener reads the client's head first: within REQUEST_TIMEOUT in all,
    not a timeout per read (the clock is the test's)."""
    import gpuwatch.web.server as server

    class Clock:
        now, calls = 1000.0, 0

        def monotonic(self):
            self.calls += 1
            return self.now

    clock = Clock()
    monkeypatch.setattr(server, "time", clock)
    with serving(tls_file(pki, tmp_path)) as (servers, _):
        with socket.create_connection(("127.0.0.1", servers.servers[0].server_address[1]), timeout=10) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n")
            wait_for(lambda: clock.calls >= 2, what="the server to read the head (its deadline, the first wait)")
            clock.now += server.REQUEST_TIMEOUT + 1
            raw.sendall(b"Host: x\r\n")
            assert raw.recv(100) == b""  # closed without the 400: the head did not come in time


def test_mtls_requires_a_certificate_from_the_client_ca(pki, tmp_path, capsys):
    logs = Logs(capsys)
    with serving(tls_file(pki, tmp_path, MTLS.format(pki=pki))) as (servers, base):
        refused(base + "/metrics", client_context(pki))  # no client certificate
        refused(base + "/metrics", client_context(pki, "other-client"))  # signed by another CA
        status, _, body = get(base + "/metrics", client_context(pki, "client"))
        assert status == 200 and b"gpuwatch_gpu_up" in body
        assert servers.alive()
        wait_for(lambda: logs.read().count('"tls_handshake_failed"') >= 2)
    assert "Traceback" not in logs.read()


def test_min_version_tls13_refuses_a_tls12_client(pki, tmp_path):
    with serving(tls_file(pki, tmp_path, "  min_version: TLS13\n")) as (_, base):
        refused(base + "/metrics", client_context(pki, max_version=ssl.TLSVersion.TLSv1_2))
        assert get(base + "/metrics", client_context(pki))[0] == 200


def test_max_version_tls12_still_serves_tls12_clients(pki, tmp_path):
    with serving(tls_file(pki, tmp_path, "  max_version: TLS12\n")) as (_, base):
        context = client_context(pki)
        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=5) as raw:
            with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
                assert tls.version() == "TLSv1.2"


def test_a_malformed_request_on_a_plain_listener_is_a_400(capsys):
    logs = Logs(capsys)
    with serving() as (servers, base):
        port = int(base.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
            raw.sendall(b"\x16\x03\x01 not http at all\r\n\r\n")
            assert b" 400 " in raw.recv(1000)
        assert get(base + "/healthz")[0] == 200 and servers.alive()
    assert "Traceback" not in logs.read()


# -- --web.max-requests ---------------------------------------------------------------------------

class Blocking:
    """A WSGI app that holds requests to /block until released."""

    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def __call__(self, environ, start_response):
        if environ["PATH_INFO"] == "/block":
            self.entered.set()
            self.release.wait(10)
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]


def test_max_requests_answers_503_while_the_limit_is_in_use():
    app = Blocking()
    with serving(app=app, max_requests=1) as (servers, base):
        with ThreadPoolExecutor(1) as pool:
            held = pool.submit(get, base + "/block")
            assert app.entered.wait(10)
            status, headers, body = get(base + "/metrics", timeout=5)
            assert status == 503 and b"--web.max-requests" in body and headers["Retry-After"] == "1"
            app.release.set()
            assert held.result(timeout=10)[0] == 200
        assert get(base + "/metrics")[0] == 200
    app = Blocking()
    app.release.set()
    with serving(app=app, max_requests=0) as (_, base):  # 0: no limit
        assert get(base + "/block")[0] == 200


def test_200_parallel_scrapes_over_tls_and_auth_are_answered(pki, tmp_path, capsys):
    logs = Logs(capsys)
    context = client_context(pki)
    with serving(tls_file(pki, tmp_path, users=True), max_requests=8) as (servers, base):
        port = servers.servers[0].server_address[1]

        def scrape(_):
            connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=30)
            try:
                connection.request("GET", "/metrics",
                                   headers={"Authorization": webconfig.basic_header("prometheus", PASSWORD)})
                response = connection.getresponse()
                response.read()
                return response.status
            finally:
                connection.close()

        with ThreadPoolExecutor(200) as pool:
            statuses = list(pool.map(scrape, range(200)))
        assert set(statuses) <= {200, 503} and 200 in statuses
        assert servers.alive()
        assert scrape(None) == 200
    assert "Traceback" not in logs.read()


# -- reloading ------------------------------------------------------------------------------------

def test_changes_to_the_file_apply_while_serving_and_a_broken_edit_is_ignored(pki, tmp_path, capsys):
    logs = Logs(capsys)
    path = tls_file(pki, tmp_path, users=True)
    with serving(path) as (_, base):
        context = client_context(pki)
        assert get(base + "/metrics", context, ("prometheus", PASSWORD))[0] == 200
        new = bcrypt.hashpw(b"rotated", bcrypt.gensalt(4)).decode()
        staged = write(tmp_path, path.read_text().replace(HASH, new), "staged.yml")
        staged.replace(path)  # as editors and config management do: a new file in place
        assert get(base + "/metrics", context, ("prometheus", PASSWORD))[0] == 401
        assert get(base + "/metrics", context, ("prometheus", "rotated"))[0] == 200
        assert '"web_config_reloaded"' in logs.read()
        write(tmp_path, "basic_auth_users: {prometheus: hunter2}\n", "broken.yml").replace(path)
        assert get(base + "/metrics", context, ("prometheus", "rotated"))[0] == 200
        assert get(base + "/metrics", context, ("prometheus", "rotated"))[0] == 200
        assert logs.read().count('"web_config_reload_failed"') == 1  # once per broken version
        # a number no reader can take, and a NUL in a file name: the same (was a 500 and a traceback per request)
        for n, broken in enumerate(("basic_auth_users: {prometheus: " + "9" * 5000 + "}\n",
                                    "tls_server_config: {cert_file: \"a\\0b\", key_file: k}\n")):
            write(tmp_path, broken, f"broken{n}.yml").replace(path)
            for _ in range(3):
                assert get(base + "/metrics", context, ("prometheus", "rotated"))[0] == 200
        text = logs.read()
        assert text.count('"web_config_reload_failed"') == 3 and "Traceback" not in text
        assert '"http_handler_failed"' not in text


def test_a_reload_that_fails_in_an_unforeseen_way_keeps_the_configuration_in_effect(tmp_path, monkeypatch, capsys):
    """Whatever a new version of the file makes load() raise (a bug in gpuwatch as much as the file), every
    request is served under the configuration in effect, and the failure is logged once per version."""
    from gpuwatch.web import config as web_config

    path = write(tmp_path, f"basic_auth_users: {{prometheus: '{HASH}'}}\n")
    source = web_config.WebConfigSource(webconfig.load(path))
    write(tmp_path, "basic_auth_users: {}\n", "next.yml").replace(path)

    def broken(_path):
        raise RuntimeError("unforeseen")

    monkeypatch.setattr(web_config, "load", broken)
    for _ in range(3):
        assert set(source.current().users) == {"prometheus"}
    failed = [line for line in capsys.readouterr().err.splitlines() if "web_config_reload_failed" in line]
    assert len(failed) == 1 and "RuntimeError: unforeseen" in failed[0]


# -- the client side (gpuwatch check) -------------------------------------------------------------

def test_local_get_pins_the_servers_certificate_and_sends_credentials(pki, tmp_path):
    path = tls_file(pki, tmp_path, MTLS.format(pki=pki), users=True)
    config = webconfig.load(path)
    password_file = write(tmp_path, PASSWORD + "\n", "password")
    with serving(config) as (servers, base):
        port = servers.servers[0].server_address[1]
        status, body = webconfig.local_get("127.0.0.1", port, "/healthz", config, username="prometheus",
                                           password=webconfig.read_secret(str(password_file)),
                                           client_cert=str(pki / "client.crt"), client_key=str(pki / "client.key"))
        assert status == 200 and body.startswith(b"ok: 2 GPUs")
        status, _ = webconfig.local_get("127.0.0.1", port, "/healthz", config,
                                        client_cert=str(pki / "client.crt"), client_key=str(pki / "client.key"))
        assert status == 401
        with pytest.raises(webconfig.LocalRequestError, match="requires a client certificate"):
            webconfig.local_get("127.0.0.1", port, "/healthz", config, username="prometheus", password=PASSWORD)
        # a daemon that presents another certificate (even one from the same CA) is not trusted
        other = webconfig.load(write(tmp_path, path.read_text().replace("/server.", "/other-server."), "other.yml"))
        with pytest.raises(webconfig.LocalRequestError, match="server does not present the certificate"):
            webconfig.local_get("127.0.0.1", port, "/healthz", other, username="prometheus", password=PASSWORD,
                                client_cert=str(pki / "client.crt"), client_key=str(pki / "client.key"))


def test_local_get_over_plain_http_and_to_nobody():
    with serving() as (servers, base):
        port = servers.servers[0].server_address[1]
        status, body = webconfig.local_get("127.0.0.1", port, "/healthz", None)
        assert status == 200 and body.startswith(b"ok")
    with pytest.raises(webconfig.LocalRequestError, match="Connection refused"):
        webconfig.local_get("127.0.0.1", port, "/healthz", None)


# -- the daemon and `gpuwatch check` (once config.py has the options) ---------------------------------

WIRED = {"web_config_file", "web_max_requests", "check_username"} <= {o.field for o in configuration.OPTIONS}


@pytest.mark.daemon
@pytest.mark.skipif(not WIRED, reason="--web.config.file is not an option of gpuwatch.config yet")
def test_the_daemon_serves_mtls_and_basic_auth_and_check_speaks_them(pki, tmp_path):
    import fakenvml
    from daemon import Daemon, fake_env

    fx = fakenvml.prepare(tmp_path, fakenvml.FakeNode.h200(1))
    web = tls_file(pki, tmp_path, MTLS.format(pki=pki), users=True)
    password_file = write(tmp_path, PASSWORD + "\n", "password")
    env = fake_env(fx)
    d = Daemon(tmp_path, env, args=["--web.config.file", str(web), "--web.max-requests", "5"])
    try:
        started = next(e for e in d.events() if e.get("event") == "started")
        assert started["scheme"] == "https" and started["basic_auth"] is True
        address = d.base.removeprefix("http://")
        base = f"https://{address}"
        context = client_context(pki, "client")
        assert get(base + "/healthz", context)[0] == 401
        refused(base + "/healthz", client_context(pki))
        wait_for(lambda: get(base + "/healthz", context, ("prometheus", PASSWORD))[0] == 200, timeout=20)

        def check(*extra):
            result = subprocess.run([sys.executable, "-m", "gpuwatch", "check", "--web.listen-address", address,
                                     "--web.config.file", str(web), *extra],
                                    capture_output=True, text=True, timeout=30, env=env)
            return result.returncode, result.stdout

        client = ["--check.client-cert-file", str(pki / "client.crt"), "--check.client-key-file", str(pki / "client.key")]
        auth = ["--check.username", "prometheus", "--check.password-file", str(password_file)]
        assert check(*client, *auth) == (0, "gpuwatch: OK (1 GPUs)\n")
        rc, out = check(*client)
        assert rc == 2 and "set --check.username and --check.password-file" in out
        rc, out = check(*auth)
        assert rc == 2 and "requires a client certificate" in out
    finally:
        d.stop()
    bad = write(tmp_path, "basic_auth_users: {prometheus: hunter2}\n", "bad.yml")
    result = subprocess.run([sys.executable, "-m", "gpuwatch", "run", "--web.config.file", str(bad)],
                            capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 78 and "basic_auth_users.prometheus: not a bcrypt hash" in result.stderr
