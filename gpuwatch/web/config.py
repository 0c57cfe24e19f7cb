"""The web configuration file (``--web.config.file``) in the Prometheus exporter-toolkit format.

The same file node_exporter reads, so operators keep one format for every exporter on a node::

    tls_server_config:
      cert_file: /etc/gpuwatch/tls/gpuwatch.crt
      key_file: /etc/gpuwatch/tls/gpuwatch.key
      client_auth_type: RequireAndVerifyClientCert   # mTLS
      client_ca_file: /etc/gpuwatch/tls/clients-ca.crt
      min_version: TLS12
    http_server_config:
      headers: {X-Content-Type-Options: nosniff}
    basic_auth_users:
      prometheus: $2y$10$...                          # bcrypt hash

``load()`` parses and validates it completely (YAML, keys, bcrypt hashes, certificate, key and CA
files, TLS versions and ciphers) into a ``WebConfig`` whose ``tls.context`` is ready to serve;
every problem is a ``ConfigError`` naming the file and the key. ``WebConfigSource`` re-reads the
file, and the files it names, when one of them changes (certificate rotation without a restart, as
the toolkit does); a broken edit keeps the previous configuration in effect. ``Authenticator``
checks basic-auth credentials against the bcrypt hashes and caches successes, so a scrape does not
pay the ~70 ms of a cost-10 hash each time. ``local_get()`` is the client side for
``gpuwatch check``. docs/security.md describes the format, gpuwatch's differences from the
toolkit and the behaviour.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from gpuwatch import logs
from gpuwatch.errors import ConfigError
from gpuwatch.yamlfile import read_yaml

if TYPE_CHECKING:
    import ssl  # imported where a TLS context is made: a node without TLS never loads OpenSSL (5 MB)

REALM = "gpuwatch"

# the toolkit's names, oldest first -> ssl.TLSVersion's
TLS_VERSIONS = {"TLS10": "TLSv1", "TLS11": "TLSv1_1", "TLS12": "TLSv1_2", "TLS13": "TLSv1_3"}
_TLS_ORDER = tuple(TLS_VERSIONS)

# client_auth_type as the toolkit spells it -> what gpuwatch does (docs/security.md).
CLIENT_AUTH_TYPES = (
    "NoClientCert",  # no client certificate asked for
    "RequestClientCert",  # the toolkit asks but never verifies: the same as NoClientCert for access
    "VerifyClientCertIfGiven",  # a certificate is optional; one that is sent must chain to client_ca_file
    "RequireAndVerifyClientCert",  # mTLS: a certificate that chains to client_ca_file is required
)
UNSUPPORTED_CLIENT_AUTH = ("RequireAnyClientCert", "RequireClientCert")  # "any certificate, unverified"

# Go cipher suite names (crypto/tls CipherSuites(), the ones the toolkit accepts) -> OpenSSL names.
# They apply to TLS 1.2 and below, as in Go (TLS 1.3 suites are not configurable).
CIPHER_SUITES = {
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
}

# Go curve names -> OpenSSL names. Python's ssl module can limit key exchange to one group only:
# gpuwatch uses the first (most preferred) entry of curve_preferences.
CURVES = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1", "X25519": "X25519"}

# http_server_config.headers the toolkit lets an operator set, with the values it allows (None: any).
HEADERS: dict[str, tuple[str, ...] | None] = {
    "Strict-Transport-Security": None,
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": None,
    "Content-Security-Policy": None,
}

KEYS = {
    "": ("tls_server_config", "http_server_config", "basic_auth_users"),
    "tls_server_config": ("cert_file", "key_file", "client_auth_type", "client_ca_file", "cipher_suites",
                          "curve_preferences", "min_version", "max_version", "prefer_server_cipher_suites"),
    "http_server_config": ("http2", "headers"),
}
# Keys of newer exporter-toolkit versions that gpuwatch does not implement, with what to do instead.
NEWER_KEYS = {
    "rate_limit": "limit parallel requests with --web.max-requests instead",
    "tls_server_config.client_allowed_sans": "issue client certificates from a CA used only for scrapers instead",
    "tls_server_config.cert": "put the certificate in a file and name it in cert_file",
    "tls_server_config.key": "put the key in a file and name it in key_file",
    "tls_server_config.client_ca": "put the CA certificates in a file and name it in client_ca_file",
}

_BCRYPT = re.compile(r"\$2[aby]\$(\d\d)\$[./A-Za-z0-9]{53}", re.ASCII)  # \d: 0-9 only, as bcrypt reads it
HASH_HINT = "write one with `htpasswd -nBC 10 \"\" | tr -d ':\\n'` or docs/security.md"
# A valid bcrypt hash (cost 10) checked when the user name is unknown, so that the answer takes as
# long as for a known user and user names cannot be found by timing (as the toolkit does).
DUMMY_HASH = b"$2y$10$QOauhQNbBCuQDKes6eFzPeMqBSjb7Mr5DUmpZ/VcEd00UAV/LDeSi"
BCRYPT_MAX = 72  # bcrypt uses the first 72 bytes of a password (Go and htpasswd do the same)


@dataclass(frozen=True)
class TlsServerConfig:
    cert_file: str
    key_file: str
    client_auth_type: str = "NoClientCert"
    client_ca_file: str | None = None
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    cipher_suites: tuple[str, ...] = ()
    curve_preferences: tuple[str, ...] = ()
    prefer_server_cipher_suites: bool = True
    context: ssl.SSLContext | None = field(default=None, compare=False, repr=False)

    @property
    def requires_client_cert(self) -> bool:
        return self.client_auth_type == "RequireAndVerifyClientCert"


@dataclass(frozen=True)
class WebConfig:
    path: str | None = None
    tls: TlsServerConfig | None = None
    users: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))  # user -> bcrypt hash
    headers: tuple[tuple[str, str], ...] = ()
    http2: bool = True  # accepted for compatibility; gpuwatch serves HTTP/1.x only

    @property
    def basic_auth(self) -> bool:
        return bool(self.users)

    def files(self) -> tuple[str, ...]:
        """The files this configuration was built from (watched for changes)."""
        found = [self.path] if self.path else []
        if self.tls is not None:
            found += [self.tls.cert_file, self.tls.key_file]
            if self.tls.client_ca_file:
                found.append(self.tls.client_ca_file)
        return tuple(found)


# -- loading ---------------------------------------------------------------------------------------

def load(path: str | os.PathLike[str]) -> WebConfig:
    """Read and validate a web configuration file; every problem raises ConfigError naming it."""
    path = os.fspath(path)
    return _validate(read_yaml(path, "web config file"), path)


def _validate(data: Any, path: str) -> WebConfig:
    """Check the parsed file; relative file names are relative to its folder."""
    where = f"web config file {path}"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: the top level must be a mapping (tls_server_config, http_server_config, "
                          "basic_auth_users)")
    base = os.path.dirname(os.path.abspath(path))
    _known(data, "", where)
    tls = _tls(data.get("tls_server_config"), base, where)
    users = _users(data.get("basic_auth_users"), where)
    headers, http2 = _http(data.get("http_server_config"), where)
    return WebConfig(path=path, tls=tls, users=MappingProxyType(users), headers=headers, http2=http2)


def _known(section: Mapping[Any, Any], name: str, where: str) -> None:
    for key in section:
        dotted = f"{name}.{key}" if name else str(key)
        if key in KEYS[name]:
            continue
        if dotted in NEWER_KEYS:
            raise ConfigError(f"{where}: {dotted} (a newer exporter-toolkit key) is not supported by gpuwatch: "
                              f"{NEWER_KEYS[dotted]}")
        raise ConfigError(f"{where}: unknown key {dotted!r}; known keys{' in ' + name if name else ''}: "
                          f"{', '.join(KEYS[name])}")


def _section(value: Any, name: str, where: str) -> dict[Any, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {name} must be a mapping, got {value!r}")
    return value


def _string(section: Mapping[str, Any], key: str, name: str, where: str) -> str | None:
    value = section.get(key)
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ConfigError(f"{where}: {name}.{key} must be a string, got {value!r}")
    return value


def _strings(section: Mapping[str, Any], key: str, name: str, where: str) -> tuple[str, ...]:
    value = section.get(key)
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where}: {name}.{key} must be a list of names, got {value!r}")
    return tuple(value)


def _readable(base: str, value: str, name: str, marker: str, what: str, where: str) -> str:
    """The absolute file name, after checking that the file can be read and holds a PEM ``marker``."""
    resolved = value if os.path.isabs(value) else os.path.join(base, value)
    try:
        content = Path(resolved).read_bytes()
    except OSError as exc:
        raise ConfigError(f"{where}: {name}: cannot read {resolved}: {exc.strerror or exc}") from None
    except ValueError:  # a NUL in the name
        raise ConfigError(f"{where}: {name}: {resolved!r} is not a file name (it has a NUL in it)") from None
    if marker.encode() not in content:
        raise ConfigError(f"{where}: {name}: {resolved} holds no PEM {what} ('{marker}')")
    return resolved


def _tls(value: Any, base: str, where: str) -> TlsServerConfig | None:
    section = _section(value, "tls_server_config", where)
    _known(section, "tls_server_config", where)
    name = "tls_server_config"
    cert = _string(section, "cert_file", name, where)
    key = _string(section, "key_file", name, where)
    if cert is None and key is None:
        if any(section.get(k) not in (None, "", []) for k in ("client_auth_type", "client_ca_file", "cipher_suites",
                                                            "curve_preferences")):
            raise ConfigError(f"{where}: tls_server_config needs cert_file and key_file")
        return None
    if cert is None:
        raise ConfigError(f"{where}: tls_server_config.cert_file is missing (key_file is set)")
    if key is None:
        raise ConfigError(f"{where}: tls_server_config.key_file is missing (cert_file is set)")
    cert = _readable(base, cert, f"{name}.cert_file", "-----BEGIN CERTIFICATE-----", "certificate", where)
    key = _readable(base, key, f"{name}.key_file", "PRIVATE KEY-----", "private key", where)

    auth = _string(section, "client_auth_type", name, where) or "NoClientCert"
    if auth in UNSUPPORTED_CLIENT_AUTH:
        raise ConfigError(f"{where}: {name}.client_auth_type {auth} (any client certificate, never verified) is "
                          "not supported by gpuwatch: use RequireAndVerifyClientCert with client_ca_file")
    if auth not in CLIENT_AUTH_TYPES:
        raise ConfigError(f"{where}: {name}.client_auth_type {auth!r} is not one of {', '.join(CLIENT_AUTH_TYPES)}")
    ca = _string(section, "client_ca_file", name, where)
    if ca is not None:
        ca = _readable(base, ca, f"{name}.client_ca_file", "-----BEGIN CERTIFICATE-----", "certificate", where)
        if auth in ("NoClientCert", "RequestClientCert"):
            raise ConfigError(f"{where}: {name}.client_ca_file is set but client_auth_type is {auth}: "
                              "set client_auth_type: RequireAndVerifyClientCert to require client certificates")
    elif auth in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert"):
        raise ConfigError(f"{where}: {name}.client_auth_type {auth} needs client_ca_file, the CA that signs the "
                          "scrapers' certificates (gpuwatch does not trust the system CAs for clients)")

    versions = []
    for which, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        version = _string(section, which, name, where) or default
        if version not in TLS_VERSIONS:
            raise ConfigError(f"{where}: {name}.{which} {version!r} is not one of {', '.join(TLS_VERSIONS)}")
        versions.append(version)
    if _TLS_ORDER.index(versions[0]) > _TLS_ORDER.index(versions[1]):
        raise ConfigError(f"{where}: {name}.min_version {versions[0]} is newer than max_version {versions[1]}")

    ciphers = _strings(section, "cipher_suites", name, where)
    for cipher in ciphers:
        if cipher not in CIPHER_SUITES:
            raise ConfigError(f"{where}: {name}.cipher_suites: unknown cipher suite {cipher!r} "
                              "(Go names, e.g. TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256)")
    curves = _strings(section, "curve_preferences", name, where)
    for curve in curves:
        if curve not in CURVES:
            raise ConfigError(f"{where}: {name}.curve_preferences: unknown curve {curve!r}; "
                              f"known: {', '.join(CURVES)}")
    prefer = section.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(f"{where}: {name}.prefer_server_cipher_suites must be true or false, got {prefer!r}")

    config = TlsServerConfig(cert_file=cert, key_file=key, client_auth_type=auth, client_ca_file=ca,
                             min_version=versions[0], max_version=versions[1], cipher_suites=ciphers,
                             curve_preferences=curves, prefer_server_cipher_suites=prefer)
    return TlsServerConfig(**{**_fields(config), "context": server_context(config, where)})


def _fields(config: TlsServerConfig) -> dict[str, Any]:
    return {f: getattr(config, f) for f in TlsServerConfig.__dataclass_fields__}


def server_context(config: TlsServerConfig, where: str = "web config") -> ssl.SSLContext:
    """An SSLContext for the listening side; ConfigError when OpenSSL refuses a part of it."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = getattr(ssl.TLSVersion, TLS_VERSIONS[config.min_version])
    context.maximum_version = getattr(ssl.TLSVersion, TLS_VERSIONS[config.max_version])
    if config.prefer_server_cipher_suites:
        context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
    else:
        context.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    asked = []

    def no_password() -> bytes:  # never let OpenSSL prompt on a terminal for an encrypted key
        asked.append(True)
        return b""

    try:
        context.load_cert_chain(config.cert_file, config.key_file, password=no_password)
    except (ssl.SSLError, OSError) as exc:
        if asked:
            problem = "the key is encrypted; gpuwatch (like node_exporter) needs an unencrypted key file"
        elif "KEY_VALUES_MISMATCH" in str(exc):
            problem = "the private key does not match the certificate"
        else:
            problem = getattr(exc, "reason", None) or str(exc)
        raise ConfigError(f"{where}: tls_server_config: cannot use cert_file {config.cert_file} with key_file "
                          f"{config.key_file}: {problem}") from None
    if config.client_ca_file:
        try:
            context.load_verify_locations(cafile=config.client_ca_file)
        except (ssl.SSLError, OSError) as exc:
            raise ConfigError(f"{where}: tls_server_config.client_ca_file {config.client_ca_file}: "
                              f"{getattr(exc, 'reason', None) or exc}") from None
    context.verify_mode = {
        "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
        "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
    }.get(config.client_auth_type, ssl.CERT_NONE)
    if config.cipher_suites:
        names = [CIPHER_SUITES[c] for c in config.cipher_suites]
        try:
            context.set_ciphers(":".join(names))
        except ssl.SSLError:
            raise ConfigError(f"{where}: tls_server_config.cipher_suites: none of {', '.join(config.cipher_suites)} "
                              "is available in this OpenSSL") from None
        available = {c["name"] for c in context.get_ciphers()}
        missing = [g for g, o in zip(config.cipher_suites, names) if o not in available]
        if missing:
            raise ConfigError(f"{where}: tls_server_config.cipher_suites: {', '.join(missing)} "
                              "not available in this OpenSSL")
    if config.curve_preferences:
        try:
            context.set_ecdh_curve(CURVES[config.curve_preferences[0]])
        except (ssl.SSLError, ValueError) as exc:
            raise ConfigError(f"{where}: tls_server_config.curve_preferences: {exc}") from None
    return context


