"""The web parts: the web configuration file (TLS, mTLS, basic auth; node_exporter's format), the HTTP
servers and the WSGI app, and the client side that `gpuwatch check` uses (docs/security.md)."""

from gpuwatch.web.app import STATUS_PATH, App
from gpuwatch.web.auth import Authenticator, basic_header, hash_password, parse_basic
from gpuwatch.web.client import LocalRequestError, local_get, read_secret
from gpuwatch.web.config import REALM, TlsServerConfig, WebConfig, WebConfigSource, load, server_context
from gpuwatch.web.server import Guard, HttpServers

__all__ = ["REALM", "STATUS_PATH", "App", "Authenticator", "Guard", "HttpServers", "LocalRequestError",
           "TlsServerConfig", "WebConfig", "WebConfigSource", "basic_header", "hash_password", "load", "local_get",
           "parse_basic", "read_secret", "server_context"]
