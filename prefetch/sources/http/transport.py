"""The one HTTP layer every source shares: the transport seam, and the public face of its parts.

* :func:`make_http_pool` / :func:`shared_http_pool`: a urllib3 pool for ranged GETs (no urllib3
  retries or redirects: the caller does both), sending each request directly or through the
  proxy the environment names (``HTTP(S)_PROXY``, bypassed per host by ``NO_PROXY``), on
  connections whose header wait a watch can interrupt (:func:`watched_pools`).
* :func:`send`: one request on the pool, credentials only to their own origin.
* :class:`Route`: the requests of one origin, sent by their path on its pool, held (no URL parse
  or pool lookup per request: S3's object GETs).
* :func:`redact_url`: a URL fit for a message (no credentials, no signed query string).

The parts with a job of their own live beside it and are imported from here by every source
(their names are this module's public interface, listed in ``__all__``):

* :mod:`prefetch.sources.http.errors`: THE status table (:func:`error_class`,
  :func:`status_error`), :func:`transport_error`, :func:`tls_error`, :func:`parse_retry_after`
  and the hints said with them.
* :mod:`prefetch.sources.http.tls_trust`: :class:`TlsTrust`, the TLS context one pool's HTTPS
  connections share (the CA bundle loaded once, again when its file changes).
* :mod:`prefetch.sources.http.body`: :class:`Response` and :class:`BodyReader` (the body of a
  ranged answer, read straight into the engine's buffer), :func:`check_range_answer`,
  :func:`range_body_reader`.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Mapping
from typing import Any, Protocol, TypedDict, Unpack
from urllib.parse import urlsplit

import urllib3
from urllib3.util.proxy import connection_requires_http_tunnel

from prefetch.pipeline.deadline import attach_to_watches
from prefetch.sources.base import shutdown_socket
from prefetch.sources.http.body import (
    BodyReader,
    Response,
    ResponseBody,
    SupportsReadinto,
    check_range_answer,
    checked_range_body,
    http_client_response,
    range_body_reader,
)
from prefetch.sources.http.errors import (
    NETWORK_HINT,
    PROXY_HINT,
    TLS_HINT,
    connection_failure,
    error_class,
    parse_retry_after,
    status_error,
    tls_error,
    transport_error,
)
from prefetch.sources.http.tls_trust import TlsTrust
from prefetch.support import settings
from prefetch.support.errors import TlsError
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
    bundle to verify TLS with instead of the system's (loaded once: :class:`TlsTrust`)."""
    kwargs: PoolOptions = {"num_pools": 8, "maxsize": size, "block": False, "retries": False}
    trust = TlsTrust(ca_certs)
    proxies = settings.proxies() if proxies is None else proxies
    direct = watched_pools(urllib3.PoolManager(**kwargs), trust)
    if not proxies.by_scheme:
        return direct
    return ProxyRouter(direct, proxies, kwargs, trust)


# ---- stop and deadlines reach the header wait ----------------------------------------------------


class _Requests:
    """The requests one connection serves, one after another, and the interrupts of each.

    An interrupt is attached to the calling thread's watches when a request waits for its
    answer, and stays attached until the watch ends: a watch that covers several requests (a
    describe retried, a resolve under a stop) keeps the interrupts of connections that have
    since gone back to the pool and may now serve another thread's request. Such an interrupt
    acts only while the request it was made for is still the connection's latest one; once the
    next request begins it does nothing, so a stale watch never cuts another request short.
    (One it meets idle in the pool shuts that socket down: the pool's liveness check drops it.)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._latest = 0

    def begin(self) -> None:
        """A new request begins on the connection: the interrupts of the earlier ones end."""
        with self._lock:
            self._latest += 1

    def interrupt_for(self, sock: object) -> Callable[[], None]:
        """How a watch interrupts the connection's latest request (``sock``: its socket)."""
        with self._lock:
            request = self._latest

        def interrupt() -> None:
            with self._lock:  # held while shutting down: no request begins meanwhile
                if self._latest == request:
                    shutdown_socket(sock)

        return interrupt


class _WatchedHTTPConnection(urllib3.connection.HTTPConnection):
    """A connection whose wait for response headers a watch can interrupt: the calling
    thread's watches (:mod:`prefetch.pipeline.deadline`: a ranged read the engine watches, a
    metadata call under a deadline, a resolve a stop interrupts) get the socket, so a stop, a stall
    or a deadline shuts it down instead of waiting out the read timeout (60 s). The socket stays
    attached until the watch ends, so the body read is covered too; a later request on the same
    connection is not (see :class:`_Requests`)."""

    # The Any: urllib3's own arguments, passed on as they are (its signature is long and
    # changes between releases; nothing here reads them).
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._requests = _Requests()

    def putrequest(
        self, method: str, url: str, skip_host: bool = False, skip_accept_encoding: bool = False
    ) -> None:
        self._requests.begin()
        super().putrequest(
            method, url, skip_host=skip_host, skip_accept_encoding=skip_accept_encoding
        )

    # The ignore: urllib3's own getresponse narrows http.client's return type to urllib3's
    # HTTPResponse and carries the same ignore; this keeps urllib3's signature exactly.
    def getresponse(self) -> urllib3.response.HTTPResponse:  # type: ignore[override]
        attach_to_watches(self._requests.interrupt_for(self.sock))
        return super().getresponse()


