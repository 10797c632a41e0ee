"""One TLS context per pool (issue 33): the HTTPS connections of a pool share one SSLContext,
the CA bundle loaded into it once (urllib3 built a context and loaded the bundle for every
connection: ~30 ms of CPU each with a public store's size), built on the first HTTPS connection
only; verification as strict as before (a wrong CA, a wrong host name refused), and a bundle
changed on disk trusted by the next connection (a long-lived agent, a rotated bundle)."""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trustme
import urllib3

from prefetch.sources.http.tls_trust import TlsTrust, tls_context
from prefetch.sources.http.transport import (
    HttpClient,
    make_http_pool,
    send,
    watched_pools,
)
from prefetch.support import settings
from prefetch.support.errors import TlsError

from .fakes.forward_proxy import ForwardProxy, _relay
from .tls import TestCA

CONNECTIONS = 8


class _Hello(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        body = b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def _serve(context: ssl.SSLContext | None) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hello)
    server.daemon_threads = True
    if context is not None:
        server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def https_port(test_ca: TestCA) -> Iterator[int]:
    yield from _serve(test_ca.server_context())


@pytest.fixture
def http_port() -> Iterator[int]:
    yield from _serve(None)


def _contexts_of_concurrent_connections(pool: HttpClient, url: str) -> list[ssl.SSLContext]:
    """The SSL contexts of ``CONNECTIONS`` connections open at once on ``pool`` (each request
    holds its connection until all have their answer)."""
    all_answered = threading.Barrier(CONNECTIONS)

    def one(_: int) -> ssl.SSLContext:
        resp = pool.request("GET", url, preload_content=False, retries=False)
        try:
            assert resp.status == 200
            all_answered.wait(30)
            conn = resp.connection
            assert conn is not None and isinstance(conn.sock, ssl.SSLSocket)
            return conn.sock.context
        finally:
            resp.drain_conn()
            resp.release_conn()

    with ThreadPoolExecutor(CONNECTIONS) as workers:
        return list(workers.map(one, range(CONNECTIONS)))


def test_concurrent_connections_of_a_pool_share_one_context(
    https_port: int, test_ca: TestCA
) -> None:
    pool = make_http_pool(CONNECTIONS, proxies=settings.proxies({}), ca_certs=str(test_ca.ca_file))
    contexts = _contexts_of_concurrent_connections(pool, test_ca.url(https_port, "hub") + "/x")
    assert len({id(c) for c in contexts}) == 1, f"{len({id(c) for c in contexts})} contexts"
    context = contexts[0]
    # urllib3 set verify_mode per connection on the shared context: never weaker than required
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname


def test_connections_tunnelled_through_a_proxy_share_one_context(
    https_port: int, test_ca: TestCA
) -> None:
    with ForwardProxy() as proxy:
        proxies = settings.proxies({"HTTPS_PROXY": proxy.url, "NO_PROXY": ""})
        pool = make_http_pool(CONNECTIONS, proxies=proxies, ca_certs=str(test_ca.ca_file))
        url = test_ca.url(https_port, "hub") + "/x"
        contexts = _contexts_of_concurrent_connections(pool, url)
        assert proxy.through(url) == CONNECTIONS  # CONNECT tunnels, one per connection
    assert len({id(c) for c in contexts}) == 1


def test_the_bundle_is_loaded_once_per_pool_and_not_for_plain_http(
    https_port: int, http_port: int, test_ca: TestCA
) -> None:
    built: list[str | None] = []
    lock = threading.Lock()

    def counted(ca_certs: str | None) -> ssl.SSLContext:
        with lock:
            built.append(ca_certs)
        return tls_context(ca_certs)

    trust = TlsTrust(str(test_ca.ca_file), build=counted)
    pool = watched_pools(urllib3.PoolManager(maxsize=CONNECTIONS, retries=False), trust)
    plain = pool.request("GET", f"http://127.0.0.1:{http_port}/x")
    assert plain.status == 200 and built == []  # an HTTP-only pull builds no context
    _contexts_of_concurrent_connections(pool, test_ca.url(https_port, "hub") + "/x")
    _contexts_of_concurrent_connections(pool, test_ca.url(https_port) + "/y")  # another host
    assert built == [str(test_ca.ca_file)]


