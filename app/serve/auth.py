"""Bearer tokens for `eft serve`: where the token comes from, who may listen without one, and the
check every request goes through.

The token is read once, in the command's process, from `--token-file` or `EFT_SERVE_TOKEN`. It is
never logged, printed or stored: the replicas are given its SHA-256 digest (Serve keeps a
deployment's arguments in its controller's checkpoint), and compare the digest of what a request
presents with `hmac.compare_digest`, whose time does not depend on where the two differ.

Serve's HTTP proxy belongs to the cluster: `check_proxy_address` holds the address it really
listens on (a Serve started earlier keeps its own) to check_bind's rule before a model is deployed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
from pathlib import Path
from typing import Optional

from app.config import ConfigError

log = logging.getLogger("eft.serve")

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


def check_proxy_address(host: str, port: Optional[int], actual: tuple[str, int], token: Optional[str]) -> None:
    """Serve's HTTP proxy is the cluster's, started once: a Serve already running keeps its own
    address whatever `eft serve` asks. Deploying onto one that listens wider than asked would put
    the model there without the token check_bind demands, so its real address passes the same rule
    (a token, or loopback); one on another port would not answer at the URL asked for. `port`
    None: any port."""
    actual_host, actual_port = actual
    asked = f"{host}:{port}" if port is not None else host
    if port is not None and actual_port != port:
        raise ServeAuthError(f"Serve already runs on this Ray cluster at {actual_host}:{actual_port}, not {asked} as "
                             f"asked (a running Serve keeps its address): ask for that address, or stop it "
                             f"(`serve shutdown`)")
    if actual_host != host and not is_loopback(actual_host) and token is None:
        raise ServeAuthError(f"Serve already runs on this Ray cluster at {actual_host}:{actual_port}, beyond this "
                             f"machine, not {asked} as asked: the model would answer there without a token; give "
                             f"one (--token-file FILE or {TOKEN_ENV}), or stop that Serve (`serve shutdown`)")
    if actual_host != host:
        log.warning("Serve already runs on this Ray cluster at %s:%d (not %s as asked): serving there",
                    actual_host, actual_port, asked)


def warn_token_in_clear(host: str, token: Optional[str]) -> None:
    """Serve's proxy speaks plain HTTP: beyond loopback every request's token crosses the network
    readable. Said once per start; TLS belongs in a gateway in front (docs/serving.md)."""
    if token is not None and not is_loopback(host):
        log.warning("the bearer token travels over plain HTTP to %s: anyone on the path can read it; put a "
                    "TLS gateway in front (docs/serving.md)", host)


def token_digest(token: Optional[str]) -> Optional[bytes]:
    return None if token is None else hashlib.sha256(token.encode()).digest()


def is_token_valid(presented: Optional[str], digest: Optional[bytes]) -> bool:
    """Whether a presented bearer token passes: anything when no token is set, else the token."""
    if digest is None:
        return True
    if not presented or not presented.strip():
        return False
    return hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), digest)
