"""The one HTTP layer every source shares: pool, proxies, redaction, status table and body reader.

* :func:`make_http_pool` / :func:`shared_http_pool`: a urllib3 pool for ranged GETs (no urllib3
  retries or redirects: the caller does both), sending each request directly or through the
  proxy the environment names (``HTTP(S)_PROXY``, bypassed per host by ``NO_PROXY``).
* :func:`redact_url`: a URL fit for a message (no credentials, no signed query string).
* :func:`parse_retry_after`: a ``Retry-After`` header in seconds.
* :func:`error_class`: THE status table: an HTTP status (and the Hub's ``X-Error-Code``) to the
  package's exception class. Every source asks it; only the wording of messages is theirs.
* :func:`transport_error`: an exception from sending a request or reading a body, as ours.
* :class:`BodyReader`: the body of one ranged answer, read with the ``http.client`` response's
  ``readinto`` straight into the engine's buffer (urllib3's and botocore's own ``readinto`` read
  into a temporary bytes object and copy it: half the client CPU per byte, measured), never
  more or less than the range, with an ``abort()`` that wakes a read blocked in another thread.
"""

from __future__ import annotations

import contextlib
import email.utils
import http.client
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol, TypedDict, Unpack, cast
from urllib.parse import urlsplit

import urllib3

from prefetch.pipeline.deadline import attach_to_watches
from prefetch.sources.base import range_answer_problem, shutdown_socket_of
from prefetch.support import settings
from prefetch.support.errors import (
    AccessDeniedError,
    NotFoundError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TlsError,
    TransientSourceError,
)
from prefetch.support.redact import redact

#: A redirect's body is read (so its connection goes back to the pool) only up to this size.
DRAIN_LIMIT = 64 * 1024

# ---- the pool ----------------------------------------------------------------------------------


class RequestOptions(TypedDict, total=False):
    """The options :func:`send` passes to urllib3's ``request`` (an absent ``timeout``: the
    pool's own)."""

    headers: Mapping[str, str]
    body: bytes | None
    preload_content: bool
    redirect: bool
    retries: bool
    decode_content: bool
    timeout: urllib3.Timeout | float


class PoolOptions(TypedDict, total=False):
    """The options :func:`make_http_pool` builds its urllib3 managers with."""

    num_pools: int
    maxsize: int
    block: bool
    retries: bool
    ca_certs: str


class HttpClient(Protocol):
    """What a source needs of a client: urllib3's ``request`` (a PoolManager, the proxy router
    below, or a test's canned client)."""

    def request(
        self, method: str, url: str, **kwargs: Unpack[RequestOptions]
    ) -> urllib3.BaseHTTPResponse: ...


_SHARED_POOLS: dict[tuple[int, object, str | None], HttpClient] = {}
_SHARED_LOCK = threading.Lock()


def shared_http_pool(
    size: int = 32, proxies: settings.Proxies | None = None, *, ca_certs: str | None = None
) -> HttpClient:
    """One pooled client per process, pool size, proxy settings (default: the environment's,
    read now) and CA bundle, so the agent reuses connections across syncs and a model with its
    own proxy never shares a pool with one that goes direct."""
    proxies = settings.proxies() if proxies is None else proxies
    key = (size, proxies.key(), ca_certs)
    with _SHARED_LOCK:
        pool = _SHARED_POOLS.get(key)
        if pool is None:
            pool = _SHARED_POOLS[key] = make_http_pool(size, proxies=proxies, ca_certs=ca_certs)
        return pool


def make_http_pool(
    size: int = 32, *, proxies: settings.Proxies | None = None, ca_certs: str | None = None
) -> HttpClient:
    """A urllib3 pool for ranged GETs: no urllib3 retries or redirects (done by the caller), and
    the proxies (default: the environment's, read now) honoured per host; ``ca_certs``: a CA
    bundle to verify TLS with instead of the system's."""
    kwargs: PoolOptions = {"num_pools": 8, "maxsize": size, "block": False, "retries": False}
    if ca_certs:
        kwargs["ca_certs"] = ca_certs
    proxies = settings.proxies() if proxies is None else proxies
    direct = watched_pools(urllib3.PoolManager(**kwargs))
    if not proxies.by_scheme:
        return direct
    return ProxyRouter(direct, proxies, kwargs)


