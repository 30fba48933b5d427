"""Fault injection for development and tests: proxies that sit in front of the local S3
endpoint and misbehave on demand, so a run can be tried against an outage or a throttling
store the way a user would meet one (the code under test sees a real network error or a real
S3 error response, through pyarrow / boto3, not a patched function).

- `TcpProxy`: bytes both ways; `refuse_for(s)` resets every open connection and refuses new
  ones (the port stops listening) for `s` seconds, or until `restore()`.
- `SlowDownProxy`: an HTTP/1.1 proxy that answers `503 SlowDown` (S3's XML error body) to a
  seeded fraction of requests and forwards the rest; it logs each request (method, path, body bytes, status).
- `slow_validation`: an evaluation of a checkpoint that first waits (without using a CPU), for
  `run_training(..., validation_fn=functools.partial(slow_validation, delay_s=...))`.
"""

from __future__ import annotations

import http.client
import http.server
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlparse


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    parsed = urlparse(endpoint if "://" in endpoint else f"http://{endpoint}")
    return parsed.hostname or "127.0.0.1", parsed.port or 80


def _reset(sock: socket.socket) -> None:
    """Close with an RST, as a dropped connection looks to the peer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass


class TcpProxy:
    """127.0.0.1:<port> → upstream, one pair of pump threads per connection."""

    def __init__(self, upstream: str, port: int = 0):
        self.upstream = _split_endpoint(upstream)
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._refusing_until = 0.0
        self._stopped = False
        self._listener = self._listen(port)
        self.port = self._listener.getsockname()[1]
        self._acceptor: Optional[threading.Thread] = None
        self.refusals = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _listen(self, port: int) -> socket.socket:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(64)
        return sock

    def start(self) -> "TcpProxy":
        self._acceptor = threading.Thread(target=self._accept, name="eft-tcp-proxy", daemon=True)
        self._acceptor.start()
        return self

    def __enter__(self) -> "TcpProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        with self._lock:
            self._stopped = True
        self._drop_everything()

    def refuse_for(self, seconds: float) -> None:
        """Drop every connection now and refuse new ones (nothing listens) for `seconds`."""
        with self._lock:
            self._refusing_until = time.monotonic() + seconds
            self.refusals += 1
        self._drop_everything()

    def _drop_everything(self) -> None:
        with self._lock:
            listener, self._listener = self._listener, None
            conns, self._open = list(self._open), set()
        if listener is not None:
            # shutdown wakes the acceptor blocked in accept(); close alone does not on Linux.
            try:
                listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            listener.close()
        for sock in conns:
            _reset(sock)

    def restore(self) -> None:
        """End an outage now."""
        with self._lock:
            self._refusing_until = 0.0

    def _accept(self) -> None:
        while True:
            with self._lock:
                if self._stopped:
                    return
                listener = self._listener
                if listener is None and time.monotonic() >= self._refusing_until:
                    listener = self._listener = self._listen(self.port)
            if listener is None:
                time.sleep(0.05)
                continue
            try:
                client, _ = listener.accept()
            except OSError:
                continue
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=10)
        except OSError:
            _reset(client)
            return
        upstream.settimeout(None)
        with self._lock:
            if self._listener is None:  # an outage began while this one connected
                _reset(client)
                _reset(upstream)
                return
            self._open.update((client, upstream))
        threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()
        self._pump(client, upstream)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src)
                self._open.discard(dst)
            for sock in (src, dst):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()


SLOW_DOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                  b'<Message>Please reduce your request rate.</Message><RequestId>eft-fault</RequestId></Error>')
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade"}


@dataclass
class RequestLog:
    """What went through a `SlowDownProxy`: (method, path, request body bytes, status)."""
    entries: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, method: str, path: str, sent: int, status: int) -> None:
        with self.lock:
            self.entries.append((method, path, sent, status))

    def count(self, status: Optional[int] = None) -> int:
        with self.lock:
            return sum(1 for e in self.entries if status is None or e[3] == status)


class SlowDownProxy:
    """HTTP proxy in front of an S3 endpoint: `503 SlowDown` to a seeded `fraction` of requests
    (decided before the request is forwarded, so the store never sees it), the rest forwarded."""

    def __init__(self, upstream: str, fraction: float = 0.1, seed: int = 0, port: int = 0):
        self.upstream = _split_endpoint(upstream)
        self.fraction = fraction
        self.log = RequestLog()
        self._random = random.Random(seed)
        self._random_lock = threading.Lock()
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    out = bytearray()
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return bytes(out)
                        out += self.rfile.read(size)
                        self.rfile.readline()
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                if proxy._throttle():
                    proxy.log.add(self.command, self.path, len(body), 503)
                    self.send_response(503, "Slow Down")
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOW_DOWN_BODY)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOW_DOWN_BODY)
                    return
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_BY_HOP}
                if body or self.command in ("PUT", "POST"):
                    headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection(*proxy.upstream, timeout=60)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    proxy.log.add(self.command, self.path, len(body), resp.status)
                    self.send_response(resp.status, resp.reason)
                    for key, value in resp.getheaders():
                        if key.lower() not in HOP_BY_HOP and key.lower() != "content-length":
                            self.send_header(key, value)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                    self.send_header("Content-Length", length or "0")
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread: Optional[threading.Thread] = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _throttle(self) -> bool:
        with self._random_lock:
            return self._random.random() < self.fraction

    def start(self) -> "SlowDownProxy":
        self._thread = threading.Thread(target=self._server.serve_forever, name="eft-slowdown-proxy", daemon=True)
        self._thread.start()
        return self

    def __enter__(self) -> "SlowDownProxy":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def slow_validation(checkpoint, cfg: dict, mlflow: Optional[dict] = None, delay_s: float = 0.0) -> dict:
    """A planted slow evaluation: sleeps `delay_s`, then scores the checkpoint as usual."""
    from app.eval.during import validate_checkpoint

    time.sleep(delay_s)
    return validate_checkpoint(checkpoint, cfg, mlflow)


class ExitOnce:
    """Mixin for a Ray Data callable class (`type("X", (ExitOnce, Scorer), {"marker": path})`): the
    first call in any process makes that process exit at once, as an actor does when its node is
    reclaimed; one exit per `marker`, a file the exit creates, so the pass can then finish."""

    marker: str

    def __call__(self, batch):
        import os

        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return super().__call__(batch)
        os._exit(1)
