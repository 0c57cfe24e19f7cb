"""Basic auth against the web config's bcrypt hashes, with a cache of successes (a cost-10 hash takes ~70 ms)."""

from __future__ import annotations

import base64
import threading
from collections import OrderedDict
from collections.abc import Mapping

from gpuwatch.web.config import BCRYPT_MAX, DUMMY_HASH

# -- basic auth ------------------------------------------------------------------------------------

class Authenticator:
    """Checks ``Authorization: Basic`` credentials against bcrypt hashes, caching the successes.

    The cache holds SHA-256 digests of (user, hash, password) of recent successes only, bounded in
    size: a wrong password always pays the full bcrypt cost, a changed hash (reload) misses the cache.
    """

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._ok: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def verify(self, users: Mapping[str, str], header: str | None) -> str | None:
        """The user name when ``header`` carries valid credentials for one of ``users``, else None."""
        credentials = parse_basic(header)
        if credentials is None:
            return None
        user, password = credentials
        hashed = users.get(user)
        secret = password.encode("utf-8", "surrogateescape")[:BCRYPT_MAX]
        import hashlib  # here, as bcrypt below: a node without basic auth never loads OpenSSL's libcrypto

        key = hashlib.sha256(b"\0".join([user.encode("utf-8", "surrogateescape"), (hashed or "").encode(),
                                         secret])).digest()
        if hashed is not None:
            with self._lock:
                if key in self._ok:
                    self._ok.move_to_end(key)
                    return user
        import bcrypt  # at the first request with credentials: a node without basic auth never loads it

        try:
            ok = bcrypt.checkpw(secret, hashed.encode() if hashed is not None else DUMMY_HASH)
        except ValueError:
            ok = False
        if not ok or hashed is None:
            return None
        with self._lock:
            self._ok[key] = None
            while len(self._ok) > self._size:
                self._ok.popitem(last=False)
        return user


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """(user, password) from an ``Authorization: Basic ...`` header value, None when absent or malformed."""
    if not header:
        return None
    scheme, _, token = header.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True).decode("utf-8", "surrogateescape")
    except ValueError:
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


def basic_header(user: str, password: str) -> str:
    # surrogateescape: argv's bytes that are not UTF-8 go out as those bytes (parse_basic reads them back alike)
    return "Basic " + base64.b64encode(f"{user}:{password}".encode("utf-8", "surrogateescape")).decode()


def hash_password(password: str, cost: int = 10) -> str:
    """A bcrypt hash for basic_auth_users (what `htpasswd -nBC 10` writes, with the $2b$ prefix)."""
    import bcrypt

    return bcrypt.hashpw(password.encode()[:BCRYPT_MAX], bcrypt.gensalt(cost)).decode()