# ---- stop and deadlines reach the header wait ----------------------------------------------------


def _interrupt_socket(sock: object) -> Callable[[], None]:
    def interrupt() -> None:
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    return interrupt


class _WatchedHTTPConnection(urllib3.connection.HTTPConnection):
    """A connection whose wait for response headers a watch can interrupt: the calling
    thread's watches (:mod:`prefetch.pipeline.deadline`: a ranged read the engine watches, a
    metadata call under a deadline, a resolve a stop interrupts) get the socket, so a stop, a stall
    or a deadline shuts it down instead of waiting out the read timeout (60 s). The socket stays
    attached until the watch ends, so the body read is covered too."""

    # The ignore: urllib3's own getresponse narrows http.client's return type to urllib3's
    # HTTPResponse and carries the same ignore; this keeps urllib3's signature exactly.
    def getresponse(self) -> urllib3.response.HTTPResponse:  # type: ignore[override]
        attach_to_watches(_interrupt_socket(self.sock))
        return super().getresponse()


class _WatchedHTTPSConnection(urllib3.connection.HTTPSConnection):
    """:class:`_WatchedHTTPConnection` over TLS. Its own method, not a copy of the plain one: a
    zero-argument ``super()`` is bound to the class it is written in, so the plain class's method
    on this class raises ``TypeError`` (every HTTPS request failed that way once)."""

    # The ignore: urllib3's own getresponse narrows http.client's return type to urllib3's
    # HTTPResponse and carries the same ignore; this keeps urllib3's signature exactly.
    def getresponse(self) -> urllib3.response.HTTPResponse:  # type: ignore[override]
        attach_to_watches(_interrupt_socket(self.sock))
        return super().getresponse()


class _WatchedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


def watched_pools(manager: urllib3.PoolManager) -> urllib3.PoolManager:
    """``manager`` making connections whose header wait a watch can interrupt (urllib3's
    documented per-scheme pool classes)."""
    manager.pool_classes_by_scheme = {"http": _WatchedHTTPPool, "https": _WatchedHTTPSPool}
    return manager


class ProxyRouter:
    """Sends each request directly or through its scheme's proxy, as the proxy settings say."""

    def __init__(self, direct: HttpClient, proxies: settings.Proxies, kwargs: PoolOptions) -> None:
        from prefetch.sources.http.proxy_auth import proxy_headers  # only with a proxy configured

        self._direct = direct
        self._proxies = proxies
        self._proxied = {
            url: watched_pools(
                urllib3.ProxyManager(url, proxy_headers=proxy_headers(url), **kwargs)
            )
            for url in set(proxies.by_scheme.values())
        }

    def manager_for(self, url: str) -> HttpClient:
        """The client that sends a request for ``url``: a proxy, or the direct pool (the rule is
        :meth:`prefetch.support.settings.Proxies.proxy_for`)."""
        proxy = self._proxies.proxy_for(url)
        return self._direct if proxy is None else self._proxied[proxy]

    def request(
        self, method: str, url: str, **kwargs: Unpack[RequestOptions]
    ) -> urllib3.BaseHTTPResponse:
        return self.manager_for(url).request(method, url, **kwargs)


#: Does ``NO_PROXY`` exempt a host? (The rule lives in settings, beside the variables.)
no_proxy_matches = settings.no_proxy_matches


def discard(resp: urllib3.BaseHTTPResponse) -> None:
    """Drop a urllib3 response whose body we do not want, closing its connection (never a
    blocking read: the connection may be the one that just failed)."""
    try:
        resp.close()
    finally:
        resp.release_conn()


def release_small_body(resp: urllib3.BaseHTTPResponse) -> None:
    """Finish a response with a small body (a redirect): read it so the connection goes back
    to the pool; a large or unknown one is discarded instead."""
    try:
        length = int(resp.headers.get("Content-Length") or -1)
    except ValueError:
        length = -1
    if not 0 <= length <= DRAIN_LIMIT:
        discard(resp)
        return
    try:
        resp.drain_conn()
    finally:
        resp.release_conn()