def _users(value: Any, where: str) -> dict[str, str]:
    section = _section(value, "basic_auth_users", where)
    users = {}
    for user, hashed in section.items():
        if not isinstance(user, str) or not user:
            raise ConfigError(f"{where}: basic_auth_users: user name {user!r} must be a non-empty string (quote it)")
        if ":" in user:
            raise ConfigError(f"{where}: basic_auth_users: user name {user!r} contains ':', which basic auth "
                              "cannot carry")
        if not isinstance(hashed, str):
            raise ConfigError(f"{where}: basic_auth_users.{user}: expected a bcrypt hash string ({HASH_HINT})")
        match = _BCRYPT.fullmatch(hashed)
        if match is None:
            raise ConfigError(f"{where}: basic_auth_users.{user}: not a bcrypt hash: passwords are stored as "
                              f"bcrypt hashes ($2y$10$ and 53 more characters), never in clear; {HASH_HINT}")
        if not 4 <= int(match.group(1)) <= 31:
            raise ConfigError(f"{where}: basic_auth_users.{user}: bcrypt cost {match.group(1)} is outside 4-31")
        users[user] = hashed
    return users


def _http(value: Any, where: str) -> tuple[tuple[tuple[str, str], ...], bool]:
    section = _section(value, "http_server_config", where)
    _known(section, "http_server_config", where)
    http2 = section.get("http2", True)
    if not isinstance(http2, bool):
        raise ConfigError(f"{where}: http_server_config.http2 must be true or false, got {http2!r}")
    headers = _section(section.get("headers"), "http_server_config.headers", where)
    result = []
    for name, text in headers.items():
        if name not in HEADERS:
            raise ConfigError(f"{where}: http_server_config.headers: {name!r} cannot be configured; "
                              f"allowed: {', '.join(HEADERS)}")
        if not isinstance(text, str) or any(c in text for c in "\r\n"):
            raise ConfigError(f"{where}: http_server_config.headers.{name} must be a one-line string")
        allowed = HEADERS[name]
        if allowed is not None and text not in allowed:
            raise ConfigError(f"{where}: http_server_config.headers.{name} must be one of "
                              f"{', '.join(allowed)}; got {text!r}")
        result.append((name, text))
    return tuple(result), http2