class _WatchedHTTPSConnection(_WatchedHTTPConnection, urllib3.connection.HTTPSConnection):
    """:class:`_WatchedHTTPConnection` over TLS. It inherits the watched methods instead of
    copying them: their zero-argument ``super()`` then follows this class's MRO to
    HTTPSConnection (a method copied from the plain class stays bound to it and raises
    ``TypeError``: every HTTPS request failed that way once). ``trust``: the pool's shared
    context (:class:`TlsTrust`), taken at each connect."""

    def __init__(self, *args: Any, trust: TlsTrust | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._trust = trust

    def connect(self) -> None:
        if self._trust is not None:
            self.ssl_context = self._trust.context()
        super().connect()


class _WatchedHTTPPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _WatchedHTTPConnection


class _WatchedHTTPSPool(urllib3.HTTPSConnectionPool):
    ConnectionCls = _WatchedHTTPSConnection


def _trusting_pool(trust: TlsTrust) -> type[_WatchedHTTPSPool]:
    """The HTTPS pool class whose connections verify with ``trust``'s context (passed to each
    connection as a connection argument: urllib3's pool keys take no unknown options)."""

    class _TrustingHTTPSPool(_WatchedHTTPSPool):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, trust=trust, **kwargs)

    return _TrustingHTTPSPool


def watched_pools(
    manager: urllib3.PoolManager, trust: TlsTrust | None = None
) -> urllib3.PoolManager:
    """``manager`` making connections whose header wait a watch can interrupt (urllib3's
    documented per-scheme pool classes); ``trust``: the TLS context its HTTPS connections share
    (None: the one it already has, if any)."""
    https = manager.pool_classes_by_scheme.get("https")
    if trust is not None:
        https = _trusting_pool(trust)
    elif https is None or not issubclass(https, _WatchedHTTPSPool):
        https = _WatchedHTTPSPool
    manager.pool_classes_by_scheme = {"http": _WatchedHTTPPool, "https": https}
    return manager


