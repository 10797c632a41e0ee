"""A scripted Cloud Storage JSON API over TLS, for what the emulator does not do: credentials (a
bearer token it checks, a token endpoint a service-account JSON points at), paging with
``maxResults``/``pageToken``, a redirect, a media answer naming another generation.

Objects live in memory (``put``); every request is recorded with its headers (``requests``).
"""

from __future__ import annotations

import base64
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from urllib.parse import parse_qs, unquote, urlsplit

from awscrt import checksums

from ..tls import TestCA
from .tlsserver import TLSThreadingHTTPServer


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]


@dataclass
class Script:
    #: the bearer token every storage request must carry (None: any, or none)
    token: str | None = None
    #: tokens the token endpoint issues, in order (the last one again when used up)
    issued: list[str] = field(default_factory=list)
    #: objects per listing page
    page_size: int = 1000
    #: media GETs are answered with a redirect to this origin
    redirect_to: str | None = None
    #: media answers carry this x-goog-generation instead of the object's
    served_generation: str | None = None
    #: after this many storage requests the token is refused once (an expiry mid-pull)
    expire_after: int | None = None


class ScriptedGcs:
    """``with ScriptedGcs(test_ca, role) as gcs``: its ``endpoint`` is
    ``https://<role>.prefetch.test:<port>``."""

    def __init__(self, ca: TestCA, role: str = "") -> None:
        self.script = Script()
        self.objects: dict[tuple[str, str], tuple[bytes, int]] = {}
        self.requests: list[Recorded] = []
        self._lock = threading.Lock()
        self._generation = 1000
        self._storage_requests = 0
        gcs = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                gcs._handle(self)

            def do_POST(self) -> None:
                gcs._handle(self)

        self._server = TLSThreadingHTTPServer(("127.0.0.1", 0), Handler, ca.server_context())
        self.endpoint = ca.url(self._server.server_address[1], role)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def put(self, bucket: str, name: str, data: bytes, generation: int | None = None) -> int:
        """Store ``data`` as a new generation (``generation``: this one, which Cloud Storage
        may give two objects uploaded in the same microsecond)."""
        with self._lock:
            self._generation += 1
            self.objects[(bucket, name)] = (data, generation or self._generation)
            return generation or self._generation

    def __enter__(self) -> ScriptedGcs:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    # -- answers -----------------------------------------------------------------------------

    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        length = int(h.headers.get("Content-Length") or 0)
        if length:
            h.rfile.read(length)
        with self._lock:
            self.requests.append(Recorded(h.command, h.path, dict(h.headers.items())))
        parts = urlsplit(h.path)
        query = {k: v[0] for k, v in parse_qs(parts.query).items()}
        if parts.path == "/token":
            self._token(h)
            return
        if not self._authorized(h):
            self._json(h, 401, {"error": {"code": 401, "message": "Invalid Credentials"}})
            return
        segments = parts.path.split("/")
        if segments[1:4] != ["storage", "v1", "b"] or len(segments) < 6 or segments[5] != "o":
            self._json(h, 404, {"error": {"code": 404, "message": "Not Found"}})
            return
        bucket = segments[4]
        if len(segments) == 6:
            self._list(h, bucket, query)
        else:
            self._media(h, bucket, unquote("/".join(segments[6:])), query)

    def _authorized(self, h: BaseHTTPRequestHandler) -> bool:
        script = self.script
        with self._lock:
            self._storage_requests += 1
            expire = (
                script.expire_after is not None and self._storage_requests > script.expire_after
            )
            if expire:
                script.expire_after = None
        if script.token is None:
            return True
        return not expire and h.headers.get("Authorization") == f"Bearer {script.token}"

    def _token(self, h: BaseHTTPRequestHandler) -> None:
        with self._lock:
            issued = self.script.issued
            token = issued.pop(0) if len(issued) > 1 else issued[0]
            self.script.token = token
        self._json(h, 200, {"access_token": token, "expires_in": 3600, "token_type": "Bearer"})

    def _list(self, h: BaseHTTPRequestHandler, bucket: str, query: dict[str, str]) -> None:
        if not any(b == bucket for b, _ in self.objects):
            self._json(
                h, 404, {"error": {"code": 404, "message": "The specified bucket does not exist."}}
            )
            return
        prefix = query.get("prefix", "")
        names = sorted(n for b, n in self.objects if b == bucket and n.startswith(prefix))
        start = int(query.get("pageToken", "0"))
        size = min(self.script.page_size, int(query.get("maxResults", "1000")))
        page = names[start : start + size]
        items = []
        for name in page:
            data, generation = self.objects[(bucket, name)]
            crc = checksums.crc32c(data).to_bytes(4, "big")
            items.append({"name": name, "size": str(len(data)), "generation": str(generation),
                          "crc32c": base64.b64encode(crc).decode()})  # fmt: skip
        doc: dict[str, object] = {"items": items}
        if start + size < len(names):
            doc["nextPageToken"] = str(start + size)
        self._json(h, 200, doc)

    def _media(
        self, h: BaseHTTPRequestHandler, bucket: str, name: str, query: dict[str, str]
    ) -> None:
        found = self.objects.get((bucket, name))
        if found is None or query.get("generation") not in (None, str(found[1])):
            self._json(h, 404, {"error": {"code": 404, "message": "No such object"}})
            return
        if self.script.redirect_to is not None:
            h.send_response(302)
            h.send_header("Location", f"{self.script.redirect_to}{h.path}")
            h.send_header("Content-Length", "0")
            h.end_headers()
            return
        data, generation = found
        first, last = 0, len(data) - 1
        rng = h.headers.get("Range")
        if rng:
            a, b = rng.removeprefix("bytes=").split("-")
            first, last = int(a), min(int(b), len(data) - 1)
        body = data[first : last + 1]
        h.send_response(206 if rng else 200)
        h.send_header("Content-Length", str(len(body)))
        if rng:
            h.send_header("Content-Range", f"bytes {first}-{last}/{len(data)}")
        h.send_header("x-goog-generation", self.script.served_generation or str(generation))
        h.end_headers()
        h.wfile.write(body)

    @staticmethod
    def _json(h: BaseHTTPRequestHandler, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)
