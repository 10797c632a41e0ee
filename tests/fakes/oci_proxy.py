"""A fault-injecting proxy in front of the real test registry, and its token service.

It forwards GETs and HEADs to the registry and can: demand a Bearer token (``WWW-Authenticate:
Bearer realm=<its /token>,service=...,scope=...``, as a registry with ``auth: token:`` does), issue
tokens at ``/token`` (anonymously, or only for the basic credentials it is given), forget every
token it issued (an expiry mid-pull), hang at ``/token``, answer blob GETs with 429 and
Retry-After, strip the Range header (a registry that ignores Range), throttle bodies, and redirect
blob GETs (307) to a second listener that plays object storage (it records the headers it got,
so a test sees whether the Authorization followed the redirect).

Given the session's :class:`tests.tls.TestCA` both listeners speak HTTPS, the proxy as
``registry.prefetch.test`` and the storage as another host, ``s3.prefetch.test`` (so a credential
that follows the redirect crosses a real host name), and the upstream registry is reached over
HTTPS when its URL says so, trusting the same CA.
"""

from __future__ import annotations

import base64
import http.client
import json
import secrets
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from tests.tls import TestCA

_HOP = {"connection", "keep-alive", "transfer-encoding", "host"}


@dataclass
class Faults:
    require_token: bool = False
    token_user: tuple[str, str] | None = None  # basic credentials /token insists on
    token_hang: bool = False
    token_expires_in: int = 300
    refuse_429: int = 0  # blob GETs answered 429 (Retry-After: 0)
    refused: int = 0  # how many were
    ignore_range: bool = False
    throttle_bps: float = 0.0
    redirect_blobs: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Server(ThreadingHTTPServer):
    """A threading HTTP server, over TLS when given a context; the handshake happens in the
    handler's thread (on its first read), so one stuck client never holds up the accept loop."""

    daemon_threads = True

    def __init__(self, handler: type[BaseHTTPRequestHandler], tls: ssl.SSLContext | None) -> None:
        self.tls = tls
        super().__init__(("127.0.0.1", 0), handler)

    def get_request(self) -> tuple[socket.socket, object]:
        sock, address = super().get_request()
        if self.tls is None:
            return sock, address
        return self.tls.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), address


class RegistryProxy:
    def __init__(self, upstream: str, tls: TestCA | None = None) -> None:
        self.upstream = urlsplit(upstream)
        self.tls = tls
        self.faults = Faults()
        self.tokens: set[str] = set()
        #: (path, headers) of every request, in order, both listeners
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.storage_requests: list[tuple[str, dict[str, str]]] = []
        self.token_requests: list[dict[str, str]] = []
        self._stop = threading.Event()
        context = tls.server_context() if tls is not None else None
        self.server = _Server(self._handler(storage=False), context)
        self.storage = _Server(self._handler(storage=True), context)
        self.url = self._url(self.server.server_address[1], "registry")
        self.host = self.url.split("://", 1)[1]
        self.storage_url = self._url(self.storage.server_address[1], "s3")

    def _url(self, port: int, role: str) -> str:
        return f"http://127.0.0.1:{port}" if self.tls is None else self.tls.url(port, role)

    def _upstream_connection(self) -> http.client.HTTPConnection:
        host, port = self.upstream.hostname or "127.0.0.1", self.upstream.port
        if self.upstream.scheme != "https":
            return http.client.HTTPConnection(host, port, timeout=30)
        context = self.tls.client_context() if self.tls is not None else None
        return http.client.HTTPSConnection(host, port, timeout=30, context=context)

    def start(self) -> RegistryProxy:
        for srv in (self.server, self.storage):
            threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for srv in (self.server, self.storage):
            srv.shutdown()
            srv.server_close()

    def expire_tokens(self) -> None:
        self.tokens.clear()

    def blob_gets(self) -> list[tuple[str, dict[str, str]]]:
        return [(p, h) for p, h in self.requests if "/blobs/" in p]

    def _handler(self, *, storage: bool) -> type[BaseHTTPRequestHandler]:
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_HEAD(self) -> None:
                self._serve(head=True)

            def do_GET(self) -> None:
                self._serve(head=False)

            def _serve(self, *, head: bool) -> None:
                headers = {k: v for k, v in self.headers.items()}
                path = self.path
                if storage:
                    proxy.storage_requests.append((path, headers))
                    self._forward(path.replace("/storage/", "/v2/", 1), headers, head)
                    return
                proxy.requests.append((path, headers))
                if path.startswith("/token"):
                    self._token(path, headers)
                    return
                f = proxy.faults
                if f.require_token and not self._authorized(headers):
                    repo = path.split("/v2/", 1)[-1].rsplit("/", 2)[0]
                    self._send(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {
                        "WWW-Authenticate": f'Bearer realm="{proxy.url}/token",'
                        f'service="test-registry",scope="repository:{repo}:pull"',
                    })  # fmt: skip
                    return
                blob = "/blobs/" in path
                if blob:
                    with f.lock:
                        refuse = f.refuse_429 > 0
                        if refuse:
                            f.refuse_429 -= 1
                            f.refused += 1
                    if refuse:
                        self._send(429, b'{"errors":[{"code":"TOOMANYREQUESTS"}]}',
                                   {"Retry-After": "0"})  # fmt: skip
                        return
                    if f.redirect_blobs:
                        target = proxy.storage_url + path.replace("/v2/", "/storage/", 1)
                        self._send(307, b"", {"Location": target})
                        return
                    if f.ignore_range:
                        headers.pop("Range", None)
                self._forward(path, headers, head)

            def _authorized(self, headers: dict[str, str]) -> bool:
                auth = headers.get("Authorization", "")
                return auth.startswith("Bearer ") and auth[7:] in proxy.tokens

            def _token(self, path: str, headers: dict[str, str]) -> None:
                proxy.token_requests.append(headers)
                f = proxy.faults
                if f.token_hang:
                    proxy._stop.wait(60)
                    return
                if f.token_user is not None:
                    user, password = f.token_user
                    want = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
                    if headers.get("Authorization") != want:
                        self._send(401, b'{"errors":[{"code":"UNAUTHORIZED"}]}', {})
                        return
                query = parse_qs(urlsplit(path).query)
                assert query.get("service") == ["test-registry"], query
                token = secrets.token_hex(16)
                proxy.tokens.add(token)
                body = json.dumps({"token": token, "expires_in": f.token_expires_in})
                self._send(200, body.encode(), {"Content-Type": "application/json"})

            def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _forward(self, path: str, headers: dict[str, str], head: bool) -> None:
                up = proxy._upstream_connection()
                sent = {k: v for k, v in headers.items() if k.lower() not in _HOP}
                sent.pop("Authorization", None)  # the registry behind is anonymous
                up.request("HEAD" if head else "GET", path, headers=sent)
                resp = up.getresponse()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in _HOP:
                        self.send_header(k, v)
                self.end_headers()
                if head:
                    up.close()
                    return
                rate = proxy.faults.throttle_bps
                try:
                    while True:
                        chunk = resp.read(16 * 1024)
                        if not chunk:
                            break
                        self.wfile.write(chunk)
                        if rate > 0:
                            time.sleep(len(chunk) / rate)
                except OSError:
                    pass
                finally:
                    up.close()

        return Handler