# ---- text fit for messages ---------------------------------------------------------------------


def redact_url(url: str) -> str:
    """A URL fit for messages: no credentials, no query string (CDN URLs carry signatures), and
    anything else :func:`prefetch.support.redact.redact` recognises as a secret masked."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    netloc = f"{host}:{parts.port}" if parts.port else host
    return redact(f"{parts.scheme}://{netloc}{parts.path}")


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delay-seconds or an HTTP date); None if absent or
    unreadable. Never negative: a date in the past means now."""
    if not value:
        return None
    try:
        return max(0.0, float(value.strip()))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


# ---- the status table --------------------------------------------------------------------------

#: The Hub's ``X-Error-Code`` values that name what went wrong better than the status does.
_ERROR_CODES: Mapping[str, type[SourceError]] = {
    "GatedRepo": AccessDeniedError,
    "RepoNotFound": RepoNotFoundError,
    "RevisionNotFound": RevisionNotFoundError,
    "EntryNotFound": NotFoundError,
}
_STATUSES: Mapping[int, type[SourceError]] = {
    401: AccessDeniedError,
    403: AccessDeniedError,
    404: NotFoundError,
    408: TransientSourceError,
    410: NotFoundError,
    412: SourceChangedError,  # a pinned (If-Match) request: the object changed
    416: SourceChangedError,  # the range is past the end: the file is not the listed size
    429: TransientSourceError,
}


def error_class(
    status: int, error_code: str | None = None, *, credentials: bool = True
) -> type[SourceError]:
    """The package's exception class for an HTTP error answer.

    In order: a status worth retrying (408, 429, 5xx) is transient whatever else it says; a 401
    to a request without credentials is access denied (a private repo hides behind it); a known
    Hub ``X-Error-Code`` comes next; then the status; anything else is a plain SourceError.
    """
    if status >= 500 or _STATUSES.get(status) is TransientSourceError:
        return TransientSourceError
    if status == 401 and not credentials:
        return AccessDeniedError
    by_code = _ERROR_CODES.get((error_code or "").strip())
    if by_code is not None:
        return by_code
    return _STATUSES.get(status, SourceError)


def status_error(
    status: int,
    message: str,
    *,
    error_code: str | None = None,
    credentials: bool = True,
    retry_after: str | None = None,
    hint: str | None = None,
) -> SourceError:
    """The exception for an HTTP error answer, of the class :func:`error_class` picks, with the
    caller's ``message`` (a transient one carries the server's ``Retry-After``)."""
    cls = error_class(status, error_code, credentials=credentials)
    if cls is TransientSourceError:
        return TransientSourceError(message, retry_after=parse_retry_after(retry_after))
    return cls(message, hint=hint)


#: What to check when no connection could be made at all (no DNS answer, refused, timed out).
NETWORK_HINT = (
    "check the network and DNS; behind a proxy set HTTPS_PROXY (or --proxy); "
    "a Hub mirror: HF_ENDPOINT (or --endpoint); another S3 server: --endpoint-url"
)


#: Said with every failure of the proxy itself (not reachable, refusing, wanting credentials).
PROXY_HINT = (
    "check HTTPS_PROXY / HTTP_PROXY (or --proxy URL; --proxy none goes direct) and NO_PROXY"
)


def connection_failure(exc: BaseException) -> str | None:
    """``cannot reach HOST:PORT: why`` when ``exc`` is urllib3's failure to open a connection
    (no DNS answer, refused, timed out), else None. urllib3 words these with the connection
    object's repr (a private class name): the host, port and reason are taken apart instead."""
    if not isinstance(exc, urllib3.exceptions.ConnectTimeoutError):
        return None
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        conn, detail = exc.conn, str(exc).removeprefix(f"{exc.conn}: ")
    elif len(exc.args) == 2 and isinstance(exc.args[1], str):  # (conn, "Connection to ...")
        conn, detail = exc.args[0], exc.args[1]
    else:
        return None
    host, port = getattr(conn, "host", None), getattr(conn, "port", None)
    where = f"{host}:{port}" if host and port else host or "the server"
    return f"cannot reach {where}: {detail}"


