"""Bearer tokens for `eft serve`: where the token comes from, who may listen without one, and the
check every request goes through.

The token is read once, in the command's process, from `--token-file` or `EFT_SERVE_TOKEN`. It is
never logged, printed or stored: the replicas are given its SHA-256 digest (Serve keeps a
deployment's arguments in its controller's checkpoint), and compare the digest of what a request
presents with `hmac.compare_digest`, whose time does not depend on where the two differ.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from pathlib import Path
from typing import Optional

from app.config import ConfigError

TOKEN_ENV = "EFT_SERVE_TOKEN"
# A token is a shared secret: one short enough to guess is no check at all.
MIN_TOKEN_CHARS = 16
LOOPBACK_NAMES = ("localhost",)


class ServeAuthError(ConfigError):
    """A token or bind address `eft serve` refuses; one line naming the flag or variable (a usage
    error, exit 2, as a bad config key is)."""


def read_token(token_file: Optional[str] = None, environ: Optional[dict] = None) -> Optional[str]:
    """The bearer token from `token_file` (first line, whitespace stripped), else from
    EFT_SERVE_TOKEN; None when neither is given."""
    environ = os.environ if environ is None else environ
    if token_file:
        path = Path(token_file)
        if not path.is_file():
            raise ServeAuthError(f"--token-file {token_file}: no such file")
        lines = path.read_text().strip().splitlines()
        token, where = (lines[0].strip() if lines else ""), f"--token-file {token_file}"
    elif environ.get(TOKEN_ENV) is not None:
        token, where = environ[TOKEN_ENV].strip(), TOKEN_ENV
    else:
        return None
    if len(token) < MIN_TOKEN_CHARS:
        what = "empty" if not token else f"shorter than {MIN_TOKEN_CHARS} characters"
        raise ServeAuthError(f"{where}: the token is {what}; use a long random one (e.g. `openssl rand -hex 32`)")
    return token


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to any interface


def check_bind(host: str, token: Optional[str]) -> None:
    """Listening beyond this machine needs a token: anyone who reaches the port could otherwise
    use the model (and the cluster's CPUs or GPUs behind it)."""
    if not is_loopback(host) and token is None:
        raise ServeAuthError(f"--host {host} listens beyond this machine: give the bearer token every request "
                             f"must carry (--token-file FILE or {TOKEN_ENV}), or serve on 127.0.0.1")


def token_digest(token: Optional[str]) -> Optional[bytes]:
    return None if token is None else hashlib.sha256(token.encode()).digest()


def is_authorized(authorization: Optional[str], digest: Optional[bytes]) -> bool:
    """Whether an `Authorization` header value passes: anything when no token is set, else exactly
    `Bearer <token>`."""
    if digest is None:
        return True
    scheme, _, presented = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        return False
    return hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), digest)