def test_a_wrong_ca_is_still_refused_with_the_clear_error(
    https_port: int, test_ca: TestCA, tmp_path: Path
) -> None:
    other = tmp_path / "other-ca.pem"
    trustme.CA(organization_name="not the test CA").cert_pem.write_to_path(str(other))
    pool = make_http_pool(4, proxies=settings.proxies({}), ca_certs=str(other))
    url = test_ca.url(https_port, "hub") + "/x"
    for _ in range(2):  # the second connection uses the context the first one built
        with pytest.raises(TlsError, match="certificate verify failed"):
            send(pool, "GET", url, headers={})


def test_a_host_name_the_certificate_does_not_name_is_refused_on_a_used_context(
    https_port: int, test_ca: TestCA
) -> None:
    pool = make_http_pool(4, proxies=settings.proxies({}), ca_certs=str(test_ca.ca_file))
    assert send(pool, "GET", test_ca.url(https_port, "hub") + "/x", headers={}).raw.status == 200
    with pytest.raises(TlsError, match="certificate verify failed: Hostname mismatch"):
        send(pool, "GET", f"https://localhost:{https_port}/x", headers={})


def test_a_bundle_changed_on_disk_is_trusted_by_the_next_connection(
    https_port: int, test_ca: TestCA, tmp_path: Path
) -> None:
    bundle = tmp_path / "bundle.pem"
    trustme.CA(organization_name="not the test CA").cert_pem.write_to_path(str(bundle))
    pool = make_http_pool(4, proxies=settings.proxies({}), ca_certs=str(bundle))
    url = test_ca.url(https_port, "hub") + "/x"
    with pytest.raises(TlsError, match="certificate verify failed"):
        send(pool, "GET", url, headers={})
    rotated = tmp_path / "rotated.pem"  # replaced as a mounted ConfigMap is: a new file
    rotated.write_bytes(bundle.read_bytes() + test_ca.ca_file.read_bytes())
    rotated.replace(bundle)
    assert send(pool, "GET", url, headers={}).raw.status == 200


class _Connect(BaseHTTPRequestHandler):
    """A CONNECT-only proxy: the tunnel's bytes relayed both ways."""

    def do_CONNECT(self) -> None:
        host, _, port = self.path.rpartition(":")
        upstream = socket.create_connection((host, int(port)), timeout=30)
        self.send_response_only(200, "Connection established")
        self.end_headers()
        self.wfile.flush()
        try:
            _relay(self.connection, upstream, lambda n: None)
        finally:
            upstream.close()
            self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_an_https_proxy_is_verified_with_the_chosen_bundle(
    https_port: int, test_ca: TestCA, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TLS to an https:// proxy itself trusts the user's bundle (urllib3 verifies it with the
    system's store unless the pool gives it a context), the origin's TLS inside the tunnel too;
    another CA's bundle refuses the proxy, naming it."""
    monkeypatch.delenv("SSL_CERT_FILE")  # the system's store trusts no test server
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Connect)
    server.daemon_threads = True
    server.socket = test_ca.server_context().wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    other = tmp_path / "other-ca.pem"
    trustme.CA(organization_name="not the test CA").cert_pem.write_to_path(str(other))
    try:
        proxy = test_ca.url(server.server_address[1], "proxy")
        proxies = settings.proxies({"HTTPS_PROXY": proxy, "NO_PROXY": ""})
        url = test_ca.url(https_port, "hub") + "/x"
        pool = make_http_pool(4, proxies=proxies, ca_certs=str(test_ca.ca_file))
        for _ in range(2):
            assert send(pool, "GET", url, headers={}).raw.status == 200
        refusing = make_http_pool(4, proxies=proxies, ca_certs=str(other))
        with pytest.raises(TlsError, match=f"the proxy {proxy}.*certificate verify failed"):
            send(refusing, "GET", url, headers={})
    finally:
        server.shutdown()
        server.server_close()