#: Said with every TLS refusal: how to trust a private CA (verification cannot be turned off).
TLS_HINT = (
    "if the server's certificate is signed by a private CA, trust it with --ca-bundle FILE "
    "(agent: caBundle), or REQUESTS_CA_BUNDLE / SSL_CERT_FILE / AWS_CA_BUNDLE"
)
#: OpenSSL's reasons for a handshake with a peer that does not speak TLS (a plain-HTTP port).
_NOT_TLS = frozenset(
    {"WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG", "HTTP_REQUEST",
     "UNKNOWN_PROTOCOL"}
)  # fmt: skip


def _ssl_error_in(exc: BaseException) -> ssl.SSLError | None:
    """The ``ssl`` error under a library's wrapping (urllib3 and botocore keep it as an argument,
    a cause or a context), or None."""
    seen: set[int] = set()
    todo: list[object] = [exc]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, ssl.SSLError):
            return item
        todo.extend([item.__cause__, item.__context__, *item.args])
    return None


def tls_error(exc: BaseException, where: str) -> TlsError | None:
    """``exc`` as a :class:`TlsError` when it is a refused certificate or a handshake with a
    peer that does not speak TLS (``where``: the message's start, naming the host); None for
    any other failure (a reset in the middle of a TLS stream stays transient)."""
    if isinstance(exc, TlsError):
        return TlsError(f"{where}: {exc}", hint=exc.hint)
    err = _ssl_error_in(exc)
    if isinstance(err, ssl.SSLCertVerificationError):
        reason = f"certificate verify failed: {err.verify_message or err.reason}"
    elif err is not None and err.reason in _NOT_TLS:
        words = str(err.reason).lower().replace("_", " ")
        reason = f"TLS handshake failed: {words} (does the port speak plain HTTP?)"
    else:
        return None
    return TlsError(f"{where}: {reason}", hint=TLS_HINT)


def transport_error(exc: BaseException, what: str) -> SourceError:
    """An exception from sending a request or reading a body, as the package's error: network
    and protocol failures are transient, a refused certificate (:func:`tls_error`) is not."""
    refused = tls_error(exc, what)
    if refused is not None:
        return refused
    unreachable = connection_failure(exc)
    if unreachable is not None:
        return TransientSourceError(f"{what}: {unreachable}", hint=NETWORK_HINT)
    if isinstance(exc, urllib3.exceptions.ProxyError):
        from prefetch.sources.http.proxy_auth import proxy_failure  # a proxy's refusal: rare

        reason, transient = proxy_failure(exc)
        cls = TransientSourceError if transient else SourceError
        return cls(f"{what}: {reason}", hint=PROXY_HINT)
    if isinstance(exc, urllib3.exceptions.HTTPError | http.client.HTTPException | OSError):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


# ---- the body reader ---------------------------------------------------------------------------


class SupportsReadinto(Protocol):
    def readinto(self, buf: memoryview, /) -> int: ...


class ResponseBody(SupportsReadinto, Protocol):
    """What the seam uses of an answer's unread body: urllib3's response, or botocore's
    ``StreamingBody`` (whose ``release_conn`` is absent: it is looked up, not required)."""

    def read(self, amt: int | None = ..., /) -> bytes: ...
    def close(self) -> None: ...


