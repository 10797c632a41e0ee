"""A small S3-compatible server on 127.0.0.1 that misbehaves on request, for hostile-server tests.

It speaks just enough S3 for the S3 source (path-style ``ListObjectsV2``, ``HEAD`` and ``GET`` of
an object, with ``Range`` and ``If-Match``) and checks no signature, so any credentials work.
Objects get an opaque ETag by default (neither an MD5 nor a multipart ETag, as with SSE-KMS), so
the source states no checksum for them: exactly the case where only the range checks stand
between a lying server and a wrong file. ``put(..., md5_etag=True)`` gives the usual MD5 ETag.

Usage::

    with MisbehavingS3(test_ca) as s3:                # HTTPS; MisbehavingS3(): plain HTTP
        s3.put("bucket", "model/weights.bin", data)
        s3.misbehave(ignore_range=True)               # every object GET, until clear()
        s3.misbehave(trickle=(1, 0.5), count=1)       # the next GET sends 1 byte every 0.5 s
        client = s3.client()                          # boto3, pointed here, retries off

A :class:`Misbehaviour` applies to GETs of objects (``key``: only that key) and is used up after
``count`` responses (``None``: until :meth:`MisbehavingS3.clear`). The first armed rule that
matches a request applies, alone. Trickling and stalled responses end (the connection closes)
when the client goes away or the server stops, so a test never leaves a thread behind for long.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit
from xml.sax.saxutils import escape

from prefetch.sources.s3.source import make_s3_client

from ..tls import TestCA
from .tlsserver import HANDSHAKE_TIMEOUT, TLSThreadingHTTPServer


@dataclass
class Misbehaviour:
    """What a GET answer does wrong (combine freely; unset fields behave)."""

    #: Answer a ranged GET with 200 and the whole object, as a server that ignores Range.
    ignore_range: bool = False
    #: Content-Range to send instead of the true one: (start, last byte, size) -> header value.
    content_range: Callable[[int, int, int], str] | None = None
    #: Send this many bytes fewer than Content-Length states, then close the connection.
    short_by: int = 0
    #: Send this many bytes past the range; with ``omit_length`` the client cannot tell by length.
    long_by: int = 0
    #: Send no Content-Length (the body ends when the connection closes).
    omit_length: bool = False
    #: (n, t): send the body n bytes every t seconds.
    trickle: tuple[int, float] | None = None
    #: Send this many bytes of the body, then nothing (the connection stays open).
    stall_after: int | None = None
    #: Send nothing at all, not even the status line (the connection stays open).
    no_headers: bool = False
    #: Apply only to GETs whose range starts at or after this byte.
    from_byte: int = 0
    #: Apply to HEADs instead of GETs (only ``no_headers`` means anything there).
    head: bool = False
    key: str | None = None
    count: int | None = None


@dataclass
class _Object:
    data: bytes
    etag: str


class MisbehavingS3:
    """The server; a context manager (``endpoint`` is valid once entered). With ``ca``, it speaks
    HTTPS as ``s3.prefetch.test`` with the session CA's certificate; else plain HTTP."""

    def __init__(self, ca: TestCA | None = None) -> None:
        self._ca = ca
        self._objects: dict[tuple[str, str], _Object] = {}
        self._rules: list[Misbehaviour] = []
        self._lock = threading.Lock()
        self._closing = threading.Event()
        #: (method, key, Range header or None) of every object request, in order
        self.requests: list[tuple[str, str, str | None]] = []
        handler = _handler_for(self)
        context = None if ca is None else ca.server_context()
        self._server = _QuietServer(("127.0.0.1", 0), handler, context)
        port = self._server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{port}" if ca is None else ca.url(port, "s3")
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def put(self, bucket: str, key: str, data: bytes, *, md5_etag: bool = False) -> str:
        """Store an object; returns its ETag (opaque unless ``md5_etag``)."""
        digest = hashlib.md5(data).hexdigest()
        etag = digest if md5_etag else f"kms-{digest}"
        with self._lock:
            self._objects[(bucket, key)] = _Object(data, etag)
        return etag

    def misbehave(self, **fields: Any) -> Misbehaviour:
        rule = Misbehaviour(**fields)
        with self._lock:
            self._rules.append(rule)
        return rule

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def client(self) -> Any:
        return make_s3_client(
            endpoint_url=self.endpoint, access_key="test", secret_key="test", region="us-east-1",
            ca_bundle=None if self._ca is None else str(self._ca.ca_file),
        )  # fmt: skip

    def env(self) -> dict[str, str]:
        """Environment variables pointing a ``prefetch`` subprocess at this server (and, over
        HTTPS, trusting its CA)."""
        return {
            **({} if self._ca is None else self._ca.env()),
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def _take_rule(self, key: str, start: int = 0, *, head: bool = False) -> Misbehaviour | None:
        with self._lock:
            for rule in self._rules:
                if rule.key is not None and rule.key != key:
                    continue
                if rule.head != head:
                    continue
                if start < rule.from_byte:
                    continue
                if rule.count is not None:
                    rule.count -= 1
                    if rule.count <= 0:
                        self._rules.remove(rule)
                return rule
        return None

    def _object(self, bucket: str, key: str) -> _Object | None:
        with self._lock:
            return self._objects.get((bucket, key))

    def _listing(self, bucket: str, prefix: str) -> bytes:
        with self._lock:
            found = sorted(
                (k, o)
                for (b, k), o in self._objects.items()
                if b == bucket and k.startswith(prefix)
            )
        contents = "".join(
            f"<Contents><Key>{escape(k)}</Key><LastModified>2026-01-01T00:00:00.000Z"
            f"</LastModified><ETag>&quot;{o.etag}&quot;</ETag><Size>{len(o.data)}</Size>"
            "<StorageClass>STANDARD</StorageClass></Contents>"
            for k, o in found
        )
        return (
            '<?xml version="1.0" encoding="UTF-8"?>'
            '<ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/">'
            f"<Name>{escape(bucket)}</Name><Prefix>{escape(prefix)}</Prefix>"
            f"<KeyCount>{len(found)}</KeyCount><MaxKeys>1000</MaxKeys>"
            f"<IsTruncated>false</IsTruncated>{contents}</ListBucketResult>"
        ).encode()

    def __enter__(self) -> MisbehavingS3:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._server.shutdown()
        self._server.server_close()


class _QuietServer(TLSThreadingHTTPServer):
    def server_activate(self) -> None:
        super().server_activate()
        # a connection reset between select() and accept() would block a blocking accept, and
        # with it shutdown(): non-blocking, such an accept fails (and is ignored) instead
        self.socket.setblocking(False)

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that hang up mid-response are the point of these tests


def _handler_for(s3: MisbehavingS3) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            self._serve(head=False)

        def do_HEAD(self) -> None:
            self._serve(head=True)

        def _serve(self, *, head: bool) -> None:
            url = urlsplit(self.path)
            bucket, _, key = unquote(url.path).lstrip("/").partition("/")
            if not key:
                query = parse_qs(url.query)
                self._send(200, {"Content-Type": "application/xml"},
                           s3._listing(bucket, query.get("prefix", [""])[0]))  # fmt: skip
                return
            s3.requests.append((self.command, key, self.headers.get("Range")))
            obj = s3._object(bucket, key)
            if obj is None:
                self._send(404, {}, b"<Error><Code>NoSuchKey</Code></Error>")
                return
            if_match = (self.headers.get("If-Match") or "").strip('"')
            if if_match and if_match != obj.etag:
                self._send(412, {}, b"<Error><Code>PreconditionFailed</Code></Error>")
                return
            headers = {"ETag": f'"{obj.etag}"', "Last-Modified": "Thu, 01 Jan 2026 00:00:00 GMT"}
            if head:
                rule = s3._take_rule(key, head=True)
                if rule is not None and rule.no_headers:
                    self.close_connection = True
                    self._hold()
                    return
                self._send(200, {**headers, "Content-Length": str(len(obj.data))}, b"", head=True)
                return
            self._get(obj, key, headers)

        def _get(self, obj: _Object, key: str, headers: dict[str, str]) -> None:
            size = len(obj.data)
            asked = _parse_range(self.headers.get("Range"), size)
            rule = s3._take_rule(key, asked[0] if asked else 0) or Misbehaviour()
            if rule.no_headers:
                self.close_connection = True
                self._hold()
                return
            if asked is None or rule.ignore_range:
                status, start, end = 200, 0, size
            else:
                status, (start, end) = 206, asked
                make = rule.content_range or (lambda s, last, n: f"bytes {s}-{last}/{n}")
                headers["Content-Range"] = make(start, end - 1, size)
            body = obj.data[start:end] + obj.data[end : end + rule.long_by]
            if not rule.omit_length:
                headers["Content-Length"] = str(end - start)
            else:
                self.close_connection = True
            sent = body[: max(len(body) - rule.short_by, 0)] if rule.short_by else body
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            try:
                self._write_body(sent, rule)
            except OSError:
                self.close_connection = True  # the client went away
                return
            if rule.short_by or rule.long_by or rule.stall_after is not None:
                self.close_connection = True

        def _write_body(self, body: bytes, rule: Misbehaviour) -> None:
            if rule.stall_after is not None:
                self.wfile.write(body[: rule.stall_after])
                self.wfile.flush()
                self._hold()
                return
            if rule.trickle is None:
                self.wfile.write(body)
                return
            n, interval = rule.trickle
            for off in range(0, len(body), n):
                self.wfile.write(body[off : off + n])
                self.wfile.flush()
                if s3._closing.wait(interval):
                    return

        def _hold(self) -> None:
            """Keep the connection open, sending nothing, until the client or server goes."""
            self.connection.settimeout(0.2)
            while not s3._closing.is_set():
                try:
                    if self.connection.recv(1) == b"":
                        return
                except TimeoutError:
                    continue
                except OSError:
                    return
                time.sleep(0.05)

        def _send(self, status: int, headers: dict[str, str], body: bytes, *, head: bool = False):  # type: ignore[no-untyped-def]
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            if "Content-Length" not in headers:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

    return Handler


def _parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """``bytes=a-b`` -> [a, b+1) clipped to the object; None for no (or an unusable) Range."""
    if not value or not value.startswith("bytes="):
        return None
    first, _, last = value[len("bytes=") :].partition("-")
    if not first.isdigit():
        return None
    start = int(first)
    end = min(int(last) + 1, size) if last.isdigit() else size
    return (start, end) if start < end else None


class SilentServer:
    """A loopback server that accepts connections, reads what is sent, and never answers (not
    even a status line) until it stops: a client waits for response headers for ever. With
    ``ca``, it completes the TLS handshake first (as ``s3.prefetch.test``), then says nothing."""

    def __init__(self, ca: TestCA | None = None) -> None:
        import socket

        self._context = None if ca is None else ca.server_context()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}" if ca is None else ca.url(self.port, "s3")
        self.accepted = 0
        self._closing = threading.Event()
        self._conns: list[Any] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                continue
            self.accepted += 1
            if self._context is not None:
                threading.Thread(target=self._handshake, args=(conn,), daemon=True).start()
                continue
            self._conns.append(conn)

    def _handshake(self, conn: Any) -> None:
        """TLS with one client, in its own thread (a client that never says hello holds up no
        other); the connection is then held, silent, like a plain one."""
        conn.settimeout(HANDSHAKE_TIMEOUT)
        try:
            assert self._context is not None
            tls = self._context.wrap_socket(conn, server_side=True)
        except OSError:
            conn.close()
            return
        self._conns.append(tls)
        if self._closing.is_set():  # stopped during the handshake: __exit__ may have missed it
            tls.close()

    def __enter__(self) -> SilentServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._closing.set()
        self._thread.join()
        for conn in self._conns:
            conn.close()
        self._listener.close()