class ProxyRouter:
    """Sends each request directly or through its scheme's proxy, as the proxy settings say
    (``trust``: the TLS context of the origins and of an https:// proxy itself)."""

    def __init__(
        self, direct: HttpClient, proxies: settings.Proxies, kwargs: PoolOptions, trust: TlsTrust
    ) -> None:
        from prefetch.sources.http.proxy_auth import proxy_headers  # only with a proxy configured

        self._direct = direct
        self._proxies = proxies
        self._proxied = {
            url: watched_pools(
                urllib3.ProxyManager(
                    url,
                    proxy_headers=proxy_headers(url),
                    proxy_ssl_context=_proxy_context(url, trust),
                    **kwargs,
                ),
                trust,
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


def _proxy_context(url: str, trust: TlsTrust) -> ssl.SSLContext | None:
    """The context TLS to an https:// proxy itself verifies with (urllib3 would otherwise build
    one per connection, with the system's store: a private CA's proxy would not be trusted)."""
    return trust.context() if urlsplit(url).scheme.lower() == "https" else None


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


# ---- one request, one answer ---------------------------------------------------------------------


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
    host and port: a redirect or a next-page link to another host never receives them.
    (A caller that sends many requests to one origin holds a :class:`Route` instead.)"""
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
    except (urllib3.exceptions.SSLError, urllib3.exceptions.ProxyError) as exc:
        refused = _tls_refusal(http, url, exc)
        if refused is None:
            raise
        raise refused from exc
    return Sent(resp)


def _tls_refusal(http: HttpClient, url: str, exc: Exception) -> TlsError | None:
    """A refused certificate (the origin's, or an https:// proxy's: urllib3's ``SSLError`` or
    ``ProxyError``) as :class:`TlsError` naming who refused; None for any other failure."""
    if isinstance(exc, urllib3.exceptions.SSLError):
        scheme, host, port = origin_of(url)
        return tls_error(exc, f"{scheme}://{host}:{port}")
    proxy = _proxy_of(http, url)  # TLS to an https:// proxy itself, refused
    return None if proxy is None else tls_error(exc, f"the proxy {proxy}")


#: urllib3's retries and redirects, off (the callers do both): one object for every request
#: (what urllib3 builds from ``retries=False, redirect=False`` per request; it never changes:
#: ``Retry.increment`` returns a new one).
NO_RETRIES = urllib3.Retry(total=False, redirect=False)


class Route:
    """The requests of one origin (``scheme://host[:port]``), sent by their target (path and
    query) on the origin's connection pool, which the route holds: no URL parsed and no pool
    looked up per request, the rest as :func:`send` (the same pool, connections, proxy, TLS,
    watch and errors). For a source that sends many requests to one host (S3's object GETs).

    The pool is the one ``http`` would use for the origin (its proxy decision included). A
    request through a forwarding proxy (``http://`` via an HTTP proxy: the target in absolute
    form, the proxy's headers added) and a client that is not urllib3's (a test's canned
    one) go through ``http.request`` as :func:`send` sends them. The pool stays usable when the
    manager drops it from its store (urllib3 2 keeps a dropped pool open); one closed
    meanwhile (urllib3 1 closed the pools it evicted) is looked up again."""

    def __init__(self, http: HttpClient, origin: str) -> None:
        self._http = http
        #: ``scheme://host[:port]`` as the caller wrote it: a whole URL is this plus a target
        #: (as written, so a request through ``http.request`` is the one :func:`send` sends:
        #: a default port written out would reach a forwarding proxy's Host header)
        self.origin = origin.rstrip("/")
        self._scheme, self._host, self._port = origin_of(origin)
        self._pool: urllib3.HTTPConnectionPool | None = self._lookup()

    def _lookup(self) -> urllib3.HTTPConnectionPool | None:
        """The origin's pool in ``http``, or None when its requests go through ``request``."""
        http = self._http
        manager = http.manager_for(self.origin) if isinstance(http, ProxyRouter) else http
        if not isinstance(manager, urllib3.PoolManager):
            return None
        if isinstance(manager, urllib3.ProxyManager) and not connection_requires_http_tunnel(
            manager.proxy, manager.proxy_config, self._scheme
        ):
            return None  # forwarded in absolute form: the manager adds the proxy's headers
        return manager.connection_from_host(self._host, self._port, self._scheme)

    def send(
        self,
        method: str,
        target: str,
        *,
        headers: Mapping[str, str],
        timeout: urllib3.Timeout | float | None = None,
        decode: bool = False,
    ) -> Sent:
        """:func:`send` of ``origin + target`` (``target``: the path, encoded as sent, and
        any query string); ``headers`` are sent as given (not copied)."""
        pool = self._pool
        if pool is None:
            return send(
                self._http, method, self.origin + target, headers=headers, timeout=timeout,
                decode=decode,
            )  # fmt: skip
        try:
            try:
                resp = self._urlopen(pool, method, target, headers, timeout, decode)
            except urllib3.exceptions.ClosedPoolError:  # raised before anything was sent
                self._pool = pool = self._lookup()
                if pool is None:
                    raise
                resp = self._urlopen(pool, method, target, headers, timeout, decode)
        except (urllib3.exceptions.SSLError, urllib3.exceptions.ProxyError) as exc:
            refused = _tls_refusal(self._http, self.origin, exc)
            if refused is None:
                raise
            raise refused from exc
        return Sent(resp)

    @staticmethod
    def _urlopen(
        pool: urllib3.HTTPConnectionPool,
        method: str,
        target: str,
        headers: Mapping[str, str],
        timeout: urllib3.Timeout | float | None,
        decode: bool,
    ) -> urllib3.BaseHTTPResponse:
        """What ``PoolManager.request`` asks of the origin's pool for :func:`send`'s options."""
        if timeout is None:
            return pool.urlopen(
                method, target, headers=headers, retries=NO_RETRIES, redirect=False,
                assert_same_host=False, preload_content=False, release_conn=False,
                decode_content=decode,
            )  # fmt: skip
        return pool.urlopen(
            method, target, headers=headers, retries=NO_RETRIES, redirect=False,
            assert_same_host=False, timeout=timeout, preload_content=False, release_conn=False,
            decode_content=decode,
        )  # fmt: skip


def _proxy_of(http: HttpClient, url: str) -> str | None:
    """``scheme://host:port`` of the proxy ``http`` sends ``url`` through (never its
    credentials), or None when it goes direct."""
    manager = http.manager_for(url) if isinstance(http, ProxyRouter) else http
    if not isinstance(manager, urllib3.ProxyManager) or manager.proxy is None:
        return None
    proxy = manager.proxy
    return f"{proxy.scheme}://{proxy.host}:{proxy.port}"


__all__ = [
    "NETWORK_HINT",
    "NO_RETRIES",
    "PROXY_HINT",
    "TLS_HINT",
    "BodyReader",
    "HttpClient",
    "ProxyRouter",
    "RequestOptions",
    "Response",
    "ResponseBody",
    "Route",
    "Sent",
    "SupportsReadinto",
    "check_range_answer",
    "checked_range_body",
    "connection_failure",
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
