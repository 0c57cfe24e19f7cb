"""The client side, for `gpuwatch check`: ask the local daemon over what it serves (TLS, mTLS, basic auth)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from gpuwatch.web.auth import basic_header
from gpuwatch.web.config import TlsServerConfig, WebConfig

if TYPE_CHECKING:
    import http.client

# -- the client side, for `gpuwatch check` ------------------------------------------------------------

class LocalRequestError(OSError):
    """The local daemon could not be asked; the message says why and what to set."""


def read_secret(path: str) -> str:
    """The first line of a password file, without its line ending."""
    text = Path(path).read_text(encoding="utf-8", errors="surrogateescape")  # any bytes, as the server reads them
    return text.splitlines()[0] if text else ""


def _leaf_der(cert_file: str) -> bytes:
    import ssl

    text = Path(cert_file).read_text(encoding="ascii", errors="replace")
    start = text.index("-----BEGIN CERTIFICATE-----")
    end = text.index("-----END CERTIFICATE-----", start) + len("-----END CERTIFICATE-----")
    return ssl.PEM_cert_to_DER_cert(text[start:end])


def local_get(host: str, port: int, path: str, config: WebConfig | None, *, username: str | None = None,
              password: str | None = None, client_cert: str | None = None, client_key: str | None = None,
              timeout: float = 5.0) -> tuple[int, bytes]:
    """GET ``path`` from the gpuwatch daemon on this node, speaking what ``config`` makes it serve.

    With TLS the daemon must present exactly the certificate in tls_server_config.cert_file (pinned:
    no CA or host name is involved, so 127.0.0.1 works); credentials are sent only after that check.
    A client certificate is presented when ``client_cert`` is given. Returns (status, body); raises
    LocalRequestError (an OSError) when there is no answer, its message saying why, without the URL.
    """
    import http.client  # here: the daemon, which never asks, does not load OpenSSL for it
    import ssl

    headers = {"Accept": "application/json", "Connection": "close"}
    if username is not None:
        headers["Authorization"] = basic_header(username, password or "")
    tls = config.tls if config is not None else None
    connection: http.client.HTTPConnection
    if tls is None:
        connection = http.client.HTTPConnection(host, port, timeout=timeout)
    else:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE  # replaced by the pin below
        if client_cert:
            try:
                context.load_cert_chain(client_cert, client_key or None, password=lambda: b"")
            except (ssl.SSLError, OSError) as exc:
                raise LocalRequestError(f"cannot use client certificate {client_cert}: "
                                        f"{getattr(exc, 'reason', None) or exc}") from None
        connection = http.client.HTTPSConnection(host, port, timeout=timeout, context=context)
    try:
        try:
            connection.connect()
        except ssl.SSLError as exc:
            raise LocalRequestError(f"TLS handshake failed: {exc.reason or exc}"
                                    f"{_client_cert_hint(tls, client_cert)}") from None
        if tls is not None:
            sock = connection.sock
            assert isinstance(sock, ssl.SSLSocket)
            if sock.getpeercert(binary_form=True) != _leaf_der(tls.cert_file):
                raise LocalRequestError(f"the server does not present the certificate in tls_server_config.cert_file "
                                        f"({tls.cert_file}): another program listens there, or the file changed")
        connection.request("GET", path, headers=headers)
        response = connection.getresponse()
        return response.status, response.read()
    except LocalRequestError:
        raise
    except ssl.SSLError as exc:
        raise LocalRequestError(f"TLS error: {exc.reason or exc}{_client_cert_hint(tls, client_cert)}") from None
    except (OSError, http.client.HTTPException) as exc:
        reason = str(exc) or type(exc).__name__
        raise LocalRequestError(f"{reason}{_client_cert_hint(tls, client_cert)}") from None
    finally:
        connection.close()


def _client_cert_hint(tls: TlsServerConfig | None, client_cert: str | None) -> str:
    if tls is not None and tls.requires_client_cert and not client_cert:
        return (" (the daemon requires a client certificate: set --check.client-cert-file and "
                "--check.client-key-file)")
    return ""
