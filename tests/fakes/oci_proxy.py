"""A fault-injecting proxy in front of the real test registry, and its token service.

It forwards GETs and HEADs to the registry and can: demand a Bearer token (``WWW-Authenticate:
Bearer realm=<its /token>,service=...,scope=...``, as a registry with ``auth: token:`` does), issue
tokens at ``/token`` (anonymously, or only for the basic credentials it is given), forget every
token it issued (an expiry mid-pull), hang at ``/token``, answer blob GETs with 429 and
Retry-After, strip the Range header (a registry that ignores Range), throttle bodies, and redirect
blob GETs (307) to a second listener that plays object storage (it records the headers it got,
so a test sees whether the Authorization followed the redirect).
"""

from __future__ import annotations

import base64
import http.client
import json
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

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


class RegistryProxy:
    def __init__(self, upstream: str) -> None:
        self.upstream = urlsplit(upstream)
        self.faults = Faults()
        self.tokens: set[str] = set()
        #: (path, headers) of every request, in order, both listeners
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.storage_requests: list[tuple[str, dict[str, str]]] = []
        self.token_requests: list[dict[str, str]] = []
        self._stop = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(storage=False))
        self.storage = ThreadingHTTPServer(("127.0.0.1", 0), self._handler(storage=True))
        self.server.daemon_threads = self.storage.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        self.url = f"http://{self.host}"
        self.storage_url = f"http://127.0.0.1:{self.storage.server_address[1]}"

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
                up = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=30
                )
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
