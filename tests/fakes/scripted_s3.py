"""A scripted S3 endpoint over HTTPS (the session CA of tests/tls.py): ListObjectsV2, HEAD and
(ranged) GET of objects held in memory, with the misbehaviours the agent's scheduling and the
throttling tests need:

* ``trickle``: key prefixes whose GET bodies come one byte every ``trickle_every`` seconds;
* ``listing_retry_after``: the next listings answer ``503 SlowDown`` with that Retry-After;
* ``rate``: above this many requests per second (a one-second sliding window over the
  requests it *served*) a request is answered ``503 SlowDown``, as S3 throttles a prefix.

Every request is counted (by kind and answer) with its time, so a test can say how many it took.
It signs nothing and checks no signature: what is under test is the client's behaviour.
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from tests.tls import TestCA

_RANGE = re.compile(r"^bytes=(\d+)-(\d*)$")


@dataclass
class Seen:
    """One request as the server saw it."""

    at: float
    method: str
    kind: str  #: "list", "head" or "get"
    key: str
    status: int


@dataclass
class ScriptedS3:
    """The server's script and what it saw; start it with ``with`` (bucket ``bkt``)."""

    ca: TestCA
    objects: dict[str, bytes] = field(default_factory=dict)
    trickle: tuple[str, ...] = ()
    trickle_every: float = 5.0
    rate: float | None = None
    listing_retry_after: list[str] = field(default_factory=list)
    seen: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._served: collections.deque[float] = collections.deque()
        self._stop = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None

    @property
    def endpoint(self) -> str:
        assert self._httpd is not None
        # 127.0.0.1 (which the certificate names too): botocore addresses it path-style
        return f"https://127.0.0.1:{self._httpd.server_address[1]}"

    def __enter__(self) -> ScriptedS3:
        handler = _handler(self)
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        context = self.ca.server_context()
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        threading.Thread(target=self._httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._httpd is not None
        self._httpd.shutdown()
        self._httpd.server_close()

    def count(self, kind: str | None = None, status: int | None = None) -> int:
        with self._lock:
            return sum(
                1
                for s in self.seen
                if (kind is None or s.kind == kind) and (status is None or s.status == status)
            )

    def requests(self) -> list[Seen]:
        with self._lock:
            return list(self.seen)

    # -- what the handler asks -------------------------------------------------------------

    def admit(self, method: str, kind: str, key: str) -> tuple[int, str | None]:
        """Record a request; the status to answer with and its Retry-After (None: none)."""
        now = time.monotonic()
        with self._lock:
            status, retry_after = 200, None
            if kind == "list" and self.listing_retry_after:
                status, retry_after = 503, self.listing_retry_after.pop(0)
            elif self.rate is not None:
                while self._served and now - self._served[0] >= 1.0:
                    self._served.popleft()
                if len(self._served) >= self.rate:
                    status = 503
                else:
                    self._served.append(now)
            self.seen.append(Seen(now, method, kind, key, status))
            return status, retry_after

    def trickles(self, key: str) -> bool:
        return any(key.startswith(p) for p in self.trickle)

    def wait(self, seconds: float) -> bool:
        """Sleep; True when the server is shutting down."""
        return self._stop.wait(seconds)


def etag(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()  # S3's ETag of a single-part object


def listing(server: ScriptedS3, prefix: str) -> bytes:
    entries = "".join(
        f"<Contents><Key>{escape(k)}</Key><Size>{len(v)}</Size>"
        f"<ETag>&quot;{etag(v)}&quot;</ETag></Contents>"
        for k, v in sorted(server.objects.items())
        if k.startswith(prefix)
    )
    return (
        '<?xml version="1.0" encoding="UTF-8"?>\n'
        '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
        f"<Name>bkt</Name><Prefix>{escape(prefix)}</Prefix><KeyCount>0</KeyCount>"
        f"<MaxKeys>1000</MaxKeys>{entries}<IsTruncated>false</IsTruncated></ListBucketResult>"
    ).encode()


_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)


def _handler(server: ScriptedS3) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _target(self) -> tuple[str, str, dict[str, str]]:
            parts = urlsplit(self.path)
            query = {k: v[0] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
            path = unquote(parts.path).lstrip("/")
            _bucket, _, key = path.partition("/")
            if "list-type" in query or not key:
                return "list", query.get("prefix", ""), query
            return ("head" if self.command == "HEAD" else "get"), key, query

        def _send(self, status: int, body: bytes, headers: dict[str, str]) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_GET(self) -> None:
            kind, key, _ = self._target()
            status, retry_after = server.admit(self.command, kind, key)
            if status != 200:
                headers = {"Content-Type": "application/xml"}
                if retry_after is not None:
                    headers["Retry-After"] = retry_after
                self._send(status, _SLOW_DOWN, headers)
                return
            if kind == "list":
                self._send(200, listing(server, key), {"Content-Type": "application/xml"})
                return
            data = server.objects.get(key)
            if data is None:
                body = b"<Error><Code>NoSuchKey</Code><Message>no such key</Message></Error>"
                self._send(404, body, {"Content-Type": "application/xml"})
                return
            self._object(key, data)

        do_HEAD = do_GET

        def _object(self, key: str, data: bytes) -> None:
            headers = {"ETag": f'"{etag(data)}"', "Accept-Ranges": "bytes"}
            wanted = _RANGE.match(self.headers.get("Range") or "")
            status, body = 200, data
            if wanted is not None:
                start = int(wanted.group(1))
                end = int(wanted.group(2)) if wanted.group(2) else len(data) - 1
                end = min(end, len(data) - 1)
                body = data[start : end + 1]
                status = 206
                headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            if self.command == "HEAD" or not server.trickles(key):
                self._send(status, body, headers)
                return
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            for byte in _bytes_of(body):
                try:
                    self.wfile.write(byte)
                    self.wfile.flush()
                except OSError:
                    return
                if server.wait(server.trickle_every):
                    return

    return Handler


def _bytes_of(body: bytes) -> Iterator[bytes]:
    for i in range(len(body)):
        yield body[i : i + 1]
