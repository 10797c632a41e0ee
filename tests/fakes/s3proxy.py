"""A fault-injecting HTTP proxy in front of the local S3 server, for corruption and reset tests.

It forwards every request unchanged (so SigV4 signatures stay valid: the client signs the Host
it talks to, and boto3 is pointed at the proxy with path-style addressing, which the server
accepts for any host) and can, for GET responses of a chosen key, flip one byte at an absolute
object offset, cut the connection after some bytes, refuse the request with a status (503
SlowDown with Retry-After, as S3 throttles), answer a ranged GET with 200 (as a server that ignores
Range; the body is what the server sent, the status and the missing Content-Range are the lie), or
trickle the body a few bytes at a time.

Given the session CA (``S3FaultProxy(upstream, test_ca)``) it speaks HTTPS itself, as ``role``'s
test host name (``s3.prefetch.test`` by default); it talks to an ``https://`` upstream over TLS
trusting the same CA, to an ``http://`` one in plain HTTP.
"""

from __future__ import annotations

import http.client
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import urlsplit

from ..tls import TestCA
from .tlsserver import TLSThreadingHTTPServer

_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+)")


@dataclass
class Faults:
    flip_key: str | None = None  # object key (path after the bucket) whose bytes get corrupted
    flip_offset: int = 0  # absolute offset of the byte to flip
    flip_times: int = 1 << 30  # how many responses to corrupt
    cut_key: str | None = None  # object key whose responses are cut short
    cut_after: int = 1024  # bytes sent before the connection is dropped
    cut_times: int = 0  # how many responses to cut
    throttle_bps: float = 0  # >0: send GET bodies at most this fast (per connection)
    refuse_key: str | None = None  # object key whose GETs are refused ...
    refuse_status: int = 503  # ... with this status (an S3 error body, code SlowDown or other)
    refuse_retry_after: str | None = None  # Retry-After header value, if any
    refuse_times: int = 0  # how many GETs to refuse
    refuse_statuses: tuple[int, ...] = ()  # when set: the n-th refusal's status, cycling
    ignore_range_key: str | None = None  # object key whose ranged GETs are answered 200
    ignore_range_times: int = 0  # how many (1 << 30: for ever)
    trickle_key: str | None = None  # object key whose GET bodies trickle ...
    trickle: tuple[int, float] = (512, 0.1)  # ... n bytes every t seconds
    trickle_times: int = 0  # how many responses (longer than n bytes) trickle
    lock: threading.Lock = field(default_factory=threading.Lock)