# -- reloading -------------------------------------------------------------------------------------

def _signature(files: tuple[str, ...]) -> tuple[Any, ...]:
    result: list[tuple[Any, ...]] = []
    for name in files:
        try:
            st = os.stat(name)
            result.append((name, st.st_mtime_ns, st.st_size, st.st_ino, st.st_dev))
        except OSError:
            result.append((name, None))
    return tuple(result)


class WebConfigSource:
    """The web configuration in effect, re-read when its file or a file it names changes.

    ``current()`` is called for every connection and request: it costs one stat() per file. A new
    version that does not load is logged once and the previous one stays in effect; TLS cannot be
    switched on or off without a restart (the listeners' scheme is fixed at start).
    """

    def __init__(self, config: WebConfig) -> None:
        self._config = config
        self._signature = _signature(config.files())
        self._refused: tuple[Any, ...] | None = None
        self._lock = threading.Lock()

    def current(self) -> WebConfig:
        config = self._config
        if config.path is None:
            return config
        signature = _signature(config.files())
        if signature == self._signature or signature == self._refused:
            return config
        with self._lock:
            if self._config is not config:  # another thread reloaded meanwhile
                return self._config
            try:
                new = load(config.path)
                if (new.tls is None) != (config.tls is None):
                    raise ConfigError(f"web config file {config.path}: TLS cannot be switched "
                                      f"{'on' if new.tls else 'off'} while gpuwatch runs")
            except Exception as exc:  # ConfigError; anything else is a gpuwatch bug, and the old config still works
                if signature != self._refused:
                    self._refused = signature
                    error = str(exc) if isinstance(exc, ConfigError) else f"{type(exc).__name__}: {exc}"
                    logs.get_logger(component="http").error(
                        "web_config_reload_failed", error=error,
                        hint="the previous web configuration stays in effect; fix the file, or restart gpuwatch "
                             "for a TLS change")
                return config
            self._config, self._signature, self._refused = new, _signature(new.files()), None
            logs.get_logger(component="http").info("web_config_reloaded", path=new.path, tls=new.tls is not None,
                                                   users=len(new.users))
            return new