def http_client_response(response: object) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under a urllib3 response (or the response itself), or None
    when there is none: the layers are private, so a caller falls back to the outer object."""
    if isinstance(response, http.client.HTTPResponse):
        return response
    fp = getattr(response, "_fp", None)
    return fp if isinstance(fp, http.client.HTTPResponse) else None


class BodyReader:
    """The body of one answer to a ranged GET of ``length`` bytes: never more, never less.

    ``raw`` is the ``http.client`` response to read from (straight into the caller's buffer;
    it honours Content-Length and chunked encoding); when None, ``body`` (the library's own
    response object) is read instead. A body that ends early is a TransientSourceError (the
    engine retries from the last byte written); one that runs past the range (possible only
    without a Content-Length, so checked only then) is an ``overrun`` error. ``translate``
    turns a read failure into the package's error. ``on_close(reusable)`` finishes the
    response: ``reusable`` is true only when the whole body was read and nothing aborted it.
    """

    def __init__(
        self,
        body: SupportsReadinto,
        what: str,
        length: int,
        *,
        raw: http.client.HTTPResponse | None,
        socket_owner: object,
        on_close: Callable[[bool], None],
        length_known: bool = True,
        translate: Callable[[Exception, str], Exception] = transport_error,
        overrun: type[SourceError] = SourceChangedError,
    ) -> None:
        self._body = body
        self._raw = raw
        self._socket_owner = socket_owner
        self._on_close = on_close
        self._what = what
        self._left = length
        self._length_known = length_known
        self._translate = translate
        self._overrun = overrun
        self._clean = False
        self._aborted = False

    def readinto(self, buf: memoryview, /) -> int:
        if self._left <= 0:
            return 0
        view = buf[: self._left] if len(buf) > self._left else buf
        n = self._read(view)
        if n <= 0:
            raise TransientSourceError(
                f"{self._what}: the body ended {self._left} bytes before the end of the range"
            )
        self._left -= n
        if self._left == 0:
            self._finish()
        return n

    def _read(self, view: memoryview) -> int:
        try:
            if self._raw is not None:
                return self._raw.readinto(view)
            return int(self._body.readinto(view))
        except Exception as exc:
            raise self._translate(exc, self._what) from exc

    def _finish(self) -> None:
        """The range is complete: a body without Content-Length must end here too."""
        if not self._length_known and self._read(memoryview(bytearray(1))) > 0:
            raise self._overrun(f"{self._what}: the body is longer than the range")
        self._clean = True

    def abort(self) -> None:
        """Make a read blocked in another thread return now (see RangeReader); the connection
        is then never reused."""
        self._aborted = True
        shutdown_socket_of(self._raw if self._raw is not None else self._socket_owner)

    def close(self) -> None:
        self._on_close(self._clean and not self._aborted)


# ---- one request, one answer ---------------------------------------------------------------------


class Response:
    """One answer on the seam: the status, the headers (case-insensitive), and ``raw``, the
    response whose body is still unread (None when a library already consumed it). ``error``:
    the (code, message) a library parsed from an error answer, when it did."""

    def __init__(
        self,
        status: int,
        headers: Mapping[str, str],
        raw: ResponseBody | None,
        *,
        error: tuple[str, str] | None = None,
    ) -> None:
        self.status = status
        self.headers = headers
        self.raw = raw
        self.error = error

    def read(self, limit: int) -> bytes:
        """At most ``limit`` bytes of the body."""
        return self.raw.read(limit) if self.raw is not None else b""

    def release(self) -> None:
        """The body was read to its end: the connection goes back to the pool."""
        if self.raw is not None:
            release = getattr(self.raw, "release_conn", None)
            if release is not None:
                release()
            else:
                self.raw.close()

    def discard(self) -> None:
        """Close the connection without reading (it may be the one that failed)."""
        if self.raw is None:
            return
        try:
            self.raw.close()
        finally:
            release = getattr(self.raw, "release_conn", None)
            if release is not None:
                release()


class Sent(Response):
    """An answer :func:`send` got from the pool: ``raw`` is urllib3's response, never None."""

    raw: urllib3.BaseHTTPResponse

    def __init__(self, resp: urllib3.BaseHTTPResponse) -> None:
        super().__init__(int(resp.status), resp.headers, resp)