class S3FaultProxy:
    def __init__(
        self,
        upstream: str,
        ca: TestCA | None = None,
        role: str = "s3",
        gate: Callable[[str, str], tuple[int, bytes] | None] | None = None,
    ) -> None:
        self.upstream = urlsplit(upstream)
        #: (method, path with query) -> an answer (status, JSON body) given instead of the
        #: upstream's, or None to forward: what an emulator lacks (tests/fakes/gcs.py)
        self.gate = gate
        self.ca = ca
        self.faults = Faults()
        self.gets: list[str] = []
        #: (key, Range header or None) of every GET, in order
        self.get_ranges: list[tuple[str, str | None]] = []
        #: (method, key, query string) of every request, in order
        self.requests: list[tuple[str, str, str]] = []
        self._refusals = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                key = self.path.split("?", 1)[0].split("/", 2)[-1]
                query = self.path.split("?", 1)[1] if "?" in self.path else ""
                proxy.requests.append((self.command, key, query))
                gated = proxy.gate(self.command, self.path) if proxy.gate else None
                if gated is not None:
                    self._gated(*gated)
                    return
                if self.command == "GET":
                    ranged = self.headers.get("Range") or self.headers.get("x-ms-range")
                    proxy.get_ranges.append((key, ranged))  # (x-ms-range: Azure's)
                    refusal = proxy._refusal(key)
                    if refusal is not None:
                        self._refuse(*refusal)
                        return
                up = proxy._upstream_connection()
                headers = {k: v for k, v in self.headers.items()}
                up.request(self.command, self.path, body=body, headers=headers)
                resp = up.getresponse()
                if self.command == "GET":
                    proxy.gets.append(self.path)
                status = resp.status
                drop = {"connection", "transfer-encoding"}
                if status == 206 and proxy._take(key, "ignore_range_key", "ignore_range_times"):
                    status = 200
                    drop.add("content-range")
                self.send_response_only(status, resp.reason if status == resp.status else "OK")
                for k, v in resp.getheaders():
                    if k.lower() not in drop:
                        self.send_header(k, v)
                data = resp.read()
                if resp.getheader("Content-Length") is None and self.command != "HEAD":
                    # a chunked answer (Azurite's listings) is sent whole: say its length
                    self.send_header("Content-Length", str(len(data)))
                self.send_header("Connection", "keep-alive")
                self.end_headers()
                if self.command == "HEAD":
                    up.close()
                    return
                start = 0
                m = _RANGE.match(resp.getheader("Content-Range") or "")
                if m:
                    start = int(m.group(1))
                data = proxy._maybe_flip(key, start, data, resp.status)
                if proxy._should_cut(key, resp.status):
                    self.wfile.write(data[: proxy.faults.cut_after])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.close_connection = True
                elif len(data) > proxy.faults.trickle[0] and proxy._take(
                    key, "trickle_key", "trickle_times"
                ):  # a body of one piece would not trickle: the next answer does
                    self._trickle(data, *proxy.faults.trickle)
                elif proxy.faults.throttle_bps > 0:
                    piece = 64 * 1024
                    for off in range(0, len(data), piece):
                        self.wfile.write(data[off : off + piece])
                        time.sleep(piece / proxy.faults.throttle_bps)
                else:
                    self.wfile.write(data)
                up.close()

            def _refuse(self, status: int, retry_after: str | None) -> None:
                code = "SlowDown" if status == 503 else "InternalError"
                body = f"<Error><Code>{code}</Code><Message>injected</Message></Error>".encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                if retry_after is not None:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(body)

            def _gated(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _trickle(self, data: bytes, n: int, interval: float) -> None:
                try:
                    for off in range(0, len(data), n):
                        self.wfile.write(data[off : off + n])
                        self.wfile.flush()
                        time.sleep(interval)
                except OSError:
                    self.close_connection = True  # the client gave up on the trickle

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        context = None if ca is None else ca.server_context()
        self._server = TLSThreadingHTTPServer(("127.0.0.1", 0), Handler, context)
        port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{port}" if ca is None else ca.url(port, role)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def handshakes(self) -> int:
        """TLS handshakes the proxy completed with its clients (over HTTPS)."""
        return self._server.handshakes

    @property
    def accepted(self) -> int:
        """Connections the proxy accepted from its clients."""
        return self._server.accepted

    def _upstream_connection(self) -> http.client.HTTPConnection:
        host, port = self.upstream.hostname, self.upstream.port
        if self.upstream.scheme == "https":
            context = self.ca.client_context() if self.ca else ssl.create_default_context()
            return http.client.HTTPSConnection(host, port, timeout=60, context=context)
        return http.client.HTTPConnection(host, port, timeout=60)

    def _maybe_flip(self, key: str, start: int, data: bytes, status: int) -> bytes:
        f = self.faults
        with f.lock:
            if f.flip_key != key or status not in (200, 206) or f.flip_times <= 0:
                return data
            rel = f.flip_offset - start
            if not 0 <= rel < len(data):
                return data
            f.flip_times -= 1
        out = bytearray(data)
        out[rel] ^= 0xFF
        return bytes(out)

    def _take(self, key: str, key_field: str, times_field: str) -> bool:
        """Use up one of a keyed fault's applications, if it applies to ``key``."""
        f = self.faults
        with f.lock:
            if getattr(f, key_field) != key or getattr(f, times_field) <= 0:
                return False
            setattr(f, times_field, getattr(f, times_field) - 1)
            return True

    def _refusal(self, key: str) -> tuple[int, str | None] | None:
        if not self._take(key, "refuse_key", "refuse_times"):
            return None
        statuses = self.faults.refuse_statuses or (self.faults.refuse_status,)
        with self.faults.lock:
            status = statuses[self._refusals % len(statuses)]
            self._refusals += 1
        return status, self.faults.refuse_retry_after

    def _should_cut(self, key: str, status: int) -> bool:
        f = self.faults
        with f.lock:
            if f.cut_key == key and status in (200, 206) and f.cut_times > 0:
                f.cut_times -= 1
                return True
        return False

    def __enter__(self) -> S3FaultProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
