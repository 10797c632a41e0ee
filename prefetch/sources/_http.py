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

import email.utils
import http.client
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol
from urllib.parse import urlsplit

import urllib3

from prefetch import settings
from prefetch.errors import (
    AccessDeniedError,
    NotFoundError,
    RepoNotFoundError,
    RevisionNotFoundError,
    SourceChangedError,
    SourceError,
    TransientSourceError,
)
from prefetch.redact import redact
from prefetch.sources.base import shutdown_socket_of
from prefetch.sources.proxy_auth import proxy_failure, proxy_headers

#: A redirect's body is read (so its connection goes back to the pool) only up to this size.
DRAIN_LIMIT = 64 * 1024

# ---- the pool ----------------------------------------------------------------------------------


class HttpClient(Protocol):
    """What a source needs of a client: urllib3's ``request`` (a PoolManager, the proxy router
    below, or a test's canned client)."""

    def request(self, method: str, url: str, **kwargs: Any) -> Any: ...


_SHARED_POOLS: dict[tuple[int, object], HttpClient] = {}
_SHARED_LOCK = threading.Lock()


def shared_http_pool(size: int = 32, proxies: settings.Proxies | None = None) -> HttpClient:
    """One pooled client per process, pool size and proxy settings (default: the environment's,
    read now), so the agent reuses connections across syncs and a model with its own proxy
    never shares a pool with one that goes direct."""
    proxies = settings.proxies() if proxies is None else proxies
    key = (size, proxies.key())
    with _SHARED_LOCK:
        pool = _SHARED_POOLS.get(key)
        if pool is None:
            pool = _SHARED_POOLS[key] = make_http_pool(size, proxies=proxies)
        return pool


def make_http_pool(size: int = 32, *, proxies: settings.Proxies | None = None) -> HttpClient:
    """A urllib3 pool for ranged GETs: no urllib3 retries or redirects (done by the caller), and
    the proxies (default: the environment's, read now) honoured per host."""
    kwargs: dict[str, Any] = {"num_pools": 8, "maxsize": size, "block": False, "retries": False}
    proxies = settings.proxies() if proxies is None else proxies
    direct = urllib3.PoolManager(**kwargs)
    if not proxies.by_scheme:
        return direct
    return ProxyRouter(direct, proxies, kwargs)


class ProxyRouter:
    """Sends each request directly or through its scheme's proxy, as the proxy settings say."""

    def __init__(
        self, direct: HttpClient, proxies: settings.Proxies, kwargs: Mapping[str, Any]
    ) -> None:
        self._direct = direct
        self._proxies = proxies
        self._proxied = {
            url: urllib3.ProxyManager(url, proxy_headers=proxy_headers(url), **kwargs)
            for url in set(proxies.by_scheme.values())
        }

    def manager_for(self, url: str) -> HttpClient:
        """The client that sends a request for ``url``: a proxy, or the direct pool (the rule is
        :meth:`prefetch.settings.Proxies.proxy_for`)."""
        proxy = self._proxies.proxy_for(url)
        return self._direct if proxy is None else self._proxied[proxy]

    def request(self, method: str, url: str, **kwargs: Any) -> Any:
        return self.manager_for(url).request(method, url, **kwargs)


#: Does ``NO_PROXY`` exempt a host? (The rule lives in settings, beside the variables.)
no_proxy_matches = settings.no_proxy_matches


def discard(resp: Any) -> None:
    """Drop a urllib3 response whose body we do not want, closing its connection (never a
    blocking read: the connection may be the one that just failed)."""
    try:
        resp.close()
    finally:
        resp.release_conn()


def release_small_body(resp: Any) -> None:
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
    anything else :func:`prefetch.redact.redact` recognises as a secret masked."""
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


def transport_error(exc: BaseException, what: str) -> SourceError:
    """An exception from sending a request or reading a body, as the package's error: network
    and protocol failures are transient, a TLS failure (a wrong certificate) is not."""
    if isinstance(exc, urllib3.exceptions.SSLError):
        return SourceError(f"{what}: TLS error: {exc}")
    if isinstance(exc, urllib3.exceptions.ProxyError):
        reason, transient = proxy_failure(exc)
        return (TransientSourceError if transient else SourceError)(f"{what}: {reason}")
    if isinstance(exc, urllib3.exceptions.HTTPError | http.client.HTTPException | OSError):
        return TransientSourceError(f"{what}: {type(exc).__name__}: {exc}")
    return SourceError(f"{what}: {type(exc).__name__}: {exc}")


# ---- the body reader ---------------------------------------------------------------------------


class SupportsReadinto(Protocol):
    def readinto(self, buf: memoryview, /) -> int: ...


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


__all__ = [
    "BodyReader",
    "HttpClient",
    "ProxyRouter",
    "discard",
    "error_class",
    "http_client_response",
    "make_http_pool",
    "no_proxy_matches",
    "parse_retry_after",
    "redact_url",
    "release_small_body",
    "shared_http_pool",
    "status_error",
    "transport_error",
]
