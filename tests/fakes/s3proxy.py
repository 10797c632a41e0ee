"""A fault-injecting HTTP proxy in front of the local S3 server, for corruption and reset tests.

It forwards every request unchanged (so SigV4 signatures stay valid: the client signs the Host
it talks to, and boto3 is pointed at the proxy with path-style addressing, which the server
accepts for any host) and can, for GET responses of a chosen key, flip one byte at an absolute
object offset or cut the connection after some bytes.
"""

from __future__ import annotations

import http.client
import re
import socket
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

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
    lock: threading.Lock = field(default_factory=threading.Lock)


class S3FaultProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.faults = Faults()
        self.gets: list[str] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _forward(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                up = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=60
                )
                headers = {k: v for k, v in self.headers.items()}
                up.request(self.command, self.path, body=body, headers=headers)
                resp = up.getresponse()
                key = self.path.split("?", 1)[0].split("/", 2)[-1]
                if self.command == "GET":
                    proxy.gets.append(self.path)
                self.send_response_only(resp.status, resp.reason)
                for k, v in resp.getheaders():
                    if k.lower() not in ("connection", "transfer-encoding"):
                        self.send_header(k, v)
                data = resp.read()
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
                elif proxy.faults.throttle_bps > 0:
                    piece = 64 * 1024
                    for off in range(0, len(data), piece):
                        self.wfile.write(data[off : off + piece])
                        time.sleep(piece / proxy.faults.throttle_bps)
                else:
                    self.wfile.write(data)
                up.close()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

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
