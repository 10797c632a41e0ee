"""A forward HTTP proxy on 127.0.0.1 that counts what passes through it, per target host.

What a caching or peer-to-peer proxy (Dragonfly's dfdaemon, squid) looks like to a client:

* **absolute-form requests** (``GET http://host:port/path HTTP/1.1``) for ``http://`` targets:
  forwarded on a connection to the target (reused per client connection and target), the answer
  streamed back; the client connection is kept alive between requests;
* **CONNECT host:port**: a TCP tunnel (what a client does for ``https://`` targets: the TLS
  session runs end to end, client to target, inside it), relayed byte for byte in both
  directions until either side closes.

``ForwardProxy.requests`` counts requests (a tunnel counts once) per ``host:port``,
``ForwardProxy.tunneled`` the bytes each target sent back through tunnels (what the proxy can
know of HTTPS traffic: it sees no requests in it); ``url`` is the proxy's own address for
``HTTP(S)_PROXY``, plain ``http://`` as most corporate proxies are. A request that is neither
(an origin-form path) is answered 400, so a client that talks to the proxy as if it were the
server is caught.

Usage::

    with ForwardProxy() as proxy:
        env["HTTPS_PROXY"] = env["HTTP_PROXY"] = proxy.url
        ...
        assert proxy.requests[f"127.0.0.1:{port}"] > 0
"""

from __future__ import annotations

import collections
import http.client
import select
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

#: Headers about one hop (RFC 9110 7.6.1), never forwarded.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
_COPY = 1024 * 1024


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _ProxyServer

    def setup(self) -> None:
        super().setup()
        self._upstreams: dict[str, http.client.HTTPConnection] = {}

    def finish(self) -> None:
        for conn in self._upstreams.values():
            conn.close()
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # -- absolute-form requests ------------------------------------------------------------

    def _forward(self) -> None:
        target = urlsplit(self.path)
        if target.scheme != "http" or not target.hostname:
            self._refuse(400, f"not an absolute http:// request: {self.path[:100]}")
            return
        host = f"{target.hostname}:{target.port or 80}"
        self.server.proxy.count(host, self.command)
        body = self._request_body()
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP_BY_HOP}
        path = target.path or "/"
        if target.query:
            path += "?" + target.query
        try:
            resp = self._send_upstream(host, path, body, headers)
        except OSError as exc:
            self._refuse(502, f"cannot reach {host}: {exc}")
            return
        self._relay_response(resp)

    def _request_body(self) -> bytes | None:
        length = self.headers.get("Content-Length")
        if length is not None:
            return self.rfile.read(int(length))
        if "chunked" in (self.headers.get("Transfer-Encoding") or "").lower():
            return self._read_chunked()
        return None

    def _read_chunked(self) -> bytes:
        parts = []
        while True:
            size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            parts.append(self.rfile.read(size))
            self.rfile.readline()

    def _send_upstream(
        self, host: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> http.client.HTTPResponse:
        """The target's answer, on this client connection's connection to ``host`` (opened
        again once if the target had closed it)."""
        for attempt in (1, 2):
            conn = self._upstreams.get(host)
            if conn is None:
                name, port = host.rsplit(":", 1)
                conn = self._upstreams[host] = http.client.HTTPConnection(name, int(port), 60)
            try:
                conn.request(self.command, path, body=body, headers=headers)
                return conn.getresponse()
            except (ConnectionError, http.client.HTTPException):
                conn.close()
                del self._upstreams[host]
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    def _relay_response(self, resp: http.client.HTTPResponse) -> None:
        self.send_response_only(resp.status, resp.reason)
        length = resp.getheader("Content-Length")
        chunked = self.command != "HEAD" and length is None and resp.status not in (204, 304)
        for name, value in resp.getheaders():
            if name.lower() not in _HOP_BY_HOP:
                self.send_header(name, value)
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        if self.command == "HEAD":
            resp.read()
            return
        while True:
            data = resp.read1(_COPY) if chunked else resp.read(_COPY)
            if not data:
                break
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
        if chunked:
            self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _refuse(self, status: int, message: str) -> None:
        body = message.encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward

    # -- CONNECT tunnels -------------------------------------------------------------------

    def do_CONNECT(self) -> None:
        host, _, port = self.path.rpartition(":")
        if not host or not port.isdigit():
            self._refuse(400, f"CONNECT needs host:port, got {self.path[:100]}")
            return
        self.server.proxy.count(f"{host.strip('[]')}:{port}", "CONNECT")
        try:
            upstream = socket.create_connection((host.strip("[]"), int(port)), timeout=60)
        except OSError as exc:
            self._refuse(502, f"cannot reach {self.path}: {exc}")
            return
        self.send_response_only(200, "Connection established")
        self.end_headers()
        self.wfile.flush()
        target = f"{host.strip('[]')}:{port}"
        try:
            _relay(self.connection, upstream, lambda n: self.server.proxy.add_tunneled(target, n))
        finally:
            upstream.close()
            self.close_connection = True


def _relay(a: socket.socket, b: socket.socket, from_b: Callable[[int], None]) -> None:
    """Copy bytes both ways between two sockets until one side closes; ``from_b`` is told how
    many bytes each read from ``b`` carried."""
    peers = {a: b, b: a}
    while True:
        readable, _, _ = select.select(list(peers), [], [], 60)
        if not readable:
            return
        for sock in readable:
            try:
                data = sock.recv(_COPY)
            except OSError:
                return
            if not data:
                return
            peers[sock].sendall(data)
            if sock is b:
                from_b(len(data))


class _ProxyServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, proxy: ForwardProxy) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.proxy = proxy


class ForwardProxy:
    """The proxy on an ephemeral 127.0.0.1 port, in a thread. A context manager."""

    def __init__(self) -> None:
        self.requests: collections.Counter[str] = collections.Counter()
        self.methods: collections.Counter[str] = collections.Counter()
        #: bytes relayed from each target (``host:port``) back to clients through tunnels
        self.tunneled: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._server = _ProxyServer(self)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="forward-proxy", daemon=True
        )

    def count(self, host: str, method: str) -> None:
        with self._lock:
            self.requests[host] += 1
            self.methods[method] += 1

    def add_tunneled(self, host: str, size: int) -> None:
        with self._lock:
            self.tunneled[host] += size

    def through(self, url: str) -> int:
        """How many requests (or tunnels) went to the host and port of ``url``."""
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        with self._lock:
            return self.requests[f"{parts.hostname}:{port}"]

    def start(self) -> ForwardProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def __enter__(self) -> ForwardProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