def origin_of(url: str) -> tuple[str, str, int]:
    """Scheme, host and port of a URL (the default port when none is written)."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    port = parts.port or (443 if scheme == "https" else 80)
    return scheme, (parts.hostname or "").lower(), port


def send(
    http: HttpClient,
    method: str,
    url: str,
    *,
    headers: Mapping[str, str],
    timeout: urllib3.Timeout | float | None = None,
    decode: bool = False,
    credentials: Mapping[str, str] | None = None,
    credentials_origin: str | None = None,
) -> Sent:
    """Send one request on the pool: no redirects, no urllib3 retries (the callers do both), the
    body left unread. Transport failures raise urllib3's errors (see :func:`transport_error`),
    but a refused certificate raises :class:`TlsError` naming the URL's host;
    the wait for the headers is interrupted by the calling thread's watch (see above).

    ``credentials`` (headers such as Authorization) go only to ``credentials_origin``'s scheme,
    host and port: a redirect or a next-page link to another host never receives them."""
    if (
        credentials
        and credentials_origin is not None
        and origin_of(url) == origin_of(credentials_origin)
    ):
        headers = {**headers, **credentials}
    kwargs: RequestOptions = {
        "headers": dict(headers),
        "preload_content": False,
        "redirect": False,
        "retries": False,
        "decode_content": decode,
    }
    if timeout is not None:
        kwargs["timeout"] = timeout
    try:
        resp = http.request(method, url, **kwargs)
    except urllib3.exceptions.SSLError as exc:
        scheme, host, port = origin_of(url)
        refused = tls_error(exc, f"{scheme}://{host}:{port}")
        if refused is None:
            raise
        raise refused from exc
    except urllib3.exceptions.ProxyError as exc:  # TLS to an https:// proxy itself, refused
        proxy = _proxy_of(http, url)
        refused = None if proxy is None else tls_error(exc, f"the proxy {proxy}")
        if refused is None:
            raise
        raise refused from exc
    return Sent(resp)


def _proxy_of(http: HttpClient, url: str) -> str | None:
    """``scheme://host:port`` of the proxy ``http`` sends ``url`` through (never its
    credentials), or None when it goes direct."""
    manager = http.manager_for(url) if isinstance(http, ProxyRouter) else http
    if not isinstance(manager, urllib3.ProxyManager) or manager.proxy is None:
        return None
    proxy = manager.proxy
    return f"{proxy.scheme}://{proxy.host}:{proxy.port}"


def check_range_answer(
    what: str,
    start: int,
    end: int,
    size: int,
    status: int | None,
    content_range: str | None,
    content_length: int | str | None,
) -> None:
    """THE range rule of every source: the answer to a GET of bytes ``[start, end)`` of a
    ``size``-byte object must be exactly that range (:func:`range_answer_problem`); anything else
    would write wrong bytes at this offset, so it is a SourceChangedError (the partial file is
    dropped: its bytes can no longer be trusted)."""
    problem = range_answer_problem(start, end, size, status, content_range, content_length)
    if problem is not None:
        raise SourceChangedError(f"{what}: {problem}")


def range_body_reader(
    answer: Response,
    what: str,
    length: int,
    *,
    translate: Callable[[Exception, str], Exception] = transport_error,
) -> BodyReader:
    """The reader of a checked ranged answer: straight from the ``http.client`` response when
    the seam sent it (else through the library's body object); the connection goes back to the
    pool only after a clean read."""

    def finish(reusable: bool) -> None:
        if reusable:
            answer.release()
        else:
            answer.discard()

    # a ranged answer that passed its checks always has its body (only an error has none)
    body = cast("ResponseBody", answer.raw)
    return BodyReader(
        body,
        what,
        length,
        raw=http_client_response(body),
        socket_owner=body,
        on_close=finish,
        length_known=answer.headers.get("Content-Length") is not None,
        translate=translate,
    )


__all__ = [
    "BodyReader",
    "HttpClient",
    "ProxyRouter",
    "RequestOptions",
    "Response",
    "ResponseBody",
    "Sent",
    "check_range_answer",
    "discard",
    "error_class",
    "http_client_response",
    "make_http_pool",
    "no_proxy_matches",
    "origin_of",
    "parse_retry_after",
    "range_body_reader",
    "redact_url",
    "release_small_body",
    "send",
    "shared_http_pool",
    "status_error",
    "tls_error",
    "transport_error",
    "watched_pools",
]
